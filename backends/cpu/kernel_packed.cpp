// The int8 kernels on row-interleaved weights (see kernel_packed.h for the layout and why).
// This file is compiled once per Highway target through foreach_target.h; HWY_ONCE holds the
// packing and the dispatching entry point.

// Also build the AVX-512 VNNI target (Highway 1.0.3 only does so on request).
#ifndef HWY_WANT_AVX3_DL
#define HWY_WANT_AVX3_DL
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "backends/cpu/kernel_packed.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <new>
#include <optional>

#include "backends/cpu/kernel_fp16_table.h"
#include "backends/cpu/kernel_packed.h"
#include "hwy/highway.h"
#include "quant/int4.h"

// What every target shares: the packed layout of a type.
#ifndef RINGLM_KERNEL_PACKED_LAYOUT
#define RINGLM_KERNEL_PACKED_LAYOUT
namespace ringlm::cpu::packed {

struct Layout {
  int group = 32;       // weights per scale (a block of the source format): 32 or 128
  bool asym = false;    // w = d * q + m (mins follow the scales)
  bool bytes = false;   // Q8_0: a signed byte per weight (else 4-bit codes)
  ScaleType scale = ScaleType::kF16;

  constexpr size_t scale_bytes() const { return scale == ScaleType::kF32 ? 4 : 2; }
  // Source: one block of one row.
  constexpr size_t source_block_bytes() const {
    return scale_bytes() * (asym ? 2 : 1) + static_cast<size_t>(bytes ? group : group / 2);
  }
  // Packed: one 32-weight sub-block's codes of 8 rows, and one block's scales (and mins) of 8 rows.
  constexpr size_t sub_bytes() const { return static_cast<size_t>(kPackRows) * (bytes ? 32 : 16); }
  constexpr size_t block_scale_bytes() const { return static_cast<size_t>(kPackRows) * scale_bytes() * (asym ? 2 : 1); }
  constexpr size_t codes_bytes(int64_t cols) const { return static_cast<size_t>(cols / kActBlock) * sub_bytes(); }
  constexpr size_t group_bytes(int64_t cols) const {
    const size_t raw = codes_bytes(cols) + static_cast<size_t>(cols / group) * block_scale_bytes();
    return (raw + 63) / 64 * 64;
  }
};

inline std::optional<Layout> layout_of(TensorType type) {
  switch (type) {
    case TensorType::Q4_0: return Layout{32, false, false, ScaleType::kF16};
    case TensorType::Q4_1: return Layout{32, true, false, ScaleType::kF16};
    case TensorType::Q8_0: return Layout{32, false, true, ScaleType::kF16};
    default: break;
  }
  const std::optional<Int4Format> f = int4_format(static_cast<uint32_t>(type));
  if (!f) return std::nullopt;
  return Layout{f->group, f->asymmetric, false, f->scale};
}

}  // namespace ringlm::cpu::packed
#endif  // RINGLM_KERNEL_PACKED_LAYOUT

