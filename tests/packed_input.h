// Test helpers for the packed products (kernel_packed.h, amx.h): random activations, and the
// input of a product in every form the kernels read, quantized by the kernels' own
// quantize_acts (itself tested against its definition), with each activation as they see it.
#pragma once

#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "backends/cpu/kernel_packed.h"
#include "backends/cpu/quantize_acts.h"
#include "tests/weight_formats.h"

namespace ringlm::test {

using cpu::kActBlock;
using cpu::kSuperBlock;

// Activations with varied magnitudes per block, and all-zero blocks.
inline std::vector<float> random_acts(int64_t m, int64_t k, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(m * k));
  for (int64_t i = 0; i < m * k; ++i) {
    const int64_t block = i / kActBlock;
    x[static_cast<size_t>(i)] = normal(rng) * static_cast<float>(1 + block % 5) * (block % 7 == 3 ? 0.0f : 1.0f);
  }
  return x;
}

// The input in every form the kernels read, and each activation as the kernels see it (the
// quantized value dx * q, or the float itself).
struct Input {
  std::vector<float> x;
  std::vector<int8_t> q32, q256, pass_q;
  std::vector<float> d32, s32, d256, pass_d, pass_s;  // pass_*: q32, d32, s32 laid out for the passes
  std::vector<int32_t> sum32_block, pass_sum;  // the block formats' integer sums, as they are and laid out
  std::vector<int32_t> sum16, sum32;
  std::vector<int8_t> super_pass_q;  // q256, d256, sum16, sum32 laid out for the passes
  std::vector<float> super_pass_d;
  std::vector<int32_t> super_pass_sum16, super_pass_sum32;
  int64_t m = 0, k = 0;

  Input(std::vector<float> values, int64_t m_, int64_t k_) : x(std::move(values)), m(m_), k(k_) {
    const auto n = static_cast<size_t>(m * k);
    q32.resize(n);
    d32.resize(n / kActBlock);
    s32.resize(n / kActBlock);
    sum32_block.resize(n / kActBlock);
    cpu::quantize_acts(x.data(), 0, m, block());
    pass_q.resize(n);
    pass_d.resize(n / kActBlock);
    pass_s.resize(n / kActBlock);
    pass_sum.resize(n / kActBlock);
    for (int64_t t = 0; t < m; ++t) cpu::lay_out_for_passes(block(), t, m, passes());
    if (k % kSuperBlock == 0) {
      q256.resize(n);
      d256.resize(n / kSuperBlock);
      sum16.resize(n / 16);
      sum32.resize(n / 32);
      cpu::quantize_acts_super(x.data(), 0, m, super());
      super_pass_q.resize(n);
      super_pass_d.resize(n / kSuperBlock);
      super_pass_sum16.resize(n / 16);
      super_pass_sum32.resize(n / 32);
      for (int64_t t = 0; t < m; ++t) cpu::lay_out_for_passes(super(), t, m, super_passes());
    }
  }
  cpu::QuantizedActs block() { return {q32.data(), d32.data(), s32.data(), sum32_block.data(), k}; }
  cpu::SuperActs super() { return {q256.data(), d256.data(), sum16.data(), sum32.data(), k}; }
  cpu::QuantizedActs passes() { return {pass_q.data(), pass_d.data(), pass_s.data(), pass_sum.data(), k}; }
  // Every form, the block formats' also laid out for the passes, as the CPU backend makes them.
  cpu::SuperActs super_passes() {
    return {super_pass_q.data(), super_pass_d.data(), super_pass_sum16.data(), super_pass_sum32.data(), k};
  }
  cpu::PackedInput packed() { return {block(), super(), x.data(), passes(), super_passes()}; }
  // Token t's input row as a one-token input.
  cpu::PackedInput row(int64_t t) {
    cpu::PackedInput p = packed();
    p.block = {q32.data() + t * k, d32.data() + t * (k / kActBlock), s32.data() + t * (k / kActBlock),
               sum32_block.data() + t * (k / kActBlock), k};
    if (!q256.empty()) {
      p.super = {q256.data() + t * k, d256.data() + t * (k / kSuperBlock), sum16.data() + t * (k / 16),
                 sum32.data() + t * (k / 32), k};
    }
    p.f32 = x.data() + t * k;
    p.passes = {};
    p.super_passes = {};
    return p;
  }
  double seen(Acts acts, int64_t t, int64_t i) const {
    const size_t at = static_cast<size_t>(t * k + i);
    switch (acts) {
      case Acts::kPer32: return static_cast<double>(d32[static_cast<size_t>((t * k + i) / kActBlock)]) * q32[at];
      case Acts::kPer256: return static_cast<double>(d256[static_cast<size_t>((t * k + i) / kSuperBlock)]) * q256[at];
      case Acts::kFloat: return x[at];
    }
    return 0;
  }
};

}  // namespace ringlm::test
