// The CUDA kernels of kdn_engine_cuda against their CPU references
// (kdn/engine/cpu_ops.h), on seeded random inputs of the shapes the engine
// runs, plus a timing of each on a prefill-sized batch.
//
// Every test that needs a device skips (GTEST_SKIP) when there is none, so
// the binary passes on a machine without a GPU or a driver; the tests of
// argument checking and of kdn/common/cuda_status.h touch no device and always run.
//
// Tolerances: fp32 outputs within 1e-5 relative (+1e-6 absolute, for values
// that cancel to near zero). The kernels differ from the reference only by
// fp32 summation order (RMSNorm), fused multiply-adds and at most one float
// ulp of cos/sin (RoPE: both sides take them in double, see rope.cuh), each
// ~1e-7. bf16 outputs within 2^-7 relative, one bf16 ulp: the reference sees
// the same bf16-rounded inputs, and the kernel rounds its fp32 result to bf16
// once (at most half an ulp), so a kernel that computed in bf16 or got the
// formula wrong would fail by far more.

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/engine/cpu_ops.h"
#include "kdn/common/cuda_status.h"
#include "kdn/engine/cuda/rmsnorm.cuh"
#include "kdn/engine/cuda/rope.cuh"
#include "kdn/model/config.h"
#include "cuda_test_util.h"

namespace kdn::engine::cuda {
namespace {

using namespace ::kdn::engine::cuda::cudatest;  // NOLINT: the tests' own helpers

// ---------------------------------------------------------------- RMSNorm

struct RmsNormCase {
  int64_t rows;
  int dim;
  float eps;
};

// Rows of uniform values scaled by 10^[-2, 2], so that eps matters for some;
// weights in [0.5, 1.5]. Rounded to T first: the reference sees exactly the
// inputs the kernel sees.
template <typename T>
void ExpectRmsNormMatchesCpu(const RmsNormCase& c, uint32_t seed) {
  SCOPED_TRACE("rows=" + std::to_string(c.rows) + " dim=" + std::to_string(c.dim));
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f), weight(0.5f, 1.5f), exponent(-2, 2);
  std::vector<float> x(c.rows * c.dim), w(c.dim);
  for (int64_t r = 0; r < c.rows; ++r) {
    const float scale = std::pow(10.0f, exponent(rng));
    for (int i = 0; i < c.dim; ++i) x[r * c.dim + i] = scale * unit(rng);
  }
  for (float& v : w) v = weight(rng);
  const std::vector<T> x_t = FromFloats<T>(x), w_t = FromFloats<T>(w);
  x = ToFloats(x_t);
  w = ToFloats(w_t);
  std::vector<float> want(x.size());
  RmsNorm(x.data(), w.data(), c.eps, c.rows, c.dim, want.data());

  auto d_x = ToDevice(x_t);
  KDN_ASSERT_OK(d_x.status());
  auto d_w = ToDevice(w_t);
  KDN_ASSERT_OK(d_w.status());
  auto d_out = ToDevice(std::vector<T>(x.size()));
  KDN_ASSERT_OK(d_out.status());
  KDN_ASSERT_OK(RmsNormCuda(d_x->get(), d_w->get(), c.eps, c.rows, c.dim, d_out->get(), nullptr));
  std::vector<T> got;
  KDN_ASSERT_OK(ToHost(d_out->get(), x.size(), &got));
  EXPECT_TRUE(AllClose(ToFloats(got), want, ToleranceFor<T>()));
}

// 100 and 1001 are not multiples of a 16-byte pack (1001 of any), so they
// take the one-element path; the others the vectorized one.
const RmsNormCase kRmsNormCases[] = {
    {1, 64, 1e-5f}, {3, 100, 1e-6f}, {17, 1001, 1e-5f}, {128, 2048, 1e-5f}, {513, 4096, 1e-6f},
};

TEST(RmsNormCuda, MatchesCpuReferenceInFp32) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  uint32_t seed = 1;
  for (const RmsNormCase& c : kRmsNormCases) ExpectRmsNormMatchesCpu<float>(c, seed++);
}

