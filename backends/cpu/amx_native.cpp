// The packed products on this CPU's own tiles (amx.h): tile_gemm-inl.h instantiated on the AMX
// instructions. They run only where amx_state() is kOn, which the CPU, the kernel and a start-up
// comparison with the emulation have all agreed to.
//
// Why a target pragma around that code and not -mamx-tile -mavx512f for the whole file: the file
// also instantiates templates every file shares (std::vector's members, std::string's), and the
// linker keeps one copy of each for the whole program; built with AVX-512, that copy could be the
// one a CPU without it runs. Everything this file includes is compiled for the baseline, before
// the pragma; only the tile code after it (its own namespace, its own symbols) gets the
// instruction sets of a CPU with AMX, every one of which has AVX-512.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "backends/cpu/amx.h"
#include "backends/cpu/kernel_packed.h"
#include "backends/cpu/packed_format.h"
#include "backends/cpu/quantize_acts.h"
#include "quant/formats.h"

#if defined(RINGLM_AMX_BUILD)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,f16c,fma"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")
#endif

#define RINGLM_TILE_NAMESPACE native
#include "backends/cpu/tile_gemm-inl.h"  // IWYU pragma: keep
#undef RINGLM_TILE_NAMESPACE

namespace ringlm::cpu {
namespace {

// LDTILECFG's 64-byte operand: palette 1, then per tile its bytes per row and its rows.
struct alignas(64) TileConfigBytes {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfigBytes) == 64);

// This thread's tiles: configured before the first tile instruction, released when the thread
// exits (OpenMP's workers included: a thread_local's destructor runs at its thread's end).
class ThreadTiles {
 public:
  ThreadTiles() {
    const TileConfig config = tile_product_config();
    for (size_t t = 0; t < config.size(); ++t) {
      bytes_.colsb[t] = static_cast<uint16_t>(config[t].colsb);
      bytes_.rows[t] = static_cast<uint8_t>(config[t].rows);
    }
    _tile_loadconfig(&bytes_);
  }
  ~ThreadTiles() { _tile_release(); }
  ThreadTiles(const ThreadTiles&) = delete;
  ThreadTiles& operator=(const ThreadTiles&) = delete;

  // Loads the configuration again if something else in this thread released or changed it since
  // (another library's tile code, say): a tile instruction on unconfigured tiles kills the
  // process. STTILECFG writes zeros where no configuration is loaded. Once per call (a run of a
  // product's rows).
  void ensure_loaded() const {
    TileConfigBytes current;
    _tile_storeconfig(&current);
    if (std::memcmp(&current, &bytes_, sizeof current) != 0) _tile_loadconfig(&bytes_);
  }

 private:
  TileConfigBytes bytes_;
};

// The tile operations tile_gemm-inl.h uses, on the instructions, whose tile numbers are
// immediates: each switch folds away where the number is a constant.
struct RealTiles {
  void load(int t, const void* base, int64_t stride) {
    switch (t) {
      case 4: _tile_loadd(4, base, stride); break;
      case 5: _tile_loadd(5, base, stride); break;
      case 6: _tile_loadd(6, base, stride); break;
      case 7: _tile_loadd(7, base, stride); break;
      default: throw std::logic_error("tile load into tile " + std::to_string(t));
    }
  }
  void store(int t, void* base, int64_t stride) {
    switch (t) {
      case 0: _tile_stored(0, base, stride); break;
      case 1: _tile_stored(1, base, stride); break;
      case 2: _tile_stored(2, base, stride); break;
      case 3: _tile_stored(3, base, stride); break;
      default: throw std::logic_error("tile store from tile " + std::to_string(t));
    }
  }
  void zero(int t) {
    switch (t) {
      case 0: _tile_zero(0); break;
      case 1: _tile_zero(1); break;
      case 2: _tile_zero(2); break;
      case 3: _tile_zero(3); break;
      default: throw std::logic_error("tile zero of tile " + std::to_string(t));
    }
  }
  void dpbssd(int c, int a, int b) {
    const bool deep = a == native::kA32 && b == native::kB32;
    if (!deep && !(a == native::kA16 && b == native::kB16)) throw std::logic_error("tile dot product of A " + std::to_string(a));
    switch (c * 2 + (deep ? 1 : 0)) {
      case 0: _tile_dpbssd(0, 6, 7); break;
      case 1: _tile_dpbssd(0, 4, 5); break;
      case 2: _tile_dpbssd(1, 6, 7); break;
      case 3: _tile_dpbssd(1, 4, 5); break;
      case 4: _tile_dpbssd(2, 6, 7); break;
      case 5: _tile_dpbssd(2, 4, 5); break;
      case 6: _tile_dpbssd(3, 6, 7); break;
      case 7: _tile_dpbssd(3, 4, 5); break;
      default: throw std::logic_error("tile dot product into tile " + std::to_string(c));
    }
  }
};
static_assert(native::kA32 == 4 && native::kB32 == 5 && native::kA16 == 6 && native::kB16 == 7 && native::kC0 == 0);

void run_on_this_cpu(const PackedWeight& w, int64_t n_begin, int64_t n_end, const PackedInput& x,
                     const TileTokenTerms& terms, int64_t n_tokens, float* y, int64_t ldy) {
  thread_local ThreadTiles configured;
  configured.ensure_loaded();
  RealTiles tiles;
  native::tile_gemm(tiles, w, n_begin, n_end, x, terms, n_tokens, y, ldy);
}

}  // namespace
}  // namespace ringlm::cpu

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif  // RINGLM_AMX_BUILD

