// kdn-bench kv-edit: whether an edit of a stored document's KV makes the
// model follow the document where it contradicts what the model knows
// (docs/kvbus.md, "Editing stored KV").
//
// The knowledge-conflict set is built here from bench/data/kv_edit_facts.txt
// (--facts): every fact whose object the model names, greedily, after the
// question alone becomes an item; its counterfactual object is another
// fact's of the same relation (a different first token), and its document
// states the counterfactual among --other-facts true facts of other
// relations, in an order drawn per item. The document's KV is computed alone, at
// positions 0.., as the KDN stores a document; a request is BOS (the head),
// the document, then a line break and a question, and the stored arms run
// through blend::BlendPrefill with the deployment's default selection
// (boundary+deviation:8 at --recompute-ratio), as a deployment serves them.
//
// Arms, on the same items in one run (a row per emphasize strength):
//   no_edit            the stored document as it is;
//   reprefill          the instruction, the document and the question
//                      computed in one prefill (the gold, and the cost
//                      baseline);
//   instruction_text   the same instruction as prompt text ahead of the
//                      stored document (the head: BOS and the instruction);
//   erratum            the stored document with a note after it, whose KV
//                      is computed once, on top of the document's (the
//                      edit), and stored with it;
//   emphasize          the stored document as it is, the counterfactual's
//                      tokens emphasized as PASTA does: an attention bias
//                      (KvSequence::SetAttentionBias) of --emphasize
//                      strength added to their scores in every query head
//                      of the middle third of the layers, for the question
//                      and the tokens generated after it;
//   emphasize_profiled the same bias of --emphasize-profiled strength in
//                      the --profile-heads heads (any layer) that a
//                      profiling pass chose, as PASTA does: each head
//                      biased alone at --profile-strength on --profile-items
//                      documents stating facts the model does not know (none
//                      of the items'), ranked by the mean rise of the stated
//                      object's log-probability after the question;
//   steer              the stored document with a value steering vector
//                      (kvbridge::SteerChunkValues) of --steer strength
//                      added to its last token's values in the middle third
//                      of the layers; the vector is the mean value
//                      difference at the last token of --steer-pairs
//                      contrastive pairs, a document of a fact the model
//                      does not know (none of the items') followed by the
//                      erratum's note and by the same note with "right"
//                      made "wrong" (KV cache steering, arXiv 2507.08799;
//                      values, not keys, as arXiv 2604.03270 found).
//
// Per arm, over the items (each with a bootstrap 95% interval): efficacy
// (the share where the counterfactual's first token is likelier than the
// true object's after the question), logodds_shift (log P(new) - log P(old)
// against the same with no document at all), paraphrase_efficacy (the three
// paraphrases of the question), specificity_top1 and specificity_kl (the
// questions of the document's other facts: greedy agreement with, and KL
// from, no_edit's answer), fluency (the mean of the bigram and trigram
// entropies, in bits, of --fluency-tokens greedy tokens after the question,
// on the first --fluency-items items), edit_ms (the note's KV, erratum; the
// steered copy of the stored chunk, steer),
// ttft_ms (the request's prefill or blend) and reprefill_ms (reprefill's,
// on the same item).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <numeric>
#include <random>

#include <CLI/CLI.hpp>

#include "bench_util.h"
#include "kv_edit_facts.h"
#include "prose.h"
#include "kdn/blend/blend.h"
#include "kdn/kvbridge/paged_chunks.h"
#include "kdn/kvbridge/steer.h"
#include "kdn/kvbus/key.h"
#include "kdn/text/tokenizer.h"

