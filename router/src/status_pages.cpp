// kdn-router's answers that are no session's own (server_state.h): job
// errors as HTTP, the SSE framing, injection progress, and /health's and
// /status.json's renderings of a StatusSnapshot (status.h).
#include <cstdio>

#include <google/protobuf/message.h>

#include "kdn/common/kv_block.h"
#include "kdn/router/status.h"
#include "server_state.h"

namespace kdn::router {

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
            {"tokens", p.tokens},
            {"stored_tokens", p.stored_tokens}};
  if (final) {
    json errors = json::array();
    for (const auto& [doc, message] : p.errors) {
      errors.push_back({{"document", doc}, {"message", message}});
    }
    j["errors"] = errors;
  }
  return j;
}

namespace {

// A proto message as JSON by its field names, numbers as numbers (proto's
// own JSON mapping writes 64-bit integers as strings), for a page's script.
json ProtoJson(const google::protobuf::Message& m) {
  using google::protobuf::FieldDescriptor;
  const google::protobuf::Reflection* r = m.GetReflection();
  const google::protobuf::Descriptor* d = m.GetDescriptor();
  json out = json::object();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    auto value = [&](int index) -> json {
      const bool rep = f->is_repeated();
      switch (f->cpp_type()) {
        case FieldDescriptor::CPPTYPE_INT32:
          return rep ? r->GetRepeatedInt32(m, f, index) : r->GetInt32(m, f);
        case FieldDescriptor::CPPTYPE_INT64:
          return rep ? r->GetRepeatedInt64(m, f, index) : r->GetInt64(m, f);
        case FieldDescriptor::CPPTYPE_UINT32:
          return rep ? r->GetRepeatedUInt32(m, f, index) : r->GetUInt32(m, f);
        case FieldDescriptor::CPPTYPE_UINT64:
          return rep ? r->GetRepeatedUInt64(m, f, index) : r->GetUInt64(m, f);
        case FieldDescriptor::CPPTYPE_DOUBLE:
          return rep ? r->GetRepeatedDouble(m, f, index) : r->GetDouble(m, f);
        case FieldDescriptor::CPPTYPE_FLOAT:
          return rep ? r->GetRepeatedFloat(m, f, index) : r->GetFloat(m, f);
        case FieldDescriptor::CPPTYPE_BOOL:
          return rep ? r->GetRepeatedBool(m, f, index) : r->GetBool(m, f);
        case FieldDescriptor::CPPTYPE_ENUM:
          return (rep ? r->GetRepeatedEnum(m, f, index) : r->GetEnum(m, f))->name();
        case FieldDescriptor::CPPTYPE_STRING:
          // Bytes (a fingerprint) are not text: left out.
          if (f->type() == FieldDescriptor::TYPE_BYTES) return nullptr;
          return rep ? r->GetRepeatedString(m, f, index) : r->GetString(m, f);
        case FieldDescriptor::CPPTYPE_MESSAGE:
          return ProtoJson(rep ? r->GetRepeatedMessage(m, f, index) : r->GetMessage(m, f));
      }
      return nullptr;
    };
    if (f->is_repeated()) {
      json list = json::array();
      for (int k = 0; k < r->FieldSize(m, f); ++k) list.push_back(value(k));
      out[f->name()] = std::move(list);
    } else if (json v = value(0); !v.is_null()) {
      out[f->name()] = std::move(v);
    }
  }
  return out;
}

template <typename T>
json ProtoList(const std::vector<T>& items) {
  json list = json::array();
  for (const T& item : items) list.push_back(ProtoJson(item));
  return list;
}

json HistogramJson(const Histogram& h) { return {{"count", h.count()}, {"sum", h.sum()}}; }

}  // namespace

