// ModelConfigFromGguf: the llama.* keys become the config.json fields they
// stand for, and config.json's one parser checks them, so that a model reads
// the same from either source.
#include <set>

#include <nlohmann/json.hpp>

#include "kdn/model/config.h"
#include "kdn/model/gguf.h"

namespace kdn::model {

using nlohmann::json;

namespace {

// Copies integer key `key` into j[field] when present; NotFound when
// `required` and absent.
Status CopyInt(const GgufFile& f, const std::string& key, bool required, const char* field,
               json* j) {
  if (f.Find(key) == nullptr) {
    return required ? NotFound(f.Where("no metadata key " + key + " (needed for " + field + ")"))
                    : Status::Ok();
  }
  KDN_ASSIGN_OR_RETURN(const int64_t v, f.Int(key));
  (*j)[field] = v;
  return Status::Ok();
}

}  // namespace

Result<int64_t> GgufTokenId(const GgufFile& f, const std::string& key) {
  if (f.Find(key) != nullptr) return f.Int(key);
  const GgufValue* model = f.Find("tokenizer.ggml.model");
  if (model == nullptr || model->type != GgufValueType::kString || model->s != "llama") return -1;
  if (key == "tokenizer.ggml.bos_token_id") return 1;
  if (key == "tokenizer.ggml.eos_token_id") return 2;
  if (key == "tokenizer.ggml.unknown_token_id") return 0;
  return -1;
}

Result<ModelConfig> ModelConfigFromGguf(const GgufFile& f) {
  KDN_ASSIGN_OR_RETURN(const std::string arch, f.String("general.architecture"));
  if (arch != "llama") {
    return Unimplemented(f.Where("general.architecture \"" + arch +
                                 "\" is not supported (kdn reads \"llama\" GGUF files)"));
  }
  const std::string p = arch + ".";
  json j;
  j["architectures"] = {"LlamaForCausalLM"};
  KDN_RETURN_IF_ERROR(CopyInt(f, p + "embedding_length", true, "hidden_size", &j));
  KDN_RETURN_IF_ERROR(CopyInt(f, p + "feed_forward_length", true, "intermediate_size", &j));
  KDN_RETURN_IF_ERROR(CopyInt(f, p + "block_count", true, "num_hidden_layers", &j));
  KDN_RETURN_IF_ERROR(CopyInt(f, p + "attention.head_count", true, "num_attention_heads", &j));
  KDN_RETURN_IF_ERROR(CopyInt(f, p + "attention.head_count_kv", false, "num_key_value_heads", &j));
  KDN_RETURN_IF_ERROR(CopyInt(f, p + "context_length", true, "max_position_embeddings", &j));
  if (f.Find(p + "vocab_size") != nullptr) {
    KDN_RETURN_IF_ERROR(CopyInt(f, p + "vocab_size", true, "vocab_size", &j));
  } else if (f.Find("tokenizer.ggml.tokens") != nullptr) {
    KDN_ASSIGN_OR_RETURN(const auto tokens, f.Strings("tokenizer.ggml.tokens"));
    j["vocab_size"] = tokens.size();
  } else {
    return NotFound(f.Where("neither " + p + "vocab_size nor tokenizer.ggml.tokens"));
  }
  if (f.Find(p + "expert_count") != nullptr) {
    KDN_ASSIGN_OR_RETURN(const int64_t experts, f.Int(p + "expert_count"));
    if (experts > 0) {
      return Unimplemented(f.Where(p + "expert_count " + std::to_string(experts) +
                                   ": mixture-of-experts models are not supported"));
    }
  }
  // head_dim: key_length where given (value_length must agree), else hidden /
  // heads as config.json has it; RoPE must turn the whole head.
  int64_t head_dim = 0;
  if (f.Find(p + "attention.key_length") != nullptr) {
    KDN_ASSIGN_OR_RETURN(head_dim, f.Int(p + "attention.key_length"));
    j["head_dim"] = head_dim;
    if (f.Find(p + "attention.value_length") != nullptr) {
      KDN_ASSIGN_OR_RETURN(const int64_t v, f.Int(p + "attention.value_length"));
      if (v != head_dim) {
        return Unimplemented(f.Where(p + "attention.value_length " + std::to_string(v) +
                                     " differs from key_length " + std::to_string(head_dim)));
      }
    }
  } else {
    const int64_t heads = j["num_attention_heads"].get<int64_t>();
    head_dim = heads > 0 ? j["hidden_size"].get<int64_t>() / heads : 0;
  }
  if (f.Find(p + "rope.dimension_count") != nullptr) {
    KDN_ASSIGN_OR_RETURN(const int64_t rot, f.Int(p + "rope.dimension_count"));
    if (rot != head_dim) {
      return Unimplemented(f.Where(p + "rope.dimension_count " + std::to_string(rot) +
                                   ": RoPE over part of the head (" + std::to_string(head_dim) +
                                   ") is not supported"));
    }
  }
  if (f.FindTensor("rope_freqs.weight") != nullptr) {
    return Unimplemented(
        f.Where("tensor rope_freqs.weight: per-frequency RoPE factors "
                "(Llama 3.1 scaling) are not read from GGUF files"));
  }
  KDN_ASSIGN_OR_RETURN(j["rms_norm_eps"], f.Float(p + "attention.layer_norm_rms_epsilon"));
  if (f.Find(p + "rope.freq_base") != nullptr) {
    KDN_ASSIGN_OR_RETURN(j["rope_theta"], f.Float(p + "rope.freq_base"));
  }
  if (f.Find(p + "rope.scaling.type") != nullptr) {
    KDN_ASSIGN_OR_RETURN(const std::string type, f.String(p + "rope.scaling.type"));
    if (type == "linear") {
      KDN_ASSIGN_OR_RETURN(const double factor, f.Float(p + "rope.scaling.factor"));
      j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", factor}};
    } else if (type != "none") {
      return Unimplemented(
          f.Where(p + "rope.scaling.type \"" + type + "\" is not supported (none, linear)"));
    }
  } else if (f.Find(p + "rope.scale_linear") != nullptr) {
    // The older key of linear scaling, which llama.cpp still reads.
    KDN_ASSIGN_OR_RETURN(const double factor, f.Float(p + "rope.scale_linear"));
    j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", factor}};
  }
  const bool q_bias = f.FindTensor("blk.0.attn_q.bias") != nullptr;
  j["attention_bias"] = q_bias;
  j["tie_word_embeddings"] = f.FindTensor("output.weight") == nullptr;
  for (const char* key : {"bos_token_id", "eos_token_id"}) {
    const std::string k = std::string("tokenizer.ggml.") + key;
    KDN_ASSIGN_OR_RETURN(const int64_t id, GgufTokenId(f, k));
    if (id >= 0 || f.Find(k) != nullptr) j[key] = id;
  }
  // The end-of-turn token ends generation too, where the file names one.
  if (f.Find("tokenizer.ggml.eot_token_id") != nullptr && j.contains("eos_token_id")) {
    KDN_ASSIGN_OR_RETURN(const int64_t eot, f.Int("tokenizer.ggml.eot_token_id"));
    if (eot != j["eos_token_id"].get<int64_t>()) j["eos_token_id"] = {j["eos_token_id"], eot};
  }
  // Each layer is at least 9 tensors: a block_count the file cannot hold is
  // refused here, before anyone lists the tensors it implies.
  const int64_t layers = j["num_hidden_layers"].get<int64_t>();
  if (layers > static_cast<int64_t>(f.tensors().size() / 9)) {
    return InvalidArgument(f.Where(p + "block_count " + std::to_string(layers) +
                                   ": the file holds only " + std::to_string(f.tensors().size()) +
                                   " tensors"));
  }
  std::set<std::string> types;
  for (const GgufTensor& t : f.tensors()) types.insert(FindGgmlType(t.type)->name);
  std::string dtype = "gguf:";
  for (const std::string& t : types) dtype += (dtype.size() > 5 ? "+" : "") + t;
  j["torch_dtype"] = dtype;
  return ParseModelConfig(j.dump(), f.path().string() + " (its " + p + "* keys as config.json)");
}

}  // namespace kdn::model
