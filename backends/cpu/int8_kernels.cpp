// Integer kernels of the CPU backend (see int8_kernels.h for the math). This file is compiled
// once per Highway target through foreach_target.h; HWY_ONCE holds the dispatching entry points.

// Also build the AVX-512 VNNI target (Highway 1.0.3 only does so on request).
#ifndef HWY_WANT_AVX3_DL
#define HWY_WANT_AVX3_DL
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "backends/cpu/int8_kernels.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backends/cpu/int8_kernels.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace ringlm::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// ---------------------------------------------------------------------------------------------
// Activation quantization: per block of 32, d = max|x| / 127 and q = nearest(x * 127 / max|x|).

void QuantizeActs(const float* x, int64_t m_begin, int64_t m_end, const QuantizedActs& out) {
  const hn::CappedTag<float, kActBlock> df;  // at most one block per vector, so N divides 32
  const hn::RebindToSigned<decltype(df)> di;
  const int64_t n_lanes = static_cast<int64_t>(hn::Lanes(df));
  const int64_t k = out.k, nb = out.blocks();
  HWY_ALIGN int32_t rounded[kActBlock];
  for (int64_t m = m_begin; m < m_end; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * k + b * kActBlock;
      auto vmax = hn::Zero(df);
      for (int64_t i = 0; i < kActBlock; i += n_lanes) vmax = hn::Max(vmax, hn::Abs(hn::LoadU(df, xb + i)));
      const float amax = hn::GetLane(hn::MaxOfLanes(df, vmax));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      for (int64_t i = 0; i < kActBlock; i += n_lanes) {
        hn::Store(hn::NearestInt(hn::Mul(hn::LoadU(df, xb + i), hn::Set(df, inv))), di, rounded + i);
      }
      int8_t* qb = out.q + m * k + b * kActBlock;
      int32_t sum = 0;
      for (int64_t i = 0; i < kActBlock; ++i) {
        qb[i] = static_cast<int8_t>(rounded[i]);
        sum += rounded[i];
      }
      const float d = amax / 127.0f;
      out.d[m * nb + b] = d;
      out.s[m * nb + b] = d * static_cast<float>(sum);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Weight formats: what a kernel needs from one block.

struct FmtQ4_0 {
  using Block = BlockQ4_0;
  static constexpr bool kNibbles = true;  // 4-bit codes, 16 bytes per block
  static constexpr bool kMin = false;     // no per-block additive term
  static constexpr int kOffset = 8;       // integer weight = code - 8
};
struct FmtQ4_1 {
  using Block = BlockQ4_1;
  static constexpr bool kNibbles = true;
  static constexpr bool kMin = true;  // w = d * q + m
  static constexpr int kOffset = 0;
};
struct FmtQ8_0 {
  using Block = BlockQ8_0;
  static constexpr bool kNibbles = false;
  static constexpr bool kMin = false;
  static constexpr int kOffset = 0;
};

// Min term of a block (Q4_1 only).
template <class Fmt>
HWY_INLINE uint16_t MinBits(const typename Fmt::Block& blk) {
  if constexpr (Fmt::kMin) {
    return blk.m;
  } else {
    (void)blk;
    return 0;
  }
}

#if HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// ---------------------------------------------------------------------------------------------
// x86 kernels on 256-bit vectors: one block of 32 weights is one register of bytes.

// Eight int32 partial sums of u[i] * s[i] (u unsigned, s signed bytes).
HWY_INLINE __m256i DotU8I8(__m256i u, __m256i s) {
#if HWY_TARGET == HWY_AVX3_DL && defined(__AVX512VNNI__)
  // Highway 1.0.3's AVX3_DL target string lacks avx512vnni (later versions add it); without it
  // this target takes the AVX2 sequence below, which is exact as well.
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  // |u * s| <= 255 * 127 per byte pair, so the pairwise i16 sums (at most 2 * 128 * 127 here:
  // weights are at most 128 in magnitude) never saturate.
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// The block's 32 integer weights as bytes: Q4 codes 0..15 (low nibbles are elements 0..15, high
// nibbles 16..31; Q4_0's offset of 8 is applied through the activation sums), or Q8_0's bytes.
template <class Fmt>
HWY_INLINE __m256i LoadWeights(const typename Fmt::Block& blk) {
  if constexpr (Fmt::kNibbles) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.qs));
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(packed), _mm_srli_epi16(packed, 4), 1);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qs));
  }
}