HWY_BEFORE_NAMESPACE();
// The AVX3_DL target (AVX-512 with VNNI) multiplies bytes with vpdpbusd (evex_dpbusd-inl.h).
#if HWY_TARGET == HWY_AVX3_DL
#define RINGLM_VNNI 1
#else
#define RINGLM_VNNI 0
#endif
namespace ringlm::cpu {
namespace HWY_NAMESPACE {
#include "backends/cpu/evex_dpbusd-inl.h"  // IWYU pragma: keep

// A packed format as a kernel instantiation.
template <int G, bool Asym, bool Bytes, ScaleType S>
struct Fmt {
  static constexpr int kSubs = G / static_cast<int>(kActBlock);  // 32-weight sub-blocks per scale
  static constexpr bool kMin = Asym;
  static constexpr bool kBytes = Bytes;
  static constexpr ScaleType kScale = S;
  static constexpr packed::Layout kLayout{G, Asym, Bytes, S};
};

// Up to this many tokens share one pass over a group's codes (their registers: one int sum per
// group and token; the float accumulators of a pair of groups partly live on the stack).
constexpr int kMaxTile = 4;

// Bytes of the next groups that a tile pass asks for, spread over its sub-blocks. With several
// passes over the same groups, only the first reads memory; asking for the next groups' bytes
// a share per pass keeps memory busy through the later ones, and the next first pass finds its
// bytes in cache. begin null: one pass (decode's GEMV), which prefetches its own bytes
// kPrefetchBytes ahead instead.
struct Prefetch {
  const uint8_t* begin = nullptr;
  const uint8_t* end = nullptr;
  int lines_per_sub = 0;
};

#if HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// ---------------------------------------------------------------------------------------------
// x86: 256-bit vectors, lane r = row r of the group.

#define RINGLM_INLINE __attribute__((always_inline))

// The 8 rows' scales (or mins) of a block, in fp32: one conversion for 8 rows.
template <ScaleType S>
HWY_INLINE __m256 LoadScales(const uint8_t* p) {
  if constexpr (S == ScaleType::kF32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  } else {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (S == ScaleType::kF16) return _mm256_cvtph_ps(bits);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));  // bf16: the top half of fp32
  }
}

// 4 activation bytes in every lane: what each row's 4 code bytes of a chunk meet.
HWY_INLINE __m256i Broadcast4(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm256_set1_epi32(v);
}

// Lane sums of unsigned codes times signed activations, byte quads to lanes. 4-bit codes: on
// AVX2 the sums stay int16 until the end of the sub-block: a vpmaddubsw pair is at most
// 2 * 15 * 127 = 3810, the sub-block's 8 of them at most 30480 < 2^15, so nothing saturates.
#if RINGLM_VNNI
HWY_INLINE __m256i DotNibbles(__m256i acc, __m256i u, __m256i s) { return DpbusdEvex(acc, u, s); }
HWY_INLINE __m256i WidenNibbles(__m256i acc) { return acc; }
HWY_INLINE __m256i DotBytes(__m256i acc, __m256i u, __m256i s) { return DpbusdEvex(acc, u, s); }
#else
HWY_INLINE __m256i DotNibbles(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s));
}
HWY_INLINE __m256i WidenNibbles(__m256i acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
// Q8_0's |w| <= 128 makes a pair up to 32512: each goes to int32 at once.
HWY_INLINE __m256i DotBytes(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif

// Ends the compiler's freedom to reassociate a running integer sum: GCC otherwise turns a
// sub-block's chain of additions per token into a tree over all the products at once, which for
// several tokens needs more registers than there are and spills most of them.
HWY_INLINE void KeepChain(__m256i& v) { asm("" : "+x"(v)); }

// The integer dots of one sub-block of NG consecutive 8-row groups with MT tokens (codes[g]:
// group g's sub-block; q[t]: token t's 32 activations of the sub-block). Chunks outside, tokens
// inside: each chunk is unpacked once per pass. Groups innermost, so that an activation
// broadcast serves 16 rows: on Zen 3 a broadcast from memory takes a vector-pipe slot, not only
// a load (a broadcast + maddubs + add loop runs at 1.4 per cycle where maddubs alone runs at 2).
template <class F, int MT, int NG>
HWY_INLINE void SubDots(const uint8_t* const* codes, const int8_t* const* q, __m256i (*dot)[MT]) {
  for (int g = 0; g < NG; ++g) {
    for (int t = 0; t < MT; ++t) dot[g][t] = _mm256_setzero_si256();
  }
  if constexpr (!F::kBytes) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      __m256i lo[NG], hi[NG];
      for (int g = 0; g < NG; ++g) {
        const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(codes[g] + 32 * c));
        lo[g] = _mm256_and_si256(v, mask);                         // weights 8c .. 8c+3
        hi[g] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);  // weights 8c+4 .. 8c+7
      }
      for (int t = 0; t < MT; ++t) {
        const __m256i x_lo = Broadcast4(q[t] + 8 * c), x_hi = Broadcast4(q[t] + 8 * c + 4);
        for (int g = 0; g < NG; ++g) {
          dot[g][t] = DotNibbles(dot[g][t], lo[g], x_lo);
          dot[g][t] = DotNibbles(dot[g][t], hi[g], x_hi);
          if constexpr (MT * NG > 1) KeepChain(dot[g][t]);
        }
      }
    }
    for (int g = 0; g < NG; ++g) {
      for (int t = 0; t < MT; ++t) dot[g][t] = WidenNibbles(dot[g][t]);
    }
  } else {
    // Signed weights through |w| * (x with w's sign); activations are never -128.
    for (int c = 0; c < 8; ++c) {
      __m256i v[NG], u[NG];
      for (int g = 0; g < NG; ++g) {
        v[g] = _mm256_load_si256(reinterpret_cast<const __m256i*>(codes[g] + 32 * c));
        u[g] = _mm256_sign_epi8(v[g], v[g]);
      }
      for (int t = 0; t < MT; ++t) {
        const __m256i x = Broadcast4(q[t] + 4 * c);
        for (int g = 0; g < NG; ++g) {
          dot[g][t] = DotBytes(dot[g][t], u[g], _mm256_sign_epi8(x, v[g]));
          if constexpr (MT * NG > 1) KeepChain(dot[g][t]);
        }
      }
    }
  }
}

