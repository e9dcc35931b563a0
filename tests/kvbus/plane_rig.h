#pragma once
// A sender and an in-place receiver on this host for the device planes'
// own cases (device_plane_test.cpp, link_plane_test.cpp): the receiver's
// landing site claims every chunk it can into a region of the kind asked
// for (the host backend's memory, standing in for a device's when
// kDevice), and stores what it accepts.

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "kdn/kvbus/transport.h"
#include "landing_site.h"
#include "kdn/testing/recording_store.h"
#include "transport_test_util.h"

namespace kdn::kvbus::testing {

// The size of an in-place receiver's region in the conformance suite's
// instantiations: room for a few chunks of the slot capacity it is given.
inline uint64_t LandingSegmentBytes(const ReceiverOptions& o) {
  return std::clamp<uint64_t>(4 * o.slot_capacity_bytes, uint64_t{1} << 20, uint64_t{256} << 20);
}

struct PlaneRig {
  kdn::testing::RecordingStore sink;
  std::unique_ptr<Receiver> receiver;
  std::unique_ptr<Sender> sender;

  PlaneRig(RegionKind landing, const SenderOptions& so,
           const ReceiverOptions& ro = transport_test::TestReceiverOptions()) {
    receiver = InPlaceReceiver::Listen(sink, ro, uint64_t{8} << 20, landing).value();
    sender = Connect(receiver->endpoint(), so).value();
  }
  const SinkLandingSite& site() const {
    return static_cast<const InPlaceReceiver&>(*receiver).site();
  }
  BatchStatus Move(const std::vector<transport_test::ChunkPtr>& chunks) {
    auto batch = sender->Submit(chunks);
    EXPECT_TRUE(batch.ok());
    auto status = sender->Wait(*batch, transport_test::kNoHang);
    EXPECT_TRUE(status.ok());
    return *status;
  }
};

}  // namespace kdn::kvbus::testing
