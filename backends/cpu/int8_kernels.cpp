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
#include <bit>
#include <cmath>
#include <cstring>

#include "backends/cpu/int8_kernels.h"
#include "backends/cpu/kernel_fp16_table.h"
#include "hwy/highway.h"
#include "quant/int4.h"

HWY_BEFORE_NAMESPACE();
// The AVX3_DL target (AVX-512 with VNNI) multiplies bytes with vpdpbusd (evex_dpbusd-inl.h).
#if HWY_TARGET == HWY_AVX3_DL
#define RINGLM_VNNI 1
#else
#define RINGLM_VNNI 0
#endif
namespace ringlm::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
#include "backends/cpu/evex_dpbusd-inl.h"  // IWYU pragma: keep

// ---------------------------------------------------------------------------------------------
// Activation quantization: per block of 32, d = max|x| / 127 and q = nearest(x * 127 / max|x|).

void QuantizeActs(const float* x, int64_t m_begin, int64_t m_end, const QuantizedActs& out) {
  const hn::CappedTag<float, kActBlock> df;  // at most one block per vector, so N divides 32
  const hn::RebindToSigned<decltype(df)> di;
  const hn::Rebind<int8_t, decltype(df)> d8;
  const int64_t n_lanes = static_cast<int64_t>(hn::Lanes(df));
  const int64_t k = out.k, nb = out.blocks();
  for (int64_t m = m_begin; m < m_end; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * k + b * kActBlock;
      auto vmax = hn::Zero(df);
      for (int64_t i = 0; i < kActBlock; i += n_lanes) vmax = hn::Max(vmax, hn::Abs(hn::LoadU(df, xb + i)));
      const float amax = hn::GetLane(hn::MaxOfLanes(df, vmax));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int8_t* qb = out.q + m * k + b * kActBlock;
      auto vsum = hn::Zero(di);  // |q| <= 127: the integer sum is exact in any order
      for (int64_t i = 0; i < kActBlock; i += n_lanes) {
        const auto rounded = hn::NearestInt(hn::Mul(hn::LoadU(df, xb + i), hn::Set(df, inv)));
        hn::StoreU(hn::DemoteTo(d8, rounded), d8, qb + i);
        vsum = hn::Add(vsum, rounded);
      }
      const int32_t sum = hn::GetLane(hn::SumOfLanes(di, vsum));
      const float d = amax / 127.0f;
      out.d[m * nb + b] = d;
      out.s[m * nb + b] = d * static_cast<float>(sum);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Weight formats: what a kernel needs from one block. Q4_0 and Q4_1 are i4s-g32 and i4a-g32
// with fp16 scales (same layout, see quant/int4.h).

template <int G, bool Asym, ScaleType S>
struct FmtI4 {
  using Block = BlockI4<G, Asym, S>;
  static constexpr int kGroup = G;         // weights per block: 32 or 128 (4 sub-blocks of 32)
  static constexpr bool kNibbles = true;   // 4-bit codes
  static constexpr bool kMin = Asym;       // w = d * q + m
  static constexpr int kOffset = Asym ? 0 : 8;  // symmetric: integer weight = code - 8
  static constexpr ScaleType kScale = S;
};
struct FmtQ8_0 {
  using Block = BlockQ8_0;
  static constexpr int kGroup = 32;
  static constexpr bool kNibbles = false;
  static constexpr bool kMin = false;
  static constexpr int kOffset = 0;
  static constexpr ScaleType kScale = ScaleType::kF16;
};
static_assert(sizeof(FmtI4<32, false, ScaleType::kF16>::Block) == sizeof(BlockQ4_0));
static_assert(sizeof(FmtI4<32, true, ScaleType::kF16>::Block) == sizeof(BlockQ4_1));

// A stored scale (or min) in fp32; fp16 through the table (exact, and one load).
template <class Fmt>
HWY_INLINE float ScaleValue(ScaleBits<Fmt::kScale> bits, const float* f16) {
  if constexpr (Fmt::kScale == ScaleType::kF32) {
    (void)f16;
    return bits;
  } else if constexpr (Fmt::kScale == ScaleType::kBF16) {
    (void)f16;
    return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
  } else {
    return f16[bits];
  }
}
template <class Fmt>
HWY_INLINE float BlockScale(const typename Fmt::Block& blk, const float* f16) {
  return ScaleValue<Fmt>(blk.d, f16);
}
template <class Fmt>
HWY_INLINE float BlockMin(const typename Fmt::Block& blk, const float* f16) {
  if constexpr (Fmt::kMin) {
    return ScaleValue<Fmt>(blk.m, f16);
  } else {
    (void)blk, (void)f16;
    return 0.0f;
  }
}

// Rows of a tile: 4 rows x 2 tokens, or 8 rows x 1 token (GEMV: more rows share each loaded and
// rearranged activation block, and the 8 accumulators of 8 lanes are there anyway).
template <int MT>
constexpr int64_t kTileRows = MT == 1 ? 8 : 4;

#if HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// ---------------------------------------------------------------------------------------------
// x86 kernels on 256-bit vectors (the AVX-512 targets use them with VNNI where they have it).
//
// A 4-bit sub-block of 32 weights is 16 bytes: low nibbles are elements 0..15, high nibbles
// 16..31. Two sub-blocks (a "pair": two Q4_0 blocks, or half an i4*-g128 block) fill one
// register of bytes; masking gives lo = [elements 0..15 of both] and a shift hi = [16..31 of
// both], which meet the activations rearranged the same way once per tile. Each half of the
// integer dot (4 int32 lanes) belongs to one sub-block, so one conversion and one or two
// multiply-adds serve two sub-blocks, with per-half scales [d_a x4 | d_a+1 x4].

// int32 lanes += sum over each lane's 4 bytes of u * s (u unsigned, s signed).
HWY_INLINE __m256i DotAdd(__m256i acc, __m256i u, __m256i s) {
#if RINGLM_VNNI
  return DpbusdEvex(acc, u, s);
#else
  // |u * s| <= 255 * 127 per byte pair, so the pairwise i16 sums (at most 2 * 128 * 127 here:
  // weights are at most 128 in magnitude) never saturate.
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// The integer dots of a pair: lo codes against lo activations plus hi against hi, as floats.
HWY_INLINE __m256 PairDot(__m256i lo, __m256i hi, __m256i xlo, __m256i xhi) {
#if RINGLM_VNNI
  return _mm256_cvtepi32_ps(DotAdd(DotAdd(_mm256_setzero_si256(), lo, xlo), hi, xhi));
#else
  // Codes are at most 15: each i16 pair sum is at most 2 * 15 * 127, two of them 7620.
  const __m256i sum16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(sum16, _mm256_set1_epi16(1)));
#endif
}

// [a x4 | b x4].
HWY_INLINE __m256 Halves(float a, float b) { return _mm256_set_m128(_mm_set1_ps(b), _mm_set1_ps(a)); }

// 32 bytes of nibbles (two sub-blocks) as lo and hi codes.
HWY_INLINE void Unpack(__m256i packed, __m256i& lo, __m256i& hi) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  lo = _mm256_and_si256(packed, mask);
  hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
}

HWY_INLINE __m256i Load16x2(const uint8_t* first, const uint8_t* second) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(first))),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(second)), 1);
}

