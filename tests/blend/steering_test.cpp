// Steering as a request asks for it (kdn/blend/steering.h) and on the wire
// (control/request_spec.h).

#include "kdn/blend/steering.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "kdn/blend/spec.h"
#include "kdn/control/request_spec.h"
#include "serving.pb.h"

namespace kdn::blend {
namespace {

TEST(Steering, StrengthsNamesAndVectorSpecsOutsideTheirRangesAreRefused) {
  for (double ok : {1.0, -2.5, kMaxSteerStrength, -kMaxSteerStrength}) {
    EXPECT_TRUE(CheckSteerStrength(ok).ok()) << ok;
  }
  for (double bad :
       {0.0, kMaxSteerStrength + 0.5, std::nan(""), std::numeric_limits<double>::infinity()}) {
    EXPECT_EQ(CheckSteerStrength(bad).code(), StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_TRUE(CheckSteeringName("trust-the_text.v2").ok());
  for (std::string bad : {std::string(), std::string("a b"), std::string("a/b"),
                          std::string(kMaxSteeringNameBytes + 1, 'x')}) {
    EXPECT_EQ(CheckSteeringName(bad).code(), StatusCode::kInvalidArgument) << bad;
  }
  const SteeringVectorSpec good{"v", {1, 2}, {{{1, 2}, {3}}}};
  EXPECT_TRUE(CheckSteeringVectorSpec(good, 4, 16).ok());
  SteeringVectorSpec bad = good;
  bad.layers = {2, 1};
  EXPECT_FALSE(CheckSteeringVectorSpec(bad, 4, 16).ok());
  bad.layers = {4};
  EXPECT_FALSE(CheckSteeringVectorSpec(bad, 4, 16).ok());
  bad = good;
  bad.pairs[0].second.clear();
  EXPECT_FALSE(CheckSteeringVectorSpec(bad, 4, 16).ok());
  EXPECT_FALSE(CheckSteeringVectorSpec(good, 4, 1).ok()) << "a prompt past the context";
  bad = good;
  bad.pairs.assign(kMaxSteeringPairs + 1, good.pairs[0]);
  EXPECT_FALSE(CheckSteeringVectorSpec(bad, 4, 16).ok());
  // The middle third, at least one layer.
  EXPECT_EQ(MiddleThirdLayers(30).front(), 10);
  EXPECT_EQ(MiddleThirdLayers(30).back(), 19);
  EXPECT_EQ(MiddleThirdLayers(2), (std::vector<int>{0}));
}

TEST(Steering, CrossesTheWireWhole) {
  BlendSpec spec;
  spec.segment_tokens = {10, 20, 5};
  spec.steer = {std::nullopt, SteerSpec{"trust", -3.5f}, std::nullopt};
  proto::BlendSpec p;
  control::BlendToProto(spec, &p);
  EXPECT_EQ(control::BlendFromProto(p).steer, spec.steer);
  spec.steer.clear();
  proto::BlendSpec none;
  control::BlendToProto(spec, &none);
  EXPECT_TRUE(control::BlendFromProto(none).steer.empty());

  const SteeringVectorSpec v{"v", {3, 5}, {{{1, 2}, {3}}, {{4}, {5, 6, 7}}}};
  proto::SteeringVectorSpec pv;
  control::SteeringVectorToProto(v, &pv);
  EXPECT_EQ(control::SteeringVectorFromProto(pv), v);
}

}  // namespace
}  // namespace kdn::blend