// acc += dw * dx * dot with the block's offset: the codes are used unsigned, so a symmetric
// block adds dw * (-8 * s) (s = dx * sum of the activations; -8 s is exact) and an asymmetric
// one m * s.
template <class F>
HWY_INLINE void Accumulate(__m256i dot, float dx, float s, __m256 dw, __m256 mv, __m256& acc) {
  const __m256 dotf = _mm256_cvtepi32_ps(dot);
  if constexpr (F::kBytes) {
    (void)s, (void)mv;
    acc = _mm256_fmadd_ps(dw, _mm256_mul_ps(dotf, _mm256_set1_ps(dx)), acc);
  } else if constexpr (F::kMin) {
    acc = _mm256_fmadd_ps(dw, _mm256_mul_ps(dotf, _mm256_set1_ps(dx)), acc);
    acc = _mm256_fmadd_ps(mv, _mm256_set1_ps(s), acc);
  } else {
    (void)mv;
    acc = _mm256_fmadd_ps(dw, _mm256_fmadd_ps(dotf, _mm256_set1_ps(dx), _mm256_set1_ps(-8.0f * s)), acc);
  }
}

// How far ahead of the sub-block being multiplied the kernel asks for weight bytes. The hardware
// prefetcher stops at every 4 KiB page and needs a few misses to start again, which a decode step
// of many small matrices pays over and over; measured on SmolLM2 (matrices of 70-550 KB) and a
// 1B model, 1 KiB ahead beat 0.5, 1.5, 2 and 3 KiB (bench/README.md).
constexpr size_t kPrefetchBytes = 1024;

// Prefetches the sub-block's worth of bytes kPrefetchBytes ahead (past the end of the matrix is
// harmless: a prefetch never faults).
HWY_INLINE void PrefetchAhead(const uint8_t* codes, size_t sub_bytes) {
  for (size_t line = 0; line < sub_bytes; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(codes + kPrefetchBytes + line), _MM_HINT_T0);
  }
}

