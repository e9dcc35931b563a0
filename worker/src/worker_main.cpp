#include "kdn/worker/worker_main.h"

#include "proto_log.h"

namespace kdn::worker {

void RouteWorkerProtobufLogs() { proto::RouteProtobufLogs(); }

}  // namespace kdn::worker
