// Emphasis as a request asks for it (kdn/blend/emphasis.h) and on the wire
// (control/request_spec.h).

#include "kdn/blend/emphasis.h"

#include <gtest/gtest.h>

#include <cmath>

#include "kdn/control/request_spec.h"
#include "serving.pb.h"

namespace kdn::blend {
namespace {

TEST(Emphasis, MiddleThirdHeadsAreEveryHeadOfTheMiddleLayers) {
  const std::vector<EmphasisHead> heads = MiddleThirdHeads(30, 9);
  ASSERT_EQ(heads.size(), 90u);  // layers 10 to 19
  EXPECT_EQ(heads.front(), (EmphasisHead{10, 0}));
  EXPECT_EQ(heads.back(), (EmphasisHead{19, 8}));
  EXPECT_TRUE(CheckEmphasisHeads(heads, 30, 9).ok());
  // A model too shallow for a third still gets a layer.
  EXPECT_EQ(MiddleThirdHeads(1, 2), (std::vector<EmphasisHead>{{0, 0}, {0, 1}}));
  EXPECT_EQ(MiddleThirdHeads(2, 1), (std::vector<EmphasisHead>{{0, 0}}));
}

TEST(Emphasis, HeadsAndStrengthsOutsideTheModelOrRangeAreRefusedByName) {
  const std::vector<EmphasisHead> outside{{2, 1}, {30, 0}};
  Status st = CheckEmphasisHeads(outside, 30, 9);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("[30, 0]"), std::string::npos) << st.ToString();
  const std::vector<EmphasisHead> twice{{2, 1}, {2, 1}};
  st = CheckEmphasisHeads(twice, 30, 9);
  EXPECT_NE(st.message().find("twice"), std::string::npos) << st.ToString();
  EXPECT_FALSE(CheckEmphasisHeads({}, 30, 9).ok());
  const std::vector<EmphasisHead> head9{{0, 9}};
  EXPECT_FALSE(CheckEmphasisHeads(head9, 30, 9).ok());
  EXPECT_TRUE(CheckEmphasisStrength(0.5).ok());
  EXPECT_TRUE(CheckEmphasisStrength(kMaxEmphasisStrength).ok());
  for (double bad : {0.0, -1.0, kMaxEmphasisStrength * 2, std::nan("")}) {
    EXPECT_FALSE(CheckEmphasisStrength(bad).ok()) << bad;
  }
  EXPECT_EQ(ParseEmphasisStrength("1.5").value(), 1.5);
  EXPECT_NE(ParseEmphasisStrength("0").status().message().find("(0, 16]"), std::string::npos);
  EXPECT_EQ(ParseEmphasisStrength("big").status().message(), "not a number: big");
}

TEST(Emphasis, AProfileIsReadFromTheBenchsJsonAndMalformedOnesAreRefused) {
  auto heads = ParseEmphasisProfile(
      R"({"model": "m", "profiled_heads": [{"gain": 2.3, "head": 4, "layer": 23},
                                            {"head": 7, "layer": 12}]})");
  ASSERT_TRUE(heads.ok()) << heads.status().ToString();
  EXPECT_EQ(*heads, (std::vector<EmphasisHead>{{23, 4}, {12, 7}}));
  for (const char* bad : {"", "[]", R"({"heads": []})", R"({"profiled_heads": []})",
                          R"({"profiled_heads": [{"layer": 1}]})",
                          R"({"profiled_heads": [{"layer": 1, "head": "2"}]})",
                          R"({"profiled_heads": [{"layer": 4294967297, "head": 0}]})"}) {
    auto r = ParseEmphasisProfile(bad);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(LoadEmphasisProfile("/nonexistent/profile.json").status().code(),
            StatusCode::kNotFound);
}

TEST(Emphasis, SpansAreMergedAndTheBiasIsTheStrengthOnItsHeadsAlone) {
  EXPECT_EQ(MergeSpans({{8, 10}, {1, 3}, {2, 5}, {5, 6}, {7, 7}}),
            (std::vector<std::pair<int64_t, int64_t>>{{1, 6}, {8, 10}}));
  const std::vector<EmphasisHead> heads{{1, 2}, {0, 0}};
  const Emphasis e = MakeEmphasis({{4, 9}}, heads, 1.5, 3, 4);
  EXPECT_EQ(e.spans, (std::vector<std::pair<int64_t, int64_t>>{{4, 9}}));
  EXPECT_EQ(e.heads, 4);
  std::vector<float> want(12, 0.0f);
  want[0] = 1.5f;      // layer 0, head 0
  want[4 + 2] = 1.5f;  // layer 1, head 2
  EXPECT_EQ(e.bias, want);
}

TEST(Emphasis, CrossesTheWireWhole) {
  BlendSpec spec;
  spec.head_tokens = 1;
  spec.segment_tokens = {10, 20};
  const std::vector<EmphasisHead> heads{{1, 2}};
  spec.emphasis = MakeEmphasis({{3, 5}, {12, 20}}, heads, 0.75, 3, 4);
  proto::BlendSpec p;
  control::BlendToProto(spec, &p);
  const BlendSpec back = control::BlendFromProto(p);
  ASSERT_TRUE(back.emphasis.has_value());
  EXPECT_EQ(*back.emphasis, *spec.emphasis);
  spec.emphasis.reset();
  proto::BlendSpec none;
  control::BlendToProto(spec, &none);
  EXPECT_FALSE(control::BlendFromProto(none).emphasis.has_value());
  // Ends that do not pair up, or no spans, give an empty span, which the
  // engine refuses: never an emphasis that silently biases nothing.
  proto::Emphasis odd;
  odd.add_span_begin(3);
  odd.set_heads(4);
  EXPECT_EQ(control::EmphasisFromProto(odd).spans,
            (std::vector<std::pair<int64_t, int64_t>>{{0, 0}}));
}

}  // namespace
}  // namespace kdn::blend
