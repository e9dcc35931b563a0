// libFuzzer harness for kdn-store's request handler (StoreServer,
// kdn/kvbus/store_service.h; proto/kvbus_store.proto), served from a host
// tier over loopback and spoken to by a DEALER socket as a client would.
//
// The input is [flags][request length, u16 little-endian][request][payload]:
// the request frame, then, with flags bit 0, the payload as the second frame
// (a put's chunk), with bit 1 its checksums written first (chunk_fuzz.cpp
// says why), with bit 2 one more empty frame. The server must answer every
// request within 10 s, without crashing or undefined behaviour, with a
// StoreReply that echoes a parsed request's id (INVALID_ARGUMENT for one
// that does not parse), a code that is a kdn::StatusCode, one presence per
// key of a successful lookup, and a chunk frame only for a successful get,
// holding a valid chunk of the key asked for. A successful put is then got
// back.
//
// Seeds: one request of each kind (KDN_FUZZ_WRITE_SEEDS=DIR
// build/bin/kdn_store_fuzz).
//
// Built with clang's -fsanitize=fuzzer,address,undefined (tests/fuzz); the
// test `store_fuzz` (label fuzz) runs it over tests/fuzz/corpus/store.
#include <xxhash.h>

#include <zmq.hpp>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <google/protobuf/stubs/logging.h>

#include "fuzz_util.h"
#include "zmq_poll.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/store_service.h"
#include "kvbus_store.pb.h"

using namespace kdn;
using kdn::fuzz::Check;

namespace {

struct Rig {
  kvbus::HostTier store{1 << 20};
  std::unique_ptr<kvbus::StoreServer> server;
  zmq::context_t ctx{1};
  zmq::socket_t client{ctx, zmq::socket_type::dealer};

  Rig() {
    auto s = kvbus::StoreServer::Start(store, "tcp://127.0.0.1:0", [this] {
      return std::vector<std::pair<std::string, kvbus::TierStats>>{{"host", store.Stats()}};
    });
    Check(s.ok(), "the store server starts");
    server = std::move(s).value();
    client.set(zmq::sockopt::linger, 0);
    client.connect(server->endpoint());
  }

  // Sends `frames` and returns the reply's frames; aborts when none comes.
  std::vector<zmq::message_t> Call(const std::vector<std::string>& frames) {
    for (size_t i = 0; i < frames.size(); ++i) {
      client.send(zmq::buffer(frames[i]),
                  i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
    }
    Check(fuzz::PollIn(client, std::chrono::milliseconds(10000)),
          "the store answers every request within 10 s");
    std::vector<zmq::message_t> reply;
    for (;;) {
      zmq::message_t m;
      (void)client.recv(m, zmq::recv_flags::none);
      const bool more = m.more();
      reply.push_back(std::move(m));
      if (!more) break;
    }
    return reply;
  }
};

Rig& TheRig() {
  static Rig* rig = new Rig;
  return *rig;
}

std::string KeyBytes(const kvbus::ChunkKey& k) {
  uint8_t b[16];
  k.ToBytes(b);
  return std::string(reinterpret_cast<const char*>(b), 16);
}

std::string Input(uint8_t flags, const proto::StoreRequest& req, const std::string& payload = {}) {
  const std::string r = req.SerializeAsString();
  std::string s(1, static_cast<char>(flags));
  s.push_back(static_cast<char>(r.size() & 0xff));
  s.push_back(static_cast<char>(r.size() >> 8));
  return s + r + payload;
}

std::vector<std::string> Seeds() {
  const kvbus::ChunkInfo info{{0x1234, 0x5678}, {5, 6}, 2, 1, 4, 2, kdn::DType::kF16, 0};
  std::vector<uint8_t> payload(info.payload_bytes());
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 13);
  auto chunk = kvbus::Chunk::Make(info, payload);
  Check(chunk.ok(), "seed chunk");
  const std::string bytes(reinterpret_cast<const char*>((*chunk)->bytes().data()),
                          (*chunk)->size());

