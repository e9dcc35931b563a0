// libFuzzer harness for the workers' message handlers: a real PrefillService
// and DecodeService (kdn/prefill_worker/prefill_service.h,
// kdn/decode_worker/decode_service.h) on the `tiny` preset on the CPU,
// spoken to over loopback by two DEALER sockets as a router would.
//
// The input is a sequence of records [target][length, u16 little-endian]
// [message]: target bit 0 picks the worker (0 prefill, 1 decode), the message
// is a proto::WorkerMessage as sent, or bytes that are not one. The harness
// changes only what would send traffic elsewhere or confuse its own waiting:
// a prefill's decode endpoint, when set, becomes the decode worker's kvbus
// endpoint, and request ids keep clear of the ids it uses itself. Each
// record is sent and its answer waited for (a prefill, inject, lookup, info
// or prepare reply, a start's first token events); a message that gets no
// answer is followed by an info request, whose answer says the worker has
// handled it. Then every request of the input is cancelled.
//
// The workers must not crash or hit undefined behaviour, must answer what
// they answer within 20 s (a hang otherwise), and once every request is
// cancelled must come back to idle: no queued or running request, every KV
// block free.
//
// Seeds: what a router sends for plain, cached, pushed and blended requests,
// injections, lookups and cancels (KDN_FUZZ_WRITE_SEEDS=DIR
// build/bin/kdn_worker_fuzz).
//
// Built with clang's -fsanitize=fuzzer,address,undefined (tests/fuzz); the
// test `worker_fuzz` (label fuzz) runs it over tests/fuzz/corpus/worker.
#include <zmq.hpp>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <google/protobuf/stubs/logging.h>

#include "fuzz_util.h"
#include "zmq_poll.h"
#include "kdn/decode_worker/decode_service.h"
#include "kdn/engine/presets.h"
#include "kdn/prefill_worker/prefill_service.h"
#include "serving.pb.h"

using namespace kdn;
using kdn::fuzz::Check;

namespace {

constexpr int kChunk = 16;
constexpr auto kWait = std::chrono::seconds(20);
// Request ids the harness uses itself (its info requests): the top bit.
constexpr uint64_t kOwnIds = uint64_t{1} << 63;

using Body = proto::WorkerMessage::BodyCase;

// One worker and the router's socket to it.
struct Peer {
  zmq::socket_t sock;
  uint64_t next_own_id = kOwnIds;

  Peer(zmq::context_t& ctx, const std::string& endpoint) : sock(ctx, zmq::socket_type::dealer) {
    sock.set(zmq::sockopt::linger, 0);
    sock.connect(endpoint);
  }

  void Send(const std::string& bytes) { sock.send(zmq::buffer(bytes), zmq::send_flags::none); }

  // Waits for a message of request `id` with body `body`; others are dropped.
  proto::WorkerMessage WaitFor(uint64_t id, Body body, const char* what) {
    const auto deadline = std::chrono::steady_clock::now() + kWait;
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (!fuzz::PollIn(sock, left)) {
        std::fprintf(stderr, "no answer to request %llu (%s)\n",
                     static_cast<unsigned long long>(id), what);
        Check(false, "a worker answers within 20 s");
      }
      zmq::message_t m;
      (void)sock.recv(m, zmq::recv_flags::none);
      proto::WorkerMessage msg;
      Check(msg.ParseFromArray(m.data(), static_cast<int>(m.size())),
            "workers send WorkerMessages");
      if (msg.request_id() == id && msg.body_case() == body) return msg;
    }
  }

  // The worker's info, once it has handled everything sent before.
  proto::WorkerInfo Info() {
    proto::WorkerMessage m;
    m.set_request_id(next_own_id++);
    m.mutable_info_request();
    Send(m.SerializeAsString());
    return WaitFor(m.request_id(), Body::kInfo, "info").info();
  }

  void Drain() {
    zmq::message_t m;
    while (sock.recv(m, zmq::recv_flags::dontwait)) {
    }
  }
};

struct Rig {
  std::unique_ptr<prefill_worker::PrefillService> prefill;
  std::unique_ptr<decode_worker::DecodeService> decode;
  zmq::context_t ctx{1};
  std::unique_ptr<Peer> to_prefill, to_decode;

