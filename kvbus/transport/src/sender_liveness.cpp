// The tcp sender's fail fast: a dead receiver costs the batches sent to it,
// and about a second, not peer_timeout. The I/O thread polls a PeerMonitor
// (peer_monitor.h) beside its socket and, each round (CheckConnection):
//   - a connection lost while batches are unfinished fails them at once,
//     UNAVAILABLE "connection lost" (their receiver is gone, and with it
//     their grants);
//   - while the endpoint refuses connections (nothing listens there), a batch
//     that has waited SenderOptions::connect_timeout fails, UNAVAILABLE
//     "connection refused"; younger ones wait, so a receiver that is starting
//     still gets them.
// ZeroMQ keeps reconnecting, so a receiver that comes back serves later
// batches. A receiver that is alive but silent is still the peer timeout's
// (CheckPeer), which fails batches through the same FailUnfinished.

#include "transport_internal.h"

namespace kdn::kvbus {

Status TcpSender::WatchConnection() {
  if (options_.connect_timeout.count() < 0) {
    return InvalidArgument("kvbus tcp sender: needs connect_timeout >= 0");
  }
  KDN_ASSIGN_OR_RETURN(monitor_, net::PeerMonitor::Watch(context_, socket_));
  return Status::Ok();
}

Status TcpSender::CheckConnection(TransportClock::time_point now) {
  KDN_ASSIGN_OR_RETURN(const net::PeerNews news, monitor_->Read());
  if (news.lost) {
    FailUnfinished(Unavailable("kvbus tcp: receiver " + endpoint_ + ": connection lost"),
                   TransportClock::time_point::max());
  }
  if (monitor_->down()) {
    FailUnfinished(
        Unavailable("kvbus tcp: receiver " + endpoint_ + ": " + monitor_->why() + " (for " +
                    std::to_string(options_.connect_timeout.count()) + " ms)"),
        now - options_.connect_timeout);
  }
  return Status::Ok();
}

void TcpSender::FailUnfinished(const Status& status, TransportClock::time_point submitted_by) {
  std::vector<uint64_t> failed;
  bool idle = false;
  {
    MutexLock lock(mu_);
    for (auto& [id, batch] : batches_) {
      if (batch.unfinished == 0 || batch.submitted > submitted_by) continue;
      failed.push_back(id);
      for (uint32_t i = 0; i < batch.slots.size() && batch.unfinished > 0; ++i) {
        if (!batch.slots[i].duplicate) Finish(batch, i, ChunkOutcome::kFailed, status);
      }
    }
    idle = unfinished_ == 0;
  }
  if (failed.empty()) return;
  done_cv_.SignalAll();
  if (idle) {
    // What was queued belongs to batches that just failed. (With batches
    // left, their offers stay queued; offers and grants of failed batches
    // are harmless: the receiver's grants for them are handed back.)
    busy_ = false;
    control_.clear();
    data_.clear();
  }
  // The cancels let a receiver that was only slow free their slots now.
  for (uint64_t id : failed) {
    Result<zmq::message_t> frame = EncodeWire(WireCancel{id, {}});
    if (frame.ok()) control_.push_back(std::move(frame).value());
  }
}

}  // namespace kdn::kvbus