bool HealthJson(const StatusSnapshot& s, json* body) {
  json list = json::array();
  int live_p = 0, live_d = 0;
  for (const WorkerView& w : s.workers) {
    const bool live = w.up && w.compatible;
    if (live) (w.role == Role::kPrefill ? live_p : live_d)++;
    list.push_back({{"name", w.name},
                    {"role", RoleName(w.role)},
                    {"endpoint", w.endpoint},
                    {"up", w.up},
                    {"compatible", w.compatible},
                    {"queue_depth", w.queue_depth},
                    {"free_kv_blocks", w.free_kv_blocks},
                    {"total_kv_blocks", w.total_kv_blocks},
                    {"host_id", w.host_id},
                    {"device", w.device},
                    {"kv_transport", w.kv_transport},
                    {"health", w.health},
                    // Not reported: what the router routed here since.
                    {"router_reserved",
                     {{"requests", w.reserved.requests},
                      {"kv_blocks", w.reserved.kv_blocks},
                      {"prefill_tokens", w.reserved.prefill_tokens}}}});
    if (w.kv_events_followed) {
      // Not reported: its KV events as this router follows them.
      list.back()["kv_events"] = {{"synced", w.kv_events_synced},
                                  {"blocks", w.kv_events_blocks},
                                  {"next_batch", w.kv_events_next}};
    }
  }
  const bool ok = live_p > 0 && live_d > 0;
  *body = {{"status", ok ? "ok" : "unavailable"}, {"model", s.model}, {"workers", list}};
  if (!ok) {
    (*body)["reason"] = live_p == 0 && live_d == 0 ? "no prefill and no decode worker answers"
                        : live_p == 0              ? "no prefill worker answers"
                                                   : "no decode worker answers";
  }
  return ok;
}

json StatusJson(const StatusSnapshot& s) {
  json body;
  HealthJson(s, &body);
  for (size_t i = 0; i < s.workers.size(); ++i) {
    const WorkerView& w = s.workers[i];
    json& j = body["workers"][i];
    j["max_batch"] = w.max_batch;
    j["queue_tokens"] = w.queue_tokens;
    j["max_context"] = w.max_context;
    j["leased_kv_blocks"] = w.leased_kv_blocks;
    j["kvbus_leased_bytes"] = w.kvbus_leased_bytes;
    j["store_unreachable"] = w.store_unreachable;
    j["kv_transports"] = ProtoList(w.kv_transports);
    j["kv_codec"] = ProtoJson(w.kv_codec);
    j["resident"] = ProtoJson(w.resident);
    j["local_prefill"] = ProtoJson(w.local_prefill);
    j["pushed_kv"] = ProtoJson(w.pushed_kv);
    j["preemption"] = ProtoJson(w.preemption);
    j["store_tiers"] = ProtoList(w.store_tiers);
  }
  const RouterFigures& f = s.router;
  json requests = json::array();
  uint64_t total = 0, api = 0;
  for (const auto& [k, n] : f.requests) {
    requests.push_back({{"route", k.first}, {"code", k.second}, {"count", n}});
    total += n;
    if (k.first.starts_with("/v1/")) api += n;
  }
  json history = json::array();
  for (const Interval& i : f.history) {
    history.push_back({{"start", i.start_unix},
                       {"requests", i.requests},
                       {"errors", i.errors},
                       {"generated_tokens", i.generated_tokens},
                       {"ttft_count", i.ttft_count},
                       {"ttft_sum", i.ttft_sum},
                       {"token_gap_count", i.token_gap_count},
                       {"token_gap_sum", i.token_gap_sum}});
  }
  json errors = json::array();
  for (const RecentError& e : f.errors) {
    errors.push_back(
        {{"time", e.unix_time}, {"route", e.route}, {"code", e.code}, {"message", e.message}});
  }
  body["kv_block_tokens"] = kKvBlockTokens;
  body["time"] = s.unix_time;
  body["started"] = s.started;
  body["router"] = {
      {"requests_total", total},
      {"api_requests_total", api},
      {"requests", requests},
      {"in_flight", f.in_flight},
      {"queue_depth", f.queue_depth},
      {"generated_tokens", f.generated},
      {"prompt_tokens",
       {{"cached", f.cached_tokens},
        {"blended", f.blended_tokens},
        {"recomputed", f.recomputed_tokens},
        {"computed", f.computed_tokens},
        {"pruned", f.pruned_tokens}}},
      {"injected_tokens", f.injected_tokens},
      {"injected_stored_tokens", f.injected_stored_tokens},
      {"kv_bytes_moved", f.kv_bytes},
      {"resumed", f.resumed},
      {"routed", {{"disaggregated", f.routed_disaggregated}, {"local", f.routed_local}}},
      {"lookups", {{"asked", f.lookups_asked}, {"from_events", f.lookups_from_events}}},
      {"pins",
       {{"held", f.pins},
        {"bytes", f.pinned_bytes},
        {"hits", f.pin_hits},
        {"refused", f.pins_refused}}},
      {"ttft", HistogramJson(f.ttft)},
      {"token_gap", HistogramJson(f.inter_token)},
      {"interval_seconds", RouterFigures::kIntervalSeconds},
      {"history", history},
      {"errors", errors}};
  return body;
}

}  // namespace kdn::router
