// kdn-generate: the engine alone, one process, no network. Loads a model
// folder, runs a prompt, prints the continuation (stdout) and timings (stderr).
// With --chat, the prompt is a conversation rendered by the model's chat
// template as kdn-router renders a chat request. With --document, the prompt
// is a blend (docs/blend.md) as a deployment runs it: BOS (with --chat, the
// conversation up to its last user message), the documents (each tokenized
// apart, its KV computed on its own), then the question (--prompt, or that
// message's content and the rest of the rendering); the fused prefill's
// answer, greedy. With --prune-method, each document's KV is pruned as
// kdn-prefill stores a document injected with `prune` (docs/kvbus.md,
// "Pruned KV") before the blend. With --steer, a document's KV is steered as
// a steer edit stores it (docs/serving.md, "Steering a document"), by the
// vector --steering-pairs makes as POST /v1/kdn/steering does.
#include <algorithm>
#include <map>
#include <optional>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "kdn/blend/blend.h"
#include "kdn/blend/emphasis.h"
#include "kdn/blend/steering.h"
#include "kdn/kvbridge/steer.h"
#include "kdn/worker/worker_flags.h"
#include "kdn/engine/generate.h"
#include "kdn/kvbridge/paged_chunks.h"
#include "kdn/engine/cpu_runtime.h"
#include "kdn/engine/open_engine.h"
#include "kdn/model/config.h"
#include "kdn/prune/head_budgets.h"
#include "kdn/prune/prune_text.h"
#include "kdn/text/chat_template.h"
#include "kdn/text/output_text.h"
#include "kdn/text/tokenizer.h"

namespace {

std::string JoinIds(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s;
}

// A rendered --chat file: the text before the documents' place (all of it
// without documents) and after it, and whether a BOS goes first.
struct ChatText {
  std::string head, rest;
  bool add_bos = true;
};

// The messages of `file` (an OpenAI messages array of {role, content}
// strings) rendered by the model's chat template, as kdn-router renders a
// chat request; `documents`: they open the last user message, as the
// router's `documents` field puts them.
kdn::Result<ChatText> RenderChatFile(const std::string& file, const std::string& model_dir,
                                     bool documents) {
  std::ifstream in(file);
  if (!in) return kdn::NotFound("--chat: cannot read " + file);
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_array() || j.empty()) {
    return kdn::InvalidArgument("--chat: " + file + " is not a JSON array of messages");
  }
  kdn::text::ChatMessages messages;
  for (const auto& m : j) {
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") ||
        !m["content"].is_string()) {
      return kdn::InvalidArgument("--chat: " + file +
                                  ": each message is {\"role\": ..., \"content\": ...}");
    }
    messages.emplace_back(m["role"].get<std::string>(), m["content"].get<std::string>());
  }
  constexpr std::string_view kSlot = "\x1a\x1bkdn-generate-documents\x1b\x1a";
  if (documents) {
    auto last_user = std::find_if(messages.rbegin(), messages.rend(),
                                  [](const auto& m) { return m.first == "user"; });
    if (last_user == messages.rend()) {
      return kdn::InvalidArgument("--chat: documents go with a user message; " + file +
                                  " has none");
    }
    last_user->second.insert(0, kSlot);
  }
  KDN_ASSIGN_OR_RETURN(kdn::model::ModelConfig config, kdn::model::LoadModelConfig(model_dir));
  KDN_ASSIGN_OR_RETURN(kdn::text::ChatTemplate tmpl,
                       kdn::text::ChatTemplate::Load(model_dir, config.architecture));
  KDN_ASSIGN_OR_RETURN(kdn::text::ChatPrompt chat, tmpl.Render(messages));
  ChatText out{chat.text, "", chat.add_bos};
  if (documents) {
    const size_t at = chat.text.find(kSlot);
    if (at == std::string::npos || chat.text.find(kSlot, at + 1) != std::string::npos) {
      return kdn::InvalidArgument(
          "--chat: the chat template does not place the last user message once");
    }
    out.head = chat.text.substr(0, at);
    out.rest = chat.text.substr(at + kSlot.size());
  }
  return out;
}