TEST(RmsNormCuda, MatchesCpuReferenceInBf16) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  uint32_t seed = 101;
  for (const RmsNormCase& c : kRmsNormCases) ExpectRmsNormMatchesCpu<bf16>(c, seed++);
}

// In place (out == x), and from pointers one element off 16-byte alignment,
// which must fall back to one-element accesses rather than fault.
TEST(RmsNormCuda, WorksInPlaceAndOnUnalignedPointers) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  const int64_t rows = 9;
  const int dim = 4096;
  const float eps = 1e-5f;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::vector<float> x(1 + rows * dim), w(1 + dim);
  for (float& v : x) v = unit(rng);
  for (float& v : w) v = 1.0f + 0.5f * unit(rng);
  std::vector<float> want(rows * dim);
  RmsNorm(x.data() + 1, w.data() + 1, eps, rows, dim, want.data());

  auto d_x = ToDevice(x);
  KDN_ASSERT_OK(d_x.status());
  auto d_w = ToDevice(w);
  KDN_ASSERT_OK(d_w.status());
  float* x1 = d_x->get() + 1;
  KDN_ASSERT_OK(RmsNormCuda<float>(x1, d_w->get() + 1, eps, rows, dim, x1, nullptr));
  std::vector<float> got;
  KDN_ASSERT_OK(ToHost<float>(x1, want.size(), &got));
  EXPECT_TRUE(AllClose(got, want, ToleranceFor<float>()));
}

