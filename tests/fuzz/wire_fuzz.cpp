// libFuzzer harness for the kvbus tcp transport's control frames
// (DecodeWire, kdn/kvbus/wire.h): what a sender or receiver reads from
// its peer before any chunk.
//
// The input is one frame. DecodeWire must not crash or hit undefined
// behaviour, refuse with CORRUPTION or INVALID_ARGUMENT, and a message it
// accepts must encode (EncodeWire) to a frame that decodes again to the
// same message (status messages aside: the decoder prefixes them with who
// said them).
//
// Seeds: one frame of each message (KDN_FUZZ_WRITE_SEEDS=DIR
// build/bin/kdn_wire_fuzz).
//
// Built with clang's -fsanitize=fuzzer,address,undefined (tests/fuzz); the
// test `wire_fuzz` (label fuzz) runs it over tests/fuzz/corpus/wire.
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include <google/protobuf/stubs/logging.h>

#include "fuzz_util.h"
#include "kdn/kvbus/wire.h"

using namespace kdn::kvbus;
using kdn::fuzz::Check;

namespace {

std::string Bytes(const WireMessage& m) {
  auto f = EncodeWire(m);
  Check(f.ok(), "EncodeWire");
  return std::string(static_cast<const char*>(f->data()), f->size());
}

// A message's fields, its statuses by code only.
std::string Fields(const WireMessage& m) {
  std::string s = std::to_string(m.index());
  auto add = [&s](uint64_t v) { s += " " + std::to_string(v); };
  auto key = [&](const ChunkKey& k) { s += " " + k.ToHex(); };
  std::visit(
      [&](const auto& x) {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, WireOffer>) {
          add(x.batch);
          for (const std::string& p : x.planes) s += " " + p;
          s += " " + x.host_id;
          for (const auto& e : x.entries) key(e.key), add(e.bytes);
        } else if constexpr (std::is_same_v<T, WireDecisions>) {
          add(x.batch);
          for (const auto& d : x.decisions) {
            key(d.key), add(static_cast<uint64_t>(d.kind)),
                add(static_cast<uint64_t>(d.status.code()));
            add(d.region), add(d.offset);
          }
          for (const auto& r : x.regions) {
            add(r.id), add(r.bytes), s += " " + r.plane, s += " " + r.handle;
          }
        } else if constexpr (std::is_same_v<T, WireChunkHeader>) {
          add(x.batch), key(x.key), add(x.bytes), add(x.landed);
        } else if constexpr (std::is_same_v<T, WireAcks>) {
          for (const auto& a : x.acks) {
            add(a.batch), key(a.key), add(static_cast<uint64_t>(a.status.code())), add(a.duplicate);
          }
        } else if constexpr (std::is_same_v<T, WirePing>) {
          add(x.seq);
        } else if constexpr (std::is_same_v<T, WirePong>) {
          add(x.seq);
          for (uint64_t b : x.waiting_batches) add(b);
        } else {
          add(x.batch);
          for (const auto& k : x.keys) key(k);
        }
      },
      m);
  return s;
}

std::vector<std::string> Seeds() {
  const ChunkKey k1{1, 2}, k2{0xfedcba9876543210ull, 3};
  WireDecisions d{7, {}, {{1, 4096, "/kdn-landing-1"}}};
  d.decisions.push_back({k1, WireDecisionKind::kHeld});
  d.decisions.push_back({k2, WireDecisionKind::kGranted, kdn::Status::Ok(), 1, 512});
  d.decisions.push_back({k1, WireDecisionKind::kRejected, kdn::ResourceExhausted("full")});
  WireAcks a;
  a.acks.push_back({7, k1, kdn::Status::Ok(), false});
  a.acks.push_back({7, k2, kdn::Corruption("bad checksum"), true});
  return {Bytes(WireOffer{7, {{k1, 100}, {k2, 200}}, {"shm", "cuda_ipc"}, "host-a"}),
          Bytes(d),
          Bytes(WireChunkHeader{7, k2, 200, true}),
          Bytes(a),
          Bytes(WirePing{9}),
          Bytes(WirePong{9, {3, 1, 2}}),
          Bytes(WireCancel{7, {k1}})};
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Refusing bytes that are not a message is the parsers' job; protobuf's
  // own log of them is noise here.
  google::protobuf::SetLogHandler(nullptr);
  kdn::fuzz::WriteSeedsIfAsked(Seeds());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto m = DecodeWire(data, size);
  if (!m.ok()) {
    Check(m.status().code() == kdn::StatusCode::kCorruption ||
              m.status().code() == kdn::StatusCode::kInvalidArgument,
          "a refusal is CORRUPTION or INVALID_ARGUMENT");
    return 0;
  }
  const std::string once = Bytes(*m);
  auto again = DecodeWire(once.data(), once.size());
  Check(again.ok(), "an accepted message encodes to a frame that decodes");
  Check(Fields(*again) == Fields(*m), "to the same message");
  return 0;
}
