// CURVE on kdn's internal sockets (kdn/net/curve.h, zmq_curve.h): the key
// file's rules, and that kdn-store and the kvbus receiver admit a peer that
// holds the deployment's key and nobody else, whatever the others send.
#include "kdn/net/curve.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>

#include "kdn/kvbus/store_service.h"
#include "kdn/kvbus/transport.h"
#include "kdn/net/zmq_curve.h"
#include "kdn/testing/recording_store.h"
#include "kdn/testing/temp_dir.h"
#include "kdn/testing/chunks.h"

namespace kdn::kvbus {
namespace {

using namespace std::chrono_literals;
using kdn::testing::RecordingStore;
using kdn::testing::TempDir;

std::shared_ptr<const Chunk> MakeChunk(uint64_t id) {
  return kdn::testing::MakeChunk(ChunkKey{id, ~id}, id, {.dtype = DType::kBF16});
}

net::CurveKeys Keys() {
  auto k = net::GenerateCurveKeys();
  EXPECT_TRUE(k.ok()) << k.status().ToString();
  return *k;
}

// Bytes a hostile peer might send: random frames and valid-looking protobuf
// prefixes of every length.
std::vector<std::string> GarbageFrames() {
  std::mt19937 rng(7);
  std::vector<std::string> frames;
  for (int n : {0, 1, 2, 7, 64, 1000, 70000}) {
    std::string f(n, '\0');
    for (char& c : f) c = static_cast<char>(rng());
    frames.push_back(f);
  }
  return frames;
}

// Sends every garbage frame (and a well-formed multi-frame message) from a
// DEALER configured by `secure` to `endpoint`.
void Bombard(const std::string& endpoint, const std::function<void(zmq::socket_t&)>& secure) {
  zmq::context_t ctx;
  zmq::socket_t s(ctx, zmq::socket_type::dealer);
  s.set(zmq::sockopt::linger, 0);
  secure(s);
  s.connect(endpoint);
  for (const std::string& f : GarbageFrames()) {
    s.send(zmq::buffer(f), zmq::send_flags::dontwait);
    s.send(zmq::buffer(f), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
    s.send(zmq::buffer(f), zmq::send_flags::dontwait);
  }
  std::this_thread::sleep_for(300ms);
}

TEST(CurveKeys, AWrittenKeyReadsBackAndIsPrivate) {
  TempDir dir;
  const net::CurveKeys keys = Keys();
  const std::string path = (dir.path() / "kdn.key").string();
  ASSERT_TRUE(net::WriteCurveKeys(path, keys).ok());
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  auto back = net::ReadCurveKeys(path);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->public_key, keys.public_key);
  EXPECT_EQ(back->secret_key, keys.secret_key);
  // Never replaced.
  EXPECT_EQ(net::WriteCurveKeys(path, Keys()).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(net::ReadCurveKeys(path)->secret_key, keys.secret_key);
}

// The members' and the router's files name each other's public keys, and
// read back as written.
TEST(CurveKeys, ADeploymentsTwoFilesNameEachOther) {
  TempDir dir;
  auto pair = net::GenerateDeploymentKeys();
  ASSERT_TRUE(pair.ok()) << pair.status().ToString();
  const auto& [members, router] = *pair;
  EXPECT_EQ(members.router_key, router.public_key);
  EXPECT_EQ(router.server_key, members.public_key);
  EXPECT_EQ(members.ServerKey(), members.public_key);
  EXPECT_EQ(router.ServerKey(), members.public_key);
  EXPECT_EQ(members.ControlClientKey(), router.public_key);
  ASSERT_TRUE(net::WriteCurveKeys((dir.path() / "curve.key").string(), members).ok());
  ASSERT_TRUE(net::WriteCurveKeys((dir.path() / "router.key").string(), router).ok());
  auto m = net::ReadCurveKeys((dir.path() / "curve.key").string());
  auto r = net::ReadCurveKeys((dir.path() / "router.key").string());
  ASSERT_TRUE(m.ok() && r.ok());
  EXPECT_EQ(m->router_key, router.public_key);
  EXPECT_TRUE(m->server_key.empty());
  EXPECT_EQ(r->server_key, members.public_key);
  EXPECT_EQ(r->secret_key, router.secret_key);
  // The router's file cannot serve: it names another server key.
  zmq::context_t ctx;
  zmq::socket_t s(ctx, zmq::socket_type::router);
  std::unique_ptr<net::CurveAuthenticator> auth;
  EXPECT_EQ(net::SecureServer(ctx, s, *r, net::CurveRole::kControl, &auth).code(),
            StatusCode::kInvalidArgument);
  s.close();
}

TEST(CurveKeys, AKeyOthersMayReadIsRefused) {
  TempDir dir;
  const std::string path = (dir.path() / "kdn.key").string();
  ASSERT_TRUE(net::WriteCurveKeys(path, Keys()).ok());
  ASSERT_EQ(::chmod(path.c_str(), 0640), 0);
  auto r = net::ReadCurveKeys(path);
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("chmod 600"), std::string::npos) << r.status().message();
}

TEST(CurveKeys, MalformedAndMismatchedFilesAreRefused) {
  TempDir dir;
  auto write = [&](const std::string& name, const std::string& text) {
    const std::string p = (dir.path() / name).string();
    std::ofstream(p) << text;
    ::chmod(p.c_str(), 0600);
    return p;
  };
  const net::CurveKeys a = Keys(), b = Keys();
  EXPECT_EQ(
      net::ReadCurveKeys(write("half", "public-key = " + a.public_key + "\n")).status().code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(
      net::ReadCurveKeys(write("short", "public-key = abc\nsecret-key = def\n")).status().code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(net::ReadCurveKeys(write("other", "public-key = " + a.public_key +
                                                  "\nsecret-key = " + b.secret_key + "\n"))
                .status()
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(net::ReadCurveKeys((dir.path() / "missing").string()).status().code(),
            StatusCode::kNotFound);
  EXPECT_TRUE(net::ReadCurveKeys(write("ok", "# comment\n\npublic-key = " + a.public_key +
                                                 "\nsecret-key = " + a.secret_key + "\n"))
                  .ok());
}

TEST(CurveKeys, TheEnvironmentNamesTheFileWhenTheFlagDoesNot) {
  TempDir dir;
  const std::string path = (dir.path() / "kdn.key").string();
  const net::CurveKeys keys = Keys();
  ASSERT_TRUE(net::WriteCurveKeys(path, keys).ok());
  ::unsetenv("KDN_CURVE_KEYS");
  EXPECT_FALSE(net::CurveKeysFromFlagOrEnv("")->has_value());
  ::setenv("KDN_CURVE_KEYS", path.c_str(), 1);
  auto from_env = net::CurveKeysFromFlagOrEnv("");
  ::unsetenv("KDN_CURVE_KEYS");
  ASSERT_TRUE(from_env.ok());
  ASSERT_TRUE(from_env->has_value());
  EXPECT_EQ((*from_env)->public_key, keys.public_key);
  EXPECT_EQ(net::CurveKeysFromFlagOrEnv((dir.path() / "missing").string()).status().code(),
            StatusCode::kNotFound);
}

// kdn-store with CURVE: its clients put and get; a client without the key, or
// with a key of its own, puts nothing and crashes nothing.
TEST(CurveStore, OnlyAHolderOfTheKeyCanPut) {
  const net::CurveKeys keys = Keys();
  RecordingStore store;
  auto server = StoreServer::Start(store, "tcp://127.0.0.1:0", {}, {.curve = keys});
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  const std::string ep = (*server)->endpoint();

  auto plain = RemoteStore::Connect(ep, {.timeout = 500ms});
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ((*plain)->Put(MakeChunk(1)).code(), StatusCode::kUnavailable);
  const net::CurveKeys forged = Keys();
  // Another deployment's key: it cannot even check the server's.
  auto foreign = RemoteStore::Connect(ep, {.timeout = 500ms, .curve = forged});
  ASSERT_TRUE(foreign.ok());
  EXPECT_EQ((*foreign)->Put(MakeChunk(2)).code(), StatusCode::kUnavailable);

  Bombard(ep, [](zmq::socket_t&) {});
  // Knows the server's public key but holds a keypair of its own: the
  // authenticator refuses it.
  Bombard(ep, [&](zmq::socket_t& s) {
    s.set(zmq::sockopt::curve_serverkey, keys.public_key);
    s.set(zmq::sockopt::curve_publickey, forged.public_key);
    s.set(zmq::sockopt::curve_secretkey, forged.secret_key);
  });
  EXPECT_EQ(store.Stats().puts, 0u);

  // The router's key is for control sockets: the store refuses it.
  {
    net::CurveKeys router = Keys();
    router.server_key = keys.public_key;
    auto r = RemoteStore::Connect(ep, {.timeout = 500ms, .curve = router});
    ASSERT_TRUE(r.ok());
    EXPECT_EQ((*r)->Put(MakeChunk(4)).code(), StatusCode::kUnavailable);
  }
  EXPECT_EQ(store.Stats().puts, 0u);

  auto member = RemoteStore::Connect(ep, {.curve = keys});
  ASSERT_TRUE(member.ok());
  ASSERT_TRUE((*member)->Put(MakeChunk(3)).ok());
  auto got = (*member)->Get(MakeChunk(3)->key());
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(store.Stats().puts, 1u);
}

// The kvbus receiver with CURVE: a sender with the key delivers; one without
// a key, or with another deployment's, delivers nothing, and its batch fails
// rather than hangs.
TEST(CurveTransport, OnlyAHolderOfTheKeyCanSendKv) {
  const net::CurveKeys keys = Keys();
  RecordingStore sink;
  ReceiverOptions ropt;
  ropt.curve = keys;
  auto receiver = Listen("tcp://127.0.0.1:0", sink, ropt);
  ASSERT_TRUE(receiver.ok()) << receiver.status().ToString();
  const std::string ep = (*receiver)->endpoint();

  SenderOptions plain;
  plain.transport = TransportKind::kTcp;
  plain.heartbeat_interval = 100ms;
  plain.peer_timeout = 600ms;
  for (bool keyed_wrong : {false, true}) {
    SenderOptions o = plain;
    if (keyed_wrong) o.curve = Keys();
    auto sender = Connect(ep, o);
    ASSERT_TRUE(sender.ok());
    auto batch = (*sender)->Submit({MakeChunk(10 + keyed_wrong)});
    ASSERT_TRUE(batch.ok());
    auto status = (*sender)->Wait(*batch, 10s);
    ASSERT_TRUE(status.ok());
    EXPECT_TRUE(status->done);
    EXPECT_EQ(status->ToStatus().code(), StatusCode::kUnavailable);
  }
  Bombard(ep, [](zmq::socket_t&) {});
  EXPECT_EQ(sink.Stats().puts, 0u);
  EXPECT_EQ((*receiver)->Stats().bad_messages, 0u);  // nothing even reached it
  EXPECT_TRUE((*receiver)->Health().ok());

  SenderOptions member = plain;
  member.peer_timeout = 5s;
  member.curve = keys;
  auto sender = Connect(ep, member);
  ASSERT_TRUE(sender.ok());
  auto batch = (*sender)->Submit({MakeChunk(20), MakeChunk(21)});
  ASSERT_TRUE(batch.ok());
  auto status = (*sender)->Wait(*batch, 10s);
  ASSERT_TRUE(status.ok());
  EXPECT_TRUE(status->ToStatus().ok()) << status->ToStatus().ToString();
  EXPECT_EQ(sink.Stats().puts, 2u);
}

// The authenticator refuses what is not CURVE with the deployment's key, and
// counts both outcomes.
TEST(CurveAuthenticator, CountsAdmittedAndRefusedClients) {
  const net::CurveKeys keys = Keys();
  zmq::context_t ctx;
  zmq::socket_t server(ctx, zmq::socket_type::router);
  std::unique_ptr<net::CurveAuthenticator> auth;
  ASSERT_TRUE(net::SecureServer(ctx, server, keys, net::CurveRole::kData, &auth).ok());
  server.set(zmq::sockopt::linger, 0);
  server.bind("tcp://127.0.0.1:0");
  const std::string ep = server.get(zmq::sockopt::last_endpoint);
  const net::CurveKeys other = Keys();
  for (const net::CurveKeys* client : {&keys, &other}) {
    zmq::socket_t s(ctx, zmq::socket_type::dealer);
    s.set(zmq::sockopt::linger, 0);
    s.set(zmq::sockopt::curve_serverkey, keys.public_key);
    s.set(zmq::sockopt::curve_publickey, client->public_key);
    s.set(zmq::sockopt::curve_secretkey, client->secret_key);
    s.connect(ep);
    s.send(zmq::str_buffer("hello"), zmq::send_flags::none);
    server.set(zmq::sockopt::rcvtimeo, client == &keys ? 5000 : 500);
    zmq::message_t id, body;
    const bool got = server.recv(id, zmq::recv_flags::none).has_value();
    EXPECT_EQ(got, client == &keys);
    if (got) {
      (void)server.recv(body, zmq::recv_flags::none);
      EXPECT_EQ(body.to_string(), "hello");
    }
  }
  EXPECT_EQ(auth->admitted(), 1u);
  EXPECT_GE(auth->refused(), 1u);
  auth.reset();
  server.close();
}

}  // namespace
}  // namespace kdn::kvbus
