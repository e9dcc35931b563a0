#include "kdn/kvbus/disk_tier.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <system_error>
#include <tuple>
#include <vector>

namespace kdn::kvbus {

namespace fs = std::filesystem;

namespace {

constexpr const char* kExtension = ".kvc";
// Temporaries are "<key>.kvc.tmp-<pid>-<n>": beside their final name, so the
// rename stays within one folder (and one file system) and is atomic.
constexpr const char* kTempMarker = ".kvc.tmp";
constexpr const char* kLockName = "LOCK";

std::string ErrnoText(int e) { return std::error_code(e, std::generic_category()).message(); }

// A full disk is the tier's capacity running out, as far as callers go.
Status ErrnoStatus(const char* op, const fs::path& path, int e) {
  std::string msg = std::string("disk tier: ") + op + " " + path.string() + ": " + ErrnoText(e);
  if (e == ENOSPC || e == EDQUOT) return ResourceExhausted(std::move(msg));
  return IoError(std::move(msg));
}

Status WriteFileSynced(const fs::path& path, std::span<const uint8_t> bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus("create", path, errno);
  const uint8_t* p = bytes.data();
  size_t left = bytes.size();
  int err = 0;
  while (left > 0 && err == 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno != EINTR) err = errno;
      continue;
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  const char* op = "write";
  if (err == 0 && ::fsync(fd) != 0) {
    err = errno;
    op = "fsync";
  }
  // close() can report a deferred write error (NFS, quota).
  if (::close(fd) != 0 && err == 0) {
    err = errno;
    op = "close";
  }
  if (err != 0) {
    ::unlink(path.c_str());
    return ErrnoStatus(op, path, err);
  }
  return Status::Ok();
}

// NOT_FOUND if the file does not exist. Sets its modification time to now
// (best effort), which is what orders eviction after a restart.
Result<std::vector<uint8_t>> ReadFileAndTouch(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int e = errno;
    if (e == ENOENT) return NotFound("disk tier: " + path.string() + " is gone");
    return ErrnoStatus("open", path, e);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    return ErrnoStatus("stat", path, e);
  }
  std::vector<uint8_t> bytes(static_cast<size_t>(st.st_size));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::read(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int e = errno;
      ::close(fd);
      return ErrnoStatus("read", path, e);
    }
    if (n == 0) break;  // shrank under us: Parse will call it truncated
    done += static_cast<size_t>(n);
  }
  bytes.resize(done);
  (void)::futimens(fd, nullptr);
  ::close(fd);
  return bytes;
}

// Makes a rename durable. Best effort: if it fails the chunk may be lost in
// a crash, which for a cache is a miss, not an error.
void SyncDir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  (void)::fsync(fd);
  ::close(fd);
}

bool IsHexByte(const std::string& s) {
  return s.size() == 2 && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

std::string TempSuffix() {
  static std::atomic<uint64_t> counter{0};
  // Appended piecewise: GCC 12 warns (-Wrestrict, falsely) on "-" + string.
  std::string s = ".tmp-";
  s += std::to_string(::getpid());
  s += '-';
  s += std::to_string(counter.fetch_add(1));
  return s;
}

}  // namespace

DiskTier::DiskTier(fs::path dir, uint64_t capacity_bytes, int lock_fd)
    : dir_(std::move(dir)), capacity_(capacity_bytes), lock_fd_(lock_fd) {}

DiskTier::~DiskTier() { ::close(lock_fd_); }

Result<std::unique_ptr<DiskTier>> DiskTier::Open(fs::path dir, uint64_t capacity_bytes) {
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec)) {
    return FailedPrecondition("disk tier: " + dir.string() + " is not a folder");
  }
  fs::create_directories(dir, ec);
  if (ec) return IoError("disk tier: create " + dir.string() + ": " + ec.message());
  const fs::path lock_path = dir / kLockName;
  const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus("open", lock_path, errno);
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    ::close(fd);
    if (e == EWOULDBLOCK) {
      return FailedPrecondition("disk tier: " + dir.string() + " is in use by another DiskTier (" +
                                lock_path.string() + " is locked)");
    }
    return ErrnoStatus("lock", lock_path, e);
  }
  std::unique_ptr<DiskTier> tier(new DiskTier(std::move(dir), capacity_bytes, fd));
  KDN_RETURN_IF_ERROR(tier->Rebuild());
  return tier;
}