  Rig() {
    const auto dir = fuzz::ScratchDir() / "tiny";
    auto preset = engine::FindPreset("tiny");
    Check(preset.ok(), "the tiny preset");
    Check(engine::WriteModelFolder(dir, preset->config, 1, preset->dtype).ok(), "model folder");
    auto p = prefill_worker::PrefillService::Start({.model_dir = dir,
                                                    .host_bytes = 16u << 20,
                                                    .chunk_tokens = kChunk,
                                                    .engine = {.kv_tokens = 1024, .threads = 1},
                                                    .kv_transport = kvbus::TransportKind::kTcp});
    Check(p.ok(), "the prefill worker starts");
    prefill = std::move(p).value();
    auto d = decode_worker::DecodeService::Start({.model_dir = dir,
                                                  .host_bytes = 16u << 20,
                                                  .staging_bytes = 16u << 20,
                                                  .chunk_tokens = kChunk,
                                                  .engine = {.kv_tokens = 1024, .threads = 1},
                                                  .max_batch = 4,
                                                  .kv_transport = kvbus::TransportKind::kTcp});
    Check(d.ok(), "the decode worker starts");
    decode = std::move(d).value();
    to_prefill = std::make_unique<Peer>(ctx, prefill->endpoint());
    to_decode = std::make_unique<Peer>(ctx, decode->endpoint());
  }
};

Rig& TheRig() {
  static Rig* rig = new Rig;  // never destroyed: workers' threads outlive inputs
  return *rig;
}

// The answer a message gets from its worker, if any (kBodyNotSet: none).
Body Answer(bool decode, const proto::WorkerMessage& m) {
  switch (m.body_case()) {
    case Body::kInfoRequest: return Body::kInfo;
    case Body::kLookup: return Body::kLookupReply;
    case Body::kPrefill: return decode ? Body::BODY_NOT_SET : Body::kPrefillReply;
    case Body::kInject: return decode ? Body::BODY_NOT_SET : Body::kInjectReply;
    case Body::kPrepare: return decode ? Body::kPrepareReply : Body::BODY_NOT_SET;
    case Body::kStart: return decode ? Body::kTokens : Body::BODY_NOT_SET;
    default: return Body::BODY_NOT_SET;
  }
}