namespace kdn::bench {

namespace {

struct Fact {
  int rel = 0;
  std::string subject, object;
  int32_t answer = 0;  // the object's first token, after a space
};

struct Item {
  const Fact* fact = nullptr;
  std::string new_object;
  int32_t new_token = 0;
  double own_logodds = 0;  // log P(new) - log P(old), no document
  std::vector<int32_t> document;
  int64_t statement_begin = 0, statement_end = 0;  // the counterfactual's tokens in it
  std::vector<const Fact*> others;                 // the document's true facts
};

enum class Arm {
  kNoEdit,
  kReprefill,
  kInstructionText,
  kErratum,
  kEmphasize,
  kEmphasizeProfiled,
  kSteer
};
const char* ArmName(Arm a) {
  switch (a) {
    case Arm::kNoEdit: return "no_edit";
    case Arm::kReprefill: return "reprefill";
    case Arm::kInstructionText: return "instruction_text";
    case Arm::kErratum: return "erratum";
    case Arm::kEmphasize: return "emphasize";
    case Arm::kEmphasizeProfiled: return "emphasize_profiled";
    case Arm::kSteer: return "steer";
  }
  return "?";
}
struct ArmSpec {
  Arm arm;
  double strength = 0;  // emphasize's bias, steer's multiple of the vector
};

struct ArmRows {
  std::vector<double> efficacy, logodds_shift, paraphrase, spec_top1, spec_kl, fluency, edit_ms,
      ttft_ms, reprefill_ms;
};

std::vector<double> LogSoftmax(std::span<const float> logits) {
  const float mx = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float x : logits) sum += std::exp(static_cast<double>(x - mx));
  const double lse = mx + std::log(sum);
  std::vector<double> out(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) out[i] = logits[i] - lse;
  return out;
}

double LogOdds(std::span<const float> logits, int32_t new_token, int32_t old_token) {
  const std::vector<double> lp = LogSoftmax(logits);
  return lp[new_token] - lp[old_token];
}

// The mean of the bigram and trigram entropies (bits) of `tokens`.
double NgramEntropy(const std::vector<int32_t>& tokens) {
  double total = 0;
  for (size_t n : {size_t{2}, size_t{3}}) {
    if (tokens.size() < n) continue;
    std::map<std::vector<int32_t>, int> counts;
    for (size_t i = 0; i + n <= tokens.size(); ++i) {
      ++counts[std::vector<int32_t>(tokens.begin() + i, tokens.begin() + i + n)];
    }
    const double all = static_cast<double>(tokens.size() - n + 1);
    double h = 0;
    for (const auto& [gram, k] : counts) h -= k / all * std::log2(k / all);
    total += h;
  }
  return total / 2;
}

}  // namespace

void AddKvEditOptions(CLI::App* sub, KvEditOptions* o) {
  sub->add_option("--facts", o->facts_path, "The facts and templates the set is built from")
      ->capture_default_str()
      ->check(CLI::ExistingFile);
  sub->add_option("--items", o->items, "Items at most (0: every fact the model knows)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--other-facts", o->other_facts,
                  "True facts of other relations in each document (its specificity questions)")
      ->capture_default_str()
      ->check(CLI::Range(1, 8));
  sub->add_option("--fluency-items", o->fluency_items, "Items whose answer is generated")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--fluency-tokens", o->fluency_tokens, "Greedy tokens generated for fluency")
      ->capture_default_str()
      ->check(CLI::Range(3, 4096));
  sub->add_option("--recompute-ratio", o->recompute_ratio,
                  "The stored arms' blend (boundary+deviation:8, the deployment's default)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  sub->add_option("--emphasize", o->emphasize_strengths,
                  "Attention bias strengths on the counterfactual's tokens, a row each "
                  "(comma-separated)")
      ->delimiter(',')
      ->capture_default_str();
  sub->add_option("--steer", o->steer_strengths,
                  "Value steering strengths, a row each (comma-separated)")
      ->delimiter(',')
      ->capture_default_str();
  sub->add_option("--steer-pairs", o->steer_pairs,
                  "Contrastive pairs the steering vector is the mean of (from facts the model "
                  "does not know)")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  sub->add_option("--emphasize-profiled", o->profiled_strengths,
                  "Attention bias strengths on the counterfactual's tokens in the profiled "
                  "heads only, a row each (comma-separated)")
      ->delimiter(',')
      ->capture_default_str();
  sub->add_option("--profile-heads", o->profile_heads,
                  "Heads the profiling chooses (those whose bias alone most raises the stated "
                  "object's log-probability)")
      ->capture_default_str()
      ->check(CLI::Range(1, 65536));
  sub->add_option("--profile-items", o->profile_items,
                  "Documents of facts the model does not know that the heads are profiled on")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  sub->add_option("--profile-strength", o->profile_strength, "The bias each head is profiled at")
      ->capture_default_str()
      ->check(CLI::Range(-100.0, 100.0));
  sub->add_option("--bootstrap", o->bootstrap, "Resamples of the intervals")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
}

