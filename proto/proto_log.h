#pragma once
// Protobuf's own log lines (it logs, for one, every string field of a parsed
// message that is not UTF-8) through kdn's log, rate-limited: a peer that
// sends such messages in a loop must not fill the disk. Each program calls
// it once, after it sets up its log.

namespace kdn::proto {

// Thread-safe; later calls do nothing.
void RouteProtobufLogs();

}  // namespace kdn::proto
