#include "kdn/net/curve.h"

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
#include "kdn/net/zmq_check.h"
#include "kdn/net/zmq_curve.h"

namespace kdn::net {

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
  return CurveKeys{pub, sec, "", ""};
}

Result<std::pair<CurveKeys, CurveKeys>> GenerateDeploymentKeys() {
  KDN_ASSIGN_OR_RETURN(CurveKeys members, GenerateCurveKeys());
  KDN_ASSIGN_OR_RETURN(CurveKeys router, GenerateCurveKeys());
  members.router_key = router.public_key;
  router.server_key = members.public_key;
  return std::make_pair(std::move(members), std::move(router));
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
      "public-key = " +
      keys.public_key + "\n" + "secret-key = " + keys.secret_key + "\n" +
      (keys.server_key.empty() ? "" : "server-key = " + keys.server_key + "\n") +
      (keys.router_key.empty() ? "" : "router-key = " + keys.router_key + "\n");
  bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ok = (::close(fd) == 0) && ok;
  if (!ok) {
    ::unlink(path.c_str());
    return IoError("cannot write " + path);
  }
  return Status::Ok();
}

Result<CurveKeys> ReadCurveKeys(const std::string& path) {
  struct stat st {};
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
                        : name == "server-key" ? &keys.server_key
                        : name == "router-key" ? &keys.router_key
                                               : nullptr;
    uint8_t decoded[32];
    if (slot == nullptr || value.size() != kZ85Chars ||
        zmq_z85_decode(decoded, value.c_str()) == nullptr) {
      return InvalidArgument(path + ":" + std::to_string(lineno) +
                             ": expected 'NAME = <40 Z85 characters>' with NAME one of "
                             "public-key, secret-key, server-key, router-key");
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

namespace {

constexpr const char* kDataDomain = "kdn-data";
constexpr const char* kControlDomain = "kdn-control";

// The 32 bytes of a Z85 key; empty if it is not one.
std::string DecodeKey(const std::string& z85) {
  std::string out(32, '\0');
  if (z85.size() != kZ85Chars ||
      zmq_z85_decode(reinterpret_cast<uint8_t*>(out.data()), z85.c_str()) == nullptr) {
    return "";
  }
  return out;
}

}  // namespace

CurveAuthenticator::CurveAuthenticator(zmq::context_t& context, std::string data_key,
                                       std::string control_key)
    : socket_(context, zmq::socket_type::rep),
      data_key_(std::move(data_key)),
      control_key_(std::move(control_key)) {}

Result<std::unique_ptr<CurveAuthenticator>> CurveAuthenticator::Start(zmq::context_t& context,
                                                                      const CurveKeys& keys) {
  if (!CurveAvailable()) {
    return FailedPrecondition("this libzmq was built without CURVE (it needs libsodium)");
  }
  std::string data_key = DecodeKey(keys.public_key);
  std::string control_key = DecodeKey(keys.ControlClientKey());
  if (data_key.empty() || control_key.empty()) {
    return InvalidArgument("CURVE public and router keys must be 40 Z85 characters");
  }
  std::unique_ptr<CurveAuthenticator> a;
  KDN_ZMQ_RETURN_IF_ERROR(
      a.reset(new CurveAuthenticator(context, std::move(data_key), std::move(control_key))));
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
      // Each domain admits one key: a data socket the members', a control
      // socket the router's.
      const bool ok =
          frames.size() >= 7 && frames[0].to_string_view() == "1.0" &&
          frames[5].to_string_view() == "CURVE" &&
          ((frames[2].to_string_view() == kDataDomain && frames[6].to_string_view() == data_key_) ||
           (frames[2].to_string_view() == kControlDomain &&
            frames[6].to_string_view() == control_key_));
      (ok ? admitted_ : refused_).fetch_add(1, std::memory_order_relaxed);
      if (!ok && frames.size() >= 4) {
        refusals.Warn(
            "refused a connection from {} to a {} socket: it does not hold the "
            "deployment's CURVE key for it",
            frames[3].to_string(),
            frames[2].to_string_view() == kControlDomain ? "control" : "data");
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
                    const std::optional<CurveKeys>& keys, CurveRole role,
                    std::unique_ptr<CurveAuthenticator>* auth) {
  if (!keys) return Status::Ok();
  if (!keys->server_key.empty() && keys->server_key != keys->public_key) {
    return InvalidArgument(
        "this CURVE key file is a client's (it names another server key): a server needs the "
        "members' key file");
  }
  if (!*auth) {
    KDN_ASSIGN_OR_RETURN(*auth, CurveAuthenticator::Start(context, *keys));
  }
  KDN_ZMQ_RETURN_IF_ERROR(socket.set(zmq::sockopt::zap_domain,
                                     role == CurveRole::kControl ? kControlDomain : kDataDomain));
  KDN_ZMQ_RETURN_IF_ERROR(socket.set(zmq::sockopt::curve_server, true));
  KDN_ZMQ_RETURN_IF_ERROR(socket.set(zmq::sockopt::curve_secretkey, keys->secret_key));
  return Status::Ok();
}

Status SecureClient(zmq::socket_t& socket, const std::optional<CurveKeys>& keys) {
  if (!keys) return Status::Ok();
  if (!CurveAvailable()) {
    return FailedPrecondition("this libzmq was built without CURVE (it needs libsodium)");
  }
  KDN_ZMQ_RETURN_IF_ERROR(socket.set(zmq::sockopt::curve_serverkey, keys->ServerKey()));
  KDN_ZMQ_RETURN_IF_ERROR(socket.set(zmq::sockopt::curve_publickey, keys->public_key));
  KDN_ZMQ_RETURN_IF_ERROR(socket.set(zmq::sockopt::curve_secretkey, keys->secret_key));
  return Status::Ok();
}

}  // namespace kdn::net
