// The shm data plane of a kvbus sender (data_plane.h): the receiver's shared
// segments mapped through their memfd handles, and chunks written into them.

#include <cstring>

#include "data_plane.h"
#include "stream_copy.h"

namespace kdn::kvbus {

void ShmPlane::Map(const std::vector<WireRegion>& regions) {
  for (const WireRegion& r : regions) {
    auto it = regions_.find(r.id);
    if (it != regions_.end() && it->second.handle == r.handle &&
        it->second.segment->bytes() == r.bytes) {
      continue;  // mapped already
    }
    if (it != regions_.end()) {  // the receiver was replaced: its old segment is gone
      (void)table_.Unregister(table_ids_[r.id]);
      table_ids_.erase(r.id);
      regions_.erase(it);
    }
    Result<std::unique_ptr<SharedSegment>> segment = SharedSegment::Open(r.handle, r.bytes);
    if (!segment.ok()) {
      // Not on this host after all (another pid namespace, another user).
      error_ = segment.status();
      continue;
    }
    Result<uint32_t> id =
        table_.Register(Region{MemoryKind::kHost, -1, (*segment)->data(), (*segment)->bytes()});
    if (!id.ok()) continue;
    table_ids_[r.id] = *id;
    regions_[r.id] = PeerRegion{r.handle, std::move(segment).value()};
  }
}

Result<std::vector<uint8_t*>> ShmPlane::Resolve(const Chunk& chunk,
                                                const RegionGrant& grant) const {
  // Region id 0 is never registered: an unmapped region is NOT_FOUND.
  const auto table_id = table_ids_.find(grant.region);
  const uint32_t id = table_id == table_ids_.end() ? 0 : table_id->second;
  std::vector<uint8_t*> at;
  if (grant.extents.empty()) {
    KDN_ASSIGN_OR_RETURN(uint8_t * dst,
                         table_.Resolve(id, grant.offset, chunk.size(), MemoryKind::kHost));
    at.push_back(dst);
    return at;
  }
  uint64_t total = 0;
  for (const Extent& x : grant.extents) {
    KDN_ASSIGN_OR_RETURN(uint8_t * dst, table_.Resolve(id, x.offset, x.bytes, MemoryKind::kHost));
    at.push_back(dst);
    total += x.bytes;
  }
  if (total != chunk.payload().size()) {
    return InvalidArgument("an in-place grant of " + std::to_string(total) +
                           " bytes for a payload of " + std::to_string(chunk.payload().size()));
  }
  return at;
}

Status ShmPlane::Write(const Chunk& chunk, const RegionGrant& grant, bool corrupt) {
  KDN_ASSIGN_OR_RETURN(std::vector<uint8_t*> dst, Resolve(chunk, grant));
  uint8_t* middle = nullptr;  // the byte `corrupt` flips
  if (!grant.extents.empty()) {
    // The payload alone, piece by piece, into the receiver's blocks.
    const uint8_t* from = chunk.payload().data();
    uint64_t left = chunk.payload().size() / 2;
    for (size_t i = 0; i < grant.extents.size(); ++i) {
      StreamCopy(dst[i], from, grant.extents[i].bytes);
      if (middle == nullptr && left < grant.extents[i].bytes) middle = dst[i] + left;
      if (middle == nullptr) left -= grant.extents[i].bytes;
      from += grant.extents[i].bytes;
    }
  } else {
    StreamCopy(dst[0], chunk.bytes().data(), chunk.size());
    middle =
        dst[0] + (chunk.payload().empty() ? 0 : Chunk::kHeaderBytes + chunk.payload().size() / 2);
  }
  if (corrupt && middle != nullptr) *middle ^= 0x5a;
  return Status::Ok();
}

}  // namespace kdn::kvbus
