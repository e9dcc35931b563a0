#include "kdn/engine/tensor.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace kdn::engine {
namespace {

TEST(DTypes, Bf16RoundsToNearestEven) {
  EXPECT_EQ(F32ToBf16(1.0f), 0x3f80);
  EXPECT_EQ(Bf16ToF32(0x3f80), 1.0f);
  // 1 + 2^-8 lies halfway between bf16 neighbours 1 and 1 + 2^-7: ties to even.
  EXPECT_EQ(F32ToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(F32ToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(DTypes, F16ConvertsNormalsSubnormalsAndOverflow) {
  EXPECT_EQ(F32ToF16(1.0f), 0x3c00);
  EXPECT_EQ(F32ToF16(-2.0f), 0xc000);
  EXPECT_EQ(F32ToF16(65504.0f), 0x7bff);
  EXPECT_EQ(F32ToF16(1e6f), 0x7c00);                   // inf
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(F16ToF32(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(F16ToF32(0x3555), 0.333251953125f);
  for (uint32_t h = 0; h < 0x7c00; ++h) {  // every finite positive half round-trips
    ASSERT_EQ(F32ToF16(F16ToF32(static_cast<uint16_t>(h))), h);
  }
}

}  // namespace
}  // namespace kdn::engine
