#include "kdn/kvbridge/fingerprint.h"

#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "kdn/model/tensors.h"
#include "kdn/model/gguf.h"

namespace kdn::kvbridge {

kvbus::ChunkKey ModelFingerprint(const model::ModelConfig& c, std::string_view weight_dtype,
                                 std::string_view kv_dtype, uint64_t weights_digest) {
  // A canonical text: one "name=value" line per field, then every tensor.
  std::string s = "kdn-model-fingerprint\n";
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "architecture=%s\nvocab=%d\nhidden=%d\nintermediate=%d\nlayers=%d\nheads=%d\n"
                "kv_heads=%d\nhead_dim=%d\nrms_norm_eps=%.17g\nrope_theta=%.17g\n"
                "rope_llama3=%d\nrope_factor=%.17g\nrope_low=%.17g\nrope_high=%.17g\n"
                "rope_original_max=%lld\nqkv_bias=%d\no_bias=%d\ntied=%d\n",
                model::ArchitectureName(c.architecture), c.vocab_size, c.hidden_size,
                c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim,
                c.rms_norm_eps, c.rope_theta,
                c.rope_scaling.type == model::RopeType::kLlama3 ? 1 : 0, c.rope_scaling.factor,
                c.rope_scaling.low_freq_factor, c.rope_scaling.high_freq_factor,
                static_cast<long long>(c.rope_scaling.original_max_position_embeddings),
                c.qkv_bias ? 1 : 0, c.o_bias ? 1 : 0, c.tie_word_embeddings ? 1 : 0);
  s += buf;
  // Later fields are written only where set, so that the models of before
  // (default or llama3 RoPE, full attention) keep their fingerprints.
  const model::RopeScaling& rs = c.rope_scaling;
  if (rs.type != model::RopeType::kDefault && rs.type != model::RopeType::kLlama3) {
    std::snprintf(buf, sizeof(buf),
                  "rope_type=%s\nrope_factor=%.17g\nrope_original_max=%lld\nrope_beta_fast=%.17g\n"
                  "rope_beta_slow=%.17g\nrope_truncate=%d\nrope_attention_factor=%.17g\n"
                  "rope_dynamic_threshold=%lld\n",
                  model::RopeTypeName(rs.type), rs.factor,
                  static_cast<long long>(rs.original_max_position_embeddings), rs.beta_fast,
                  rs.beta_slow, rs.truncate ? 1 : 0, rs.attention_factor,
                  static_cast<long long>(rs.dynamic_threshold));
    s += buf;
  }
  if (c.sliding_window > 0) {
    s += "sliding_window=" + std::to_string(c.sliding_window) + "\nwindowed_layers=";
    for (int l = 0; l < c.num_layers; ++l) s += c.windowed_layers[l] ? '1' : '0';
    s += "\n";
  }
  for (const model::TensorSpec& t : model::ExpectedTensors(c)) {
    s += "tensor=" + t.name + model::ShapeToString(t.shape) + "\n";
  }
  s += "weight_dtype=" + std::string(weight_dtype) + "\nkv_dtype=" + std::string(kv_dtype) + "\n";
  std::snprintf(buf, sizeof(buf), "weights_digest=%016llx\n",
                static_cast<unsigned long long>(weights_digest));
  s += buf;
  const XXH128_hash_t h = XXH3_128bits_withSeed(s.data(), s.size(), kvbus::kChunkKeyVersion);
  return kvbus::ChunkKey{h.high64, h.low64};
}

Result<uint64_t> WeightsDigest(const std::filesystem::path& model_dir) {
  std::vector<std::filesystem::path> files;
  std::error_code ec;
  if (model::IsGgufPath(model_dir)) {
    files.push_back(model_dir);
  } else {
    for (const auto& e : std::filesystem::directory_iterator(model_dir, ec)) {
      if (e.is_regular_file() && e.path().extension() == ".safetensors") files.push_back(e.path());
    }
    if (ec) return NotFound(model_dir.string() + ": " + ec.message());
    if (files.empty()) return NotFound(model_dir.string() + ": no .safetensors files");
  }
  std::sort(files.begin(), files.end());
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  std::vector<char> buf(size_t{4} << 20);
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    if (!in) {
      XXH3_freeState(st);
      return IoError(f.string() + ": cannot open");
    }
    while (in) {
      in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
      XXH3_64bits_update(st, buf.data(), static_cast<size_t>(in.gcount()));
    }
    if (in.bad()) {  // a read error, not the end of the file
      XXH3_freeState(st);
      return IoError(f.string() + ": read failed");
    }
  }
  const uint64_t d = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return d;
}

Result<kvbus::ChunkKey> FolderFingerprint(const std::filesystem::path& model_dir,
                                          const model::ModelConfig& config, kdn::DType kv_dtype) {
  KDN_ASSIGN_OR_RETURN(uint64_t digest, WeightsDigest(model_dir));
  const std::string& weight_dtype = config.torch_dtype;
  return ModelFingerprint(config, weight_dtype.empty() ? "unknown" : weight_dtype,
                          kdn::DTypeName(kv_dtype), digest);
}

}  // namespace kdn::kvbridge
