#pragma once
// A Sender for tests that turns every chunk it is given into a SourcedChunk
// (kdn/kvbus/transport.h): the payload copied into a region of the host
// backend, scattered in three pieces in reverse order (as a KV pool's
// blocks lie), and submitted with SubmitSourced, so that the conformance
// suite, which hands over Chunks, runs unchanged over chunks a sender
// reads where they lie. A batch with a null chunk goes to Submit as it is
// (its refusal is the suite's to check). Regions are kept until the
// sender goes: they must outlive every batch.

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kdn/kvbus/device_ops.h"
#include "kdn/kvbus/transport.h"

namespace kdn::kvbus::testing {

class SourcingSender final : public Sender {
 public:
  static Result<std::unique_ptr<Sender>> Connect(const std::string& endpoint,
                                                 const SenderOptions& options) {
    KDN_ASSIGN_OR_RETURN(std::unique_ptr<Sender> inner, kvbus::Connect(endpoint, options));
    return std::unique_ptr<Sender>(new SourcingSender(std::move(inner)));
  }
  ~SourcingSender() override { inner_.reset(); }  // before the regions it reads

  Result<uint64_t> Submit(std::vector<std::shared_ptr<const Chunk>> chunks) override {
    uint64_t bytes = 0;
    for (const auto& c : chunks) {
      if (!c || c->encoded()) return inner_->Submit(std::move(chunks));
      bytes += c->payload().size();
    }
    std::unique_ptr<DeviceMemory> region;
    if (bytes > 0) {
      KDN_ASSIGN_OR_RETURN(region, HostDeviceOps().Allocate(bytes));
    }
    std::vector<SourcedChunk> sourced;
    uint64_t at = 0;
    for (const auto& c : chunks) {
      const uint64_t n = c->payload().size();
      std::vector<Extent> extents;
      const uint64_t piece = (n + 2) / 3;
      for (uint64_t end = n; end > 0;) {
        const uint64_t begin = end > piece ? end - piece : 0;
        extents.insert(extents.begin(), Extent{at + (n - end), end - begin});
        end = begin;
      }
      // extents[i] holds payload bytes in order; place them.
      uint64_t from = 0;
      for (const Extent& x : extents) {
        std::copy_n(c->payload().data() + from, x.bytes, region->data() + x.offset);
        from += x.bytes;
      }
      KDN_ASSIGN_OR_RETURN(SourcedChunk s, MakeSourcedChunk(c->info(), *region, extents));
      sourced.push_back(std::move(s));
      at += n;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (region) regions_.push_back(std::move(region));
    }
    return inner_->SubmitSourced(std::move(sourced));
  }
  Result<uint64_t> SubmitSourced(std::vector<SourcedChunk> chunks) override {
    return inner_->SubmitSourced(std::move(chunks));
  }
  Result<BatchStatus> Poll(uint64_t batch) override { return inner_->Poll(batch); }
  Result<BatchStatus> Wait(uint64_t batch, std::chrono::milliseconds timeout) override {
    return inner_->Wait(batch, timeout);
  }
  std::string endpoint() const override { return inner_->endpoint(); }
  SenderStats Stats() const override { return inner_->Stats(); }

 private:
  explicit SourcingSender(std::unique_ptr<Sender> inner) : inner_(std::move(inner)) {}
  std::unique_ptr<Sender> inner_;
  std::mutex mu_;
  std::vector<std::unique_ptr<DeviceMemory>> regions_;
};

}  // namespace kdn::kvbus::testing