// Argument checks come before any CUDA call: these run without a device.
TEST(RmsNormCuda, RejectsBadShapesAndNullPointersBeforeTouchingTheDevice) {
  float dummy[4] = {};
  EXPECT_EQ(RmsNormCuda<float>(dummy, dummy, 1e-5f, 1, 0, dummy, nullptr).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(RmsNormCuda<float>(dummy, dummy, 1e-5f, -1, 4, dummy, nullptr).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(RmsNormCuda<float>(dummy, dummy, 1e-5f, int64_t{1} << 31, 4, dummy, nullptr).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(RmsNormCuda<float>(nullptr, dummy, 1e-5f, 1, 4, dummy, nullptr).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(RmsNormCuda<bf16>(nullptr, nullptr, 1e-5f, 0, 4, nullptr, nullptr).ok());
}

TEST(RmsNormCuda, ReportsItsBandwidthOnAPrefillBatch) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  const int64_t rows = 4096;
  const int dim = 4096;
  auto d_x = ToDevice(std::vector<bf16>(rows * dim, __float2bfloat16_rn(0.5f)));
  KDN_ASSERT_OK(d_x.status());
  auto d_w = ToDevice(std::vector<bf16>(dim, __float2bfloat16_rn(1.0f)));
  KDN_ASSERT_OK(d_w.status());
  auto d_out = ToDevice(std::vector<bf16>(rows * dim));
  KDN_ASSERT_OK(d_out.status());
  const Result<double> us = MeanLaunchMicros(
      [&] { return RmsNormCuda(d_x->get(), d_w->get(), 1e-5f, rows, dim, d_out->get(), nullptr); },
      50);
  KDN_ASSERT_OK(us.status());
  const double bytes = 2.0 * rows * dim * sizeof(bf16);  // x read once from DRAM, out written
  std::printf("[ timing   ] RmsNormCuda bf16 [%lld x %d]: %.1f us, %.0f GB/s\n",
              static_cast<long long>(rows), dim, *us, bytes / (*us * 1e3));
  RecordProperty("microseconds", std::to_string(*us));
}

// ---------------------------------------------------------------- RoPE

struct RopeCase {
  int64_t rows;
  int heads;
  int head_dim;
  double theta;
  model::RopeType type;  // kLlama3: Llama 3.1's scaling; the others factor 4
};

model::ModelConfig RopeConfig(const RopeCase& c) {
  model::ModelConfig config;
  config.head_dim = c.head_dim;
  config.rope_theta = c.theta;
  config.rope_scaling.type = c.type;
  config.rope_scaling.factor = c.type == model::RopeType::kLlama3 ? 8.0 : 4.0;
  config.rope_scaling.original_max_position_embeddings = 8192;
  if (c.type == model::RopeType::kYarn) config.rope_scaling.attention_factor = 1.1386;
  if (c.type == model::RopeType::kDynamic) config.rope_scaling.dynamic_threshold = 4096;
  return config;
}

// Uniform values in [-1, 1] at positions drawn from [0, 32768], with 0 and
// 32768 themselves among them.
template <typename T>
void ExpectRopeMatchesCpu(const RopeCase& c, uint32_t seed) {
  SCOPED_TRACE("rows=" + std::to_string(c.rows) + " heads=" + std::to_string(c.heads) +
               " head_dim=" + std::to_string(c.head_dim) + " theta=" + std::to_string(c.theta) +
               " " + model::RopeTypeName(c.type));
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int32_t> position(0, 32768);
  std::vector<float> x(c.rows * c.heads * c.head_dim);
  for (float& v : x) v = unit(rng);
  std::vector<int32_t> positions(c.rows);
  for (int32_t& p : positions) p = position(rng);
  positions[0] = 32768;
  if (c.rows > 1) positions[1] = 0;
  const std::vector<float> inv_freq = RopeInvFreq(RopeConfig(c));
  const RopeParams rope = RopeParamsFor(RopeConfig(c));

  const std::vector<T> x_t = FromFloats<T>(x);
  std::vector<float> want = ToFloats(x_t);
  ApplyRope(want.data(), c.rows, c.heads, c.head_dim, positions.data(), inv_freq.data(), rope);

  auto d_x = ToDevice(x_t);
  KDN_ASSERT_OK(d_x.status());
  auto d_positions = ToDevice(positions);
  KDN_ASSERT_OK(d_positions.status());
  auto d_inv_freq = ToDevice(inv_freq);
  KDN_ASSERT_OK(d_inv_freq.status());
  KDN_ASSERT_OK(ApplyRopeCuda(d_x->get(), c.rows, c.heads, c.head_dim, d_positions->get(),
                              d_inv_freq->get(), nullptr, rope));
  std::vector<T> got;
  KDN_ASSERT_OK(ToHost(d_x->get(), x.size(), &got));
  EXPECT_TRUE(AllClose(ToFloats(got), want, ToleranceFor<T>()));
}

// head_dim 80 (half 40) exercises a frequency count that is no warp multiple;
// 513 rows of 8 heads more rows than one wave of blocks.
// yarn (frequencies and the factor on cos and sin) and dynamic (positions
// past 4096 with bases of their own) go through rope.h on both sides.
using model::RopeType;
const RopeCase kRopeCases[] = {
    {1, 1, 64, 10000.0, RopeType::kDefault},    {7, 32, 128, 500000.0, RopeType::kLlama3},
    {33, 8, 64, 10000.0, RopeType::kDefault},   {513, 8, 128, 1000000.0, RopeType::kDefault},
    {64, 40, 128, 500000.0, RopeType::kLlama3}, {5, 3, 80, 10000.0, RopeType::kDefault},
    {65, 8, 128, 1000000.0, RopeType::kYarn},   {65, 8, 128, 10000.0, RopeType::kDynamic},
    {9, 4, 64, 10000.0, RopeType::kLinear},
};

TEST(ApplyRopeCuda, MatchesCpuReferenceInFp32) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  uint32_t seed = 201;
  for (const RopeCase& c : kRopeCases) ExpectRopeMatchesCpu<float>(c, seed++);
}

TEST(ApplyRopeCuda, MatchesCpuReferenceInBf16) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  uint32_t seed = 301;
  for (const RopeCase& c : kRopeCases) ExpectRopeMatchesCpu<bf16>(c, seed++);
}

TEST(ApplyRopeCuda, RejectsBadShapesAndNullPointersBeforeTouchingTheDevice) {
  float x[8] = {};
  int32_t pos[1] = {};
  float inv[4] = {};
  EXPECT_EQ(ApplyRopeCuda<float>(x, 1, 1, 7, pos, inv, nullptr).code(),
            StatusCode::kInvalidArgument);  // odd head_dim
  EXPECT_EQ(ApplyRopeCuda<float>(x, 1, 0, 8, pos, inv, nullptr).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ApplyRopeCuda<float>(x, 1, 1, 16384, pos, inv, nullptr).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ApplyRopeCuda<float>(x, -1, 1, 8, pos, inv, nullptr).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ApplyRopeCuda<float>(x, 1, 1, 8, nullptr, inv, nullptr).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(ApplyRopeCuda<bf16>(nullptr, 0, 1, 8, nullptr, nullptr, nullptr).ok());
}

TEST(ApplyRopeCuda, ReportsItsBandwidthOnAPrefillBatch) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  const int64_t rows = 4096;
  const int heads = 32;
  const int head_dim = 128;
  std::vector<int32_t> positions(rows);
  for (int64_t r = 0; r < rows; ++r) positions[r] = static_cast<int32_t>(r);
  auto d_x = ToDevice(std::vector<bf16>(rows * heads * head_dim, __float2bfloat16_rn(0.5f)));
  KDN_ASSERT_OK(d_x.status());
  auto d_positions = ToDevice(positions);
  KDN_ASSERT_OK(d_positions.status());
  auto d_inv_freq =
      ToDevice(RopeInvFreq(RopeConfig({rows, heads, head_dim, 500000.0, RopeType::kLlama3})));
  KDN_ASSERT_OK(d_inv_freq.status());
  const Result<double> us = MeanLaunchMicros(
      [&] {
        return ApplyRopeCuda(d_x->get(), rows, heads, head_dim, d_positions->get(),
                             d_inv_freq->get(), nullptr);
      },
      50);
  KDN_ASSERT_OK(us.status());
  const double bytes = 2.0 * rows * heads * head_dim * sizeof(bf16);  // read and written once
  std::printf("[ timing   ] ApplyRopeCuda bf16 [%lld x %d x %d]: %.1f us, %.0f GB/s\n",
              static_cast<long long>(rows), heads, head_dim, *us, bytes / (*us * 1e3));
  RecordProperty("microseconds", std::to_string(*us));
}

// ---------------------------------------------------------------- cuda_status.h

cudaError_t Fail(cudaError_t err) { return err; }

Status CallThatRunsOutOfMemory() {
  KDN_CUDA_RETURN_IF_ERROR(Fail(cudaErrorMemoryAllocation));
  return Status::Ok();
}

Status CallThatSucceeds() {
  KDN_CUDA_RETURN_IF_ERROR(Fail(cudaSuccess));
  return Status::Ok();
}

TEST(CudaCheck, TurnsAnErrorIntoAStatusThatNamesTheCallAndWhere) {
  const Status st = CallThatRunsOutOfMemory();
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("Fail(cudaErrorMemoryAllocation)"), std::string::npos)
      << st.ToString();
  EXPECT_NE(st.message().find("cuda_kernels_test.cpp:"), std::string::npos) << st.ToString();
  EXPECT_NE(st.message().find(cudaGetErrorString(cudaErrorMemoryAllocation)), std::string::npos)
      << st.ToString();
  EXPECT_TRUE(CallThatSucceeds().ok());
}

TEST(CudaCheck, DeviceProbeAnswersWithoutADriver) {
  const Result<int> count = CudaDeviceCount();
  if (count.ok()) {
    EXPECT_GE(*count, 0);
    EXPECT_EQ(CudaDeviceAvailable(), *count > 0);
  } else {
    EXPECT_EQ(count.status().code(), StatusCode::kUnavailable) << count.status().ToString();
    EXPECT_FALSE(CudaDeviceAvailable());
  }
}

}  // namespace
}  // namespace kdn::engine::cuda
