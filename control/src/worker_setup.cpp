#include "kdn/control/worker_setup.h"

#include <vector>

#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/store_service.h"

namespace kdn::control {

Result<WorkerModel> LoadWorkerModel(const std::filesystem::path& dir,
                                    const engine::EngineOptions& options) {
  WorkerModel w;
  KDN_ASSIGN_OR_RETURN(w.model, engine::Model::Load(dir, options));
  KDN_ASSIGN_OR_RETURN(w.tokenizer, engine::Tokenizer::Load(dir));
  KDN_ASSIGN_OR_RETURN(uint64_t digest, kvbus::WeightsDigest(dir));
  const engine::ModelConfig& c = w.model->config();
  w.fingerprint = kvbus::ModelFingerprint(c, c.torch_dtype.empty() ? "unknown" : c.torch_dtype,
                                          kvbus::KvDTypeName(kvbus::KvDType::kF32), digest);
  return w;
}

Result<std::unique_ptr<kvbus::TieredStore>> MakeWorkerStore(uint64_t host_bytes,
                                                            const std::string& store_endpoint) {
  std::vector<std::unique_ptr<kvbus::ChunkStore>> tiers;
  tiers.push_back(std::make_unique<kvbus::HostTier>(host_bytes));
  kvbus::TieredStoreOptions options;
  if (!store_endpoint.empty()) {
    KDN_ASSIGN_OR_RETURN(auto remote, kvbus::RemoteStore::Connect(store_endpoint));
    tiers.push_back(std::move(remote));
    options.write_through = true;
  }
  return std::make_unique<kvbus::TieredStore>(std::move(tiers), options);
}

}  // namespace kdn::control