// --erratum and --emphasize: N=TEXT, N a document's index and TEXT not
// empty; with `once`, each N at most once. False (and a message) otherwise.
bool ParseIndexedTexts(const std::vector<std::string>& args, size_t documents, const char* flag,
                       bool once, std::vector<std::pair<size_t, std::string>>* out) {
  for (const std::string& e : args) {
    const size_t eq = e.find('=');
    size_t n = documents;
    try {
      if (eq != std::string::npos) n = std::stoul(e.substr(0, eq));
    } catch (...) {
    }
    const bool repeated =
        once && std::any_of(out->begin(), out->end(), [&](const auto& p) { return p.first == n; });
    if (n >= documents || eq + 1 >= e.size() || repeated) {
      std::fprintf(stderr,
                   "kdn-generate: %s \"%s\": give N=TEXT, N a document's index (0 to %zu)%s, "
                   "TEXT not empty\n",
                   flag, e.c_str(), documents - 1, once ? " once" : "");
      return false;
    }
    out->emplace_back(n, e.substr(eq + 1));
  }
  return true;
}

// --steering-pairs FILE: a body of POST /v1/kdn/steering, read as kdn-router
// reads one (blend::ParseSteeringBody; its cache_salt unused).
kdn::Result<kdn::blend::SteeringVectorSpec> LoadSteeringPairs(const std::string& file,
                                                              const kdn::text::Tokenizer& tok,
                                                              const kdn::model::ModelConfig& cfg) {
  std::ifstream in(file);
  if (!in) return kdn::NotFound("--steering-pairs: cannot read " + file);
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object())
    return kdn::InvalidArgument("--steering-pairs: " + file + " is not a JSON object");
  std::string field;
  auto spec = kdn::blend::ParseSteeringBody(
      j, [&](const std::string& text) { return tok.Encode(text, true); }, cfg.num_layers,
      cfg.max_context, &field);
  if (!spec.ok()) {
    return kdn::InvalidArgument("--steering-pairs: " + file + ": " + field + ": " +
                                spec.status().message());
  }
  return spec;
}

// The KV a steering vector's pairs take while it is made, one prompt at a time.
int64_t SteeringRoom(const kdn::blend::SteeringVectorSpec& spec) {
  size_t longest = 0;
  for (const auto& [pos, neg] : spec.pairs) longest = std::max({longest, pos.size(), neg.size()});
  return longest == 0 ? 0 : static_cast<int64_t>(longest) + kdn::kKvBlockTokens;
}

struct BlendOutput {
  std::vector<int32_t> tokens;
  int cached_tokens = 0;
  int recomputed_tokens = 0;
  double recompute_ratio = 0;
  int pruned_tokens = 0;         // documents' tokens with no KV (--prune-method)
  int question_pass_tokens = 0;  // a query selection's pass over the question
};

