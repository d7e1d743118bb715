// Test helpers for weight matrices of every type the CPU backend's packed kernels run: random
// valid blocks, and what each weight is worth, read through quant/formats.cpp's dequantizer
// (itself checked against the `gguf` package's, test_dequant). Nothing here touches the
// packing or the kernels, so the tests compare them against an independent reading.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "quant/formats.h"
#include "quant/int4.h"

namespace ringlm::test {

// Every weight type the packed kernels run, with a name usable in a test name.
inline std::vector<std::pair<TensorType, std::string>> packed_types() {
  std::vector<std::pair<TensorType, std::string>> out = {
      {TensorType::F32, "F32"},       {TensorType::F16, "F16"},       {TensorType::BF16, "BF16"},
      {TensorType::Q4_0, "Q4_0"},     {TensorType::Q4_1, "Q4_1"},     {TensorType::Q5_0, "Q5_0"},
      {TensorType::Q5_1, "Q5_1"},     {TensorType::Q8_0, "Q8_0"},     {TensorType::IQ4_NL, "IQ4_NL"},
      {TensorType::Q2_K, "Q2_K"},     {TensorType::Q3_K, "Q3_K"},     {TensorType::Q4_K, "Q4_K"},
      {TensorType::Q5_K, "Q5_K"},     {TensorType::Q6_K, "Q6_K"},     {TensorType::IQ4_XS, "IQ4_XS"},
      {TensorType::MXFP4, "MXFP4"}};
  for (uint32_t id = kInt4TypeBase; id < kInt4TypeBase + 12; ++id) {
    std::string name(kInt4TypeNames[id - kInt4TypeBase]);
    for (char& c : name) c = c == '-' ? '_' : c;
    out.push_back({static_cast<TensorType>(id), name});
  }
  return out;
}

// How the kernels quantize the activations a type meets: per 32, per 256 (K-quants and
// IQ4_XS, as llama.cpp's Q8_K), or not at all (float weights).
enum class Acts { kPer32, kPer256, kFloat };
inline Acts acts_of(TensorType t) {
  switch (t) {
    case TensorType::F32:
    case TensorType::F16:
    case TensorType::BF16: return Acts::kFloat;
    case TensorType::Q2_K:
    case TensorType::Q3_K:
    case TensorType::Q4_K:
    case TensorType::Q5_K:
    case TensorType::Q6_K:
    case TensorType::IQ4_XS: return Acts::kPer256;
    default: return Acts::kPer32;
  }
}

inline int64_t block_elems(TensorType t) { return type_traits(static_cast<uint32_t>(t))->block_elems; }
inline size_t block_bytes(TensorType t) { return type_traits(static_cast<uint32_t>(t))->block_bytes; }

// Where a block keeps its float fields and its codes (bytes [codes_begin, codes_end)).
struct BlockLayout {
  std::vector<size_t> f16;   // offsets of fp16 scales / mins
  std::vector<size_t> bf16;  // ... bf16
  std::vector<size_t> f32;   // ... fp32
  size_t codes_begin = 0, codes_end = 0;
  uint8_t zero_code = 0;  // the code byte of the weight farthest below zero... of code 0 (Q8_0: -128)
  std::vector<size_t> e8m0 = {};  // offsets of E8M0 exponent scales (MXFP4)
  // The offset a kernel splits off is what zero_code's weight is worth times this: 1, but for
  // MXFP4, whose values reach only 12 (code byte 0x77) where VNNI still adds 128 to each.
  float zero_times = 1.0f;
};
inline BlockLayout block_layout(TensorType t) {
  if (const auto f = int4_format(static_cast<uint32_t>(t))) {
    BlockLayout l;
    const size_t sb = int4_scale_bytes(f->scale);
    const size_t n = f->asymmetric ? 2 : 1;
    for (size_t i = 0; i < n; ++i) {
      (f->scale == ScaleType::kF32 ? l.f32 : f->scale == ScaleType::kBF16 ? l.bf16 : l.f16).push_back(i * sb);
    }
    l.codes_begin = n * sb;
    l.codes_end = int4_block_bytes(*f);
    return l;
  }
  switch (t) {
    case TensorType::Q4_0: return {{0}, {}, {}, 2, 18};
    case TensorType::Q4_1: return {{0, 2}, {}, {}, 4, 20};
    case TensorType::Q5_0: return {{0}, {}, {}, 2, 22};
    case TensorType::Q5_1: return {{0, 2}, {}, {}, 4, 24};
    case TensorType::Q8_0: return {{0}, {}, {}, 2, 34, 0x80};
    case TensorType::IQ4_NL: return {{0}, {}, {}, 2, 18};
    case TensorType::Q2_K: return {{80, 82}, {}, {}, 16, 80};
    case TensorType::Q3_K: return {{108}, {}, {}, 0, 96};
    case TensorType::Q4_K: return {{0, 2}, {}, {}, 16, 144};
    case TensorType::Q5_K: return {{0, 2}, {}, {}, 16, 176};
    case TensorType::Q6_K: return {{208}, {}, {}, 0, 192};
    case TensorType::IQ4_XS: return {{0}, {}, {}, 8, 136};
    case TensorType::MXFP4: {
      BlockLayout l;
      l.e8m0 = {0};
      l.codes_begin = 1, l.codes_end = 17;
      l.zero_code = 0x77;
      l.zero_times = 128.0f / 12.0f;
      return l;
    }
    default: return {};
  }
}

// Random valid weights: random codes and sub-block scales, float fields of either sign with
// magnitudes that keep the weights near those of real models (super formats multiply their
// fp16 scale by sub-block scales up to 63 or 127). Float types: normal values.
inline std::vector<uint8_t> random_weights(TensorType t, int64_t rows, int64_t cols, std::mt19937& rng) {
  std::vector<uint8_t> bytes(row_bytes(t, cols) * static_cast<size_t>(rows));
  if (t == TensorType::F32 || t == TensorType::F16 || t == TensorType::BF16) {
    std::normal_distribution<float> normal(0.0f, 0.05f);
    const size_t vb = t == TensorType::F32 ? 4 : 2;
    for (size_t i = 0; i < bytes.size() / vb; ++i) {
      const float v = normal(rng);
      if (t == TensorType::F32) std::memcpy(&bytes[i * 4], &v, 4);
      const uint16_t h = t == TensorType::F16 ? fp32_to_fp16(v) : fp32_to_bf16(v);
      if (vb == 2) std::memcpy(&bytes[i * 2], &h, 2);
    }
    return bytes;
  }
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  const BlockLayout l = block_layout(t);
  const bool super = acts_of(t) == Acts::kPer256;
  std::uniform_real_distribution<float> scale(super ? -0.002f : -0.05f, super ? 0.002f : 0.05f);
  for (size_t off = 0; off < bytes.size(); off += block_bytes(t)) {
    for (size_t f : l.f16) {
      const uint16_t h = fp32_to_fp16(scale(rng));
      std::memcpy(&bytes[off + f], &h, 2);
    }
    for (size_t f : l.bf16) {
      const uint16_t h = fp32_to_bf16(scale(rng));
      std::memcpy(&bytes[off + f], &h, 2);
    }
    for (size_t f : l.f32) {
      const float v = scale(rng);
      std::memcpy(&bytes[off + f], &v, 4);
    }
    // Scales 2^-11 .. 2^-6 (halved, times values up to 12): weights as large as the others'.
    for (size_t f : l.e8m0) bytes[off + f] = static_cast<uint8_t>(117 + rng() % 6);
  }
  return bytes;
}

// The weights in fp32 ([rows][cols]), by quant/formats.cpp's dequantizer.
inline std::vector<float> dequantize(TensorType t, const std::vector<uint8_t>& w, int64_t rows, int64_t cols) {
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (int64_t n = 0; n < rows; ++n) dequantize_row(t, w.data() + static_cast<size_t>(n) * row_bytes(t, cols), out.data() + n * cols, cols);
  return out;
}

// Per weight, the magnitude of what code 0 is worth in its (sub-)block: the offset or min a
// kernel splits off and adds back (Q4_0: 8|d|, Q4_1: |m|, Q4_K: |dmin m_j|, Q6_K: 32|d sc_j|,
// Q8_0, IQ4 and MXFP4: about 128|d|, where a kernel turns signed values unsigned). A kernel's
// intermediate terms are as large as |w| + this, which bounds its rounding error.
inline std::vector<float> offset_magnitudes(TensorType t, std::vector<uint8_t> w, int64_t rows, int64_t cols) {
  const BlockLayout l = block_layout(t);
  if (l.codes_end == 0) return std::vector<float>(static_cast<size_t>(rows * cols), 0.0f);  // float types
  for (size_t off = 0; off < w.size(); off += block_bytes(t)) {
    std::memset(&w[off + l.codes_begin], l.zero_code, l.codes_end - l.codes_begin);
  }
  std::vector<float> zero = dequantize(t, w, rows, cols);
  for (float& v : zero) v = std::fabs(v) * l.zero_times;
  return zero;
}

}  // namespace ringlm::test