int RunKvEdit(const Common& c, const KvEditOptions& o) {
  for (const auto* s : {&o.emphasize_strengths, &o.steer_strengths, &o.profiled_strengths}) {
    for (double b : *s) {
      if (!std::isfinite(b) || std::fabs(b) > 100) {
        std::fprintf(stderr, "kdn-bench kv-edit: --%s %g: a strength is in [-100, 100]\n",
                     s == &o.steer_strengths      ? "steer"
                     : s == &o.profiled_strengths ? "emphasize-profiled"
                                                  : "emphasize",
                     b);
        return 2;
      }
    }
  }
  std::string what;
  auto model_r = MakeModel(c, 8192, &what);
  if (!model_r.ok()) {
    std::fprintf(stderr, "kdn-bench: %s\n", model_r.status().ToString().c_str());
    return 1;
  }
  engine::Engine& model = **model_r;
  const model::ModelConfig& cfg = model.config();
  if (c.model_dir.empty()) {
    std::fprintf(stderr, "kdn-bench kv-edit: needs --model (a model with a tokenizer)\n");
    return 2;
  }
  auto tok_r = text::Tokenizer::Load(c.model_dir);
  if (!tok_r.ok()) {
    std::fprintf(stderr, "kdn-bench kv-edit: %s\n", tok_r.status().ToString().c_str());
    return 1;
  }
  const text::Tokenizer& tok = **tok_r;
  auto rels_r = ReadFacts(o.facts_path);
  if (!rels_r.ok()) {
    std::fprintf(stderr, "kdn-bench kv-edit: %s\n", rels_r.status().ToString().c_str());
    return 2;
  }
  const std::vector<Relation>& rels = *rels_r;
  auto encode = [&](const std::string& s) { return tok.Encode(s, false); };
  std::vector<int32_t> bos = tok.Encode("", true);
  if (bos.empty()) bos.push_back(cfg.bos_token_id >= 0 ? cfg.bos_token_id : 0);
  engine::KvCache& cache = model.kv_cache();
  const auto first_token = [&](const std::string& object) { return encode(" " + object).front(); };
  // The logits after `prompt`, prefilled alone.
  const auto prefill = [&](const std::vector<int32_t>& prompt) -> Result<std::vector<float>> {
    engine::KvSequence seq = cache.NewSequence();
    std::vector<float> logits;
    KDN_RETURN_IF_ERROR(model.Prefill(seq, prompt, {}, &logits));
    return logits;
  };

  // The facts the model knows: its greedy next token after the question
  // alone is the object's first.
  std::vector<Fact> facts;
  size_t candidates = 0;
  std::vector<std::vector<float>> own_logits;  // the question's, with no document
  for (size_t r = 0; r < rels.size(); ++r) {
    for (const auto& [s, obj] : rels[r].facts) {
      ++candidates;
      std::vector<int32_t> prompt = bos;
      const std::vector<int32_t> q = encode(Fill(rels[r].question, s, obj));
      prompt.insert(prompt.end(), q.begin(), q.end());
      auto logits = prefill(prompt);
      if (!logits.ok()) {
        std::fprintf(stderr, "kdn-bench kv-edit: %s\n", logits.status().ToString().c_str());
        return 1;
      }
      const int32_t answer = first_token(obj);
      if (engine::Argmax(*logits) != answer) continue;
      facts.push_back({static_cast<int>(r), s, obj, answer});
      own_logits.push_back(*std::move(logits));
    }
  }
  // Facts the model does not know make the steering vector's pairs.
  std::vector<std::pair<int, const std::pair<std::string, std::string>*>> unknown;
  for (size_t r = 0; r < rels.size(); ++r) {
    for (const auto& f : rels[r].facts) {
      if (std::none_of(facts.begin(), facts.end(), [&](const Fact& k) {
            return k.rel == static_cast<int>(r) && k.subject == f.first;
          })) {
        unknown.emplace_back(static_cast<int>(r), &f);
      }
    }
  }
  std::printf("kv-edit on %s: %zu of %zu facts known (%s):", what.c_str(), facts.size(), candidates,
              o.facts_path.c_str());
  json known = json::object();
  for (size_t r = 0; r < rels.size(); ++r) {
    const auto k = std::count_if(facts.begin(), facts.end(),
                                 [&](const Fact& f) { return f.rel == static_cast<int>(r); });
    known[rels[r].name] = {{"known", k}, {"facts", rels[r].facts.size()}};
    std::printf(" %s %td/%zu", rels[r].name.c_str(), k, rels[r].facts.size());
  }
  std::printf("\n");

  // Items: a counterfactual each, and a document.
  std::mt19937_64 rng(c.seed + 75);
  std::vector<size_t> order(facts.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<Item> items;
  for (size_t i : order) {
    if (o.items > 0 && static_cast<int>(items.size()) == o.items) break;
    const Fact& f = facts[i];
    const Relation& rel = rels[f.rel];
    std::vector<std::string> alts;
    for (const auto& [s, obj] : rel.facts) {
      if (obj != f.object && first_token(obj) != f.answer &&
          std::find(alts.begin(), alts.end(), obj) == alts.end()) {
        alts.push_back(obj);
      }
    }
    std::vector<size_t> pick = order;
    std::shuffle(pick.begin(), pick.end(), rng);
    std::vector<const Fact*> others;
    for (size_t j : pick) {
      if (static_cast<int>(others.size()) == o.other_facts) break;
      const Fact& g = facts[j];
      // Of other relations, and not about this fact's subject.
      if (g.rel == f.rel || g.subject == f.subject ||
          std::any_of(others.begin(), others.end(),
                      [&](const Fact* h) { return h->rel == g.rel; })) {
        continue;
      }
      others.push_back(&g);
    }
    if (alts.empty() || static_cast<int>(others.size()) < o.other_facts) continue;
    Item it;
    it.fact = &f;
    it.new_object = alts[rng() % alts.size()];
    it.new_token = first_token(it.new_object);
    it.own_logodds = LogOdds(own_logits[i], it.new_token, f.answer);
    it.others = others;
    // Sentence by sentence (each after a space but the first), so that the
    // counterfactual's tokens are known.
    std::vector<std::string> sentences = {Fill(rel.statement, f.subject, it.new_object)};
    for (const Fact* g : others) {
      sentences.push_back(Fill(rels[g->rel].statement, g->subject, g->object));
    }
    const std::string statement = sentences[0];
    std::shuffle(sentences.begin(), sentences.end(), rng);
    for (const std::string& sentence : sentences) {
      const std::vector<int32_t> t = encode((it.document.empty() ? "" : " ") + sentence);
      if (sentence == statement) {
        it.statement_begin = static_cast<int64_t>(it.document.size());
        it.statement_end = it.statement_begin + static_cast<int64_t>(t.size());
      }
      it.document.insert(it.document.end(), t.begin(), t.end());
    }
    items.push_back(std::move(it));
  }
  if (items.empty()) {
    std::fprintf(stderr, "kdn-bench kv-edit: no item could be built\n");
    return 1;
  }
  double doc_tokens = 0;
  for (const Item& it : items) doc_tokens += static_cast<double>(it.document.size());
  doc_tokens /= static_cast<double>(items.size());

  const std::vector<int32_t> instruction = encode(o.instruction + "\n");
  const std::vector<int32_t> note = encode("\n" + o.erratum);
  std::printf(
      "%zu items, each a document of the counterfactual and %d true facts (%.1f tokens on "
      "average); the instruction %zu tokens, the erratum %zu\n",
      items.size(), o.other_facts, doc_tokens, instruction.size(), note.size());
  std::vector<int32_t> instructed_head = bos;
  instructed_head.insert(instructed_head.end(), instruction.begin(), instruction.end());
  const kvbus::KeyContext ctx{{0, 75}, "", 256};
  const blend::BlendSpec spec{.recompute_ratio = o.recompute_ratio,
                              .selection = {blend::BlendSelection::Kind::kBoundaryDeviation,
                                            blend::kDefaultBoundaryTokens}};

  std::vector<ArmSpec> arms = {
      {Arm::kNoEdit}, {Arm::kReprefill}, {Arm::kInstructionText}, {Arm::kErratum}};
  for (double b : o.emphasize_strengths) arms.push_back({Arm::kEmphasize, b});
  for (double b : o.profiled_strengths) arms.push_back({Arm::kEmphasizeProfiled, b});
  for (double b : o.steer_strengths) arms.push_back({Arm::kSteer, b});
  // Emphasis and steering: the middle third of the layers.
  const int layer0 = cfg.num_layers / 3, layer1 = 2 * cfg.num_layers / 3;

  // The steering vector: "right" against "wrong" in the note after a
  // document of an unknown fact stated with another fact's object.
  std::string wrong = o.erratum;
  if (const size_t at = wrong.rfind("right"); at != std::string::npos) {
    wrong.replace(at, 5, "wrong");
  }
  std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>> steer_pairs;
  for (size_t i = 0; i < unknown.size() && static_cast<int>(steer_pairs.size()) < o.steer_pairs;
       ++i) {
    const auto& [r, f] = unknown[(i * 7919) % unknown.size()];
    const Relation& rel = rels[r];
    const std::string& other = rel.facts[(i * 31 + 1) % rel.facts.size()].second;
    std::vector<int32_t> doc = bos;
    const std::vector<int32_t> t = encode(Fill(rel.statement, f->first, other));
    doc.insert(doc.end(), t.begin(), t.end());
    std::vector<int32_t> pos = doc, neg = doc;
    const std::vector<int32_t> a = encode("\n" + o.erratum), b = encode("\n" + wrong);
    pos.insert(pos.end(), a.begin(), a.end());
    neg.insert(neg.end(), b.begin(), b.end());
    steer_pairs.emplace_back(std::move(pos), std::move(neg));
  }
  std::vector<int> steer_layers(static_cast<size_t>(layer1 - layer0));
  std::iota(steer_layers.begin(), steer_layers.end(), layer0);
  kvbridge::SteeringVector steer;
  if (!o.steer_strengths.empty()) {
    auto v = kvbridge::ValueSteeringVector(model, "trust-the-text", std::move(steer_pairs),
                                           steer_layers);
    if (!v.ok()) {
      std::fprintf(stderr, "kdn-bench kv-edit: the steering vector: %s\n",
                   v.status().ToString().c_str());
      return 1;
    }
    steer = *std::move(v);
    double norm = 0;
    for (float x : steer.values) norm += double{x} * x;
    std::printf("steering vector: %zu pairs, layers %d to %d, norm %.3f per layer\n",
                steer.pairs.size(), layer0, layer1 - 1,
                std::sqrt(norm / static_cast<double>(steer.layers.size())));
  }
  // Head profiling: each (layer, query head) biased alone on the stated
  // object's statement, ranked by the mean rise of its log-probability.
  // `bias_of` builds a request's bias: `strength` on the heads `on` says.
  const size_t all_heads = static_cast<size_t>(cfg.num_layers) * cfg.num_heads;
  const auto bias_of = [&](int64_t begin, int64_t end, const std::vector<bool>& on,
                           double strength) {
    const auto at = static_cast<int64_t>(bos.size());
    engine::KvSequence::AttentionBias bias{
        {{at + begin, at + end}}, cfg.num_heads, std::vector<float>(all_heads, 0.0f)};
    for (size_t h = 0; h < all_heads; ++h) {
      if (on[h]) bias.bias[h] = static_cast<float>(strength);
    }
    return bias;
  };
  std::vector<bool> profiled(all_heads, false);
  std::vector<std::pair<double, size_t>> head_gain;
  if (!o.profiled_strengths.empty()) {
    const auto t0 = Clock::now();
    std::vector<double> gain(all_heads, 0.0);
    int used = 0;
    for (size_t i = 0; i < unknown.size() && used < o.profile_items; ++i) {
      const auto& [r, f] = unknown[(i * 104729 + 17) % unknown.size()];
      const Relation& rel = rels[r];
      const std::string& other = rel.facts[(i * 37 + 3) % rel.facts.size()].second;
      if (other == f->second) continue;
      const std::vector<int32_t> doc = encode(Fill(rel.statement, f->first, other));
      const std::vector<int32_t> question = encode("\n" + Fill(rel.question, f->first, other));
      const int32_t stated = first_token(other);
      engine::KvSequence dseq = cache.NewSequence();
      std::vector<float> logits;
      Status st = model.Prefill(dseq, doc, {}, &logits);
      auto kv = st.ok()
                    ? kvbridge::ChunkFromPagedKv(cache, dseq, 0, static_cast<int64_t>(doc.size()),
                                                 {}, {}, model.kv_dtype())
                    : Result<std::shared_ptr<const kvbus::Chunk>>(st);
      if (!kv.ok()) {
        std::fprintf(stderr, "kdn-bench kv-edit: profiling: %s\n", kv.status().ToString().c_str());
        return 1;
      }
      const std::vector<blend::Segment> segments = {{bos, nullptr}, {doc, *kv}};
      // log P(stated) with the bias on the heads `on` (none: the baseline).
      const auto logp = [&](const std::vector<bool>& on) -> Result<double> {
        engine::KvSequence seq = cache.NewSequence();
        KDN_RETURN_IF_ERROR(seq.SetAttentionBias(
            bias_of(0, static_cast<int64_t>(doc.size()), on, o.profile_strength)));
        KDN_ASSIGN_OR_RETURN(
            blend::BlendResult res,
            blend::BlendPrefill(model, seq, segments, question, {.spec = spec, .seed = i + 1}));
        return LogSoftmax(res.logits)[static_cast<size_t>(stated)];
      };
      auto base = logp(std::vector<bool>(all_heads, false));
      if (!base.ok()) {
        std::fprintf(stderr, "kdn-bench kv-edit: profiling: %s\n",
                     base.status().ToString().c_str());
        return 1;
      }
      std::vector<bool> one(all_heads, false);
      for (size_t h = 0; h < all_heads; ++h) {
        one[h] = true;
        auto lp = logp(one);
        one[h] = false;
        if (!lp.ok()) {
          std::fprintf(stderr, "kdn-bench kv-edit: profiling: %s\n",
                       lp.status().ToString().c_str());
          return 1;
        }
        gain[h] += *lp - *base;
      }
      ++used;
    }
    for (size_t h = 0; h < all_heads; ++h) {
      head_gain.emplace_back(gain[h] / std::max(used, 1), h);
    }
    std::sort(head_gain.begin(), head_gain.end(), std::greater<>());
    head_gain.resize(std::min(head_gain.size(), static_cast<size_t>(o.profile_heads)));
    for (const auto& [g, h] : head_gain) profiled[h] = true;
    std::printf("profiled %zu heads on %d documents in %.1f s:", head_gain.size(), used,
                Seconds(t0, Clock::now()));
    for (const auto& [g, h] : head_gain) {
      std::printf(" %zu.%zu (%+.3f)", h / cfg.num_heads, h % cfg.num_heads, g);
    }
    std::printf("\n");
  }
  std::vector<bool> middle(all_heads, false);
  for (int l = layer0; l < layer1; ++l) {
    std::fill_n(middle.begin() + static_cast<std::ptrdiff_t>(l) * cfg.num_heads, cfg.num_heads,
                true);
  }

  std::vector<ArmRows> rows(arms.size());
  const auto t_start = Clock::now();
  for (size_t n = 0; n < items.size(); ++n) {
    const Item& it = items[n];
    const Relation& rel = rels[it.fact->rel];
    // The document's KV alone, then with the note after it (the edit: only
    // the note's tokens computed, on top of the document's).
    std::vector<int32_t> noted_tokens = it.document;
    noted_tokens.insert(noted_tokens.end(), note.begin(), note.end());
    std::shared_ptr<const kvbus::Chunk> plain_kv, noted_kv;
    double edit_ms = 0;
    const auto store_document = [&]() -> Status {
      engine::KvSequence seq = cache.NewSequence();
      const auto chunk_of = [&](const std::vector<int32_t>& tokens) {
        return kvbridge::ChunkFromPagedKv(cache, seq, 0, static_cast<int64_t>(tokens.size()),
                                          kvbus::SegmentKey(ctx, tokens), ctx.model_fingerprint,
                                          model.kv_dtype());
      };
      std::vector<float> logits;
      KDN_RETURN_IF_ERROR(model.Prefill(seq, it.document, {}, &logits));
      KDN_ASSIGN_OR_RETURN(plain_kv, chunk_of(it.document));
      const auto t0 = Clock::now();
      KDN_RETURN_IF_ERROR(model.Prefill(seq, note, {}, &logits));
      edit_ms = 1e3 * Seconds(t0, Clock::now());
      KDN_ASSIGN_OR_RETURN(noted_kv, chunk_of(noted_tokens));
      return Status::Ok();
    };
    if (Status st = store_document(); !st.ok()) {
      std::fprintf(stderr, "kdn-bench kv-edit: %s\n", st.ToString().c_str());
      return 1;
    }
    // Each steer arm's copy of the stored chunk, its last token steered.
    std::vector<std::shared_ptr<const kvbus::Chunk>> steered_kv(arms.size());
    std::vector<double> steer_ms(arms.size(), 0);
    for (size_t a = 0; a < arms.size(); ++a) {
      if (arms[a].arm != Arm::kSteer) continue;
      const auto t0 = Clock::now();
      auto s = kvbridge::SteerChunkValues(*plain_kv, steer, static_cast<float>(arms[a].strength),
                                          static_cast<int64_t>(it.document.size()) - 1, 1,
                                          kvbus::ChunkKey{n + 1, a});
      steer_ms[a] = 1e3 * Seconds(t0, Clock::now());
      if (!s.ok()) {
        std::fprintf(stderr, "kdn-bench kv-edit: steer: %s\n", s.status().ToString().c_str());
        return 1;
      }
      steered_kv[a] = *std::move(s);
    }

    // The questions: the item's, its paraphrases, the other facts'.
    const auto suffix = [&](const std::string& q) { return encode("\n" + q); };
    std::vector<std::vector<int32_t>> questions = {
        suffix(Fill(rel.question, it.fact->subject, it.fact->object))};
    for (const std::string& p : rel.paraphrases) {
      questions.push_back(suffix(Fill(p, it.fact->subject, it.fact->object)));
    }
    for (const Fact* g : it.others) {
      questions.push_back(suffix(Fill(rels[g->rel].question, g->subject, g->object)));
    }
    const bool fluency = static_cast<int>(n) < o.fluency_items;

    std::vector<std::vector<std::vector<float>>> answers(arms.size());  // [arm][question] logits
    double reprefill_ms = 0;
    for (size_t a = 0; a < arms.size(); ++a) {
      const Arm arm = arms[a].arm;
      std::vector<std::vector<float>>& out = answers[a];
      double ttft_ms = 0, entropy = 0;
      for (size_t q = 0; q < questions.size(); ++q) {
        engine::KvSequence seq = cache.NewSequence();
        if (arm == Arm::kEmphasize || arm == Arm::kEmphasizeProfiled) {
          // The counterfactual's slots in the prompt, after the head (BOS).
          if (Status st = seq.SetAttentionBias(bias_of(it.statement_begin, it.statement_end,
                                                       arm == Arm::kEmphasize ? middle : profiled,
                                                       arms[a].strength));
              !st.ok()) {
            std::fprintf(stderr, "kdn-bench kv-edit: %s\n", st.ToString().c_str());
            return 1;
          }
        }
        std::vector<float> logits;
        const auto t0 = Clock::now();
        Status st;
        if (arm == Arm::kReprefill) {
          std::vector<int32_t> prompt = instructed_head;
          prompt.insert(prompt.end(), it.document.begin(), it.document.end());
          prompt.insert(prompt.end(), questions[q].begin(), questions[q].end());
          st = model.Prefill(seq, prompt, {}, &logits);
        } else {
          const bool noted = arm == Arm::kErratum;
          std::vector<blend::Segment> segments = {
              {arm == Arm::kInstructionText ? instructed_head : bos, nullptr},
              {noted ? noted_tokens : it.document, noted                ? noted_kv
                                                   : arm == Arm::kSteer ? steered_kv[a]
                                                                        : plain_kv}};
          // As a deployment blends a steered version: its steered token keeps
          // its values (blend::Segment::pinned).
          if (arm == Arm::kSteer) {
            segments[1].pinned = {static_cast<int64_t>(it.document.size()) - 1};
          }
          auto res = blend::BlendPrefill(model, seq, segments, questions[q],
                                         {.spec = spec, .seed = n + 1});
          if (res.ok()) logits = std::move(res->logits);
          st = res.status();
        }
        if (!st.ok()) {
          std::fprintf(stderr, "kdn-bench kv-edit: %s: %s\n", ArmName(arm), st.ToString().c_str());
          return 1;
        }
        if (q == 0) {
          ttft_ms = 1e3 * Seconds(t0, Clock::now());
          if (fluency) {
            auto gen = GreedyTokens(model, seq, logits, o.fluency_tokens);
            if (!gen.ok()) {
              std::fprintf(stderr, "kdn-bench kv-edit: %s\n", gen.status().ToString().c_str());
              return 1;
            }
            entropy = NgramEntropy(*gen);
          }
        }
        out.push_back(std::move(logits));
      }
      if (arm == Arm::kReprefill) reprefill_ms = ttft_ms;
      ArmRows& r = rows[a];
      const double lo = LogOdds(out[0], it.new_token, it.fact->answer);
      r.efficacy.push_back(lo > 0 ? 1 : 0);
      r.logodds_shift.push_back(lo - it.own_logodds);
      double para = 0;
      for (size_t q = 1; q <= 3; ++q) para += LogOdds(out[q], it.new_token, it.fact->answer) > 0;
      r.paraphrase.push_back(para / 3);
      r.ttft_ms.push_back(ttft_ms);
      r.edit_ms.push_back(arm == Arm::kErratum ? edit_ms : steer_ms[a]);
      if (fluency) r.fluency.push_back(entropy);
    }
    const std::vector<std::vector<float>>& base = answers[0];  // no_edit
    for (size_t a = 0; a < arms.size(); ++a) {
      ArmRows& r = rows[a];
      double top1 = 0, kl = 0;
      for (size_t q = 4; q < base.size(); ++q) {
        top1 += engine::Argmax(answers[a][q]) == engine::Argmax(base[q]);
        kl += blend::KlDivergence(base[q], answers[a][q]);
      }
      const double k = static_cast<double>(base.size() - 4);
      r.spec_top1.push_back(top1 / k);
      r.spec_kl.push_back(kl / k);
      r.reprefill_ms.push_back(reprefill_ms);
    }
    if ((n + 1) % 20 == 0 || n + 1 == items.size()) {
      std::fprintf(stderr, "kv-edit: %zu of %zu items, %.0f s\n", n + 1, items.size(),
                   Seconds(t_start, Clock::now()));
    }
  }

  std::printf("%-21s %22s %9s %22s %20s %9s %8s %8s %8s %9s\n", "arm", "efficacy [95%]", "logodds",
              "paraphrase [95%]", "spec top1 / KL", "fluency", "edit ms", "ttft ms", "reprefill",
              "edit/rep");
  json out_rows = json::array();
  uint64_t seed = c.seed + 7500;
  for (size_t a = 0; a < arms.size(); ++a) {
    const Arm arm = arms[a].arm;
    const ArmRows& r = rows[a];
    const auto iv = [&](const std::vector<double>& x) {
      const Interval v = Bootstrap(x, o.bootstrap, ++seed);
      return json{{"mean", v.mean}, {"lo", v.lo}, {"hi", v.hi}};
    };
    char label_buf[48];
    const bool graded =
        arm == Arm::kEmphasize || arm == Arm::kEmphasizeProfiled || arm == Arm::kSteer;
    std::snprintf(label_buf, sizeof(label_buf), graded ? "%s %g" : "%s", ArmName(arm),
                  arms[a].strength);
    const std::string label = label_buf;
    json row = {{"arm", ArmName(arm)},
                {"strength", graded ? json(arms[a].strength) : json(nullptr)},
                {"items", r.efficacy.size()},
                {"efficacy", iv(r.efficacy)},
                {"logodds_shift", iv(r.logodds_shift)},
                {"paraphrase_efficacy", iv(r.paraphrase)},
                {"specificity_top1", iv(r.spec_top1)},
                {"specificity_kl", iv(r.spec_kl)},
                {"fluency", iv(r.fluency)},
                {"fluency_items", r.fluency.size()},
                {"edit_ms", iv(r.edit_ms)},
                {"ttft_ms", iv(r.ttft_ms)},
                {"reprefill_ms", iv(r.reprefill_ms)}};
    const double rep = Mean(r.reprefill_ms);
    std::printf(
        "%-21s %6.3f [%5.3f, %5.3f] %9.3f %6.3f [%5.3f, %5.3f] %9.3f / %8.4f %9.3f %8.2f %8.2f "
        "%8.2f %9.3f\n",
        label.c_str(), row["efficacy"]["mean"].get<double>(), row["efficacy"]["lo"].get<double>(),
        row["efficacy"]["hi"].get<double>(), Mean(r.logodds_shift), Mean(r.paraphrase),
        row["paraphrase_efficacy"]["lo"].get<double>(),
        row["paraphrase_efficacy"]["hi"].get<double>(), Mean(r.spec_top1), Mean(r.spec_kl),
        Mean(r.fluency), Mean(r.edit_ms), Mean(r.ttft_ms), rep,
        rep > 0 ? Mean(r.edit_ms) / rep : 0.0);
    out_rows.push_back(std::move(row));
  }
  // The profiled heads: layer, query head and their mean gain.
  json profiled_json = json::array();
  for (const auto& [g, h] : head_gain) {
    profiled_json.push_back(
        {{"layer", h / cfg.num_heads}, {"head", h % cfg.num_heads}, {"gain", g}});
  }
  json j = {{"workload", "kv-edit"},
            {"model", what},
            {"facts", o.facts_path},
            {"facts_known", facts.size()},
            {"facts_candidates", candidates},
            {"known_by_relation", known},
            {"items", items.size()},
            {"instruction", o.instruction},
            {"erratum", o.erratum},
            {"recompute_ratio", o.recompute_ratio},
            {"selection", "boundary+deviation:" + std::to_string(blend::kDefaultBoundaryTokens)},
            {"other_facts", o.other_facts},
            {"emphasize_layers", {layer0, layer1}},
            {"steer_layers", {layer0, layer1}},
            {"profiled_heads", profiled_json},
            {"profile_strength", o.profile_strength},
            {"steer_pairs", steer.pairs.size()},
            {"steer_negative_note", wrong},
            {"document_tokens", doc_tokens},
            {"instruction_tokens", instruction.size()},
            {"erratum_tokens", note.size()},
            {"fluency_tokens", o.fluency_tokens},
            {"bootstrap", o.bootstrap},
            {"seed", c.seed},
            {"machine", Machine(c)},
            {"rows", out_rows}};
  Emit(c, j);
  return 0;
}

}  // namespace kdn::bench
