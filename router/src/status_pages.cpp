// kdn-router's answers that are no session's own (server_state.h): job
// errors as HTTP, the SSE framing, injection progress, and the pages that
// show the workers, what they reported apart from the router's reservations.
#include <cstdio>

#include "server_state.h"

namespace kdn::router {

int64_t UnixNow() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

ApiError JobError(const Status& st) {
  ApiError e;
  e.message = st.message();
  switch (st.code()) {
    case StatusCode::kInvalidArgument: e.http_status = 400; break;
    case StatusCode::kResourceExhausted:  // the admission queue is full
      e.http_status = 429;
      e.type = "rate_limit_exceeded";
      break;
    case StatusCode::kUnavailable:
      e.http_status = 503;
      e.type = "service_unavailable";
      break;
    default: e.http_status = 502; e.type = "server_error";
  }
  return e;
}

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string SseEvent(const std::string& data) { return "data: " + data + "\n\n"; }

std::string Chunked(const std::string& piece) {
  char head[32];
  std::snprintf(head, sizeof(head), "%zx\r\n", piece.size());
  return head + piece + "\r\n";
}

json ProgressJson(const InjectProgress& p, bool final) {
  json j = {{"object", final ? "kdn.inject" : "kdn.inject.progress"},
            {"total", p.total},
            {"done", p.done},
            {"stored", p.stored},
            {"already_held", p.already_held},
            {"failed", p.failed},
            {"tokens", p.tokens}};
  if (final) {
    json errors = json::array();
    for (const auto& [doc, message] : p.errors) {
      errors.push_back({{"document", doc}, {"message", message}});
    }
    j["errors"] = errors;
  }
  return j;
}

bool HealthBody(const std::vector<WorkerView>& workers, const std::string& model, json* body) {
  json list = json::array();
  int live_p = 0, live_d = 0;
  for (const WorkerView& w : workers) {
    const bool live = w.up && w.compatible;
    if (live) (w.role == Role::kPrefill ? live_p : live_d)++;
    list.push_back({{"name", w.name},
                    {"role", RoleName(w.role)},
                    {"endpoint", w.endpoint},
                    {"up", w.up},
                    {"compatible", w.compatible},
                    {"queue_depth", w.queue_depth},
                    {"free_kv_blocks", w.free_kv_blocks},
                    {"host_id", w.host_id},
                    {"kv_transport", w.kv_transport},
                    {"health", w.health},
                    // Not reported: what the router routed here since.
                    {"router_reserved",
                     {{"requests", w.reserved.requests},
                      {"kv_blocks", w.reserved.kv_blocks},
                      {"prefill_tokens", w.reserved.prefill_tokens}}}});
  }
  const bool ok = live_p > 0 && live_d > 0;
  *body = {{"status", ok ? "ok" : "unavailable"}, {"model", model}, {"workers", list}};
  if (!ok) {
    (*body)["reason"] = live_p == 0 && live_d == 0 ? "no prefill and no decode worker answers"
                        : live_p == 0              ? "no prefill worker answers"
                                                   : "no decode worker answers";
  }
  return ok;
}

std::vector<WorkerGauge> WorkerGauges(const std::vector<WorkerView>& workers) {
  std::vector<WorkerGauge> gauges;
  for (const WorkerView& w : workers) {
    WorkerGauge g;
    g.name = w.name;
    g.role = RoleName(w.role);
    g.up = w.up && w.compatible;
    g.queue_depth = w.queue_depth;
    g.free_kv_blocks = w.free_kv_blocks;
    g.reserved_requests = w.reserved.requests;
    g.reserved_kv_blocks = w.reserved.kv_blocks;
    for (const auto& t : w.kv_transports) {
      g.kv_transports.push_back({t.transport, t.chunks, t.bytes, t.seconds});
    }
    g.kv_codec = w.kv_codec;
    g.store_unreachable = w.store_unreachable;
    g.leased_kv_blocks = w.leased_kv_blocks;
    g.kvbus_leased_bytes = w.kvbus_leased_bytes;
    g.resident = w.resident;
    g.local_prefill = w.local_prefill;
    g.pushed_kv = w.pushed_kv;
    gauges.push_back(std::move(g));
  }
  return gauges;
}

}  // namespace kdn::router