// Fixed-order horizontal sum of 8 floats.
HWY_INLINE float HSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Scale (and Q4_1's min) of a block as broadcast vectors: one 4-byte load, one conversion.
template <class Fmt>
HWY_INLINE void LoadScales(const typename Fmt::Block& blk, __m256& dw, __m256& mv) {
  int32_t bits;  // d, then m for Q4_1: adjacent fp16 values
  std::memcpy(&bits, &blk, sizeof(bits));
  const __m128 both = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
  dw = _mm256_broadcastss_ps(both);
  if constexpr (Fmt::kMin) mv = _mm256_broadcastss_ps(_mm_movehdup_ps(both));
}

// One weight block of one row against the same block of MT (1 or 2) tokens: the block is
// unpacked once for both tokens. `off` is the per-token block term prepared by Tile, spread
// over the 8 lanes that the horizontal sum adds back (so divided by 8, exactly): -8 * s / 8 for
// Q4_0, whose codes are used unsigned (dw * (dx * dot - 8 s) = dw * dx * sum (q - 8) qx), and
// s / 8 for Q4_1's m * s.
template <class Fmt, int MT>
HWY_INLINE void BlockStep(const typename Fmt::Block& blk, __m256i act0, __m256i act1, __m256 dx0, __m256 dx1,
                          __m256 off0, __m256 off1, __m256& acc0, __m256& acc1) {
  // Q8_0's signed weights go through |w| * (a with w's sign), the usual way to feed a signed
  // product to an unsigned-by-signed instruction (activations are never -128: negating is exact).
  constexpr bool kSigned = !Fmt::kNibbles;
  __m256 dw, mv;
  LoadScales<Fmt>(blk, dw, mv);
  const __m256i wq = LoadWeights<Fmt>(blk);
  const __m256i wabs = kSigned ? _mm256_sign_epi8(wq, wq) : wq;
  const auto step = [&](__m256i act, __m256 dx, __m256 off, __m256& acc) {
    const __m256 dot = _mm256_cvtepi32_ps(DotU8I8(wabs, kSigned ? _mm256_sign_epi8(act, wq) : act));
    const __m256 scaled = Fmt::kOffset != 0 ? _mm256_fmadd_ps(dot, dx, off) : _mm256_mul_ps(dot, dx);
    acc = _mm256_fmadd_ps(dw, scaled, acc);
    if constexpr (Fmt::kMin) acc = _mm256_fmadd_ps(mv, off, acc);
  };
  step(act0, dx0, off0, acc0);
  if constexpr (MT == 2) step(act1, dx1, off1, acc1);
}

// The per-token block term BlockStep expects (see there).
template <class Fmt>
HWY_INLINE __m256 BlockOffset(const float* s) {
  if constexpr (Fmt::kOffset != 0) return _mm256_set1_ps(*s * (static_cast<float>(-Fmt::kOffset) / 8));
  if constexpr (Fmt::kMin) return _mm256_set1_ps(*s * 0.125f);
  (void)s;
  return _mm256_setzero_ps();
}

// 4 weight rows x MT tokens (1 or 2): the 4 * MT accumulators of 8 lanes stay in registers
// (named variables: GCC keeps arrays of vectors on the stack); each activation block is loaded
// once for the 4 rows. Rows past the matrix edge repeat the last row and are not stored, so
// edge outputs are computed by the very same code.
template <class Fmt, int MT>
HWY_NOINLINE void Tile(const uint8_t* w, size_t row_stride, int64_t n, int64_t rows, const QuantizedActs& x,
                       int64_t m0, float* y, int64_t ldy) {
  using Block = typename Fmt::Block;
  const int64_t nb = x.blocks();
  const auto row = [&](int64_t r) {
    return reinterpret_cast<const Block*>(w + static_cast<size_t>(n + std::min(r, rows - 1)) * row_stride);
  };
  const Block *w0 = row(0), *w1 = row(1), *w2 = row(2), *w3 = row(3);
  const int64_t m1 = MT == 2 ? m0 + 1 : m0;
  const int8_t *q0 = x.q + m0 * x.k, *q1 = x.q + m1 * x.k;
  const float *d0 = x.d + m0 * nb, *d1 = x.d + m1 * nb, *s0 = x.s + m0 * nb, *s1 = x.s + m1 * nb;
  __m256 a00 = _mm256_setzero_ps(), a10 = a00, a20 = a00, a30 = a00;
  __m256 a01 = a00, a11 = a00, a21 = a00, a31 = a00;
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i act0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q0 + b * kActBlock));
    const __m256i act1 =
        MT == 2 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q1 + b * kActBlock)) : act0;
    const __m256 dx0 = _mm256_broadcast_ss(d0 + b), dx1 = MT == 2 ? _mm256_broadcast_ss(d1 + b) : dx0;
    const __m256 off0 = BlockOffset<Fmt>(s0 + b), off1 = MT == 2 ? BlockOffset<Fmt>(s1 + b) : off0;
    BlockStep<Fmt, MT>(w0[b], act0, act1, dx0, dx1, off0, off1, a00, a01);
    BlockStep<Fmt, MT>(w1[b], act0, act1, dx0, dx1, off0, off1, a10, a11);
    BlockStep<Fmt, MT>(w2[b], act0, act1, dx0, dx1, off0, off1, a20, a21);
    BlockStep<Fmt, MT>(w3[b], act0, act1, dx0, dx1, off0, off1, a30, a31);
  }
  const float sums[2][4] = {{HSum(a00), HSum(a10), HSum(a20), HSum(a30)},
                            {HSum(a01), HSum(a11), HSum(a21), HSum(a31)}};
  for (int t = 0; t < MT; ++t) {
    for (int64_t r = 0; r < std::min<int64_t>(4, rows); ++r) y[(m0 + t) * ldy + n + r] = sums[t][r];
  }
}