  std::vector<std::string> seeds;
  proto::StoreRequest put;
  put.set_id(1);
  put.mutable_put();
  seeds.push_back(Input(1, put, bytes));
  seeds.push_back(Input(3, put, bytes));
  proto::StoreRequest get;
  get.set_id(2);
  get.mutable_get()->set_key(KeyBytes(info.key));
  seeds.push_back(Input(0, get));
  proto::StoreRequest lookup;
  lookup.set_id(3);
  lookup.mutable_lookup()->add_keys(KeyBytes(info.key));
  lookup.mutable_lookup()->add_keys(KeyBytes({9, 9}));
  seeds.push_back(Input(0, lookup));
  proto::StoreRequest stats;
  stats.set_id(4);
  stats.mutable_stats();
  seeds.push_back(Input(4, stats));
  seeds.push_back(Input(0, proto::StoreRequest()));
  return seeds;
}

// Checks the reply to `frames` (request first); returns it.
proto::StoreReply CheckedCall(const std::vector<std::string>& frames) {
  std::vector<zmq::message_t> reply = TheRig().Call(frames);
  Check(reply.size() == 1 || reply.size() == 2, "a reply, and at most a chunk");
  proto::StoreReply r;
  Check(r.ParseFromArray(reply[0].data(), static_cast<int>(reply[0].size())), "a StoreReply");
  Check(r.code() >= 0 && r.code() <= static_cast<int32_t>(StatusCode::kIoError),
        "its code is a StatusCode");
  proto::StoreRequest req;
  if (!req.ParseFromArray(frames[0].data(), static_cast<int>(frames[0].size()))) {
    Check(r.code() == static_cast<int32_t>(StatusCode::kInvalidArgument),
          "a request that does not parse is INVALID_ARGUMENT");
    Check(reply.size() == 1, "and gets no chunk");
    return r;
  }
  Check(r.id() == req.id(), "the reply echoes the request's id");
  if (req.op_case() == proto::StoreRequest::kLookup && r.code() == 0) {
    Check(r.present_size() == req.lookup().keys_size(), "a presence per key");
  }
  if (reply.size() == 2) {
    Check(req.op_case() == proto::StoreRequest::kGet && r.code() == 0,
          "a chunk only for a successful get");
    const auto* d = static_cast<const uint8_t*>(reply[1].data());
    auto chunk = kvbus::Chunk::Parse(std::vector<uint8_t>(d, d + reply[1].size()));
    Check(chunk.ok(), "a valid chunk");
    Check(KeyBytes((*chunk)->key()) == req.get().key(), "of the key asked for");
  } else {
    Check(!(req.op_case() == proto::StoreRequest::kGet && r.code() == 0),
          "a successful get has its chunk");
  }
  return r;
}

void Put64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Refusing bytes that are not a message is the parsers' job; protobuf's
  // own log of them is noise here.
  google::protobuf::SetLogHandler(nullptr);
  fuzz::WriteSeedsIfAsked(Seeds());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  const uint8_t flags = data[0];
  const size_t len = std::min<size_t>(data[1] | (size_t{data[2]} << 8), size - 3);
  std::vector<std::string> frames{std::string(reinterpret_cast<const char*>(data + 3), len)};
  std::string payload(reinterpret_cast<const char*>(data + 3 + len), size - 3 - len);
  if ((flags & 2) && payload.size() >= kvbus::Chunk::kHeaderBytes) {
    auto* h = reinterpret_cast<uint8_t*>(payload.data());
    const size_t n = payload.size() - kvbus::Chunk::kHeaderBytes;
    Put64(h + 72, n);
    Put64(h + 80, XXH3_64bits(h + kvbus::Chunk::kHeaderBytes, n));
    Put64(h + 120, XXH3_64bits(h, 120));
  }
  if (flags & 1) frames.push_back(payload);
  if (flags & 4) frames.emplace_back();
  const proto::StoreReply r = CheckedCall(frames);

  proto::StoreRequest req;
  if (r.code() == 0 && (flags & 1) &&
      req.ParseFromArray(frames[0].data(), static_cast<int>(frames[0].size())) &&
      req.op_case() == proto::StoreRequest::kPut) {
    auto chunk = kvbus::Chunk::Parse(std::vector<uint8_t>(payload.begin(), payload.end()));
    Check(chunk.ok(), "a stored chunk is valid");
    proto::StoreRequest get;
    get.set_id(req.id() + 1);
    get.mutable_get()->set_key(KeyBytes((*chunk)->key()));
    Check(CheckedCall({get.SerializeAsString()}).code() == 0, "a stored chunk is got back");
  }
  return 0;
}
