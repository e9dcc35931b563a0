// The Decoder's side of the KV a prefill worker pushes (docs/serving.md,
// "Inside a worker"): the regions its layer slices name, where they land
// in place, and how they are placed at the Start, with a per-head pruned
// document's holes.

#include <algorithm>

#include "kdn/decode_worker/decoder.h"
#include "kdn/kvbridge/head_pruned.h"
#include "kdn/kvbridge/paged_chunks.h"
#include "kdn/kvbus/transfer_plan.h"

namespace kdn::decode_worker {

Status Decoder::PlacePushedSlices(Prepared& p, const std::set<kvbus::ChunkKey>& landed) {
  engine::KvCache& cache = model_.kv_cache();
  const auto prompt = static_cast<int64_t>(p.request.tokens.size());
  const int64_t n = p.kv_tokens > 0 ? p.kv_tokens : prompt;
  for (const kvbus::KvRegion& r : PushedRegions(p, n)) {
    for (int l = 0; l < cache.num_layers(); ++l) {
      const kvbus::ChunkKey key = kvbus::LayerSliceKey(r.parent, l);
      if (landed.count(key) != 0) continue;  // in its blocks already
      auto slice = staging_.Get(key);
      if (!slice.ok()) {
        return Unavailable("layer " + std::to_string(l) + " of the KV of tokens [" +
                           std::to_string(r.first) + ", " + std::to_string(r.first + r.count) +
                           ") never arrived");
      }
      if ((*slice)->info().tokens != static_cast<uint32_t>(r.count)) {
        return Corruption("KV slice " + key.ToHex() + " has " +
                          std::to_string((*slice)->info().tokens) + " tokens, expected " +
                          std::to_string(r.count));
      }
      KDN_RETURN_IF_ERROR(kvbridge::LayerSliceToPagedKv(**slice, l, cache, p.seq, r.first));
      start_copy_bytes_ += (*slice)->payload().size();
      staging_.Erase(key);  // named for this request alone
    }
  }
  cache.SetLength(p.seq, n);
  // A document pruned per head: its heads' holes.
  if (!p.kv_holes.empty()) KDN_RETURN_IF_ERROR(kvbridge::UnpackHoles(p.kv_holes, n, cache, p.seq));
  // Fewer slots than tokens (pruned documents): the next token still sits
  // where it would after the whole prompt.
  return n < prompt ? p.seq.SetNextPosition(prompt) : Status::Ok();
}

void Decoder::ExpectSlices(uint64_t id, const Prepared& p) {
  if (options_.landing == nullptr || p.request.local_prefill) return;
  engine::KvCache& cache = model_.kv_cache();
  std::vector<ExpectedSlice> slices;
  for (const kvbus::KvRegion& r : PushedRegions(p, static_cast<int64_t>(p.request.tokens.size()))) {
    for (int l = 0; l < cache.num_layers(); ++l) {
      ExpectedSlice s;
      // A slice whose place cannot be named (not expected: it does not
      // happen with a pool of one region) comes through staging.
      if (!cache.LayerRanges(p.seq, l, r.first, r.count, &s.extents).ok()) continue;
      s.info = kvbridge::LayerSliceInfo(cache, r.first, r.count, kvbus::LayerSliceKey(r.parent, l),
                                        fingerprint_, cache.Memory().dtype);
      slices.push_back(std::move(s));
    }
  }
  options_.landing->Expect(id, std::move(slices));
}

std::vector<kvbus::KvRegion> Decoder::PushedRegions(const Prepared& p, int64_t kv_tokens) const {
  return kvbus::TransferRegions(static_cast<int64_t>(p.keys.size()), kv_tokens,
                                options_.chunk_tokens, std::max<int64_t>(p.held_tokens, 0),
                                p.request.transfer_id);
}

void Decoder::DropOwnSlices(const Prepared& p) {
  for (const kvbus::KvRegion& r : PushedRegions(p, static_cast<int64_t>(p.request.tokens.size()))) {
    for (int l = 0; l < model_.kv_cache().num_layers(); ++l) {
      staging_.Erase(kvbus::LayerSliceKey(r.parent, l));
    }
  }
}

}  // namespace kdn::decode_worker