// One token's activations for the sub-blocks a, a + 1 (from q = its first byte, d = its scale),
// in the pair order: lo = [0..15 of a | 0..15 of a+1], hi = [16..31 of a | 16..31 of a+1].
struct PairActs {
  __m256i lo, hi;
  __m256 dx;  // [dx_a x4 | dx_a+1 x4]
};
HWY_INLINE PairActs LoadPair(const int8_t* q, const float* d) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + kActBlock));
  return {_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31), Halves(d[0], d[1])};
}

// For the lambdas of the kernels' inner loops, which GCC would otherwise sometimes leave as
// calls (eight rows' worth of one step is large).
#define RINGLM_INLINE __attribute__((always_inline))

// Fixed-order horizontal sum of 8 floats.
HWY_INLINE float HSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Where a block's offset goes. The kernels use the 4-bit codes unsigned; for w = d * (c - 8)
// that leaves -8 * d * sum(qx) * dx = -8 * d * s, and for w = d * c + m the min term m * s.
// Both are added as per-lane terms that the final horizontal sum adds back: a sub-block's term
// spread over the lanes that carry it (4 in a pair, 8 for a whole g128 group or a lone block),
// so the per-lane term is T / lanes with T = -8 s (symmetric) or s (asymmetric): exact scalings.
template <class Fmt>
constexpr float kTermScale = Fmt::kOffset != 0 ? -static_cast<float>(Fmt::kOffset) : 1.0f;

