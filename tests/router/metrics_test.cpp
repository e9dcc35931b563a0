// kdn-router's figures: the /metrics families, the status page's history
// and errors, /status.json and the page itself (docs/serving.md, "Metrics",
// "Status page").
#include "kdn/router/metrics.h"

#include <gtest/gtest.h>

#include <chrono>

#include "kdn/common/kv_block.h"
#include "kdn/router/openai.h"
#include "kdn/router/status.h"
#include "kdn/router/worker_view.h"

namespace kdn::router {
namespace {

TEST(Metrics, HistogramBucketsAreCumulativeAndEndInTheCount) {
  Histogram h({0.1, 1});
  h.Observe(0.05);
  h.Observe(0.5);
  h.Observe(0.5);
  h.Observe(7);
  std::string out;
  h.Render("x", &out);
  EXPECT_NE(out.find("x_bucket{le=\"0.1\"} 1\n"), std::string::npos) << out;
  EXPECT_NE(out.find("x_bucket{le=\"1\"} 3\n"), std::string::npos) << out;
  EXPECT_NE(out.find("x_bucket{le=\"+Inf\"} 4\n"), std::string::npos) << out;
  EXPECT_NE(out.find("x_count 4\n"), std::string::npos) << out;
}

TEST(Metrics, RendersEveryDocumentedFamilyAndEscapesLabels) {
  Metrics m;
  m.RequestFinished("/v1/completions", 200);
  m.PromptTokens(768, 0, 0, 233, 200);
  m.PromptTokens(0, 500, 90, 40);
  m.Injected("stored", 120);
  m.Injected("already_held", 30);
  WorkerView w;
  w.name = "we\"ird";
  w.role = Role::kDecode;
  w.up = true;
  w.queue_depth = 2;
  w.free_kv_blocks = 10;
  const std::string out = m.Render({w});
  for (const char* name :
       {"kdn_requests_total", "kdn_requests_in_flight", "kdn_ttft_seconds",
        "kdn_inter_token_seconds", "kdn_prompt_tokens_total", "kdn_generated_tokens_total",
        "kdn_kv_bytes_moved_total", "kdn_kv_chunks_skipped_total", "kdn_kv_slices_sourced_total",
        "kdn_worker_up", "kdn_worker_queue_depth", "kdn_worker_free_kv_blocks",
        "kdn_injected_documents_total", "kdn_injected_tokens_total", "kdn_prompt_tail_tokens_total",
        "kdn_pins", "kdn_pinned_bytes", "kdn_pin_hits_total", "kdn_pins_refused_total"}) {
    EXPECT_NE(out.find(std::string("# TYPE ") + name + " "), std::string::npos) << name;
  }
  EXPECT_NE(out.find("kdn_prompt_tokens_total{source=\"cached\"} 768\n"), std::string::npos);
  EXPECT_NE(out.find("kdn_prompt_tokens_total{source=\"blended\"} 500\n"), std::string::npos);
  EXPECT_NE(out.find("kdn_prompt_tokens_total{source=\"recomputed\"} 90\n"), std::string::npos);
  EXPECT_NE(out.find("kdn_prompt_tokens_total{source=\"computed\"} 273\n"), std::string::npos);
  EXPECT_NE(out.find("kdn_prompt_tail_tokens_total 200\n"), std::string::npos);
  EXPECT_NE(out.find("kdn_injected_documents_total{result=\"stored\"} 1\n"), std::string::npos);
  EXPECT_NE(out.find("kdn_injected_documents_total{result=\"failed\"} 0\n"), std::string::npos);
  EXPECT_NE(out.find("kdn_injected_tokens_total 150\n"), std::string::npos);
  EXPECT_NE(out.find("worker=\"we\\\"ird\""), std::string::npos) << out;
}

// The status page's history: intervals of RouterFigures::kIntervalSeconds,
// without gaps, the last kIntervals of them, on the clock Metrics is given.
int64_t fake_now = 0;
int64_t FakeNow() { return fake_now; }

TEST(Metrics, KeepsTheLastTenMinutesInIntervalsWithoutGaps) {
  fake_now = 1'000'003;
  Metrics m(FakeNow);
  m.RequestFinished("/v1/completions", 200);
  m.Ttft(0.5);
  m.InterToken(0.01);
  m.InterToken(0.03);
  m.GeneratedTokens(7);
  fake_now += 25;  // two intervals on: one empty between
  m.RequestFinished("/v1/completions", 400);
  m.RequestFinished("/v1/completions", 499);  // the client left: not an error
  m.RequestFinished("/metrics", 200);         // not an API request
  RouterFigures f = m.Figures();
  ASSERT_EQ(f.history.size(), 3u);
  EXPECT_EQ(f.history[0].start_unix, 1'000'000);
  EXPECT_EQ(f.history[1].start_unix, 1'000'010);
  EXPECT_EQ(f.history[2].start_unix, 1'000'020);
  EXPECT_EQ(f.history[0].requests, 1u);
  EXPECT_EQ(f.history[0].ttft_count, 1u);
  EXPECT_DOUBLE_EQ(f.history[0].ttft_sum, 0.5);
  EXPECT_EQ(f.history[0].token_gap_count, 2u);
  EXPECT_DOUBLE_EQ(f.history[0].token_gap_sum, 0.04);
  EXPECT_EQ(f.history[0].generated_tokens, 7u);
  EXPECT_EQ(f.history[1].requests, 0u);
  EXPECT_EQ(f.history[2].requests, 2u);
  EXPECT_EQ(f.history[2].errors, 1u);
  // Read later, the history runs up to now; never more than kIntervals.
  fake_now += 5 * RouterFigures::kIntervalSeconds;
  EXPECT_EQ(m.Figures().history.size(), 8u);
  fake_now += 1000 * RouterFigures::kIntervalSeconds;
  f = m.Figures();
  ASSERT_EQ(f.history.size(), RouterFigures::kIntervals);
  EXPECT_EQ(f.history.back().start_unix, fake_now - fake_now % RouterFigures::kIntervalSeconds);
  for (const Interval& i : f.history) EXPECT_EQ(i.requests, 0u);
}

TEST(Metrics, KeepsTheNewestErrorsWithTheirMessages) {
  fake_now = 50;
  Metrics m(FakeNow);
  for (size_t i = 0; i < RouterFigures::kRecentErrors + 3; ++i) {
    m.Error("/v1/completions", 400, "error " + std::to_string(i));
  }
  const RouterFigures f = m.Figures();
  ASSERT_EQ(f.errors.size(), RouterFigures::kRecentErrors);
  EXPECT_EQ(f.errors.front().message, "error 3");
  EXPECT_EQ(f.errors.back().message, "error " + std::to_string(RouterFigures::kRecentErrors + 2));
  EXPECT_EQ(f.errors.back().code, 400);
  EXPECT_EQ(f.errors.back().unix_time, 50);
}

// /status.json carries every counter a worker reported under its proto
// field name, beside /health's fields and the router's figures.
TEST(StatusJson, ShowsWhatWorkersReportedByFieldNameAndTheRoutersFigures) {
  fake_now = 1'000'000;
  Metrics m(FakeNow);
  m.RequestFinished("/v1/completions", 200);
  m.RequestFinished("/v1/chat/completions", 503);
  m.Error("/v1/chat/completions", 503, "no decode worker");
  m.PromptTokens(256, 0, 0, 44);
  StatusSnapshot s;
  s.model = "m";
  s.unix_time = fake_now;
  s.started = fake_now - 60;
  WorkerView d;
  d.name = "d0";
  d.role = Role::kDecode;
  d.up = true;
  d.device = "cpu";
  d.total_kv_blocks = 64;
  d.free_kv_blocks = 60;
  d.resident.set_hit_tokens(1ull << 40);  // a uint64 past 32 bits stays a number
  d.local_prefill.set_step_ms(12.5);
  proto::StoreTier tier;
  tier.set_name("host");
  tier.set_hits(3);
  tier.set_misses(1);
  d.store_tiers.push_back(tier);
  s.workers = {d};
  s.router = m.Figures();
  const json j = StatusJson(s);
  EXPECT_EQ(j["status"], "unavailable");  // no prefill worker
  EXPECT_EQ(j["model"], "m");
  const json& w = j["workers"][0];
  EXPECT_EQ(w["name"], "d0");
  EXPECT_EQ(w["role"], "decode");
  EXPECT_EQ(w["device"], "cpu");
  EXPECT_EQ(w["total_kv_blocks"], 64);
  EXPECT_EQ(w["resident"]["hit_tokens"], 1ull << 40);
  EXPECT_TRUE(w["resident"]["hit_tokens"].is_number());
  EXPECT_EQ(w["resident"]["evictions"], 0);  // fields at their default are there too
  EXPECT_DOUBLE_EQ(w["local_prefill"]["step_ms"].get<double>(), 12.5);
  EXPECT_EQ(w["store_tiers"][0]["name"], "host");
  EXPECT_EQ(w["store_tiers"][0]["hits"], 3);
  const json& r = j["router"];
  EXPECT_EQ(r["requests_total"], 2);
  EXPECT_EQ(r["api_requests_total"], 2);
  EXPECT_EQ(r["prompt_tokens"]["cached"], 256);
  EXPECT_EQ(r["history"].size(), 1u);
  EXPECT_EQ(r["history"][0]["errors"], 1);
  EXPECT_EQ(r["errors"][0]["message"], "no decode worker");
  EXPECT_EQ(j["time"].get<int64_t>() - j["started"].get<int64_t>(), 60);
  EXPECT_EQ(j["kv_block_tokens"], kKvBlockTokens);
  // /health's body is the same snapshot's.
  json health;
  EXPECT_FALSE(HealthJson(s, &health));
  EXPECT_EQ(health["workers"][0]["name"], "d0");
  EXPECT_EQ(health["reason"], "no prefill worker answers");
}

// The page is one document that names the JSON it reads and nothing
// fetched from elsewhere.
TEST(StatusPage, IsOneSelfContainedDocumentReadingStatusJson) {
  const std::string& page = StatusPageHtml();
  EXPECT_TRUE(page.starts_with("<!DOCTYPE html>"));
  EXPECT_NE(page.find("fetch(\"status.json\""), std::string::npos);
  EXPECT_EQ(page.find("http://", page.find("<script>")), page.find("http://www.w3.org/2000/svg"));
  EXPECT_EQ(page.find("https://"), std::string::npos);
  EXPECT_EQ(page.find("<link"), std::string::npos);
  EXPECT_EQ(page.find("src="), std::string::npos);
}

}  // namespace
}  // namespace kdn::router