Status DiskTier::Rebuild() {
  struct Found {
    fs::file_time_type mtime;
    ChunkKey key;
    uint64_t bytes;
  };
  std::vector<Found> found;
  std::error_code ec;
  for (fs::directory_iterator sub(dir_, ec), end; !ec && sub != end; sub.increment(ec)) {
    const std::string prefix = sub->path().filename().string();
    if (!IsHexByte(prefix) || !sub->is_directory(ec)) continue;
    std::error_code fec;
    for (fs::directory_iterator f(sub->path(), fec); !fec && f != end; f.increment(fec)) {
      const std::string name = f->path().filename().string();
      if (name.find(kTempMarker) != std::string::npos) {
        // A write that never reached its rename: its writer is gone, since
        // we hold the folder's lock.
        std::error_code rec;
        fs::remove(f->path(), rec);
        continue;
      }
      if (!f->is_regular_file(fec) || name.size() != 32 + 4 || !name.ends_with(kExtension))
        continue;
      const std::string hex = name.substr(0, 32);
      auto key = ChunkKey::FromHex(hex);
      // Only the canonical name in the right folder: anything else is not ours.
      if (!key.ok() || key->ToHex() != hex || hex.compare(0, 2, prefix) != 0) continue;
      std::error_code sec;
      const uint64_t size = f->file_size(sec);
      const fs::file_time_type mtime = f->last_write_time(sec);
      if (sec) continue;  // vanished while we looked
      found.push_back({mtime, *key, size});
    }
    if (fec)
      return IoError("disk tier: read folder " + sub->path().string() + ": " + fec.message());
  }
  if (ec) return IoError("disk tier: read folder " + dir_.string() + ": " + ec.message());
  // Oldest first, so the newest ends up most recent; ties broken by key so
  // the order does not depend on the file system's listing order.
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) {
    return std::tie(a.mtime, a.key) < std::tie(b.mtime, b.key);
  });
  MutexLock lock(mu_);
  for (const Found& f : found) InsertLocked(f.key, f.bytes);
  EvictLocked(nullptr);
  return Status::Ok();
}

fs::path DiskTier::PathFor(const ChunkKey& key) const {
  const std::string hex = key.ToHex();
  return dir_ / hex.substr(0, 2) / (hex + kExtension);
}

void DiskTier::InsertLocked(const ChunkKey& key, uint64_t bytes) {
  lru_.push_front(key);
  index_[key] = Entry{bytes, next_generation_++, lru_.begin()};
  bytes_ += bytes;
}

void DiskTier::EraseLocked(const ChunkKey& key, bool remove_file) {
  auto it = index_.find(key);
  if (it == index_.end()) return;
  if (remove_file) {
    // A file that cannot be removed is re-indexed by the next Open, and is
    // verified before it is ever served, so nothing more is needed here.
    (void)::unlink(PathFor(key).c_str());
  }
  bytes_ -= it->second.bytes;
  lru_.erase(it->second.lru);
  index_.erase(it);
}

void DiskTier::EvictLocked(const ChunkKey* keep) {
  if (capacity_ == 0) return;
  auto victim = lru_.end();
  while (bytes_ > capacity_ && victim != lru_.begin()) {
    --victim;
    if (keep != nullptr && *victim == *keep) continue;
    const ChunkKey key = *victim;
    ++victim;  // stays valid: only the victim's node is erased
    EraseLocked(key, true);
    ++evictions_;
  }
}

