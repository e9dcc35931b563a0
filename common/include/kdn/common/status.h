#pragma once
// kdn::Status and kdn::Result<T>: the project's one error type.
//
// A Status is OK or carries a code and a message that names what failed (the
// file, the tensor, the peer). Functions that can fail return Status or
// Result<T>; both are [[nodiscard]]. Nothing here throws. Thread-compatible:
// a Status is a value, copy it freely.

#include <optional>
#include <string>
#include <utility>
#include <variant>

namespace kdn {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,    // the caller's input is wrong (bad request, bad flag)
  kNotFound,           // a file, tensor, key or peer is not there
  kCorruption,         // data is there but malformed (truncated file, bad header)
  kUnimplemented,      // well-formed but not supported (unknown architecture)
  kResourceExhausted,  // no free KV blocks, capacity reached
  kFailedPrecondition,
  kUnavailable,  // peer down, device missing
  kDeadlineExceeded,
  kInternal,
  kIoError,
};

const char* StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "CODE: message", or "OK".
  std::string ToString() const;

  // Returns a copy whose message is "context: message".
  Status WithContext(const std::string& context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) {
  return {StatusCode::kInvalidArgument, std::move(m)};
}
inline Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status Corruption(std::string m) { return {StatusCode::kCorruption, std::move(m)}; }
inline Status Unimplemented(std::string m) { return {StatusCode::kUnimplemented, std::move(m)}; }
inline Status ResourceExhausted(std::string m) {
  return {StatusCode::kResourceExhausted, std::move(m)};
}
inline Status FailedPrecondition(std::string m) {
  return {StatusCode::kFailedPrecondition, std::move(m)};
}
inline Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
inline Status IoError(std::string m) { return {StatusCode::kIoError, std::move(m)}; }

// A value or the Status that explains its absence. Never holds an OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT
    if (std::get<Status>(v_).ok()) {
      v_ = Status(StatusCode::kInternal, "Result constructed from an OK Status");
    }
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace kdn

#define KDN_CONCAT_INNER_(a, b) a##b
#define KDN_CONCAT_(a, b) KDN_CONCAT_INNER_(a, b)

// Returns the Status of `expr` from the enclosing function if it is not OK.
#define KDN_RETURN_IF_ERROR(expr)      \
  do {                                 \
    ::kdn::Status _kdn_st = (expr);    \
    if (!_kdn_st.ok()) return _kdn_st; \
  } while (0)

// `KDN_ASSIGN_OR_RETURN(auto x, MakeX());` binds the value or returns the Status.
#define KDN_ASSIGN_OR_RETURN(lhs, expr) \
  KDN_ASSIGN_OR_RETURN_IMPL_(KDN_CONCAT_(_kdn_res_, __LINE__), lhs, expr)
#define KDN_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.status();              \
  lhs = std::move(tmp).value()
