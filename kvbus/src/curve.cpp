#include "kdn/kvbus/curve.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "kdn/common/log.h"
#include "kdn/kvbus/zmq_check.h"
#include "kdn/kvbus/zmq_curve.h"

namespace kdn::kvbus {

namespace {

constexpr int kZ85Chars = 40;  // a 32-byte key in Z85
constexpr const char* kZapEndpoint = "inproc://zeromq.zap.01";

std::string Trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t\r");
  return s.substr(b, e - b + 1);
}

}  // namespace

bool CurveAvailable() { return zmq_has("curve") != 0; }

Result<CurveKeys> GenerateCurveKeys() {
  if (!CurveAvailable()) {
    return FailedPrecondition("this libzmq was built without CURVE (it needs libsodium)");
  }
  char pub[kZ85Chars + 1], sec[kZ85Chars + 1];
  if (zmq_curve_keypair(pub, sec) != 0) return ZmqErrorStatus(errno, "zmq_curve_keypair");
  return CurveKeys{pub, sec};
}

Status WriteCurveKeys(const std::string& path, const CurveKeys& keys) {
  // O_EXCL: never replace a deployment's key; 0600 from the start, so the
  // secret is never readable by others, not even briefly.
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    if (errno == EEXIST) return FailedPrecondition(path + " exists: not replacing a key");
    return IoError("cannot create " + path + ": " + std::strerror(errno));
  }
  std::string text =
      "# kdn deployment key: ZeroMQ CURVE, Z85 (docs/kvbus.md, \"Authenticated sockets\").\n"
      "# Every process of the deployment reads it (--curve-keys); keep it private.\n"
      "public-key = " + keys.public_key + "\n" +
      "secret-key = " + keys.secret_key + "\n";
  bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ok = (::close(fd) == 0) && ok;
  if (!ok) {
    ::unlink(path.c_str());
    return IoError("cannot write " + path);
  }
  return Status::Ok();
}

Result<CurveKeys> ReadCurveKeys(const std::string& path) {
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return NotFound("CURVE key file " + path + " does not exist");
    return IoError("cannot stat " + path + ": " + std::strerror(errno));
  }
  if ((st.st_mode & 077) != 0) {
    return FailedPrecondition("CURVE key file " + path +
                              " may be read by group or others: chmod 600 it");
  }
  std::ifstream in(path);
  if (!in) return IoError("cannot read " + path);
  CurveKeys keys;
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    line = Trim(line);
    if (line.empty() || line[0] == '#') continue;
    size_t eq = line.find('=');
    std::string name = eq == std::string::npos ? line : Trim(line.substr(0, eq));
    std::string value = eq == std::string::npos ? "" : Trim(line.substr(eq + 1));
    std::string* slot = name == "public-key"   ? &keys.public_key
                        : name == "secret-key" ? &keys.secret_key
                                               : nullptr;
    if (slot == nullptr || value.size() != kZ85Chars) {
      return InvalidArgument(path + ":" + std::to_string(lineno) +
                             ": expected 'public-key = <40 Z85 characters>' or "
                             "'secret-key = <40 Z85 characters>'");
    }
    *slot = value;
  }
  if (keys.public_key.empty() || keys.secret_key.empty()) {
    return InvalidArgument(path + ": needs both public-key and secret-key");
  }
  if (!CurveAvailable()) {
    return FailedPrecondition("this libzmq was built without CURVE (it needs libsodium)");
  }
  char derived[kZ85Chars + 1];
  if (zmq_curve_public(derived, keys.secret_key.c_str()) != 0 || keys.public_key != derived) {
    return InvalidArgument(path + ": its public-key is not the secret-key's");
  }
  return keys;
}

Result<std::optional<CurveKeys>> CurveKeysFromFlagOrEnv(const std::string& path) {
  std::string file = path;
  if (file.empty()) {
    const char* env = std::getenv("KDN_CURVE_KEYS");
    if (env != nullptr) file = env;
  }
  if (file.empty()) return std::optional<CurveKeys>();
  KDN_ASSIGN_OR_RETURN(CurveKeys keys, ReadCurveKeys(file));
  return std::optional<CurveKeys>(std::move(keys));
}

// --- ZeroMQ sockets ---------------------------------------------------------

CurveAuthenticator::CurveAuthenticator(zmq::context_t& context, std::string allowed)
    : socket_(context, zmq::socket_type::rep), allowed_(std::move(allowed)) {}