namespace ringlm::cpu {

#if defined(RINGLM_AMX_BUILD)
namespace {

// Random file bytes of a type, each block's fp16 fields (at these offsets) set to small scales.
std::vector<uint8_t> check_weights(TensorType type, int64_t rows, int64_t cols, std::initializer_list<size_t> fp16_at,
                                   uint32_t seed) {
  const std::optional<TypeTraits> traits = type_traits(static_cast<uint32_t>(type));
  std::vector<uint8_t> bytes(static_cast<size_t>(rows * cols / traits->block_elems) * traits->block_bytes);
  uint32_t state = seed;
  for (auto& b : bytes) {
    state = state * 1664525u + 1013904223u;
    b = static_cast<uint8_t>(state >> 24);
  }
  for (size_t at = 0; at < bytes.size(); at += traits->block_bytes) {
    for (const size_t field : fp16_at) {
      const uint16_t h = fp32_to_fp16(0.001f * static_cast<float>(1 + (at / traits->block_bytes + field) % 7));
      std::memcpy(bytes.data() + at + field, &h, 2);
    }
  }
  return bytes;
}

// 70 tokens: a pass of four token tiles (every result tile), then one of a tile and a part tile.
bool agrees(TensorType type, std::initializer_list<size_t> fp16_at) {
  constexpr int64_t kRows = 20, kCols = 512, kTokens = 70;
  const std::vector<uint8_t> file = check_weights(type, kRows, kCols, fp16_at, static_cast<uint32_t>(type) + 1);
  const PackedWeight w = pack_weight(type, file.data(), row_bytes(type, kCols), kRows, kCols);
  std::vector<float> x(static_cast<size_t>(kTokens * kCols));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(static_cast<int>(i * 37 % 255) - 127) / 64.0f;
  std::vector<int8_t> q(x.size());
  std::vector<float> d(x.size() / 32), s(x.size() / 32), d256(x.size() / 256);
  std::vector<int32_t> sum16(x.size() / 16), sum32(x.size() / 32), sum(x.size() / 32);
  PackedInput in;
  in.block = {q.data(), d.data(), s.data(), sum.data(), kCols};
  in.super = {q.data(), d256.data(), sum16.data(), sum32.data(), kCols};
  if (packed_format(type)->super()) {
    quantize_acts_super(x.data(), 0, kTokens, in.super);
  } else {
    quantize_acts(x.data(), 0, kTokens, in.block);
  }
  std::vector<float> real(static_cast<size_t>(kTokens * kRows)), emulated(real.size());
  TileTokenTerms terms;
  terms.make(*packed_format(type), in.block, kTokens);
  run_on_this_cpu(w, 0, kRows, in, terms, kTokens, real.data(), kRows);
  EmulatedTiles tiles;
  tiles.load_config(tile_product_config());
  tile_gemm_packed(tiles, w, 0, kRows, in, kTokens, emulated.data(), kRows);
  return std::memcmp(real.data(), emulated.data(), real.size() * sizeof(float)) == 0;
}

}  // namespace

void amx_gemm_packed(const PackedWeight& w, int64_t n_begin, int64_t n_end, const PackedInput& x,
                     const TileTokenTerms& terms, int64_t n_tokens, float* y, int64_t ldy) {
  if (amx_state() != AmxState::kOn) throw std::logic_error("amx_gemm_packed: AMX is " + amx_state_words(amx_state()));
  run_on_this_cpu(w, n_begin, n_end, x, terms, n_tokens, y, ldy);
}

bool amx_agrees_with_emulation() {
  // Q4_0: a block format, fp16 scale at 0. Q4_K: depth 32, d and dmin at 0 and 2. Q6_K: depth 16, d at 208.
  try {
    return agrees(TensorType::Q4_0, {0}) && agrees(TensorType::Q4_K, {0, 2}) && agrees(TensorType::Q6_K, {208});
  } catch (const std::exception&) {
    return false;  // a check that cannot run has not agreed
  }
}

#else

void amx_gemm_packed(const PackedWeight&, int64_t, int64_t, const PackedInput&, const TileTokenTerms&, int64_t, float*,
                     int64_t) {
  throw std::logic_error("this build of ringlm has no AMX code");
}

bool amx_agrees_with_emulation() { return false; }

#endif

void amx_gemm_packed(const PackedWeight& w, int64_t n_begin, int64_t n_end, const PackedInput& x, int64_t n_tokens,
                     float* y, int64_t ldy) {
  TileTokenTerms terms;
  if (tiles_multiply(w.type)) terms.make(*packed_format(w.type), x.block, n_tokens);
  amx_gemm_packed(w, n_begin, n_end, x, terms, n_tokens, y, ldy);
}

}  // namespace ringlm::cpu
