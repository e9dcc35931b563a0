#pragma once
// One snapshot of a router's state, taken when a page is asked for: the
// workers (what each reported, and the router's reservations on it) and the
// router's own figures. /health, /metrics, /status.json and the status page
// are renderings of it (docs/serving.md, "Health and metrics"), so a figure
// is declared once: a worker's in proto/serving.proto (worker_view.h), the
// router's in RouterFigures (metrics.h).
//
// Values; thread-compatible.

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kdn/router/metrics.h"
#include "kdn/router/worker_view.h"

namespace kdn::router {

struct StatusSnapshot {
  std::string model;
  int64_t unix_time = 0;  // when it was taken
  int64_t started = 0;    // when the router started (unix seconds)
  std::vector<WorkerView> workers;
  RouterFigures router;
};

// /health's body: what each worker reported, and apart, the router's
// reservations on it; true when a prefill and a decode worker are live.
bool HealthJson(const StatusSnapshot& s, nlohmann::json* body);

// /status.json, the status page's data: /health's body, every counter each
// worker reported (its proto messages by their field names), the router's
// totals, its last intervals and its last errors.
nlohmann::json StatusJson(const StatusSnapshot& s);

// The status page (HTML, CSS and JavaScript in one document; it reads
// /status.json and fetches nothing else).
const std::string& StatusPageHtml();

}  // namespace kdn::router
