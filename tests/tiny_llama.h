// A tiny valid Llama GGUF built in memory (F32 weights by default), and the one change a test
// makes to it: the model the model-level tests load, run and break. With arch "phi3" the layer
// has Phi-3's fused tensors (attn_qkv; ffn_up holding gate and up) instead.
#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/gguf/gguf.h"
#include "quant/formats.h"
#include "tests/gguf_test_builder.h"

namespace ringlm::test {

namespace tt = ggml_type;
inline constexpr char kTinyLlamaLabel[] = "tiny-llama.gguf";

// The tiny model, and the one change a test makes to it.
struct LlamaSpec {
  std::string arch = "llama";
  uint32_t n_embd = 64, n_layer = 2, n_head = 4, n_head_kv = 2, n_ff = 128, n_vocab = 32, n_ctx = 128;
  std::set<std::string> omit_keys;                        // metadata keys not written
  std::map<std::string, uint64_t> key_values;             // integer keys written with this value instead
  std::map<std::string, std::string> string_values;       // integer keys written as this string instead
  std::set<std::string> omit_tensors;                     // tensors not written
  std::map<std::string, std::vector<uint64_t>> shapes;    // tensors written with this shape instead
  std::map<std::string, uint32_t> types;                  // tensors written with this GGML type instead
  std::map<std::string, uint32_t> extra_uints;            // metadata written in addition
  std::map<std::string, float> extra_floats;
  std::map<std::string, std::string> extra_strings;
  std::map<std::string, std::vector<uint64_t>> extra_tensors;  // tensors written in addition (F32, near 1 if 1-D)
  float matrix_range = 0.1f;                              // F32 matrix weights uniform in +-this
};

// Bytes for a tensor of `type` holding n elements: random F32 values, or random bytes for any
// other type (the tests that use other types never get as far as reading the values).
inline std::vector<uint8_t> tensor_data(uint32_t type, uint64_t n, bool is_norm, std::mt19937& rng,
                                        float matrix_range = 0.1f) {
  if (type != tt::kF32) {
    const auto traits = type_traits(type);
    std::vector<uint8_t> bytes(traits ? n / static_cast<uint64_t>(traits->block_elems) * traits->block_bytes : n);
    for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
    return bytes;
  }
  // Norm weights near 1 and small matrix weights keep activations and logits in a sane range.
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> values(n);
  for (float& v : values) v = is_norm ? 1.0f + 0.1f * dist(rng) : matrix_range * dist(rng);
  std::vector<uint8_t> bytes(n * sizeof(float));
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

inline std::vector<uint8_t> build_llama(const LlamaSpec& s) {
  GgufBuilder b;
  auto put_string = [&](const std::string& key, const std::string& value) {
    if (s.omit_keys.count(key) == 0) b.kv_string(key, value);
  };
  auto put_uint = [&](const std::string& key, uint32_t value) {
    if (s.omit_keys.count(key) != 0) return;
    const auto it = s.key_values.find(key);
    if (it != s.key_values.end()) {
      b.kv<uint64_t>(key, it->second);
    } else if (s.string_values.count(key) != 0) {
      b.kv_string(key, s.string_values.at(key));
    } else {
      b.kv<uint32_t>(key, value);
    }
  };
  auto put_float = [&](const std::string& key, float value) {
    if (s.omit_keys.count(key) == 0) b.kv<float>(key, value);
  };
  const std::string p = s.arch + ".";
  put_string("general.architecture", s.arch);
  put_string("general.name", "tiny test llama");
  put_uint(p + "context_length", s.n_ctx);
  put_uint(p + "embedding_length", s.n_embd);
  put_uint(p + "block_count", s.n_layer);
  put_uint(p + "feed_forward_length", s.n_ff);
  put_uint(p + "attention.head_count", s.n_head);
  put_uint(p + "attention.head_count_kv", s.n_head_kv);
  put_float(p + "attention.layer_norm_rms_epsilon", 1e-5f);
  put_float(p + "rope.freq_base", 10000.0f);
  for (const auto& [key, value] : s.extra_uints) b.kv<uint32_t>(key, value);
  for (const auto& [key, value] : s.extra_floats) b.kv<float>(key, value);
  for (const auto& [key, value] : s.extra_strings) b.kv_string(key, value);

  std::mt19937 rng(1234);
  auto put_tensor = [&](const std::string& name, std::vector<uint64_t> shape) {
    if (s.omit_tensors.count(name) != 0) return;
    if (auto it = s.shapes.find(name); it != s.shapes.end()) shape = it->second;
    const uint32_t type = s.types.count(name) != 0 ? s.types.at(name) : tt::kF32;
    uint64_t n = 1;
    for (uint64_t d : shape) n *= d;
    b.tensor(name, shape, type, tensor_data(type, n, shape.size() == 1, rng, s.matrix_range));
  };
  const uint64_t d = s.n_embd, kv_dim = uint64_t{s.n_embd} / s.n_head * s.n_head_kv;
  const bool phi3 = s.arch == "phi3";
  put_tensor("token_embd.weight", {d, s.n_vocab});
  for (uint32_t il = 0; il < s.n_layer; ++il) {
    const std::string blk = "blk." + std::to_string(il) + ".";
    put_tensor(blk + "attn_norm.weight", {d});
    if (phi3) {
      put_tensor(blk + "attn_qkv.weight", {d, d + 2 * kv_dim});
    } else {
      put_tensor(blk + "attn_q.weight", {d, d});
      put_tensor(blk + "attn_k.weight", {d, kv_dim});
      put_tensor(blk + "attn_v.weight", {d, kv_dim});
    }
    put_tensor(blk + "attn_output.weight", {d, d});
    put_tensor(blk + "ffn_norm.weight", {d});
    if (phi3) {
      put_tensor(blk + "ffn_up.weight", {d, 2 * uint64_t{s.n_ff}});
    } else {
      put_tensor(blk + "ffn_gate.weight", {d, s.n_ff});
      put_tensor(blk + "ffn_up.weight", {d, s.n_ff});
    }
    put_tensor(blk + "ffn_down.weight", {s.n_ff, d});
  }
  for (const auto& [name, shape] : s.extra_tensors) put_tensor(name, shape);
  put_tensor("output_norm.weight", {d});
  put_tensor("output.weight", {d, s.n_vocab});
  return b.build();
}

// A spec's image, parsed, with the model built over it. The image must outlive the model
// (tensor data points into it), so they live together.
class TinyLlama {
 public:
  explicit TinyLlama(const LlamaSpec& spec) : image_(build_llama(spec)) {
    gguf_ = GgufFile::parse(image_.data(), image_.size(), kTinyLlamaLabel);  // the reader must accept it
  }
  const GgufFile& gguf() const { return *gguf_; }

 private:
  std::vector<uint8_t> image_;
  std::unique_ptr<GgufFile> gguf_;
};

}  // namespace ringlm::test
