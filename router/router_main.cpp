// kdn-router: the OpenAI-compatible HTTP front of a kdn deployment
// (docs/serving.md). Tokenizes, computes chunk keys, picks a prefill and a
// decode worker per request and relays the token stream. Prints its URL on
// stdout once it serves.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "kdn/common/log_flags.h"
#include "kdn/control/stop_signal.h"
#include "kdn/net/curve_flag.h"
#include "kdn/router/router.h"
#include "proto_log.h"

int main(int argc, char** argv) {
  kdn::router::RouterOptions o;
  CLI::App app{
      "kdn-router: OpenAI-compatible HTTP endpoint in front of kdn-prefill and kdn-decode "
      "workers. Prints its URL on stdout once it serves."};
  kdn::LogFlags log_flags;
  log_flags.Add(app);
  app.add_option("--model", o.model_dir,
                 "Model folder (its config.json, tokenizer.json and chat template are read) or a "
                 ".gguf file")
      ->required();
  app.add_option("--prefill", o.backend.prefill_endpoints,
                 "Prefill workers' control endpoints (comma-separated or repeated)")
      ->required()
      ->delimiter(',');
  app.add_option("--decode", o.backend.decode_endpoints,
                 "Decode workers' control endpoints (comma-separated or repeated)")
      ->required()
      ->delimiter(',');
  app.add_option("--host", o.host, "Address to listen on")->capture_default_str();
  app.add_option("--port", o.port, "Port to listen on (0 picks a free one)")->capture_default_str();
  app.add_option("--separator", o.separator,
                 "A string that marks document boundaries in a prompt (blend: the pieces before "
                 "its last occurrence are documents); a request's 'separator' overrides it. "
                 "Empty: prompts are not split");
  app.add_option("--recompute-ratio", o.recompute_ratio,
                 "Blend: the share of a prompt's cached document tokens recomputed (0: full "
                 "reuse, 1: full prefill); a request's 'recompute_ratio' overrides it")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--check-layer", o.check_layer,
                 "Blend: the layer at which tokens are chosen by KV deviation (every token is "
                 "recomputed up to it): the first of the progressive checks unless "
                 "--check-layers is given; a request's 'check_layer' overrides it")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--check-layers", o.check_layers,
                 "Blend: progressive filtering, the ascending layers at which the tokens still "
                 "recomputed are narrowed by KV deviation (comma-separated; one layer: one check "
                 "there; default: --check-layer and the two after it, or one check on a model "
                 "with fewer layers); a request's 'check_layers' overrides it")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--check-ratios", o.check_ratios,
                 "Blend: the share of cached tokens kept at each of --check-layers, "
                 "non-increasing, the last equal to --recompute-ratio (default: from twice "
                 "the ratio down to it); a request's 'check_ratios' overrides it")
      ->delimiter(',');
  app.add_option("--emphasis-heads", o.emphasis_heads,
                 "Emphasis: a head profile (a JSON file whose 'profiled_heads' lists "
                 "{\"layer\", \"head\"}, as `kdn-bench kv-edit --json` writes it) naming the "
                 "heads a request's emphasized spans are biased in (docs/serving.md, "
                 "\"Emphasis\"); a request's 'emphasis.heads' overrides it. Default: every "
                 "head of the middle third of the layers")
      ->check(CLI::ExistingFile);
  app.add_option(
         "--emphasis-strength", o.emphasis_strength,
         "Emphasis: the bias, in (0, 16], added to the emphasized spans' attention scores in those "
         "heads; a request's 'emphasis.strength' overrides it")
      ->check([](const std::string& v) {
        auto s = kdn::blend::ParseEmphasisStrength(v);
        return s.ok() ? std::string() : s.status().message();
      })
      ->capture_default_str();
  std::string blend_selection = kdn::blend::BlendSelectionName(o.selection);
  app.add_option("--blend-selection", blend_selection,
                 "Blend: how the recomputed document tokens are chosen (docs/blend.md, "
                 "\"Selection policies\"): deviation (CacheBlend's, at the check layers), "
                 "boundary:K (the first K tokens of each document, no check), "
                 "boundary+deviation:K (those, and the rest of the ratio by deviation), query "
                 "(the tokens the question attends to most, from a pass of the question over "
                 "the documents' KV), query+boundary:K or random; a request's 'blend_selection' "
                 "overrides it")
      ->check([](const std::string& v) {
        auto s = kdn::blend::ParseBlendSelection(v);
        return s.ok() ? std::string() : s.status().message();
      })
      ->capture_default_str();
  app.add_option("--served-model-name", o.served_model_name,
                 "Model name in the API (default: the model folder's name, or the .gguf file's "
                 "without .gguf)");
  std::string api_keys_file;
  app.add_option("--api-keys", api_keys_file,
                 "A file of API keys, one \"KEY TENANT\" a line: /v1/ requests then need "
                 "'Authorization: Bearer KEY', and each tenant's cache is its own (default: "
                 "$KDN_API_KEYS_FILE; neither: no keys)");
  app.add_option("--max-queued", o.backend.max_queued,
                 "Requests that may wait for a decode worker with room (KV for prompt + "
                 "max_tokens, a place in its batch) before any prefill is spent on them; past "
                 "that a request gets 429")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  int64_t queue_timeout_ms = o.backend.queue_timeout.count();
  app.add_option("--queue-timeout-ms", queue_timeout_ms,
                 "How long a request may wait for a decode worker with room before it gets 503")
      ->check(CLI::Range(int64_t{1}, int64_t{24} * 3600 * 1000))
      ->capture_default_str();
  app.add_option("--max-connections", o.max_connections,
                 "Open HTTP connections at most; one more is answered 503 and closed")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  uint64_t max_body_buffer_mib = o.max_body_buffer_bytes >> 20;
  app.add_option("--max-body-buffer-mib", max_body_buffer_mib,
                 "Request-body MiB all connections may buffer together; a body past it is "
                 "answered 503 with Retry-After before it is read")
      ->check(CLI::Range(uint64_t{16}, uint64_t{1} << 20))
      ->capture_default_str();
  bool no_resume = false;
  app.add_flag("--no-resume", no_resume,
               "A request whose decode worker is lost mid-stream fails (its client gets an "
               "error) instead of going on at another decode worker");
  app.add_option("--max-resumes", o.backend.max_resumes,
                 "Decode workers a request may lose and still go on")
      ->check(CLI::Range(0, 100))
      ->capture_default_str();
  std::string disaggregation = kdn::router::DisaggregationName(o.backend.disaggregation);
  app.add_option("--disaggregation", disaggregation,
                 "Where prompts are computed: always on a prefill worker (KV moved to the "
                 "decode worker), never (on the decode worker, but blended and resumed "
                 "requests), or auto (the decode worker when placement's cost model says so; "
                 "docs/serving.md, \"Two paths\"); a request's \"disaggregation\" field "
                 "overrides it")
      ->check(CLI::IsMember({"always", "auto", "never"}))
      ->capture_default_str();
  app.add_option("--local-prefill-max-tokens", o.backend.local_prefill_max_tokens,
                 "With --disaggregation auto: the most prompt tokens a decode worker lacks "
                 "for it to compute the prompt itself")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
      ->capture_default_str();
  uint64_t max_pinned_mib = o.backend.max_pinned_bytes_per_tenant >> 20;
  app.add_option("--max-pinned-mib", max_pinned_mib,
                 "KV MiB (counted as f32) the live pins of one tenant may hold: a request's "
                 "cache_control past it is refused with 429; 0 refuses every pin "
                 "(docs/serving.md, \"Pinning a prefix\")")
      ->check(CLI::Range(uint64_t{0}, uint64_t{1} << 30))
      ->capture_default_str();
  app.add_flag("--lookups-from-events", o.backend.lookups_from_events,
               "Follow the KV events of the workers that publish them (their --kv-events) and "
               "take a prompt's cached prefix at such a worker from them instead of asking it, "
               "where the worker has no shared tier (docs/serving.md, \"Lookups from the event "
               "stream\")");
  kdn::net::CurveFlag curve_flag;
  curve_flag.Add(app);
  CLI11_PARSE(app, argc, argv);
  o.backend.disaggregation = *kdn::router::ParseDisaggregation(disaggregation);
  o.backend.max_pinned_bytes_per_tenant = max_pinned_mib << 20;
  o.selection = *kdn::blend::ParseBlendSelection(blend_selection);
  o.backend.queue_timeout = std::chrono::milliseconds(queue_timeout_ms);
  o.max_body_buffer_bytes = max_body_buffer_mib << 20;
  o.backend.resume = !no_resume;
  if (kdn::Status st = log_flags.Init("router"); !st.ok()) {
    kdn::LogError("{}", st.ToString());
    return 2;
  }
  kdn::proto::RouteProtobufLogs();
  auto curve = curve_flag.Load();
  if (!curve.ok()) return 2;
  if (curve->has_value() && !(*curve)->router_key.empty()) {
    // The members' file names the router's key: the workers would refuse
    // this router.
    kdn::LogError(
        "--curve-keys: {} is the members' key file (it names a router key); the router takes "
        "the router's (kdn-keygen --router)",
        curve_flag.path.empty() ? std::string("$KDN_CURVE_KEYS") : curve_flag.path);
    return 2;
  }
  o.backend.curve = *std::move(curve);
  std::signal(SIGPIPE, SIG_IGN);
  if (api_keys_file.empty()) {
    if (const char* env = std::getenv("KDN_API_KEYS_FILE"); env != nullptr) api_keys_file = env;
  }
  if (!api_keys_file.empty()) {
    auto keys = kdn::router::ApiKeys::Load(api_keys_file);
    if (!keys.ok()) {
      kdn::LogError("{}", keys.status().ToString());
      return 2;
    }
    kdn::LogInfo("{} API keys for {} tenants; /health and /metrics need none", keys->size(),
                 keys->tenants());
    o.api_keys = std::make_shared<const kdn::router::ApiKeys>(*std::move(keys));
  } else {
    kdn::LogInfo(
        "no --api-keys: every request is served, and requests share the cache unless "
        "their cache_salt differs");
  }

  auto router = kdn::router::Router::Start(o);
  if (!router.ok()) {
    kdn::LogError("{}", router.status().ToString());
    return 1;
  }
  kdn::control::CatchStopSignals();
  kdn::LogInfo("serving on {} ({} prefill, {} decode workers)", (*router)->url(),
               o.backend.prefill_endpoints.size(), o.backend.decode_endpoints.size());
  std::printf("%s\n", (*router)->url().c_str());
  std::fflush(stdout);
  kdn::control::WaitForStopSignal();
  router->reset();
  kdn::LogInfo("stopped");
  return 0;
}