// Waits until the worker is idle with every KV block free.
void WaitIdle(Peer& peer, const char* who) {
  const auto deadline = std::chrono::steady_clock::now() + kWait;
  for (;;) {
    const proto::WorkerInfo info = peer.Info();
    if (info.queue_depth() == 0 && info.free_kv_blocks() == info.total_kv_blocks()) return;
    if (std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "%s: %d requests, %d of %d KV blocks free\n", who, info.queue_depth(),
                   info.free_kv_blocks(), info.total_kv_blocks());
      Check(false, "a worker whose requests are all cancelled comes back to idle");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

std::string Record(bool decode, const proto::WorkerMessage& m) {
  const std::string b = m.SerializeAsString();
  std::string s(1, decode ? '\1' : '\0');
  s.push_back(static_cast<char>(b.size() & 0xff));
  s.push_back(static_cast<char>(b.size() >> 8));
  return s + b;
}

std::vector<int32_t> Prompt(int n, int seed) {
  std::vector<int32_t> t{256};
  for (int i = 1; i < n; ++i) t.push_back(32 + (i * 7 + seed * 13) % 90);
  return t;
}

proto::WorkerMessage Prefill(uint64_t id, const std::vector<int32_t>& tokens, bool push) {
  proto::WorkerMessage m;
  m.set_request_id(id);
  auto* p = m.mutable_prefill();
  for (int32_t t : tokens) p->add_tokens(t);
  p->mutable_sampling()->set_temperature(0);
  p->mutable_sampling()->set_top_p(1);
  if (push) {
    p->set_decode_endpoint("decode");
    p->set_transfer_id("t" + std::to_string(id));
  }
  return m;
}

proto::WorkerMessage Prepare(uint64_t id, const std::vector<int32_t>& tokens, int max_tokens,
                             bool blended = false) {
  proto::WorkerMessage m;
  m.set_request_id(id);
  auto* p = m.mutable_prepare();
  for (int32_t t : tokens) p->add_tokens(t);
  p->mutable_sampling()->set_temperature(0);
  p->mutable_sampling()->set_top_p(1);
  p->set_max_tokens(max_tokens);
  p->add_stop_ids(257);
  p->add_stop_strings("\n\n");
  p->set_transfer_id("t" + std::to_string(id));
  p->set_blended(blended);
  return m;
}

proto::WorkerMessage Start(uint64_t id, int32_t first, bool sent) {
  proto::WorkerMessage m;
  m.set_request_id(id);
  m.mutable_start()->set_first_token(first);
  m.mutable_start()->set_first_token_sent(sent);
  return m;
}

proto::WorkerMessage Cancel(uint64_t id) {
  proto::WorkerMessage m;
  m.set_request_id(id);
  m.mutable_cancel();
  return m;
}

std::vector<std::string> Seeds() {
  std::vector<std::string> seeds;
  proto::WorkerMessage info;
  info.set_request_id(1);
  info.mutable_info_request();
  seeds.push_back(Record(false, info) + Record(true, info));

  const auto prompt = Prompt(40, 1);
  auto longer = prompt;
  for (int32_t t : Prompt(20, 2)) longer.push_back(t);
  seeds.push_back(Record(false, Prefill(1, prompt, false)) +
                  Record(false, Prefill(2, longer, false)));

  // Prepare, prefill pushing the KV, start: a whole request.
  seeds.push_back(Record(true, Prepare(3, prompt, 4)) + Record(false, Prefill(3, prompt, true)) +
                  Record(true, Start(3, 65, true)));
  seeds.push_back(Record(true, Prepare(4, longer, 3)) + Record(false, Prefill(4, longer, true)) +
                  Record(true, Start(4, 65, false)));

  // A document injected, then a blend request over it.
  const auto doc = Prompt(24, 3);
  proto::WorkerMessage inject;
  inject.set_request_id(5);
  for (size_t i = 1; i < doc.size(); ++i) inject.mutable_inject()->add_tokens(doc[i]);
  std::vector<int32_t> blended{256};
  blended.insert(blended.end(), doc.begin() + 1, doc.end());
  for (int32_t t : Prompt(10, 4)) blended.push_back(t == 256 ? 65 : t);
  proto::WorkerMessage blend = Prefill(6, blended, true);
  auto* b = blend.mutable_prefill()->mutable_blend();
  b->set_head_tokens(1);
  b->add_segment_tokens(static_cast<int32_t>(doc.size()) - 1);
  b->set_recompute_ratio(0.5);
  b->set_check_layer(1);
  seeds.push_back(Record(false, inject) + Record(true, Prepare(6, blended, 2, true)) +
                  Record(false, blend) + Record(true, Start(6, 70, true)));

  // Lookups with the prompt, keys that are not 16 bytes and segment keys.
  proto::WorkerMessage lookup;
  lookup.set_request_id(7);
  auto* l = lookup.mutable_lookup();
  for (int32_t t : prompt) l->add_tokens(t);
  l->add_keys(std::string(16, '\1'));
  l->add_keys("short");
  l->add_segment_keys(std::string(16, '\2'));
  l->set_ns("tenant");
  seeds.push_back(Record(false, lookup) + Record(true, lookup));

  // Cancels: of a prepared request, of nothing, and a start never prepared.
  seeds.push_back(Record(true, Prepare(8, prompt, 8)) + Record(true, Cancel(8)) +
                  Record(false, Cancel(9)) + Record(true, Start(10, 1, false)));
  // Not a WorkerMessage.
  seeds.push_back(std::string("\1\4\0\xff\xff\xff\xff", 7));
  return seeds;
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
  Rig& rig = TheRig();
  std::set<std::pair<bool, uint64_t>> ids;
  for (int records = 0; size >= 3 && records < 8; ++records) {
    const bool decode = data[0] & 1;
    const size_t len = std::min<size_t>(data[1] | (size_t{data[2]} << 8), size - 3);
    std::string bytes(reinterpret_cast<const char*>(data + 3), len);
    data += 3 + len;
    size -= 3 + len;
    Peer& peer = decode ? *rig.to_decode : *rig.to_prefill;
    proto::WorkerMessage m;
    if (!m.ParseFromString(bytes)) {
      peer.Send(bytes);
      (void)peer.Info();
      continue;
    }
    m.set_request_id(m.request_id() & ~kOwnIds);
    if (m.has_prefill() && !m.prefill().decode_endpoint().empty()) {
      m.mutable_prefill()->set_decode_endpoint(rig.decode->kvbus_endpoint());
    }
    ids.insert({decode, m.request_id()});
    peer.Send(m.SerializeAsString());
    const Body answer = Answer(decode, m);
    if (answer == Body::BODY_NOT_SET) {
      (void)peer.Info();
    } else {
      (void)peer.WaitFor(m.request_id(), answer, decode ? "decode" : "prefill");
    }
  }
  for (const auto& [decode, id] : ids) {
    (decode ? *rig.to_decode : *rig.to_prefill).Send(Cancel(id).SerializeAsString());
  }
  WaitIdle(*rig.to_prefill, "prefill");
  WaitIdle(*rig.to_decode, "decode");
  rig.to_prefill->Drain();
  rig.to_decode->Drain();
  return 0;
}
