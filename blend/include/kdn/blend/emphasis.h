#pragma once
// Emphasis (blend::Emphasis, kdn/blend/spec.h) as a request asks for it:
// the heads it biases, chosen by a profiling pass or given, a strength, and
// the spans of the prompt's documents (docs/serving.md, "Emphasis").
// Engine-free: kdn-router and kdn-generate build an Emphasis with it, the
// workers hand it to the engine as a KvSequence::AttentionBias.
//
// Pure functions.

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kdn/blend/spec.h"
#include "kdn/common/status.h"

namespace kdn::blend {

// The strength a request gets when it names none: with SmolLM2's profiled
// heads the measured one that raises efficacy and loses at most 2 points of
// specificity (docs/kvbus.md, "Editing stored KV").
inline constexpr double kDefaultEmphasisStrength = 0.5;
// The largest strength a request may ask for: past it the biased heads
// attend to the span alone.
inline constexpr double kMaxEmphasisStrength = 16.0;

struct EmphasisHead {
  int layer = 0;
  int head = 0;  // a query head of that layer
  friend bool operator==(const EmphasisHead&, const EmphasisHead&) = default;
};

// Every query head of the layers [num_layers / 3, 2 * num_layers / 3) (at
// least one layer): what emphasis biases when no profile names its heads.
std::vector<EmphasisHead> MiddleThirdHeads(int num_layers, int num_heads);

// OK for a non-empty list of distinct heads inside the model; otherwise
// INVALID_ARGUMENT saying which head is wrong.
Status CheckEmphasisHeads(std::span<const EmphasisHead> heads, int num_layers, int num_heads);

// OK for a finite strength in (0, kMaxEmphasisStrength].
Status CheckEmphasisStrength(double strength);
// A strength written as text (a flag's value), checked as above;
// INVALID_ARGUMENT for text that is not a number.
Result<double> ParseEmphasisStrength(const std::string& text);

// The heads a profile names: a JSON object whose "profiled_heads" lists
// {"layer": L, "head": H} objects (what `kdn-bench kv-edit --json` writes
// for its profiling pass; other keys are ignored). INVALID_ARGUMENT for
// anything else, naming what is wrong; the heads are checked against the
// model by CheckEmphasisHeads.
Result<std::vector<EmphasisHead>> ParseEmphasisProfile(std::string_view json_text);
// ParseEmphasisProfile of a file's text; NOT_FOUND when it cannot be read.
Result<std::vector<EmphasisHead>> LoadEmphasisProfile(const std::string& path);

// `spans` sorted, with overlapping or touching spans merged and empty ones
// dropped.
std::vector<std::pair<int64_t, int64_t>> MergeSpans(std::vector<std::pair<int64_t, int64_t>> spans);

// The emphasis of `strength` on `heads` (checked: CheckEmphasisHeads,
// CheckEmphasisStrength) over `spans` (merged by MergeSpans).
Emphasis MakeEmphasis(std::vector<std::pair<int64_t, int64_t>> spans,
                      std::span<const EmphasisHead> heads, double strength, int num_layers,
                      int num_heads);

}  // namespace kdn::blend