// NG consecutive 8-row groups (`group`: the first one's packed bytes, `group_bytes` apart)
// against tokens [m0, m0 + MT): y[t][r] for the first `stored` rows r (at most 8 NG), y pointing
// at the first group's first output of token m0.
template <class F, int MT, int NG>
HWY_NOINLINE void GroupTile(const uint8_t* group, size_t group_bytes, const QuantizedActs& x, int64_t m0, float* y,
                            int64_t ldy, int64_t stored, const Prefetch& pf) {
  constexpr packed::Layout L = F::kLayout;
  const uint8_t* pf_next = pf.begin;
  const int64_t nb = x.blocks();
  const uint8_t* codes[NG];
  const uint8_t* scales[NG];
  for (int g = 0; g < NG; ++g) {
    codes[g] = group + group_bytes * static_cast<size_t>(g);
    scales[g] = codes[g] + L.codes_bytes(x.k);
  }
  const int8_t* q[MT];
  const float *d[MT], *s[MT];
  __m256 acc[NG][MT];
  for (int t = 0; t < MT; ++t) {
    q[t] = x.q + (m0 + t) * x.k;
    d[t] = x.d + (m0 + t) * nb;
    s[t] = x.s + (m0 + t) * nb;
    for (int g = 0; g < NG; ++g) acc[g][t] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; b += F::kSubs) {
    __m256 dw[NG], mv[NG];
    for (int g = 0; g < NG; ++g) {
      dw[g] = LoadScales<F::kScale>(scales[g]);
      mv[g] = F::kMin ? LoadScales<F::kScale>(scales[g] + L.block_scale_bytes() / 2) : dw[g];
      scales[g] += L.block_scale_bytes();
    }
    for (int sub = 0; sub < F::kSubs; ++sub) {
      if (pf.begin == nullptr) {
        for (int g = 0; g < NG; ++g) PrefetchAhead(codes[g], L.sub_bytes());
      } else {
        for (int i = 0; i < pf.lines_per_sub && pf_next < pf.end; ++i, pf_next += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(pf_next), _MM_HINT_T0);
        }
      }
      const int8_t* qb[MT];
      for (int t = 0; t < MT; ++t) qb[t] = q[t] + (b + sub) * kActBlock;
      __m256i dot[NG][MT];
      SubDots<F, MT, NG>(codes, qb, dot);
      for (int g = 0; g < NG; ++g) {
        for (int t = 0; t < MT; ++t) Accumulate<F>(dot[g][t], d[t][b + sub], s[t][b + sub], dw[g], mv[g], acc[g][t]);
        codes[g] += L.sub_bytes();
      }
    }
  }
  for (int g = 0; g < NG; ++g) {
    const int64_t rows = std::min<int64_t>(kPackRows, stored - kPackRows * g);
    for (int t = 0; t < MT; ++t) {
      float* out = y + t * ldy + kPackRows * g;
      if (rows == kPackRows) {
        _mm256_storeu_ps(out, acc[g][t]);
      } else {
        alignas(32) float lanes[kPackRows];
        _mm256_store_ps(lanes, acc[g][t]);
        std::copy(lanes, lanes + rows, out);
      }
    }
  }
}

#else
// ---------------------------------------------------------------------------------------------
// Portable fallback (SSE4, SSSE3, emulation, other architectures): the same sums in scalar code.

template <ScaleType S>
HWY_INLINE float ScaleAt(const uint8_t* p, int r) {
  if constexpr (S == ScaleType::kF32) {
    float v;
    std::memcpy(&v, p + 4 * r, 4);
    return v;
  } else {
    uint16_t bits;
    std::memcpy(&bits, p + 2 * r, 2);
    if constexpr (S == ScaleType::kF16) return fp16_table()[bits];
    return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
  }
}

// Integer weight i (0..31) of row r in a packed sub-block: unsigned code, or Q8_0's signed byte.
template <class F>
HWY_INLINE int CodeAt(const uint8_t* codes, int r, int i) {
  if constexpr (F::kBytes) {
    return static_cast<int8_t>(codes[32 * (i / 4) + 4 * r + i % 4]);
  } else {
    const uint8_t byte = codes[32 * (i / 8) + 4 * r + i % 4];
    return i % 8 < 4 ? (byte & 0x0F) : (byte >> 4);
  }
}

