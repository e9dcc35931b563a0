#include "kdn/prune/spec.h"

#include <algorithm>
#include <iterator>
#include <string>

namespace kdn::prune {

const char* GranularityName(Granularity g) {
  switch (g) {
    case Granularity::kToken: return "token";
    case Granularity::kLayer: return "layer";
    case Granularity::kHead: return "head";
    case Granularity::kGlobal: return "global";
  }
  return "?";
}

Result<Granularity> ParseGranularity(const std::string& name) {
  if (name == "token") return Granularity::kToken;
  if (name == "layer") return Granularity::kLayer;
  if (name == "head") return Granularity::kHead;
  if (name == "global") return Granularity::kGlobal;
  return InvalidArgument("prune granularity \"" + name + "\": token, layer, head or global");
}

Granularity DefaultGranularity(std::string_view method) {
  if (method == "kvzip") return Granularity::kGlobal;
  if (method == "expected_attention") return Granularity::kLayer;
  return Granularity::kToken;
}

Granularity GranularityOf(const PruneSpec& spec) {
  return spec.granularity ? *spec.granularity : DefaultGranularity(spec.method);
}

KvzipScoring ScoringOf(const PruneSpec& spec) {
  if (spec.method != "kvzip") return KvzipScoring::kFull;
  if (spec.scoring) return *spec.scoring;
  return GranularityOf(spec) == Granularity::kGlobal ? KvzipScoring::kProfiled
                                                     : KvzipScoring::kFull;
}

const char* KvzipScoringName(KvzipScoring s) {
  switch (s) {
    case KvzipScoring::kFull: return "full";
    case KvzipScoring::kProfiled: return "profiled";
    case KvzipScoring::kCombined: return "combined";
  }
  return "?";
}

Result<KvzipScoring> ParseKvzipScoring(const std::string& name) {
  if (name == "full") return KvzipScoring::kFull;
  if (name == "profiled") return KvzipScoring::kProfiled;
  if (name == "combined") return KvzipScoring::kCombined;
  return InvalidArgument("prune scoring \"" + name + "\": full, profiled or combined");
}

bool IsPruneMethod(std::string_view method) {
  return std::find(std::begin(kPruneMethods), std::end(kPruneMethods), method) !=
         std::end(kPruneMethods);
}

std::string PruneMethodNames() {
  std::string names;
  for (std::string_view m : kPruneMethods) {
    names += (names.empty() ? "'" : ", '") + std::string(m) + "'";
  }
  return names;
}

void TokenizeKvzipPrompts(const std::function<std::vector<int32_t>(const std::string&)>& encode,
                          PruneSpec* spec) {
  if (spec->method != "kvzip") return;
  spec->kvzip_first = encode(std::string(kKvzipFirstPrompt));
  spec->kvzip_next = encode(std::string(kKvzipNextPrompt));
  spec->kvzip_suffix = encode(std::string(kKvzipSuffix));
}

Status ValidatePruneSpec(const PruneSpec& spec) {
  if (!IsPruneMethod(spec.method)) {
    return InvalidArgument("prune: unknown method '" + spec.method + "' (one of " +
                           PruneMethodNames() + ")");
  }
  if (!(spec.keep > 0 && spec.keep <= 1)) {
    return InvalidArgument("prune: keep must be in (0, 1], got " + std::to_string(spec.keep));
  }
  if (spec.sinks < 0 || spec.sinks > kMaxPruneSinks) {
    return InvalidArgument("prune: sinks must be in [0, " + std::to_string(kMaxPruneSinks) +
                           "], got " + std::to_string(spec.sinks));
  }
  if (spec.method == "kvzip" &&
      (spec.kvzip_first.empty() || spec.kvzip_next.empty() || spec.kvzip_suffix.empty())) {
    return InvalidArgument("prune: kvzip needs its repeat prompts");
  }
  if (spec.scoring && spec.method != "kvzip") {
    return InvalidArgument("prune: a scoring is kvzip's, not " + spec.method + "'s");
  }
  if (spec.scoring && *spec.scoring != KvzipScoring::kFull &&
      GranularityOf(spec) != Granularity::kGlobal) {
    return InvalidArgument(std::string("prune: kvzip's ") + KvzipScoringName(*spec.scoring) +
                           " scoring chooses globally, not by " +
                           GranularityName(GranularityOf(spec)));
  }
  return Status::Ok();
}

int64_t PrunePeakTokens(const PruneSpec& spec, int64_t tokens) {
  if (spec.method != "kvzip") return tokens;
  const auto first = static_cast<int64_t>(spec.kvzip_first.size());
  const int64_t next =
      tokens > kKvzipChunkTokens ? static_cast<int64_t>(spec.kvzip_next.size()) + kKvzipOverlap : 0;
  return tokens + std::max(first, next) + static_cast<int64_t>(spec.kvzip_suffix.size()) +
         std::min(tokens, kKvzipChunkTokens);
}

}  // namespace kdn::prune
