// A kvbus sender's region planes (kdn/kvbus/region_plane.h): the receiver's
// regions opened through a DeviceOps backend, chunks written into them, and
// the registry of planes by name.

#include <algorithm>
#include <utility>

#include "kdn/common/mutex.h"
#include "planes/data_plane.h"

namespace kdn::kvbus {

namespace {

struct Registry {
  Mutex mu;
  std::map<std::string, RegionPlaneFactory> factories KDN_GUARDED_BY(mu);
};

// The registry, with the built-in planes.
Registry& Planes() {
  static Registry* r = [] {
    auto* reg = new Registry;
    MutexLock lock(reg->mu);
    reg->factories[kShmPlaneName] = [](const SenderOptions&) -> std::unique_ptr<RegionPlane> {
      return std::make_unique<MemoryPlane>(kShmPlaneName, RegionKind::kShm, HostDeviceOps());
    };
    // A kNccl sender's device plane is its link: it maps no device region.
    reg->factories[kCudaIpcPlaneName] = [](const SenderOptions& o) -> std::unique_ptr<RegionPlane> {
      if (o.device_ops == nullptr || o.transport == TransportKind::kNccl) return nullptr;
      return std::make_unique<MemoryPlane>(kCudaIpcPlaneName, RegionKind::kDevice, *o.device_ops);
    };
    return reg;
  }();
  return *r;
}

}  // namespace

const char* DefaultPlaneOf(RegionKind kind) {
  switch (kind) {
    case RegionKind::kShm: return kShmPlaneName;
    case RegionKind::kDevice: return kCudaIpcPlaneName;
    case RegionKind::kUnknown: break;
  }
  return "";
}

Status RegisterRegionPlane(const std::string& name, RegionPlaneFactory factory) {
  if (name.empty() || name == "tcp" || name == kLinkPlaneName || !factory) {
    return InvalidArgument(
        "kvbus: a region plane needs a name other than tcp and nccl, and a "
        "factory ('" +
        name + "')");
  }
  Registry& r = Planes();
  MutexLock lock(r.mu);
  if (!r.factories.emplace(name, std::move(factory)).second) {
    return FailedPrecondition("kvbus: a region plane named '" + name + "' is registered already");
  }
  return Status::Ok();
}

std::vector<std::string> RegionPlaneNames() {
  Registry& r = Planes();
  MutexLock lock(r.mu);
  std::vector<std::string> names;
  for (const auto& [name, factory] : r.factories) names.push_back(name);
  return names;
}

Status CheckRegionPlane(const std::string& name) {
  const std::vector<std::string> names = RegionPlaneNames();
  if (std::find(names.begin(), names.end(), name) != names.end()) return Status::Ok();
  std::string known;
  for (const std::string& n : names) known += (known.empty() ? "" : ", ") + n;
  return InvalidArgument("kvbus: no region plane named '" + name + "' (registered: " + known + ")");
}

std::map<std::string, std::unique_ptr<RegionPlane>> MakeRegionPlanes(const SenderOptions& options) {
  std::vector<std::pair<std::string, RegionPlaneFactory>> factories;
  {
    Registry& r = Planes();
    MutexLock lock(r.mu);
    factories.assign(r.factories.begin(), r.factories.end());
  }
  std::map<std::string, std::unique_ptr<RegionPlane>> planes;
  for (const auto& [name, make] : factories) {
    if (std::unique_ptr<RegionPlane> p = make(options)) planes.emplace(name, std::move(p));
  }
  return planes;
}

void MemoryPlane::Map(const std::vector<WireRegion>& regions) {
  for (const WireRegion& r : regions) {
    auto it = regions_.find(r.id);
    if (it != regions_.end() && it->second.handle == r.handle &&
        it->second.memory->bytes() == r.bytes) {
      continue;  // mapped already
    }
    if (it != regions_.end()) {  // the receiver was replaced: its old region is gone
      (void)table_.Unregister(table_ids_[r.id]);
      table_ids_.erase(r.id);
      regions_.erase(it);
    }
    Result<std::unique_ptr<DeviceMemory>> memory = ops_.Open(r.handle, r.bytes);
    if (!memory.ok()) {
      // Not on this host (or GPU) after all: another pid namespace, another user.
      error_ = memory.status();
      continue;
    }
    Result<uint32_t> id = table_.Register(
        Region{ops_.memory_kind(), ops_.device(), (*memory)->data(), (*memory)->bytes()});
    if (!id.ok()) continue;
    table_ids_[r.id] = *id;
    regions_[r.id] = PeerRegion{r.handle, std::move(memory).value()};
  }
}

Result<std::shared_ptr<const Chunk>> OutChunk::InHost() const {
  if (chunk_) return chunk_;
  const SourcedChunk& s = *sourced_;
  Status read;
  KDN_ASSIGN_OR_RETURN(std::shared_ptr<const Chunk> c, Chunk::Build(s.info, [&](uint8_t* p) {
                         read = s.memory->ops().Download(s.memory->data(), s.extents, p);
                       }));
  KDN_RETURN_IF_ERROR(read);
  if (!std::equal(s.header.begin(), s.header.end(), c->bytes().begin())) {
    return Corruption("sourced chunk " + s.info.key.ToHex() +
                      ": its payload changed since its header was sealed");
  }
  return c;
}

Result<std::pair<uint8_t*, std::vector<Extent>>> MemoryPlane::Resolve(
    const OutChunk& chunk, const RegionGrant& grant) const {
  // Region id 0 is never registered: an unmapped region is NOT_FOUND.
  const auto table_id = table_ids_.find(grant.region);
  const uint32_t id = table_id == table_ids_.end() ? 0 : table_id->second;
  const MemoryKind kind = ops_.memory_kind();
  const int device = ops_.device();
  KDN_ASSIGN_OR_RETURN(uint8_t * base, table_.Resolve(id, 0, 1, kind, device));
  if (grant.extents.empty()) {
    KDN_RETURN_IF_ERROR(table_.Resolve(id, grant.offset, chunk.size(), kind, device).status());
    return std::make_pair(base, std::vector<Extent>{{grant.offset, chunk.size()}});
  }
  uint64_t total = 0;
  for (const Extent& x : grant.extents) {
    KDN_RETURN_IF_ERROR(table_.Resolve(id, x.offset, x.bytes, kind, device).status());
    total += x.bytes;
  }
  if (total != chunk.payload_bytes()) {
    return InvalidArgument("an in-place grant of " + std::to_string(total) +
                           " bytes for a payload of " + std::to_string(chunk.payload_bytes()));
  }
  return std::make_pair(base, grant.extents);
}

Status MemoryPlane::Write(const OutChunk& chunk, const RegionGrant& grant, bool corrupt) {
  KDN_ASSIGN_OR_RETURN(auto where, Resolve(chunk, grant));
  auto& [base, extents] = where;
  // In place: the payload alone, piece by piece, into the receiver's
  // blocks; else the whole chunk at its offset, its header first.
  const bool in_place = !grant.extents.empty();
  std::vector<Extent> payload_at = extents;
  if (!in_place) {
    const Extent header{grant.offset, Chunk::kHeaderBytes};
    KDN_RETURN_IF_ERROR(ops_.Upload(chunk.header().data(), base, {&header, 1}));
    payload_at = {{grant.offset + Chunk::kHeaderBytes, chunk.payload_bytes()}};
  }
  const SourcedChunk* s = chunk.sourced();
  std::shared_ptr<const Chunk> host = chunk.chunk();
  if (s != nullptr && &s->memory->ops() == &ops_) {
    // From where it lies, by this backend alone: no host copy.
    KDN_RETURN_IF_ERROR(ops_.Copy(s->memory->data(), s->extents, base, payload_at));
  } else {
    if (!host) {
      KDN_ASSIGN_OR_RETURN(host, chunk.InHost());
    }
    // Everything past the header (a pruned chunk's kept offsets too): what
    // payload_bytes() counts.
    KDN_RETURN_IF_ERROR(
        ops_.Upload(host->bytes().subspan(Chunk::kHeaderBytes).data(), base, payload_at));
  }
  if (corrupt && chunk.payload_bytes() > 0) {
    // One payload byte flipped where it landed (SenderFaults::corrupt_data).
    uint64_t at = chunk.payload_bytes() / 2;
    for (const Extent& x : payload_at) {
      if (at < x.bytes) {
        const Extent one{x.offset + at, 1};
        uint8_t b = 0;
        KDN_RETURN_IF_ERROR(ops_.Download(base, {&one, 1}, &b));
        b ^= 0x5a;
        return ops_.Upload(&b, base, {&one, 1});
      }
      at -= x.bytes;
    }
  }
  return Status::Ok();
}

// ---- LinkPlane ----------------------------------------------------------------

Result<std::unique_ptr<LinkPlane>> LinkPlane::Make(DeviceOps& ops,
                                                   std::chrono::milliseconds timeout) {
  KDN_ASSIGN_OR_RETURN(std::string id, ops.NewLinkId());
  KDN_ASSIGN_OR_RETURN(std::unique_ptr<DeviceLink> link, ops.JoinLink(id, 0, timeout));
  return std::unique_ptr<LinkPlane>(new LinkPlane(ops, std::move(id), std::move(link)));
}

Status LinkPlane::Send(const OutChunk& chunk, bool corrupt) {
  if (!error_.ok()) return error_;
  Status sent = SendPayload(chunk, corrupt);
  if (!sent.ok()) {
    // The receiver is waiting for this message: a link that did not carry
    // it whole is out of step for good.
    link_->Abort();
    error_ = sent;
  }
  return sent;
}

Status LinkPlane::SendPayload(const OutChunk& chunk, bool corrupt) {
  const SourcedChunk* s = chunk.sourced();
  if (s != nullptr && &s->memory->ops() == &ops_ && !corrupt) {
    // From where it lies, by this backend alone: no host copy.
    return link_->Send(s->memory->data(), s->extents);
  }
  // From host memory: the chunk's, or a sourced payload read as it lies
  // now (the receiver checks it against the sealed header).
  std::span<const uint8_t> payload;
  std::vector<uint8_t> copy;
  if (const std::shared_ptr<const Chunk>& host = chunk.chunk()) {
    payload = host->bytes().subspan(Chunk::kHeaderBytes);  // kept offsets too
  } else {
    copy.resize(chunk.payload_bytes());
    KDN_RETURN_IF_ERROR(s->memory->ops().Download(s->memory->data(), s->extents, copy.data()));
    payload = copy;
  }
  if (corrupt && !payload.empty()) {
    if (copy.empty()) copy.assign(payload.begin(), payload.end());
    copy[copy.size() / 2] ^= 0x5a;
    payload = copy;
  }
  const Extent whole{0, payload.size()};
  if (ops_.memory_kind() == MemoryKind::kHost) return link_->Send(payload.data(), {&whole, 1});
  if (!stage_ || stage_->bytes() < payload.size()) {
    stage_.reset();
    KDN_ASSIGN_OR_RETURN(stage_, ops_.Allocate(std::max<uint64_t>(1, payload.size())));
  }
  KDN_RETURN_IF_ERROR(ops_.Upload(payload.data(), stage_->data(), {&whole, 1}));
  return link_->Send(stage_->data(), {&whole, 1});
}

}  // namespace kdn::kvbus