template <class F, int MT, int NG>
HWY_NOINLINE void GroupTile(const uint8_t* groups, size_t group_bytes, const QuantizedActs& x, int64_t m0, float* y,
                            int64_t ldy, int64_t stored, const Prefetch&) {
  constexpr packed::Layout L = F::kLayout;
  const int64_t nb = x.blocks();
  for (int64_t row = 0; row < stored; ++row) {
    const uint8_t* group = groups + group_bytes * static_cast<size_t>(row / kPackRows);
    const int r = static_cast<int>(row % kPackRows);
    for (int t = 0; t < MT; ++t) {
      const int8_t* q = x.q + (m0 + t) * x.k;
      const float *d = x.d + (m0 + t) * nb, *s = x.s + (m0 + t) * nb;
      const uint8_t* codes = group;
      const uint8_t* scales = group + L.codes_bytes(x.k);
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; b += F::kSubs, scales += L.block_scale_bytes()) {
        const float dw = ScaleAt<F::kScale>(scales, r);
        const float mv = F::kMin ? ScaleAt<F::kScale>(scales + L.block_scale_bytes() / 2, r) : 0.0f;
        for (int sub = 0; sub < F::kSubs; ++sub, codes += L.sub_bytes()) {
          int32_t dot = 0;
          for (int i = 0; i < kActBlock; ++i) dot += CodeAt<F>(codes, r, i) * q[(b + sub) * kActBlock + i];
          const float dx = d[b + sub], sum = s[b + sub];
          if constexpr (F::kBytes) {
            acc += dw * (static_cast<float>(dot) * dx);
          } else if constexpr (F::kMin) {
            acc += dw * (static_cast<float>(dot) * dx) + mv * sum;
          } else {
            acc += dw * (static_cast<float>(dot) * dx - 8.0f * sum);
          }
        }
      }
      y[t * ldy + row] = acc;
    }
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// Groups of 8 rows, in pairs when there are several tokens, each against the tokens in tiles of
// up to kMaxTile: a group's codes (18 KiB for Q4_0 at K = 4096) stay in L1/L2 while the tiles
// pass over them, so memory gives each weight byte once per call. An output's sum depends on its
// row and token only, not on the pairing or the tiling.

// NG groups from `group` (rows from the output column y points at; `stored` of them) against
// every token, a tile at a time.
template <class F, int NG>
void TokenTiles(const uint8_t* group, size_t group_bytes, const QuantizedActs& x, int64_t n_tokens, float* y,
                int64_t ldy, int64_t stored) {
  const int64_t tiles = (n_tokens + kMaxTile - 1) / kMaxTile;
  const size_t span = group_bytes * NG, subs = static_cast<size_t>(x.k / kActBlock);
  for (int64_t i = 0; i < tiles; ++i) {
    const int64_t m0 = i * kMaxTile;
    Prefetch pf;
    if (tiles > 1) {
      const size_t share = (span + tiles - 1) / tiles;
      pf.begin = group + span + share * static_cast<size_t>(i);
      pf.end = pf.begin + share;
      pf.lines_per_sub = static_cast<int>((share / 64 + subs) / subs);
    }
    float* out = y + m0 * ldy;
    switch (std::min<int64_t>(kMaxTile, n_tokens - m0)) {
      case 1: GroupTile<F, 1, NG>(group, group_bytes, x, m0, out, ldy, stored, pf); break;
      case 2: GroupTile<F, 2, NG>(group, group_bytes, x, m0, out, ldy, stored, pf); break;
      case 3: GroupTile<F, 3, NG>(group, group_bytes, x, m0, out, ldy, stored, pf); break;
      default: GroupTile<F, 4, NG>(group, group_bytes, x, m0, out, ldy, stored, pf); break;
    }
  }
}

template <class F>
void GemmFmt(const PackedWeight& w, int64_t n_begin, int64_t n_end, const QuantizedActs& x, int64_t n_tokens,
             float* y, int64_t ldy) {
  // One token (decode's GEMV) streams one group at a time: it is bound by memory, not by the
  // broadcasts that a pair shares. Q8_0's bytes take twice the registers per chunk and a sign
  // per group and token, which leave a pair of groups nothing to gain (measured).
  for (int64_t n = n_begin; n < n_end;) {
    const uint8_t* group = w.group(n / kPackRows);
    const int64_t left = n_end - n;
    if constexpr (!F::kBytes) {
      if (n_tokens > 1 && left > kPackRows) {
        TokenTiles<F, 2>(group, w.group_bytes, x, n_tokens, y + n, ldy, std::min(2 * kPackRows, left));
        n += 2 * kPackRows;
        continue;
      }
    }
    TokenTiles<F, 1>(group, w.group_bytes, x, n_tokens, y + n, ldy, std::min(kPackRows, left));
    n += kPackRows;
  }
}

template <int G, bool Asym>
void GemmInt4(ScaleType scale, const PackedWeight& w, int64_t n_begin, int64_t n_end, const QuantizedActs& x,
              int64_t n_tokens, float* y, int64_t ldy) {
  switch (scale) {
    case ScaleType::kF16:
      return GemmFmt<Fmt<G, Asym, false, ScaleType::kF16>>(w, n_begin, n_end, x, n_tokens, y, ldy);
    case ScaleType::kBF16:
      return GemmFmt<Fmt<G, Asym, false, ScaleType::kBF16>>(w, n_begin, n_end, x, n_tokens, y, ldy);
    case ScaleType::kF32:
      return GemmFmt<Fmt<G, Asym, false, ScaleType::kF32>>(w, n_begin, n_end, x, n_tokens, y, ldy);
  }
}

void GemmPacked(const PackedWeight& w, int64_t n_begin, int64_t n_end, const QuantizedActs& x, int64_t n_tokens,
                float* y, int64_t ldy) {
  const std::optional<packed::Layout> l = packed::layout_of(w.type);
  if (!l) return;  // pack_int8 made it: never
  if (l->bytes) return GemmFmt<Fmt<32, false, true, ScaleType::kF16>>(w, n_begin, n_end, x, n_tokens, y, ldy);
  if (l->group == 128 && l->asym) return GemmInt4<128, true>(l->scale, w, n_begin, n_end, x, n_tokens, y, ldy);
  if (l->group == 128) return GemmInt4<128, false>(l->scale, w, n_begin, n_end, x, n_tokens, y, ldy);
  if (l->asym) return GemmInt4<32, true>(l->scale, w, n_begin, n_end, x, n_tokens, y, ldy);
  return GemmInt4<32, false>(l->scale, w, n_begin, n_end, x, n_tokens, y, ldy);
}

}  // namespace HWY_NAMESPACE
}  // namespace ringlm::cpu
#undef RINGLM_VNNI
#undef RINGLM_INLINE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ringlm::cpu {