Result<std::shared_ptr<const Chunk>> DiskTier::Get(const ChunkKey& key) {
  uint64_t generation = 0;
  {
    MutexLock lock(mu_);
    auto it = index_.find(key);
    if (it == index_.end()) {
      ++misses_;
      return NotFound("disk tier: no chunk " + key.ToHex());
    }
    lru_.splice(lru_.begin(), lru_, it->second.lru);
    generation = it->second.generation;
  }
  const fs::path path = PathFor(key);
  // Read outside the lock: chunks are megabytes and disks are slow. If the
  // file is evicted meanwhile, the read sees it gone (or, already open, whole).
  auto bytes = ReadFileAndTouch(path);
  auto drop_if_same = [&](bool remove_file) KDN_REQUIRES(mu_) {
    auto it = index_.find(key);
    if (it != index_.end() && it->second.generation == generation) EraseLocked(key, remove_file);
  };
  if (!bytes.ok()) {
    MutexLock lock(mu_);
    ++misses_;
    // Someone removed the file behind our back: forget it, and it is a miss.
    if (bytes.status().code() == StatusCode::kNotFound) drop_if_same(false);
    return bytes.status();
  }
  auto chunk = Chunk::Parse(std::move(bytes).value());
  std::string damage;
  if (!chunk.ok()) {
    damage = chunk.status().message();
  } else if ((*chunk)->key() != key) {
    damage = "its header names chunk " + (*chunk)->key().ToHex();
  }
  MutexLock lock(mu_);
  if (!damage.empty()) {
    ++misses_;
    ++corrupt_;
    drop_if_same(true);
    return NotFound("disk tier: " + path.string() + " is damaged (" + damage + "); removed");
  }
  ++hits_;
  return std::move(chunk).value();
}

bool DiskTier::Contains(const ChunkKey& key) {
  MutexLock lock(mu_);
  return index_.count(key) != 0;
}

Status DiskTier::Put(std::shared_ptr<const Chunk> chunk) {
  if (!chunk) return InvalidArgument("disk tier: Put of a null chunk");
  const ChunkKey key = chunk->key();
  const uint64_t size = chunk->size();
  const fs::path path = PathFor(key);
  if (capacity_ != 0 && size > capacity_) {
    return ResourceExhausted("disk tier: chunk " + key.ToHex() + " of " + std::to_string(size) +
                             " bytes exceeds the capacity of " + std::to_string(capacity_) +
                             " of " + dir_.string());
  }
  {
    MutexLock lock(mu_);
    if (auto it = index_.find(key); it != index_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second.lru);
      return Status::Ok();
    }
  }
  const fs::path sub = path.parent_path();
  if (::mkdir(sub.c_str(), 0755) != 0 && errno != EEXIST) return ErrnoStatus("create", sub, errno);
  fs::path tmp = path;
  tmp += TempSuffix();
  // The slow part (write + fsync) runs unlocked; only the rename, which
  // publishes the file, happens under the lock, so the index and the folder
  // never disagree about which keys are there.
  KDN_RETURN_IF_ERROR(WriteFileSynced(tmp, chunk->bytes()));
  {
    MutexLock lock(mu_);
    if (auto it = index_.find(key); it != index_.end()) {
      // Another Put of the same key won the race; chunks are immutable.
      (void)::unlink(tmp.c_str());
      lru_.splice(lru_.begin(), lru_, it->second.lru);
      return Status::Ok();
    }
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      const int e = errno;
      (void)::unlink(tmp.c_str());
      return ErrnoStatus("rename", path, e);
    }
    InsertLocked(key, size);
    ++puts_;
    EvictLocked(&key);
  }
  SyncDir(sub);
  return Status::Ok();
}

TierStats DiskTier::Stats() {
  MutexLock lock(mu_);
  TierStats s;
  s.chunks = index_.size();
  s.bytes = bytes_;
  s.capacity_bytes = capacity_;
  s.hits = hits_;
  s.misses = misses_;
  s.puts = puts_;
  s.evictions = evictions_;
  s.corrupt = corrupt_;
  return s;
}

}  // namespace kdn::kvbus