// One row's accumulator after a scaled integer dot: acc += dw * (dot * dx + term) for the
// symmetric formats, acc += dw * dot * dx + mv * term for the asymmetric ones.
template <class Fmt>
HWY_INLINE void Accumulate(__m256 dot, __m256 dx, __m256 term, __m256 dw, __m256 mv, __m256& acc) {
  if constexpr (Fmt::kMin) {
    acc = _mm256_fmadd_ps(dw, _mm256_mul_ps(dot, dx), acc);
    acc = _mm256_fmadd_ps(mv, term, acc);
  } else if constexpr (Fmt::kOffset != 0) {
    acc = _mm256_fmadd_ps(dw, _mm256_fmadd_ps(dot, dx, term), acc);
  } else {
    (void)term, (void)mv;
    acc = _mm256_fmadd_ps(dw, _mm256_mul_ps(dot, dx), acc);
  }
}

// Token t's quantized activations.
struct TokenActs {
  const int8_t* q;
  const float *d, *s;
};

// Weight pair (sub-blocks a, a + 1 of a g32 format: two blocks) of one row against MT tokens.
template <class Fmt, int MT>
HWY_INLINE void StepPair32(const typename Fmt::Block* w, int64_t a, const PairActs& x0, const PairActs& x1,
                           __m256 t0, __m256 t1, const float* f16, __m256& acc0, __m256& acc1) {
  __m256i lo, hi;
  Unpack(Load16x2(w[a].qs, w[a + 1].qs), lo, hi);
  const __m256 dw = Halves(BlockScale<Fmt>(w[a], f16), BlockScale<Fmt>(w[a + 1], f16));
  const __m256 mv = Fmt::kMin ? Halves(BlockMin<Fmt>(w[a], f16), BlockMin<Fmt>(w[a + 1], f16)) : dw;
  Accumulate<Fmt>(PairDot(lo, hi, x0.lo, x0.hi), x0.dx, t0, dw, mv, acc0);
  if constexpr (MT == 2) Accumulate<Fmt>(PairDot(lo, hi, x1.lo, x1.hi), x1.dx, t1, dw, mv, acc1);
}

// A lone 32-weight block (the last of a row with an odd number of blocks, and Q8_0's blocks):
// one register of codes [0..31] against the activations in their stored order.
template <class Fmt, int MT>
HWY_INLINE void StepOne(const typename Fmt::Block& blk, __m256i act0, __m256i act1, __m256 dx0, __m256 dx1,
                        __m256 t0, __m256 t1, const float* f16, __m256& acc0, __m256& acc1) {
  const __m256 dw = _mm256_set1_ps(BlockScale<Fmt>(blk, f16));
  const __m256 mv = _mm256_set1_ps(BlockMin<Fmt>(blk, f16));
  __m256i codes;
  if constexpr (Fmt::kNibbles) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.qs));
    codes = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(packed), _mm_srli_epi16(packed, 4), 1),
                             _mm256_set1_epi8(0x0F));
  } else {
    codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qs));
  }
  // Q8_0's signed weights go through |w| * (a with w's sign), the usual way to feed a signed
  // product to an unsigned-by-signed instruction (activations are never -128: negating is exact).
  constexpr bool kSigned = !Fmt::kNibbles;
  const __m256i u = kSigned ? _mm256_sign_epi8(codes, codes) : codes;
  const auto step = [&](__m256i act, __m256 dx, __m256 t, __m256& acc) RINGLM_INLINE {
    const __m256i s = kSigned ? _mm256_sign_epi8(act, codes) : act;
    Accumulate<Fmt>(_mm256_cvtepi32_ps(DotAdd(_mm256_setzero_si256(), u, s)), dx, t, dw, mv, acc);
  };
  step(act0, dx0, t0, acc0);
  if constexpr (MT == 2) step(act1, dx1, t1, acc1);
}