HWY_EXPORT(GemmPacked);

namespace {

// One row's 32 nibble codes of a source sub-block (byte j: weight j low, weight j + 16 high)
// into a packed sub-block: chunk c's bytes j = 0..3 of the row take weight 8c + j low and
// 8c + 4 + j high. `dst` is the row's first byte in chunk 0; chunks are 32 bytes apart.
// In 64-bit words of 8 source bytes, x = the low (or high) nibbles: chunk bytes = x's bytes
// 0..3 with bytes 4..7 moved up a nibble, i.e. the low half of x | x >> 28 (x's top nibbles are 0).
void pack_nibbles(const uint8_t* src, uint8_t* dst) {
  constexpr uint64_t kLow = 0x0F0F0F0F0F0F0F0Full;
  const auto chunk = [](uint64_t x) { return static_cast<uint32_t>(x | x >> 28); };
  if constexpr (std::endian::native == std::endian::little) {
    uint64_t a, b;  // source bytes 0..7 (weights 0..7 and 16..23), 8..15 (8..15 and 24..31)
    std::memcpy(&a, src, 8);
    std::memcpy(&b, src + 8, 8);
    const uint32_t c[4] = {chunk(a & kLow), chunk(b & kLow), chunk(a >> 4 & kLow), chunk(b >> 4 & kLow)};
    for (int i = 0; i < 4; ++i) std::memcpy(dst + 32 * i, &c[i], 4);
  } else {
    uint8_t code[kActBlock];
    for (int j = 0; j < 16; ++j) {
      code[j] = src[j] & 0x0F;
      code[j + 16] = src[j] >> 4;
    }
    for (int c = 0; c < 4; ++c) {
      for (int j = 0; j < 4; ++j) dst[32 * c + j] = static_cast<uint8_t>(code[8 * c + j] | code[8 * c + 4 + j] << 4);
    }
  }
}

// A scale's bits (2 or 4 bytes), with constant-size copies: a memcpy of a run-time size would
// be a library call per block.
void copy_scale(uint8_t* dst, const uint8_t* src, size_t bytes) {
  if (bytes == 4) {
    std::memcpy(dst, src, 4);
  } else {
    std::memcpy(dst, src, 2);
  }
}

// Rows [8g, 8g + 8) into `dst` (group_bytes, zeroed: rows past the matrix stay zero, so their
// scales are 0 and their outputs, never stored, are finite).
void pack_group(const packed::Layout& l, const uint8_t* w, size_t row_stride, int64_t rows, int64_t cols, int64_t g,
                uint8_t* dst) {
  const size_t sb = l.scale_bytes();
  const int subs = l.group / static_cast<int>(kActBlock);
  uint8_t* scales = dst + l.codes_bytes(cols);
  for (int r = 0; r < kPackRows && g * kPackRows + r < rows; ++r) {
    const uint8_t* row = w + static_cast<size_t>(g * kPackRows + r) * row_stride;
    for (int64_t blk = 0; blk < cols / l.group; ++blk) {
      const uint8_t* src = row + static_cast<size_t>(blk) * l.source_block_bytes();
      uint8_t* block_scales = scales + static_cast<size_t>(blk) * l.block_scale_bytes();
      copy_scale(block_scales + sb * r, src, sb);
      if (l.asym) copy_scale(block_scales + sb * (kPackRows + r), src + sb, sb);
      const uint8_t* qs = src + sb * (l.asym ? 2 : 1);
      for (int sub = 0; sub < subs; ++sub) {
        uint8_t* codes = dst + static_cast<size_t>(blk * subs + sub) * l.sub_bytes() + 4 * r;
        if (l.bytes) {
          for (int c = 0; c < 8; ++c) std::memcpy(codes + 32 * c, qs + 4 * c, 4);
        } else {
          pack_nibbles(qs + sub * 16, codes);
        }
      }
    }
  }
}

}  // namespace

