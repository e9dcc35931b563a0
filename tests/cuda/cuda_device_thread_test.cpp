// A CudaEngine on a device other than 0, called from a thread whose current
// device is 0: what a worker started with `--device cuda:1` does from its
// compute, store I/O and lookup threads. Every entry point must make the
// engine's device current itself, or it allocates on device 0 and launches
// onto a stream of device 1. Needs two devices to show that; with one it
// runs as a check that another thread may call in at all.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <thread>
#include <vector>

#include "cuda_test_util.h"
#include "kdn/engine/cuda/cuda_engine.h"
#include "kdn/engine/presets.h"

namespace kdn::engine::cuda {
namespace {

using namespace ::kdn::engine::cuda::cudatest;  // NOLINT: the tests' own helpers

// What one thread gets from the engine: a prefill's logits, a decode step's,
// a layer's KV read back after a write, a row pass's logits and a rotated
// key read back.
struct Outputs {
  std::vector<float> prefill, decode, written, row_pass, rotated;
};

Status RunEveryEntryPoint(CudaEngine& g, Outputs* out) {
  KvCache& cache = g.kv_cache();
  const std::vector<int32_t> prompt = Tokens(40, 5);
  KvSequence seq = cache.NewSequence();
  KDN_RETURN_IF_ERROR(g.Prefill(seq, prompt, {}, &out->prefill));
  KvSequence* one[] = {&seq};
  const int32_t next[] = {7};
  KDN_RETURN_IF_ERROR(g.DecodeStep(one, next, &out->decode));
  // A layer's KV through the cache, written into a second sequence and read
  // back (the store I/O thread's calls).
  std::vector<float> kv;
  KDN_RETURN_IF_ERROR(ReadKv(g, seq, 1, 0, 32, &kv));
  KvSequence copy = cache.NewSequence();
  KDN_RETURN_IF_ERROR(cache.Reserve(copy, 32));
  KDN_RETURN_IF_ERROR(cache.Write(copy, 1, 0, 32, DType::kF32,
                                  {reinterpret_cast<const uint8_t*>(kv.data()), kv.size() * 4}));
  KDN_RETURN_IF_ERROR(ReadKv(g, copy, 1, 0, 32, &out->written));
  // A row pass over the prompt's last rows (blend's calls).
  const std::vector<int64_t> rows = {30, 35, 39};
  KvSequence full = cache.NewSequence();
  std::vector<float> unused;
  KDN_RETURN_IF_ERROR(g.Prefill(full, prompt, {}, &unused));
  {
    KDN_ASSIGN_OR_RETURN(auto pass, g.BeginRowPass(full, prompt, rows));
    for (int l = 0; l < g.config().num_layers; ++l) KDN_RETURN_IF_ERROR(pass->RunLayer());
    KDN_RETURN_IF_ERROR(pass->Logits(&out->row_pass));
  }
  KDN_RETURN_IF_ERROR(g.RotateCachedKeys(full, 0, 16, 3));
  return ReadKv(g, full, 0, 0, 16, &out->rotated);
}

TEST(CudaDeviceThread, EveryEntryPointRunsOnTheEnginesDeviceFromAnotherThread) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  // With one device this only shows that another thread may call in; with
  // two, the thread starts on device 0 and the engine is on device 1.
  const int devices = DeviceCount();
  auto p = FindPreset("tiny");
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  CudaEngineOptions o;
  o.device = devices - 1;
  o.kv_tokens = 2048;
  o.max_prefill_tokens = 256;
  o.max_batch = 4;
  auto made = CudaEngine::Create(p->config, GenerateWeights(p->config, 9, DType::kBF16), o);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  CudaEngine& g = **made;

  Outputs here;
  KDN_ASSERT_OK(RunEveryEntryPoint(g, &here));

  Outputs there;
  Status st;
  int current_after = -1;
  std::thread worker([&] {
    if (cudaSetDevice(0) != cudaSuccess) {
      st = Internal("cudaSetDevice(0) failed");
      return;
    }
    st = RunEveryEntryPoint(g, &there);
    (void)cudaGetDevice(&current_after);
  });
  worker.join();
  KDN_ASSERT_OK(st);
  EXPECT_EQ(current_after, o.device);
  // The same work on the same device: the same answers, up to the order
  // of a reduction.
  EXPECT_TRUE(LogitsClose(there.prefill, here.prefill));
  EXPECT_TRUE(LogitsClose(there.decode, here.decode));
  EXPECT_TRUE(LogitsClose(there.row_pass, here.row_pass));
  EXPECT_TRUE(AllClose(there.written, here.written, {1.0 / 64, 1e-2}));
  EXPECT_TRUE(AllClose(there.rotated, here.rotated, {1.0 / 64, 1e-2}));
}

}  // namespace
}  // namespace kdn::engine::cuda