// One g128 block of one row (two pairs, one scale) against MT tokens: the pairs' scaled dots
// are summed per lane, then multiplied by the block scale once.
template <class Fmt, int MT>
HWY_INLINE void StepGroup128(const typename Fmt::Block& blk, const PairActs& x0a, const PairActs& x0b,
                             const PairActs& x1a, const PairActs& x1b, __m256 t0, __m256 t1, const float* f16,
                             __m256& acc0, __m256& acc1) {
  __m256i lo_a, hi_a, lo_b, hi_b;
  Unpack(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qs)), lo_a, hi_a);
  Unpack(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qs + 32)), lo_b, hi_b);
  const __m256 dw = _mm256_set1_ps(BlockScale<Fmt>(blk, f16));
  const __m256 mv = _mm256_set1_ps(BlockMin<Fmt>(blk, f16));
  const auto step = [&](const PairActs& xa, const PairActs& xb, __m256 t, __m256& acc) RINGLM_INLINE {
    // Pair b's dot goes in through Accumulate (with the group term); pair a's is folded in as
    // part of that term, so the sum is dw * (dot_a dx_a + dot_b dx_b + term).
    const __m256 dot_a = _mm256_mul_ps(PairDot(lo_a, hi_a, xa.lo, xa.hi), xa.dx);
    if constexpr (Fmt::kMin) {
      acc = _mm256_fmadd_ps(dw, _mm256_fmadd_ps(PairDot(lo_b, hi_b, xb.lo, xb.hi), xb.dx, dot_a), acc);
      acc = _mm256_fmadd_ps(mv, t, acc);
    } else {
      Accumulate<Fmt>(PairDot(lo_b, hi_b, xb.lo, xb.hi), xb.dx, _mm256_add_ps(t, dot_a), dw, mv, acc);
    }
  };
  step(x0a, x0b, t0, acc0);
  if constexpr (MT == 2) step(x1a, x1b, t1, acc1);
}

// kTileRows rows x MT tokens (1 or 2): the 8 accumulators stay in registers (named variables:
// GCC keeps arrays of vectors on the stack); each activation block is loaded and rearranged
// once for all the rows. Rows past the matrix edge repeat the last row and are not stored, so
// edge outputs are computed by the very same code.
template <class Fmt, int MT>
HWY_NOINLINE void Tile(const uint8_t* w, size_t row_stride, int64_t n, int64_t rows, const QuantizedActs& x,
                       int64_t m0, float* y, int64_t ldy, const float* f16) {
  using Block = typename Fmt::Block;
  const int64_t nb = x.blocks();  // sub-blocks of 32 per row
  const auto row = [&](int64_t r) {
    return reinterpret_cast<const Block*>(w + static_cast<size_t>(n + std::min(r, rows - 1)) * row_stride);
  };
  const Block *w0 = row(0), *w1 = row(1), *w2 = row(2), *w3 = row(3);
  const Block *w4 = row(4), *w5 = row(5), *w6 = row(6), *w7 = row(7);
  const int64_t m1 = MT == 2 ? m0 + 1 : m0;
  const TokenActs k0{x.q + m0 * x.k, x.d + m0 * nb, x.s + m0 * nb};
  const TokenActs k1{x.q + m1 * x.k, x.d + m1 * nb, x.s + m1 * nb};
  __m256 a00 = _mm256_setzero_ps(), a10 = a00, a20 = a00, a30 = a00;
  __m256 a01 = a00, a11 = a00, a21 = a00, a31 = a00;  // token 1, or rows 4..7 when MT = 1
  // step(row, acc for token 0, acc for token 1) on every row of the tile.
  const auto each_row = [&](auto&& step) RINGLM_INLINE {
    step(w0, a00, a01);
    step(w1, a10, a11);
    step(w2, a20, a21);
    step(w3, a30, a31);
    if constexpr (MT == 1) {
      __m256 unused;
      step(w4, a01, unused);
      step(w5, a11, unused);
      step(w6, a21, unused);
      step(w7, a31, unused);
    }
  };
  int64_t b = 0;  // next sub-block
  if constexpr (Fmt::kNibbles && Fmt::kGroup == 32) {
    for (; b + 2 <= nb; b += 2) {
      const PairActs x0 = LoadPair(k0.q + b * kActBlock, k0.d + b);
      const PairActs x1 = MT == 2 ? LoadPair(k1.q + b * kActBlock, k1.d + b) : x0;
      constexpr float kT = kTermScale<Fmt> / 4;
      const __m256 t0 = Halves(k0.s[b] * kT, k0.s[b + 1] * kT);
      const __m256 t1 = MT == 2 ? Halves(k1.s[b] * kT, k1.s[b + 1] * kT) : t0;
      each_row([&](const Block* w, __m256& acc0, __m256& acc1) RINGLM_INLINE {
        StepPair32<Fmt, MT>(w, b, x0, x1, t0, t1, f16, acc0, acc1);
      });
    }
  }
  if constexpr (Fmt::kGroup == 128) {
    for (int64_t g = 0; g < nb / 4; ++g, b += 4) {
      const PairActs x0a = LoadPair(k0.q + b * kActBlock, k0.d + b);
      const PairActs x0b = LoadPair(k0.q + (b + 2) * kActBlock, k0.d + b + 2);
      const PairActs x1a = MT == 2 ? LoadPair(k1.q + b * kActBlock, k1.d + b) : x0a;
      const PairActs x1b = MT == 2 ? LoadPair(k1.q + (b + 2) * kActBlock, k1.d + b + 2) : x0b;
      constexpr float kT = kTermScale<Fmt> / 8;
      const auto term = [&](const float* s) { return _mm256_set1_ps(((s[b] + s[b + 1]) + (s[b + 2] + s[b + 3])) * kT); };
      const __m256 t0 = term(k0.s), t1 = MT == 2 ? term(k1.s) : t0;
      each_row([&](const Block* w, __m256& acc0, __m256& acc1) RINGLM_INLINE {
        StepGroup128<Fmt, MT>(w[g], x0a, x0b, x1a, x1b, t0, t1, f16, acc0, acc1);
      });
    }
  } else {
    for (; b < nb; ++b) {  // Q8_0, and the last block of a g32 row with an odd block count
      const __m256i act0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k0.q + b * kActBlock));
      const __m256i act1 = MT == 2 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k1.q + b * kActBlock)) : act0;
      const __m256 dx0 = _mm256_set1_ps(k0.d[b]), dx1 = _mm256_set1_ps(k1.d[b]);
      constexpr float kT = kTermScale<Fmt> / 8;
      const __m256 t0 = _mm256_set1_ps(k0.s[b] * kT), t1 = _mm256_set1_ps(k1.s[b] * kT);
      each_row([&](const Block* w, __m256& acc0, __m256& acc1) RINGLM_INLINE {
        StepOne<Fmt, MT>(w[b], act0, act1, dx0, dx1, t0, t1, f16, acc0, acc1);
      });
    }
  }
  const float sums[8] = {HSum(a00), HSum(a10), HSum(a20), HSum(a30), HSum(a01), HSum(a11), HSum(a21), HSum(a31)};
  const int64_t stored = std::min(kTileRows<MT>, rows);
  for (int t = 0; t < MT; ++t) {
    for (int64_t r = 0; r < stored; ++r) y[(m0 + t) * ldy + n + r] = sums[MT == 1 ? r : 4 * t + r];
  }
}