PackedWeight pack_int8(TensorType type, const uint8_t* w, size_t row_stride, int64_t rows, int64_t cols,
                       WeightArena* arena) {
  PackedWeight p;
  const std::optional<packed::Layout> l = packed::layout_of(type);
  if (!l || rows <= 0 || cols <= 0 || cols % l->group != 0) return p;  // callers check int8_supported()
  p.type = type;
  p.rows = rows;
  p.cols = cols;
  p.group_bytes = l->group_bytes(cols);
  p.data = arena != nullptr ? arena->allocate(p.bytes()) : allocate_weight_block(p.bytes());
  const int64_t groups = p.groups();
  uint8_t* base = p.data.get();
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups; ++g) {
    uint8_t* dst = base + p.group_bytes * static_cast<size_t>(g);
    std::memset(dst, 0, p.group_bytes);
    pack_group(*l, w, row_stride, rows, cols, g, dst);
  }
  return p;
}

void gemm_int8_packed(const PackedWeight& w, int64_t n_begin, int64_t n_end, const QuantizedActs& xq,
                      int64_t n_tokens, float* y, int64_t ldy) {
  HWY_DYNAMIC_DISPATCH(GemmPacked)(w, n_begin, n_end, xq, n_tokens, y, ldy);
}

}  // namespace ringlm::cpu
#endif  // HWY_ONCE
