#pragma once
// The conformance suite every kvbus transport passes (docs/design.md,
// "kvbus transports"). The tests (TEST_P bodies) live in transport_test.cpp;
// a transport joins by instantiating the suite with its factory, in its own
// test file:
//
//   INSTANTIATE_TEST_SUITE_P(CudaIpc, TransportConformance,
//                            ::testing::Values(CudaIpcTransportFactory()),
//                            TransportFactoryName);
//
// The suite drives a transport only through transport.h: the factory's two
// functions, Sender/Receiver, ReceiverStats and SenderFaults (which every
// transport must honour). Peer timeouts are short (500 ms) where a test is
// about a dead peer; leases are short (300 ms, ShortLease) only where a test
// is about expiry, since a grant that runs out under load fails its chunk;
// time is asserted only as generous upper bounds on hangs.

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <ostream>
#include <string>

#include "kdn/common/status.h"
#include "kdn/kvbus/chunk_store.h"
#include "kdn/kvbus/transport.h"

namespace kdn::kvbus {

struct TransportFactory {
  std::string name;  // names the instantiation ("tcp")
  // Starts a receiver that delivers into `sink` (which outlives it).
  std::function<Result<std::unique_ptr<Receiver>>(ChunkStore& sink, const ReceiverOptions&)> listen;
  // Connects a sender to the receiver that reported `endpoint`.
  std::function<Result<std::unique_ptr<Sender>>(const std::string& endpoint, const SenderOptions&)>
      connect;
};

class TransportConformance : public ::testing::TestWithParam<TransportFactory> {};

inline void PrintTo(const TransportFactory& factory, std::ostream* os) { *os << factory.name; }

inline std::string TransportFactoryName(const ::testing::TestParamInfo<TransportFactory>& info) {
  return info.param.name;
}

}  // namespace kdn::kvbus