#else
// ---------------------------------------------------------------------------------------------
// Portable fallback (SSE4, SSSE3, emulation, other architectures): scalar integer dots per
// sub-block of 32, scaled by the activation scale, summed over the block, then times the
// weight scale (plus min * sum of the activation sums for the asymmetric formats).

// Integer weight i (0..kGroup-1) of a block: nibble codes minus the symmetric offset.
template <class Fmt>
HWY_INLINE int WeightAt(const typename Fmt::Block& blk, int i) {
  if constexpr (Fmt::kNibbles) {
    const int sub = i / kActBlock, j = i % kActBlock;
    const uint8_t* qs = blk.qs + sub * (kActBlock / 2);
    const int code = j < 16 ? (qs[j] & 0x0F) : (qs[j - 16] >> 4);
    return code - Fmt::kOffset;
  } else {
    return blk.qs[i];
  }
}

// Same tiling contract as the x86 Tile: kTileRows rows (clamped at the edge) x MT tokens.
template <class Fmt, int MT>
HWY_NOINLINE void Tile(const uint8_t* w, size_t row_stride, int64_t n, int64_t rows, const QuantizedActs& x,
                       int64_t m0, float* y, int64_t ldy, const float* f16) {
  using Block = typename Fmt::Block;
  constexpr int kSubs = Fmt::kGroup / kActBlock;
  const int64_t nb = x.blocks();
  for (int64_t r = 0; r < std::min(kTileRows<MT>, rows); ++r) {
    const Block* row = reinterpret_cast<const Block*>(w + static_cast<size_t>(n + r) * row_stride);
    for (int t = 0; t < MT; ++t) {
      const int8_t* q = x.q + (m0 + t) * x.k;
      const float *d = x.d + (m0 + t) * nb, *s = x.s + (m0 + t) * nb;
      float acc = 0.0f;
      for (int64_t g = 0; g < nb / kSubs; ++g) {
        float inner = 0.0f, sums = 0.0f;
        for (int sub = 0; sub < kSubs; ++sub) {
          const int64_t b = g * kSubs + sub;
          int32_t dot = 0;
          for (int i = 0; i < kActBlock; ++i) dot += WeightAt<Fmt>(row[g], sub * kActBlock + i) * q[b * kActBlock + i];
          inner += d[b] * static_cast<float>(dot);
          sums += s[b];
        }
        acc += BlockScale<Fmt>(row[g], f16) * inner;
        if constexpr (Fmt::kMin) acc += BlockMin<Fmt>(row[g], f16) * sums;
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
// Tiles are 4 rows x 2 tokens (8 x 1 for the last odd token and for GEMV); every output is
// summed by the same sequence of operations whichever tile computes it.
template <class Fmt>
void GemmFmt(const uint8_t* w, size_t row_stride, int64_t n_begin, int64_t n_end, const QuantizedActs& x,
             int64_t n_tokens, float* y, int64_t ldy) {
  const float* f16 = fp16_table();
  constexpr int64_t kRows = kTileRows<1>;  // a multiple of every tile's rows
  const int64_t group_rows =
      std::max<int64_t>(kRows, (int64_t{128} << 10) / static_cast<int64_t>(row_stride) / kRows * kRows);
  for (int64_t g = n_begin; g < n_end; g += group_rows) {
    const int64_t g_end = std::min(n_end, g + group_rows);
    for (int64_t m0 = 0; m0 < n_tokens; m0 += 2) {
      if (m0 + 1 < n_tokens) {
        for (int64_t n = g; n < g_end; n += kTileRows<2>) Tile<Fmt, 2>(w, row_stride, n, g_end - n, x, m0, y, ldy, f16);
      } else {
        for (int64_t n = g; n < g_end; n += kTileRows<1>) Tile<Fmt, 1>(w, row_stride, n, g_end - n, x, m0, y, ldy, f16);
      }
    }
  }
}

// The int4 format of a ringlm type id, as a kernel instantiation.
template <int G, bool Asym>
void GemmInt4(ScaleType scale, const uint8_t* w, size_t row_stride, int64_t n_begin, int64_t n_end,
              const QuantizedActs& x, int64_t n_tokens, float* y, int64_t ldy) {
  switch (scale) {
    case ScaleType::kF16:
      return GemmFmt<FmtI4<G, Asym, ScaleType::kF16>>(w, row_stride, n_begin, n_end, x, n_tokens, y, ldy);
    case ScaleType::kBF16:
      return GemmFmt<FmtI4<G, Asym, ScaleType::kBF16>>(w, row_stride, n_begin, n_end, x, n_tokens, y, ldy);
    case ScaleType::kF32:
      return GemmFmt<FmtI4<G, Asym, ScaleType::kF32>>(w, row_stride, n_begin, n_end, x, n_tokens, y, ldy);
  }
}

void GemmInt8(TensorType type, const uint8_t* w, size_t row_stride, int64_t n_begin, int64_t n_end,
              const QuantizedActs& x, int64_t n_tokens, float* y, int64_t ldy) {
  using Q4_0 = FmtI4<32, false, ScaleType::kF16>;
  using Q4_1 = FmtI4<32, true, ScaleType::kF16>;
  switch (type) {
    case TensorType::Q4_0: return GemmFmt<Q4_0>(w, row_stride, n_begin, n_end, x, n_tokens, y, ldy);
    case TensorType::Q4_1: return GemmFmt<Q4_1>(w, row_stride, n_begin, n_end, x, n_tokens, y, ldy);
    case TensorType::Q8_0: return GemmFmt<FmtQ8_0>(w, row_stride, n_begin, n_end, x, n_tokens, y, ldy);
    default: break;
  }
  const std::optional<Int4Format> f = int4_format(static_cast<uint32_t>(type));
  if (!f) return;  // callers check int8_supported() first
  const bool g128 = f->group == 128;
  if (g128 && f->asymmetric) return GemmInt4<128, true>(f->scale, w, row_stride, n_begin, n_end, x, n_tokens, y, ldy);
  if (g128) return GemmInt4<128, false>(f->scale, w, row_stride, n_begin, n_end, x, n_tokens, y, ldy);
  if (f->asymmetric) return GemmInt4<32, true>(f->scale, w, row_stride, n_begin, n_end, x, n_tokens, y, ldy);
  return GemmInt4<32, false>(f->scale, w, row_stride, n_begin, n_end, x, n_tokens, y, ldy);
}

}  // namespace HWY_NAMESPACE
}  // namespace ringlm::cpu
#undef RINGLM_VNNI
#undef RINGLM_INLINE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ringlm::cpu {

HWY_EXPORT(QuantizeActs);
HWY_EXPORT(GemmInt8);

bool int8_supported(TensorType type) {
  return type == TensorType::Q4_0 || type == TensorType::Q4_1 || type == TensorType::Q8_0 || is_int4_type(type);
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