Result<std::unique_ptr<CurveAuthenticator>> CurveAuthenticator::Start(zmq::context_t& context,
                                                                      const CurveKeys& keys) {
  if (!CurveAvailable()) {
    return FailedPrecondition("this libzmq was built without CURVE (it needs libsodium)");
  }
  std::string allowed(32, '\0');
  if (keys.public_key.size() != kZ85Chars ||
      zmq_z85_decode(reinterpret_cast<uint8_t*>(allowed.data()), keys.public_key.c_str()) ==
          nullptr) {
    return InvalidArgument("CURVE public key is not 40 Z85 characters");
  }
  std::unique_ptr<CurveAuthenticator> a;
  KDN_ZMQ_RETURN_IF_ERROR(a.reset(new CurveAuthenticator(context, std::move(allowed))));
  KDN_ZMQ_RETURN_IF_ERROR(a->socket_.set(zmq::sockopt::linger, 0));
  KDN_ZMQ_RETURN_IF_ERROR(a->socket_.bind(kZapEndpoint));
  a->thread_ = std::thread(&CurveAuthenticator::Run, a.get());
  return a;
}

CurveAuthenticator::~CurveAuthenticator() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  socket_.close();
}

void CurveAuthenticator::Run() {
  // ZAP (ZeroMQ RFC 27): a request is version, request id, domain, address,
  // routing id, mechanism, then the mechanism's credentials (CURVE: the
  // client's 32-byte public key); the reply is version, request id, status
  // code, status text, user id, metadata.
  LogLimiter refusals, errors;
  zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
  while (!stop_.load(std::memory_order_relaxed)) {
    try {
      zmq::poll(&item, 1, std::chrono::milliseconds(100));
      if (!(item.revents & ZMQ_POLLIN)) continue;
      std::vector<zmq::message_t> frames;
      do {
        frames.emplace_back();
        (void)socket_.recv(frames.back(), zmq::recv_flags::none);
      } while (frames.back().more());
      const bool ok = frames.size() >= 7 && frames[0].to_string_view() == "1.0" &&
                      frames[5].to_string_view() == "CURVE" &&
                      frames[6].to_string_view() == allowed_;
      (ok ? admitted_ : refused_).fetch_add(1, std::memory_order_relaxed);
      if (!ok && frames.size() >= 4) {
        refusals.Warn("refused a connection from {}: it does not hold this deployment's CURVE key",
                      frames[3].to_string());
      }
      const std::string request_id = frames.size() >= 2 ? frames[1].to_string() : "";
      socket_.send(zmq::buffer(std::string_view("1.0")), zmq::send_flags::sndmore);
      socket_.send(zmq::buffer(request_id), zmq::send_flags::sndmore);
      socket_.send(zmq::buffer(std::string_view(ok ? "200" : "400")), zmq::send_flags::sndmore);
      socket_.send(zmq::buffer(std::string_view(ok ? "OK" : "unknown client key")),
                   zmq::send_flags::sndmore);
      socket_.send(zmq::buffer(std::string_view("")), zmq::send_flags::sndmore);  // user id
      socket_.send(zmq::buffer(std::string_view("")), zmq::send_flags::none);     // metadata
    } catch (const zmq::error_t& e) {
      if (e.num() == ETERM) return;
      errors.Error("CURVE authenticator: {}", e.what());
    }
  }
}

Status SecureServer(zmq::context_t& context, zmq::socket_t& socket,
                    const std::optional<CurveKeys>& keys,
                    std::unique_ptr<CurveAuthenticator>* auth) {
  if (!keys) return Status::Ok();
  if (!*auth) {
    KDN_ASSIGN_OR_RETURN(*auth, CurveAuthenticator::Start(context, *keys));
  }
  KDN_ZMQ_RETURN_IF_ERROR(socket.set(zmq::sockopt::zap_domain, "kdn"));
  KDN_ZMQ_RETURN_IF_ERROR(socket.set(zmq::sockopt::curve_server, true));
  KDN_ZMQ_RETURN_IF_ERROR(socket.set(zmq::sockopt::curve_secretkey, keys->secret_key));
  return Status::Ok();
}

Status SecureClient(zmq::socket_t& socket, const std::optional<CurveKeys>& keys) {
  if (!keys) return Status::Ok();
  if (!CurveAvailable()) {
    return FailedPrecondition("this libzmq was built without CURVE (it needs libsodium)");
  }
  KDN_ZMQ_RETURN_IF_ERROR(socket.set(zmq::sockopt::curve_serverkey, keys->public_key));
  KDN_ZMQ_RETURN_IF_ERROR(socket.set(zmq::sockopt::curve_publickey, keys->public_key));
  KDN_ZMQ_RETURN_IF_ERROR(socket.set(zmq::sockopt::curve_secretkey, keys->secret_key));
  return Status::Ok();
}

}  // namespace kdn::kvbus
