#pragma once
// ZeroMQ errors become kdn::Status here, and nowhere else (the one macro the
// house style asks for, as ggml's CUDA_CHECK). cppzmq throws zmq::error_t;
// KDN_ZMQ_RETURN_IF_ERROR catches it around one call so that no exception
// leaves a kvbus function or thread. The C API's -1 + errno goes through
// ZmqErrorStatus. Thread-safe (pure functions).

#include <zmq.h>

#include <cerrno>
#include <string>
#include <string_view>
#include <zmq.hpp>

#include "kdn/common/status.h"

namespace kdn::net {

// "zmq: <what>: <zmq_strerror>" with a code that says whose fault it is.
inline Status ZmqErrorStatus(int errnum, std::string_view what) {
  std::string m = "zmq: " + std::string(what) + ": " + zmq_strerror(errnum);
  switch (errnum) {
    case EINVAL:
    case EPROTONOSUPPORT:
    case ENOCOMPATPROTO: return InvalidArgument(std::move(m));
    case ENOMEM:
    case EMFILE: return ResourceExhausted(std::move(m));
    case EADDRINUSE:
    case EADDRNOTAVAIL:
    case ENODEV:
    case ETERM:
    case EHOSTUNREACH:
    case ECONNREFUSED: return Unavailable(std::move(m));
    case EAGAIN: return {StatusCode::kDeadlineExceeded, std::move(m)};
    default: return IoError(std::move(m));
  }
}

}  // namespace kdn::net

// Evaluates `expr` (a cppzmq call); if it throws zmq::error_t, returns its
// Status from the enclosing function (which returns Status or Result<T>).
#define KDN_ZMQ_RETURN_IF_ERROR(expr)                             \
  do {                                                            \
    try {                                                         \
      (void)(expr);                                               \
    } catch (const ::zmq::error_t& _kdn_zmq_e) {                  \
      return ::kdn::net::ZmqErrorStatus(_kdn_zmq_e.num(), #expr); \
    }                                                             \
  } while (0)