#else
// ---------------------------------------------------------------------------------------------
// Portable fallback (SSE4, SSSE3, emulation, other architectures): scalar integer dots.

HWY_INLINE float HalfToFloat(uint16_t h) { return fp16_to_fp32(h); }

template <class Fmt>
HWY_INLINE int WeightAt(const typename Fmt::Block& blk, int i) {
  if constexpr (Fmt::kNibbles) {
    const int code = i < 16 ? (blk.qs[i] & 0x0F) : (blk.qs[i - 16] >> 4);
    return code - Fmt::kOffset;
  } else {
    return blk.qs[i];
  }
}

// Same tiling contract as the x86 Tile: 4 rows (clamped at the edge) x MT tokens.
template <class Fmt, int MT>
HWY_NOINLINE void Tile(const uint8_t* w, size_t row_stride, int64_t n, int64_t rows, const QuantizedActs& x,
                       int64_t m0, float* y, int64_t ldy) {
  using Block = typename Fmt::Block;
  const int64_t nb = x.blocks();
  for (int64_t r = 0; r < std::min<int64_t>(4, rows); ++r) {
    const Block* row = reinterpret_cast<const Block*>(w + static_cast<size_t>(n + r) * row_stride);
    for (int t = 0; t < MT; ++t) {
      const int8_t* q = x.q + (m0 + t) * x.k;
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t dot = 0;
        for (int i = 0; i < kActBlock; ++i) dot += WeightAt<Fmt>(row[b], i) * q[b * kActBlock + i];
        acc += HalfToFloat(row[b].d) * x.d[(m0 + t) * nb + b] * static_cast<float>(dot);
        if constexpr (Fmt::kMin) acc += HalfToFloat(MinBits<Fmt>(row[b])) * x.s[(m0 + t) * nb + b];
      }
      y[(m0 + t) * ldy + n + r] = acc;
    }
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// Tiling over rows and tokens.

// Rows are taken in groups small enough to stay in L2 while every token tile passes over
// them, so each weight byte comes from memory once per call whatever the number of tokens.
// Tiles are 4 rows x 2 tokens (4 x 1 for the last odd token and for GEMV); every output is
// summed by the same sequence of operations whichever tile computes it.
template <class Fmt>
void GemmFmt(const uint8_t* w, size_t row_stride, int64_t n_begin, int64_t n_end, const QuantizedActs& x,
             int64_t n_tokens, float* y, int64_t ldy) {
  constexpr int64_t kRows = 4;
  const int64_t group_rows =
      std::max<int64_t>(kRows, (int64_t{128} << 10) / static_cast<int64_t>(row_stride) / kRows * kRows);
  for (int64_t g = n_begin; g < n_end; g += group_rows) {
    const int64_t g_end = std::min(n_end, g + group_rows);
    for (int64_t m0 = 0; m0 < n_tokens; m0 += 2) {
      for (int64_t n = g; n < g_end; n += kRows) {
        if (m0 + 1 < n_tokens) {
          Tile<Fmt, 2>(w, row_stride, n, g_end - n, x, m0, y, ldy);
        } else {
          Tile<Fmt, 1>(w, row_stride, n, g_end - n, x, m0, y, ldy);
        }
      }
    }
  }
}

void GemmInt8(TensorType type, const uint8_t* w, size_t row_stride, int64_t n_begin, int64_t n_end,
              const QuantizedActs& x, int64_t n_tokens, float* y, int64_t ldy) {
  switch (type) {
    case TensorType::Q4_0: return GemmFmt<FmtQ4_0>(w, row_stride, n_begin, n_end, x, n_tokens, y, ldy);
    case TensorType::Q4_1: return GemmFmt<FmtQ4_1>(w, row_stride, n_begin, n_end, x, n_tokens, y, ldy);
    case TensorType::Q8_0: return GemmFmt<FmtQ8_0>(w, row_stride, n_begin, n_end, x, n_tokens, y, ldy);
    default: return;  // callers check int8_supported() first
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace ringlm::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ringlm::cpu {

HWY_EXPORT(QuantizeActs);
HWY_EXPORT(GemmInt8);

bool int8_supported(TensorType type) {
  return type == TensorType::Q4_0 || type == TensorType::Q4_1 || type == TensorType::Q8_0;
}

void quantize_acts(const float* x, int64_t m_begin, int64_t m_end, const QuantizedActs& out) {
  HWY_DYNAMIC_DISPATCH(QuantizeActs)(x, m_begin, m_end, out);
}

void gemm_int8(TensorType type, const uint8_t* w, size_t row_stride, int64_t n_begin, int64_t n_end,
               const QuantizedActs& xq, int64_t n_tokens, float* y, int64_t ldy) {
  HWY_DYNAMIC_DISPATCH(GemmInt8)(type, w, row_stride, n_begin, n_end, xq, n_tokens, y, ldy);
}

}  // namespace ringlm::cpu
#endif  // HWY_ONCE
