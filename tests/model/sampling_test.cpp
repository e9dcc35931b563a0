#include "kdn/model/sampling.h"

#include <gtest/gtest.h>

#include <cmath>

namespace kdn::model {
namespace {

TEST(SamplingParams, ValidationRejectsBadParameters) {
  EXPECT_FALSE(ValidateSamplingParams({.top_k = -1}).ok());
  EXPECT_FALSE(ValidateSamplingParams({.top_p = 0.0f}).ok());
  EXPECT_FALSE(ValidateSamplingParams({.top_p = 1.5f}).ok());
  EXPECT_FALSE(ValidateSamplingParams({.temperature = NAN}).ok());
  EXPECT_TRUE(ValidateSamplingParams({.temperature = 0.0f, .top_k = 5, .top_p = 0.9f}).ok());
}

}  // namespace
}  // namespace kdn::model