// Each document's KV computed on its own (from position 0, as kdn-prefill
// stores it under its segment key), those of `steer_of` steered by `vector`
// at their strength as a steer edit stores them, then fused with `head` and
// `question` by blend::BlendPrefill as kdn-prefill fuses them, then greedy
// decoding on the fused KV.
kdn::Result<BlendOutput> BlendAnswer(
    kdn::engine::Engine& model, const std::vector<int32_t>& head,
    const std::vector<std::vector<int32_t>>& docs, const std::vector<int32_t>& question,
    const kdn::blend::BlendSpec& spec, const kdn::prune::PruneSpec* prune,
    const kdn::prune::HeadBudgets* budgets, const std::map<size_t, float>& steer_of,
    const kdn::kvbridge::SteeringVector* vector, const kdn::engine::GenerateOptions& gen) {
  kdn::engine::KvCache& cache = model.kv_cache();
  const auto dtype = model.kv_dtype();
  std::vector<kdn::blend::Segment> segments;
  if (!head.empty()) segments.push_back({head, nullptr});
  for (const auto& d : docs) {
    kdn::engine::KvSequence seq = cache.NewSequence();
    if (prune != nullptr) {
      KDN_ASSIGN_OR_RETURN(kdn::prune::KeptTokens kept,
                           kdn::prune::PruneText(model, d, *prune, &seq, budgets));
      KDN_ASSIGN_OR_RETURN(auto kv, kdn::prune::PrunedChunkOf(cache, seq, kept, {}, {}, dtype));
      segments.push_back({d, std::move(kv)});
      continue;
    }
    KDN_RETURN_IF_ERROR(cache.Reserve(seq, static_cast<int64_t>(d.size())));
    std::vector<float> logits;
    KDN_RETURN_IF_ERROR(model.Prefill(seq, d, {}, &logits));
    KDN_ASSIGN_OR_RETURN(
        auto kv, kdn::kvbridge::ChunkFromPagedKv(cache, seq, 0, seq.length(), {}, {}, dtype));
    const auto steer = steer_of.find(segments.size() - (head.empty() ? 0 : 1));
    if (steer != steer_of.end() && vector != nullptr) {
      // The document's last token, kept by the blend (Segment::pinned).
      const auto last = static_cast<int64_t>(d.size()) - 1;
      KDN_ASSIGN_OR_RETURN(
          kv, kdn::kvbridge::SteerChunkValues(*kv, *vector, steer->second, last, 1, {}));
      segments.push_back({d, std::move(kv), {last}});
      continue;
    }
    segments.push_back({d, std::move(kv)});
  }
  kdn::engine::KvSequence seq = cache.NewSequence();
  if (spec.emphasis) {
    KDN_RETURN_IF_ERROR(
        seq.SetAttentionBias({spec.emphasis->spans, spec.emphasis->heads, spec.emphasis->bias}));
  }
  KDN_ASSIGN_OR_RETURN(kdn::blend::BlendResult r,
                       kdn::blend::BlendPrefill(model, seq, segments, question, {.spec = spec}));
  BlendOutput out{{},
                  r.cached_tokens,
                  r.recomputed_tokens,
                  r.recompute_ratio,
                  r.dropped_tokens,
                  r.question_pass_tokens};
  KDN_ASSIGN_OR_RETURN(
      out.tokens,
      kdn::engine::GreedyTokens(model, seq, std::move(r.logits), gen.max_tokens, [&](int32_t t) {
        return std::find(gen.stop_ids.begin(), gen.stop_ids.end(), t) != gen.stop_ids.end();
      }));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kdn::engine;
  kdn::engine::PrepareCpuRuntime(argv);
  CLI::App app{"Run a prompt through the kdn engine, on the CPU or a GPU, in one process."};
  std::string model_dir, prompt, prompt_ids;
  GenerateOptions gen;
  gen.sampling.temperature = 0.0f;
  bool no_bos = false, print_ids = false, ignore_eos = false;
  int threads = 0;
  std::string device = "cpu";
  app.add_option("--model", model_dir,
                 "Model folder (config.json, *.safetensors, tokenizer.json) or a .gguf file")
      ->required();
  auto* p = app.add_option("--prompt", prompt, "Prompt text");
  app.add_option("--prompt-ids", prompt_ids,
                 "Prompt as comma-separated token ids (instead of --prompt)")
      ->excludes(p);
  std::string chat_file;
  app.add_option("--chat", chat_file,
                 "A conversation (a JSON file: an OpenAI messages array) rendered by the model's "
                 "chat template as kdn-router renders it, instead of --prompt")
      ->excludes(p)
      ->excludes("--prompt-ids");
  app.add_option("--max-tokens", gen.max_tokens, "Tokens to generate")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--temperature", gen.sampling.temperature, "0 = greedy")->capture_default_str();
  app.add_option("--top-k", gen.sampling.top_k, "0 = off")->capture_default_str();
  app.add_option("--top-p", gen.sampling.top_p, "1 = off")->capture_default_str();
  app.add_option("--seed", gen.sampling.seed, "Sampling seed")->capture_default_str();
  app.add_option("--device", device, "Where the engine runs: cpu, cuda (device 0) or cuda:N")
      ->capture_default_str();
  app.add_option("--threads", threads, "CPU threads (0 = all cores)")->capture_default_str();
  std::string weights_dtype = "native";
  kdn::worker::AddWeightsDTypeOption(app, &weights_dtype);
  app.add_flag("--no-bos", no_bos, "Do not prepend the BOS token");
  app.add_flag("--ignore-eos", ignore_eos, "Keep generating past the EOS token");
  app.add_flag("--print-ids", print_ids, "Print generated token ids instead of text");
  std::vector<std::string> documents;
  kdn::blend::BlendSpec blend;
  std::string selection = kdn::blend::BlendSelectionName(kdn::blend::DefaultBlendSelection());
  app.add_option("--document", documents,
                 "A document of a blend prompt (repeat in order; --prompt is the question, or "
                 "with --chat they open the last user message): "
                 "each document's KV is computed on its own and fused as kdn-prefill does")
      ->excludes("--prompt-ids");
  app.add_option("--recompute-ratio", blend.recompute_ratio, "Blend: the recompute ratio")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--check-layers", blend.check_layers,
                 "Blend: the check layers (comma-separated; default: kdn-router's, 1,2,3 where "
                 "the model has them)")
      ->delimiter(',');
  app.add_option("--blend-selection", selection,
                 "Blend: the selection policy (kdn-router's --blend-selection)")
      ->capture_default_str();
  app.add_option("--blend-max-kl", blend.max_kl, "Blend: a quality target (0: none)")
      ->check(CLI::NonNegativeNumber);
  std::vector<std::string> errata;
  app.add_option("--erratum", errata,
                 "Blend: N=TEXT, an erratum after document N (from 0), its KV computed after the "
                 "document's as a kdn/edit erratum stores it (repeat for other documents)")
      ->needs("--document");
  std::vector<std::string> emphasize;
  app.add_option("--emphasize", emphasize,
                 "Blend: N=PHRASE, a phrase of document N (its text or erratum) emphasized as "
                 "kdn-router emphasizes a request's 'documents[N].emphasize' (repeat for more)")
      ->needs("--document");
  std::string emphasis_heads;
  double emphasis_strength = kdn::blend::kDefaultEmphasisStrength;
  app.add_option("--emphasis-heads", emphasis_heads,
                 "Blend: the head profile emphasis biases (kdn-router's --emphasis-heads; "
                 "default: every head of the middle third of the layers)")
      ->check(CLI::ExistingFile)
      ->needs("--emphasize");
  app.add_option("--emphasis-strength", emphasis_strength,
                 "Blend: the emphasis bias, in (0, 16] (kdn-router's --emphasis-strength)")
      ->check([](const std::string& v) {
        auto s = kdn::blend::ParseEmphasisStrength(v);
        return s.ok() ? std::string() : s.status().message();
      })
      ->needs("--emphasize")
      ->capture_default_str();
  std::vector<std::string> steer;
  app.add_option("--steer", steer,
                 "Blend: N=STRENGTH, document N steered by the --steering-pairs vector at that "
                 "strength, as a request naming its steered version gets it (repeat for others)")
      ->needs("--document");
  std::string steering_pairs;
  app.add_option("--steering-pairs", steering_pairs,
                 "Blend: a POST /v1/kdn/steering body (name, pairs, layers) the --steer vector is "
                 "made from, as kdn-prefill makes it")
      ->check(CLI::ExistingFile)
      ->needs("--steer");
  kdn::prune::PruneSpec prune;
  auto* prune_method =
      app.add_option("--prune-method", prune.method,
                     "Blend: prune each document's KV first, as kdn-prefill stores a document "
                     "injected with `prune` (expected_attention, knorm or kvzip)")
          ->needs("--document");
  app.add_option("--prune-keep", prune.keep, "Blend: the share of each document's tokens kept")
      ->needs(prune_method)
      ->capture_default_str();
  app.add_option("--prune-sinks", prune.sinks, "Blend: leading tokens always kept")
      ->needs(prune_method)
      ->capture_default_str();
  std::string granularity_name;
  app.add_option("--prune-granularity", granularity_name,
                 "Blend: the same kept tokens in every layer and head (token), per layer "
                 "(layer), per layer and KV head (head), or each head as many as its scores earn "
                 "among all (global); the last three are stored per head (docs/kvbus.md, "
                 "\"Per-head kept tokens\"). Default: the method's, as kdn-prefill's (kvzip "
                 "global, expected_attention layer, knorm token)")
      ->needs(prune_method);
  std::string scoring_name;
  app.add_option("--prune-scoring", scoring_name,
                 "Blend, kvzip: full (KVzip's repeat pass over every layer, about two prefills "
                 "of a document), profiled (the model's head budgets, measured once on kdn's "
                 "calibration texts, and cheaper scores within each head: under one prefill) or "
                 "combined (KVzip's counts per head, ranked within each head by KVzip's and "
                 "Expected Attention's ranks together). Default: profiled when choosing "
                 "globally, as kdn-prefill's")
      ->needs(prune_method);
  CLI11_PARSE(app, argc, argv);

  if (auto s = kdn::blend::ParseBlendSelection(selection); s.ok()) {
    blend.selection = *s;
  } else {
    std::fprintf(stderr, "kdn-generate: --blend-selection: %s\n", s.status().message().c_str());
    return 2;
  }
  if (granularity_name.empty()) {
    // The method's default, as kdn-prefill's.
  } else if (auto g = kdn::prune::ParseGranularity(granularity_name); g.ok()) {
    prune.granularity = *g;
  } else {
    std::fprintf(stderr, "kdn-generate: --prune-granularity: %s\n", g.status().message().c_str());
    return 2;
  }
  if (scoring_name.empty()) {
    // kvzip's default at the granularity, as kdn-prefill's.
  } else if (auto sc = kdn::prune::ParseKvzipScoring(scoring_name); sc.ok()) {
    prune.scoring = *sc;
  } else {
    std::fprintf(stderr, "kdn-generate: --prune-scoring: %s\n", sc.status().message().c_str());
    return 2;
  }
  // --erratum N=TEXT, by document; --emphasize N=PHRASE.
  std::vector<std::pair<size_t, std::string>> errata_list, emphasized;
  if (!ParseIndexedTexts(errata, documents.size(), "--erratum", true, &errata_list) ||
      !ParseIndexedTexts(emphasize, documents.size(), "--emphasize", false, &emphasized)) {
    return 2;
  }
  const std::map<size_t, std::string> erratum_of(errata_list.begin(), errata_list.end());
  // --steer N=STRENGTH, with the vector of --steering-pairs.
  std::vector<std::pair<size_t, std::string>> steer_list;
  if (!ParseIndexedTexts(steer, documents.size(), "--steer", true, &steer_list)) return 2;
  std::map<size_t, float> steer_of;
  for (const auto& [n, text] : steer_list) {
    float strength = 0;  // as a request's strength travels; all of TEXT a number
    try {
      size_t used = 0;
      strength = std::stof(text, &used);
      if (used != text.size()) strength = 0;
    } catch (...) {
      strength = 0;
    }
    if (auto st = kdn::blend::CheckSteerStrength(strength); !st.ok()) {
      std::fprintf(stderr, "kdn-generate: --steer %zu=%s: %s\n", n, text.c_str(),
                   st.message().c_str());
      return 2;
    }
    if (erratum_of.count(n) != 0) {
      std::fprintf(stderr, "kdn-generate: --steer %zu: a steered document has no erratum\n", n);
      return 2;
    }
    steer_of[n] = strength;
  }
  if (!steer_of.empty() && (steering_pairs.empty() || !prune.method.empty())) {
    std::fprintf(stderr,
                 "kdn-generate: --steer needs --steering-pairs, and does not go with pruning\n");
    return 2;
  }
  if (!emphasized.empty() && !prune.method.empty()) {
    std::fprintf(stderr, "kdn-generate: emphasis does not go with pruned documents\n");
    return 2;
  }
  if (!erratum_of.empty() && !prune.method.empty()) {
    std::fprintf(stderr, "kdn-generate: a document with an erratum is not pruned\n");
    return 2;
  }
  if (!documents.empty() && gen.sampling.temperature != 0.0f) {
    std::fprintf(stderr, "kdn-generate: a blend (--document) decodes greedily: --temperature 0\n");
    return 2;
  }
  if (prompt.empty() && prompt_ids.empty() && chat_file.empty()) {
    std::fprintf(stderr, "kdn-generate: give --prompt, --prompt-ids or --chat\n");
    return 2;
  }
  if (auto st = kdn::model::ValidateSamplingParams(gen.sampling); !st.ok()) {
    std::fprintf(stderr, "kdn-generate: %s\n", st.message().c_str());
    return 2;
  }
  auto dev = ParseDevice(device);
  if (!dev.ok()) {
    std::fprintf(stderr, "kdn-generate: --device: %s\n", dev.status().message().c_str());
    return 2;
  }
  auto tok = kdn::text::Tokenizer::Load(model_dir);
  if (!tok.ok()) {
    std::fprintf(stderr, "kdn-generate: %s\n", tok.status().ToString().c_str());
    return 1;
  }
  std::vector<int32_t> ids;
  if (!prompt_ids.empty()) {
    std::stringstream ss(prompt_ids);
    std::string item;
    while (std::getline(ss, item, ',')) {
      try {
        ids.push_back(std::stoi(item));
      } catch (...) {
        std::fprintf(stderr, "kdn-generate: --prompt-ids: \"%s\" is not a token id\n",
                     item.c_str());
        return 2;
      }
    }
  }
  ChatText chat{"", prompt, !no_bos};
  if (!chat_file.empty()) {
    auto rendered = RenderChatFile(chat_file, model_dir, !documents.empty());
    if (!rendered.ok()) {
      std::fprintf(stderr, "kdn-generate: %s\n", rendered.status().ToString().c_str());
      return rendered.status().code() == kdn::StatusCode::kNotFound ? 1 : 2;
    }
    chat = *rendered;
  }
  if (prompt_ids.empty() && documents.empty()) {
    ids = (*tok)->Encode(chat_file.empty() ? prompt : chat.head, chat.add_bos);
  }
  // A blend prompt, tokenized as kdn-router's BlendPrompt does: BOS (or the
  // chat up to the documents), each document apart, then the question.
  std::vector<std::vector<int32_t>> doc_ids;
  std::vector<int32_t> question, head;
  if (!documents.empty()) {
    ids = (*tok)->Encode(chat.head, chat.add_bos);
    head = ids;
    for (size_t i = 0; i < documents.size(); ++i) {
      doc_ids.push_back((*tok)->Encode(documents[i], false));
      if (auto e = erratum_of.find(i); e != erratum_of.end()) {
        const std::vector<int32_t> note = (*tok)->Encode(e->second, false);
        doc_ids.back().insert(doc_ids.back().end(), note.begin(), note.end());
      }
      // Its emphasized phrases, where kdn-router puts them.
      for (const auto& [n, phrase] : emphasized) {
        if (n != i) continue;
        const auto held = kdn::text::TokensHolding(**tok, doc_ids.back(), phrase);
        if (!held) {
          std::fprintf(stderr, "kdn-generate: --emphasize %zu=%s: not in document %zu\n", n,
                       phrase.c_str(), n);
          return 2;
        }
        if (!blend.emphasis) blend.emphasis.emplace();
        const auto at = static_cast<int64_t>(ids.size());
        blend.emphasis->spans.emplace_back(at + held->first, at + held->second);
      }
      ids.insert(ids.end(), doc_ids.back().begin(), doc_ids.back().end());
    }
    question = (*tok)->Encode(chat.rest, false);
    ids.insert(ids.end(), question.begin(), question.end());
  }
  kdn::blend::SteeringVectorSpec steering;
  if (!steer_of.empty()) {
    auto cfg = kdn::model::LoadModelConfig(model_dir);
    auto spec = cfg.ok() ? LoadSteeringPairs(steering_pairs, **tok, *cfg)
                         : kdn::Result<kdn::blend::SteeringVectorSpec>(cfg.status());
    if (!spec.ok()) {
      std::fprintf(stderr, "kdn-generate: %s\n", spec.status().ToString().c_str());
      return spec.status().code() == kdn::StatusCode::kNotFound ? 1 : 2;
    }
    steering = *std::move(spec);
  }
  // Pruning holds a document's KV at its peak (a KVzip repeat pass
  // included) and its kept copy at once, each in whole blocks.
  int64_t prune_room = 0;
  std::vector<std::vector<int32_t>> budget_texts;  // kvzip's profiled scoring's
  if (!prune.method.empty()) {
    kdn::prune::TokenizeKvzipPrompts(  // as kdn-router does
        [&](const std::string& text) { return (*tok)->Encode(text, /*add_bos=*/false); }, &prune);
    if (auto st = kdn::prune::ValidatePruneSpec(prune); !st.ok()) {
      std::fprintf(stderr, "kdn-generate: %s\n", st.message().c_str());
      return 2;
    }
    if (kdn::prune::ScoringOf(prune) == kdn::prune::KvzipScoring::kProfiled) {
      for (const std::string& text : kdn::prune::CalibrationTexts()) {
        budget_texts.push_back((*tok)->Encode(text, /*add_bos=*/false));
      }
    }
    for (const auto* texts : {&doc_ids, &budget_texts}) {
      for (const auto& d : *texts) {
        const auto n = static_cast<int64_t>(d.size());
        prune_room =
            std::max(prune_room, kdn::prune::PrunePeakTokens(prune, n) + n + 2 * kKvBlockTokens);
      }
    }
  }
  // The KV pool holds the prompt and every token generated.
  OpenOptions opts{.device = *dev,
                   .kv_tokens = static_cast<int64_t>(ids.size()) + gen.max_tokens + kKvBlockTokens +
                                prune_room + SteeringRoom(steering),
                   .threads = threads};
  opts.max_batch = 1;
  opts.weights_dtype = *kdn::engine::ParseWeightsDType(weights_dtype);  // checked by the flag
  auto model = OpenEngine(model_dir, opts);
  if (!model.ok()) {
    std::fprintf(stderr, "kdn-generate: %s\n", model.status().ToString().c_str());
    return 1;
  }
  if (!ignore_eos) gen.stop_ids = kdn::text::ModelStopIds(**tok, (*model)->config());
  if (!documents.empty()) {
    const int layers = (*model)->config().num_layers;
    blend.check_layers =
        kdn::blend::ResolveCheckLayers(blend.check_layer, blend.check_layers, false, layers);
    if (blend.emphasis) {
      const int heads = (*model)->config().num_heads;
      std::vector<kdn::blend::EmphasisHead> on = kdn::blend::MiddleThirdHeads(layers, heads);
      if (!emphasis_heads.empty()) {
        auto profile = kdn::blend::LoadEmphasisProfile(emphasis_heads);
        kdn::Status st = profile.ok() ? kdn::blend::CheckEmphasisHeads(*profile, layers, heads)
                                      : profile.status();
        if (!st.ok()) {
          std::fprintf(stderr, "kdn-generate: --emphasis-heads: %s\n", st.message().c_str());
          return 2;
        }
        on = *std::move(profile);
      }
      if (auto st = kdn::blend::CheckEmphasisStrength(emphasis_strength); !st.ok()) {
        std::fprintf(stderr, "kdn-generate: --emphasis-strength: %s\n", st.message().c_str());
        return 2;
      }
      blend.emphasis = kdn::blend::MakeEmphasis(std::move(blend.emphasis->spans), on,
                                                emphasis_strength, layers, heads);
    }
    std::optional<kdn::kvbridge::SteeringVector> vector;
    if (!steer_of.empty()) {
      auto v = kdn::kvbridge::ValueSteeringVector(**model, steering.name, steering.pairs,
                                                  steering.layers);
      if (!v.ok()) {
        std::fprintf(stderr, "kdn-generate: the steering vector: %s\n",
                     v.status().ToString().c_str());
        return 1;
      }
      vector = *std::move(v);
    }
    // kvzip's profiled scoring: the model's head budgets, as kdn-prefill
    // measures them.
    std::optional<kdn::prune::HeadBudgets> budgets;
    if (!budget_texts.empty()) {
      auto b = kdn::prune::MeasureHeadBudgets(
          **model, budget_texts, {prune.kvzip_first, prune.kvzip_next, prune.kvzip_suffix});
      if (!b.ok()) {
        std::fprintf(stderr, "kdn-generate: kvzip's head budgets: %s\n",
                     b.status().ToString().c_str());
        return 1;
      }
      budgets = *std::move(b);
    }
    auto out = BlendAnswer(**model, head, doc_ids, question, blend,
                           prune.method.empty() ? nullptr : &prune, budgets ? &*budgets : nullptr,
                           steer_of, vector ? &*vector : nullptr, gen);
    if (!out.ok()) {
      std::fprintf(stderr, "kdn-generate: %s\n", out.status().ToString().c_str());
      return 1;
    }
    std::printf("%s\n",
                print_ids ? JoinIds(out->tokens).c_str() : (*tok)->Decode(out->tokens).c_str());
    std::fprintf(stderr,
                 "kdn-generate: blend of %zu documents: %d cached tokens, %d recomputed "
                 "(ratio %.2f), %d pruned, %d in a question pass, %zu tokens generated\n",
                 documents.size(), out->cached_tokens, out->recomputed_tokens, out->recompute_ratio,
                 out->pruned_tokens, out->question_pass_tokens, out->tokens.size());
    return 0;
  }
  auto res = Generate(**model, ids, gen);
  if (!res.ok()) {
    std::fprintf(stderr, "kdn-generate: %s\n", res.status().ToString().c_str());
    return 1;
  }
  if (print_ids) {
    std::printf("%s\n", JoinIds(res->tokens).c_str());
  } else {
    std::printf("%s\n", (*tok)->Decode(res->tokens).c_str());
  }
  const size_t n = res->tokens.size();
  std::fprintf(stderr,
               "kdn-generate: prompt %zu tokens in %.3f s (%.1f tok/s); %zu tokens generated, "
               "%.1f tok/s decode; finish: %s\n",
               ids.size(), res->prefill_seconds, ids.size() / std::max(res->prefill_seconds, 1e-9),
               n, n > 1 ? (n - 1) / std::max(res->decode_seconds, 1e-9) : 0.0,
               res->finish_reason.c_str());
  return 0;
}
