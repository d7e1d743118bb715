// The products on packed weights (kernel_packed.h; the layout: packed_format.h). Compiled once
// per Highway target through foreach_target.h: AVX-512 targets hold a chunk of 16 rows in one
// 512-bit register, AVX2 in two 256-bit ones, other targets run the same sums in scalar code.
// HWY_ONCE holds the dispatching entry point.

// Also build the AVX-512 VNNI target (Highway 1.0.3 only does so on request).
#ifndef HWY_WANT_AVX3_DL
#define HWY_WANT_AVX3_DL
#endif
// SSSE3 and SSE4 would compile the same portable code as the baseline target (the x86 kernels
// below need AVX2): CPUs without AVX2 run the baseline's copy of it, and the build makes one copy
// instead of three.
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SSSE3 | HWY_SSE4)
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "backends/cpu/kernel_packed.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>
#include <bit>
#include <cstring>
#include <utility>
#include <vector>

#include "backends/cpu/kernel_packed.h"
#include "backends/cpu/packed_format.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace ringlm::cpu {
namespace HWY_NAMESPACE {

// Bytes of its own stream a single pass over a group asks for ahead of what it multiplies. The
// hardware prefetcher alone keeps too few lines in flight for one core to read at the memory's
// speed (the out-of-order window covers about 2 KB of a group), and it stops at every page.
// Measured on a 2-core AMD EPYC (Zen 5) with a Llama-2-7B decode step (bench_gemv_roofline):
// see bench/README.md.
constexpr size_t kPrefetchBytes = 16384;

// A single pass (one token tile) keeps a cursor kPrefetchBytes ahead of what it multiplies, in
// the call's stream of groups: `ahead` is where the previous group left it (the first group
// starts it at its own first byte, so a thread's first lines are asked for too). Several passes
// over the same group (several token tiles) share the prefetching of the next group instead:
// each asks for its share, spread over its sub-blocks (begin not null).
struct Prefetch {
  const uint8_t* begin = nullptr;
  const uint8_t* end = nullptr;
  int lines_per_sub = 0;
  const uint8_t** ahead = nullptr;
};

// The activations of one pass (quantize_acts.h, PassPlace), from its token t0 on: token t's
// unit u of 32 values at q + (u * width + t) * 32; block formats: the block's scale, dx * sum
// and integer sum at d, s, sum[u * width + t]; super formats: d[b * width + t] for 256-block b,
// the sums of unit u of 16 or 32 values at sum16, sum32[u * width + t].
struct PassActs {
  const int8_t* q = nullptr;
  const float* d = nullptr;
  const float* s = nullptr;
  const int32_t* sum = nullptr;
  const int32_t *sum16 = nullptr, *sum32 = nullptr;
  int64_t width = 1;
};

// A code book's least and largest values, read from the tables themselves (not through
// codebook_values: a constant expression may not compare a global's address under the sanitizers).
constexpr std::pair<int, int> codebook_range(CodeBook c) {
  int least = 127, largest = -128;
  for (int i = 0; i < 16; ++i) {
    const int v = c == CodeBook::kMxfp4 ? kMxfp4Values[i] : kIq4nlValues[i];
    least = std::min(least, v);
    largest = std::max(largest, v);
  }
  return {least, largest};
}

// A format as a kernel instantiation.
template <TensorType T>
struct Fmt {
  static constexpr PackedFormat F = *packed_format(T);
  // Weights that are signed values (Q8_0's bytes, IQ4's and MXFP4's code books) rather than
  // unsigned codes.
  static constexpr bool kSignedValues = F.codes == Codes::kBytes || F.has_codebook();
  // A code book's least and largest values.
  static constexpr int kBookLeast = F.has_codebook() ? codebook_range(F.codebook).first : 0;
  static constexpr int kBookLargest = F.has_codebook() ? codebook_range(F.codebook).second : 0;
  // Whether, without VNNI, the code book's values minus the least one (kBookLift = -least) are
  // small enough unsigned bytes for vpmaddubsw's int16 pair sums, 2 x 127 x (largest - least)
  // <= 32767: MXFP4's -12..12 are (0..24), IQ4's -127..113 are not. The lift comes off the dot
  // as kBookLift times the activations' sum, and a quad costs a vpmaddubsw and an add per token
  // where the sign trick for signed values costs two vpsignb, a vpmaddubsw, a vpmaddwd and an add.
  static constexpr bool kLiftedBook = F.has_codebook() && 2 * 127 * (kBookLargest - kBookLeast) <= 32767;
  static constexpr int kBookLift = kLiftedBook ? -kBookLeast : 0;
  // The largest unsigned code, for the int16 sums of vpmaddubsw.
  static constexpr int kMaxCode = kLiftedBook                    ? kBookLargest + kBookLift
                                  : F.codes == Codes::kNib4Hb1   ? 31
                                  : F.codes == Codes::kNib4Hb2   ? 63
                                  : F.codes == Codes::kCrumb2    ? 3
                                  : F.codes == Codes::kCrumb2Hb1 ? 7
                                                                 : 15;
};

// Up to this many tokens share one pass over a group's codes (on AVX-512 the block formats and
// the super formats with a scale per 32: 8, see kTileFor).
constexpr int kMaxTile = 4;

#if HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// =============================================================================================
// x86: a "vector" is the 16 rows' lanes, one 512-bit register or two 256-bit ones.

#define RINGLM_INLINE __attribute__((always_inline))

// Calls f.template operator()<t>() for t = 0 .. N-1, unrolled at compile time, so that the tiles'
// per-token arrays are indexed by constants only and GCC keeps them in registers. Indexed by a loop
// variable (even one GCC unrolls later), they stayed in memory, and every element was stored back
// on each pass of the loop over the weights: GCC does not move stores out of a loop that holds an
// asm reading memory (vpdpbusd's broadcast operand) or a prefetch. That cost 5% of the Q4_0 prompt
// products on Zen 5; it halved the F32 kernel's rate.
template <int N, class F>
RINGLM_INLINE inline void ForTokens(F&& f) {
  [&]<int... T>(std::integer_sequence<int, T...>) RINGLM_INLINE { (f.template operator()<T>(), ...); }(std::make_integer_sequence<int, N>{});
}

#if HWY_TARGET == HWY_AVX3_DL
#define RINGLM_VNNI 1
#else
#define RINGLM_VNNI 0
#endif

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
struct VI {
  __m512i v;
};
struct VF {
  __m512 v;
};
HWY_INLINE VI LoadI(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
HWY_INLINE VI ZeroI() { return {_mm512_setzero_si512()}; }
HWY_INLINE VI Set8(char c) { return {_mm512_set1_epi8(c)}; }
HWY_INLINE VI Set32(int32_t c) { return {_mm512_set1_epi32(c)}; }
HWY_INLINE VI And(VI a, VI b) { return {_mm512_and_si512(a.v, b.v)}; }
HWY_INLINE VI Or(VI a, VI b) { return {_mm512_or_si512(a.v, b.v)}; }
HWY_INLINE VI Xor(VI a, VI b) { return {_mm512_xor_si512(a.v, b.v)}; }
HWY_INLINE VI Add32(VI a, VI b) { return {_mm512_add_epi32(a.v, b.v)}; }
HWY_INLINE VI Sub32(VI a, VI b) { return {_mm512_sub_epi32(a.v, b.v)}; }
HWY_INLINE VI MulLo32(VI a, VI b) { return {_mm512_mullo_epi32(a.v, b.v)}; }
template <int N>
HWY_INLINE VI Srli32(VI a) {
  return {_mm512_srli_epi32(a.v, N)};
}
// Shifts the 16-bit lanes left by N (right by -N); callers mask the bits they keep.
template <int N>
HWY_INLINE VI Shift16(VI a) {
  if constexpr (N > 0) return {_mm512_slli_epi16(a.v, N)};
  if constexpr (N < 0) return {_mm512_srli_epi16(a.v, -N)};
  return a;
}
// 16 bytes of a 16-row field as int32 lanes.
HWY_INLINE VI LoadU8I32(const uint8_t* p) { return {_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
HWY_INLINE VI LoadS8I32(const uint8_t* p) { return {_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
// Bytes looked up in a 16-entry table (the table repeated in every 128-bit lane).
HWY_INLINE VI LoadTable(const int8_t* t) {
  return {_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)))};
}
HWY_INLINE VI Lookup(VI table, VI idx) { return {_mm512_shuffle_epi8(table.v, idx.v)}; }
#if RINGLM_VNNI
// int32 lanes += the sum over each lane's 4 bytes of u (unsigned) * s (signed). In asm: Highway
// 1.0.3's AVX3_DL target enables GCC's "avxvnni" (the VEX form) but not "avx512vnni", so the
// intrinsic does not compile there; the 512-bit form only exists as EVEX, which Zen 4, Ice Lake
// and later run.
HWY_INLINE VI DotU(VI acc, VI u, VI s) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc.v) : "v"(u.v), "v"(s.v));
  return acc;
}
HWY_INLINE VI WidenU(VI acc) { return acc; }
#else
// int16 lanes += pairs of u * s; WidenU sums the pairs into int32 lanes.
HWY_INLINE VI DotU(VI acc, VI u, VI s) { return {_mm512_add_epi16(acc.v, _mm512_maddubs_epi16(u.v, s.v))}; }
HWY_INLINE VI WidenU(VI acc) { return {_mm512_madd_epi16(acc.v, _mm512_set1_epi16(1))}; }
// int32 lanes += signed w * signed x through |w| * (x with w's sign); x is never -128.
HWY_INLINE VI DotS(VI acc, VI w, VI x) {
  const __m512i s = _mm512_mask_sub_epi8(x.v, _mm512_movepi8_mask(w.v), _mm512_setzero_si512(), x.v);
  const __m512i pairs = _mm512_maddubs_epi16(_mm512_abs_epi8(w.v), s);
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)))};
}
#endif
HWY_INLINE VF ZeroF() { return {_mm512_setzero_ps()}; }
HWY_INLINE VF Set1F(float f) { return {_mm512_set1_ps(f)}; }
HWY_INLINE VF Cvt(VI a) { return {_mm512_cvtepi32_ps(a.v)}; }
HWY_INLINE VF Mul(VF a, VF b) { return {_mm512_mul_ps(a.v, b.v)}; }
HWY_INLINE VF AddF(VF a, VF b) { return {_mm512_add_ps(a.v, b.v)}; }
HWY_INLINE VF Fma(VF a, VF b, VF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
HWY_INLINE VF LoadHalf(const uint8_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
HWY_INLINE VF LoadBf16(const uint8_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};  // bf16 is the top half of fp32
}
HWY_INLINE VF LoadF32(const uint8_t* p) { return {_mm512_loadu_ps(p)}; }
HWY_INLINE void StoreF(float* p, VF v, int64_t n) {
  if (n >= 16) {
    _mm512_storeu_ps(p, v.v);
  } else {
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v.v);
  }
}
#else  // AVX2: lanes 0-7 (rows 0-7) in a, lanes 8-15 in b
struct VI {
  __m256i a, b;
};
struct VF {
  __m256 a, b;
};
HWY_INLINE VI LoadI(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
HWY_INLINE VI ZeroI() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
HWY_INLINE VI Set8(char c) { return {_mm256_set1_epi8(c), _mm256_set1_epi8(c)}; }
HWY_INLINE VI Set32(int32_t c) { return {_mm256_set1_epi32(c), _mm256_set1_epi32(c)}; }
HWY_INLINE VI And(VI x, VI y) { return {_mm256_and_si256(x.a, y.a), _mm256_and_si256(x.b, y.b)}; }
HWY_INLINE VI Or(VI x, VI y) { return {_mm256_or_si256(x.a, y.a), _mm256_or_si256(x.b, y.b)}; }
HWY_INLINE VI Xor(VI x, VI y) { return {_mm256_xor_si256(x.a, y.a), _mm256_xor_si256(x.b, y.b)}; }
HWY_INLINE VI Add32(VI x, VI y) { return {_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)}; }
HWY_INLINE VI Sub32(VI x, VI y) { return {_mm256_sub_epi32(x.a, y.a), _mm256_sub_epi32(x.b, y.b)}; }
HWY_INLINE VI MulLo32(VI x, VI y) { return {_mm256_mullo_epi32(x.a, y.a), _mm256_mullo_epi32(x.b, y.b)}; }
template <int N>
HWY_INLINE VI Srli32(VI x) {
  return {_mm256_srli_epi32(x.a, N), _mm256_srli_epi32(x.b, N)};
}
template <int N>
HWY_INLINE VI Shift16(VI x) {
  if constexpr (N > 0) return {_mm256_slli_epi16(x.a, N), _mm256_slli_epi16(x.b, N)};
  if constexpr (N < 0) return {_mm256_srli_epi16(x.a, -N), _mm256_srli_epi16(x.b, -N)};
  return x;
}
HWY_INLINE __m128i Load8Bytes(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
HWY_INLINE VI LoadU8I32(const uint8_t* p) { return {_mm256_cvtepu8_epi32(Load8Bytes(p)), _mm256_cvtepu8_epi32(Load8Bytes(p + 8))}; }
HWY_INLINE VI LoadS8I32(const uint8_t* p) { return {_mm256_cvtepi8_epi32(Load8Bytes(p)), _mm256_cvtepi8_epi32(Load8Bytes(p + 8))}; }
HWY_INLINE VI LoadTable(const int8_t* t) {
  const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)));
  return {v, v};
}
HWY_INLINE VI Lookup(VI table, VI idx) { return {_mm256_shuffle_epi8(table.a, idx.a), _mm256_shuffle_epi8(table.b, idx.b)}; }
// int16 lanes += pairs of u * s; WidenU sums the pairs into int32 lanes.
HWY_INLINE VI DotU(VI acc, VI u, VI s) {
  return {_mm256_add_epi16(acc.a, _mm256_maddubs_epi16(u.a, s.a)), _mm256_add_epi16(acc.b, _mm256_maddubs_epi16(u.b, s.b))};
}
HWY_INLINE VI WidenU(VI acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  return {_mm256_madd_epi16(acc.a, ones), _mm256_madd_epi16(acc.b, ones)};
}
// int32 lanes += signed w * signed x through |w| * (x with w's sign); x is never -128.
HWY_INLINE __m256i DotS1(__m256i acc, __m256i w, __m256i x) {
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
HWY_INLINE VI DotS(VI acc, VI w, VI x) { return {DotS1(acc.a, w.a, x.a), DotS1(acc.b, w.b, x.b)}; }
HWY_INLINE VF ZeroF() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
HWY_INLINE VF Set1F(float f) { return {_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
HWY_INLINE VF Cvt(VI x) { return {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
HWY_INLINE VF Mul(VF x, VF y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
HWY_INLINE VF AddF(VF x, VF y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
HWY_INLINE VF Fma(VF x, VF y, VF z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
HWY_INLINE VF LoadHalf(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
HWY_INLINE __m256 Bf16x8(const uint8_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));  // bf16 is the top half of fp32
}
HWY_INLINE VF LoadBf16(const uint8_t* p) { return {Bf16x8(p), Bf16x8(p + 16)}; }
HWY_INLINE VF LoadF32(const uint8_t* p) {
  return {_mm256_loadu_ps(reinterpret_cast<const float*>(p)), _mm256_loadu_ps(reinterpret_cast<const float*>(p + 32))};
}
HWY_INLINE void StoreF(float* p, VF v, int64_t n) {
  if (n >= 16) {
    _mm256_storeu_ps(p, v.a);
    _mm256_storeu_ps(p + 8, v.b);
    return;
  }
  alignas(32) float lanes[16];
  _mm256_store_ps(lanes, v.a);
  _mm256_store_ps(lanes + 8, v.b);
  std::copy(lanes, lanes + n, p);
}
#endif

// 4 activation bytes in every lane: what each row's 4 codes of a quad meet.
HWY_INLINE VI Bcast4(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return Set32(v);
}

// A block's scales (or mins) of the 16 rows in fp32.
template <ScaleType S>
HWY_INLINE VF LoadScales(const uint8_t* p) {
  if constexpr (S == ScaleType::kF32) return LoadF32(p);
  if constexpr (S == ScaleType::kBF16) return LoadBf16(p);
  return LoadHalf(p);
}

// Ends the compiler's freedom to reassociate a running integer sum: GCC otherwise turns a
// sub-block's chain of additions per token into a tree over all the products at once, which for
// several tokens needs more registers than there are and spills most of them.
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
HWY_INLINE void KeepChain(VI& x) { asm("" : "+v"(x.v)); }
#else
HWY_INLINE void KeepChain(VI& x) { asm("" : "+x"(x.a), "+x"(x.b)); }
#endif

// The bits of a code plane moved to bit position `To` from `From`, masked to `Bits` bits.
template <int From, int To, int Bits>
HWY_INLINE VI PlaneBits(VI plane) {
  return And(Shift16<To - From>(plane), Set8(static_cast<char>(((1 << Bits) - 1) << To)));
}

// The codes of quads 2P and 2P+1 of a sub-block, as the bytes the dot products take: unsigned
// codes, or for signed values (Q8_0, IQ4) their bytes, made unsigned (+128) on VNNI.
template <class Fm, int P>
HWY_INLINE void DecodePair(const uint8_t* sub, VI table, VI& q0, VI& q1) {
  constexpr PackedFormat F = Fm::F;
  constexpr Codes C = F.codes;
  if constexpr (C == Codes::kNib4 || C == Codes::kNib4Hb1 || C == Codes::kNib4Hb2) {
    const VI v = LoadI(sub + kChunkBytes * P);
    q0 = And(v, Set8(0x0F));
    q1 = And(Shift16<-4>(v), Set8(0x0F));
    if constexpr (C == Codes::kNib4Hb1) {  // bit 2c+h of the fifth-bit plane is quad 2c+h's bit 4
      const VI hb = LoadI(sub + 4 * kChunkBytes);
      q0 = Or(q0, PlaneBits<2 * P, 4, 1>(hb));
      q1 = Or(q1, PlaneBits<2 * P + 1, 4, 1>(hb));
    }
    if constexpr (C == Codes::kNib4Hb2) {  // bits 2k, 2k+1 of plane e are quad 4e+k's bits 4-5
      const VI hb = LoadI(sub + (4 + P / 2) * kChunkBytes);
      q0 = Or(q0, PlaneBits<2 * ((2 * P) % 4), 4, 2>(hb));
      q1 = Or(q1, PlaneBits<2 * ((2 * P + 1) % 4), 4, 2>(hb));
    }
    if constexpr (F.has_codebook()) {
      q0 = Lookup(table, q0);
      q1 = Lookup(table, q1);
    }
  } else if constexpr (C == Codes::kCrumb2 || C == Codes::kCrumb2Hb1) {
    const VI v = LoadI(sub + kChunkBytes * (P / 2));
    constexpr int k0 = 2 * (P % 2);  // quads 4c+k, k = k0, k0+1
    q0 = PlaneBits<2 * k0, 0, 2>(v);
    q1 = PlaneBits<2 * k0 + 2, 0, 2>(v);
    if constexpr (C == Codes::kCrumb2Hb1) {  // bit i of the third-bit plane is quad i's bit 2
      const VI hb = LoadI(sub + 2 * kChunkBytes);
      q0 = Or(q0, PlaneBits<2 * P, 2, 1>(hb));
      q1 = Or(q1, PlaneBits<2 * P + 1, 2, 1>(hb));
    }
  } else {  // Q8_0's signed bytes
    q0 = LoadI(sub + kChunkBytes * (2 * P));
    q1 = LoadI(sub + kChunkBytes * (2 * P + 1));
#if RINGLM_VNNI
    q0 = Xor(q0, Set8(static_cast<char>(0x80)));
    q1 = Xor(q1, Set8(static_cast<char>(0x80)));
#endif
  }
}

// What the kernel subtracts per unit of activation sum: the code offset, 128 where signed values
// were made unsigned for vpdpbusd, or a code book's lift without VNNI (Fmt::kLiftedBook).
template <class Fm>
constexpr int kOffset = (Fm::kSignedValues && RINGLM_VNNI) ? 128 : Fm::kLiftedBook ? Fm::kBookLift : Fm::F.offset;
// Whether the products use the sign trick on signed values (not VNNI) rather than unsigned codes.
template <class Fm>
constexpr bool kSignTrick = Fm::kSignedValues && !RINGLM_VNNI && !Fm::kLiftedBook;

// The table a code book format looks its codes up in: its values plus kOffset (on VNNI 128,
// unsigned bytes for vpdpbusd; without, the lift of a narrow book, else the values themselves).
template <class Fm>
HWY_INLINE VI CodeTable() {
  if constexpr (Fm::F.has_codebook()) {
    const int8_t* values = codebook_values(Fm::F.codebook);
    alignas(16) int8_t t[16];
    for (int i = 0; i < 16; ++i) t[i] = static_cast<int8_t>(values[i] + kOffset<Fm>);
    return LoadTable(t);
  }
  return ZeroI();
}

// Quads whose vpmaddubsw pairs an int16 lane can sum before widening: each pair is at most
// 2 * 127 * max code. A power of two dividing 4 where sub-blocks are 16 weights.
template <class Fm>
constexpr int kWidenEvery = [] {
  if (RINGLM_VNNI) return Fm::F.sub == 16 ? 4 : 8;
  int n = 8;
  while (n > 1 && n * 2 * 127 * Fm::kMaxCode > 32767) n /= 2;
  return Fm::F.sub == 16 ? std::min(n, 4) : n;
}();

// Independent chains of dot products per token: a chain of vpdpbusd (or vpmaddubsw + add)
// waits on itself, about 4 cycles a step, so one token with one chain leaves the core mostly
// idle; a pair of quads per chain at one token, and the tokens themselves as chains from 4 on.
template <int MT>
constexpr int kChains = MT >= 4 ? 1 : MT >= 2 ? 2 : 4;

// DotU against the 4 activation bytes at q, broadcast to every lane. On VNNI the broadcast is
// the instruction's own memory operand ({1to16}): one micro-op less per quad and token.
HWY_INLINE VI DotUQuad(VI acc, VI u, const int8_t* q) {
#if RINGLM_VNNI
  using Quad = int32_t __attribute__((may_alias, aligned(1)));
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc.v) : "v"(u.v), "m"(*reinterpret_cast<const Quad*>(q)));
  return acc;
#else
  return DotU(acc, u, Bcast4(q));
#endif
}

// The sum of two partial dots as DotU / DotS left them (int16 pairs without VNNI, else int32).
template <class Fm>
HWY_INLINE VI AddDots(VI a, VI b) {
#if RINGLM_VNNI
  return Add32(a, b);
#else
  if constexpr (kSignTrick<Fm>) return Add32(a, b);
#if HWY_TARGET == HWY_AVX3
  return {_mm512_add_epi16(a.v, b.v)};
#else
  return {_mm256_add_epi16(a.a, b.a), _mm256_add_epi16(a.b, b.b)};
#endif
#endif
}

// The integer dots of one sub-block of 32 weights (16 rows) with MT tokens (token t's 32
// activations at q + t * stride). idot[t][h]: the dot of half h (weights 16h..16h+15) for
// formats whose sub-block scales cover 16 weights, else idot[t][0] over all 32. Quads outside, tokens inside: each code
// vector is decoded once for all the tokens.
template <class Fm, int MT>
HWY_INLINE void SubDots(const uint8_t* sub, const int8_t* q, int64_t stride, VI table, VI (*idot)[2]) {
  constexpr int kWiden = kWidenEvery<Fm>;
  constexpr int kC = kChains<MT>;
  VI acc[kC][MT];
  for (int t = 0; t < MT; ++t) {
    for (int c = 0; c < kC; ++c) acc[c][t] = ZeroI();
    idot[t][0] = ZeroI();
    idot[t][1] = ZeroI();
  }
  const auto pair = [&]<int P>(std::integral_constant<int, P>) RINGLM_INLINE {
    VI c0, c1;
    DecodePair<Fm, P>(sub, table, c0, c1);
    constexpr int c = P % kC;
    for (int t = 0; t < MT; ++t) {
      if constexpr (kSignTrick<Fm>) {
        acc[c][t] = DotS(DotS(acc[c][t], c0, Bcast4(q + t * stride + 8 * P)), c1, Bcast4(q + t * stride + 8 * P + 4));
      } else {
        acc[c][t] = DotUQuad(DotUQuad(acc[c][t], c0, q + t * stride + 8 * P), c1, q + t * stride + 8 * P + 4);
      }
      if constexpr (MT > 1) KeepChain(acc[c][t]);
    }
    constexpr int done = 2 * P + 2;  // quads summed so far
    if constexpr (done % kWiden == 0) {  // (the chains' int16 sums together stay within kWiden quads)
      constexpr int h = Fm::F.sub == 16 && done > 4 ? 1 : 0;
      for (int t = 0; t < MT; ++t) {
        VI sum = acc[0][t];
        for (int k = 1; k < kC; ++k) sum = AddDots<Fm>(sum, acc[k][t]);
        idot[t][h] = Add32(idot[t][h], kSignTrick<Fm> ? sum : WidenU(sum));
        for (int k = 0; k < kC; ++k) acc[k][t] = ZeroI();
      }
    }
  };
  pair(std::integral_constant<int, 0>{});
  pair(std::integral_constant<int, 1>{});
  pair(std::integral_constant<int, 2>{});
  pair(std::integral_constant<int, 3>{});
}

// Issues the software prefetches of a pass (see kPrefetchBytes and Prefetch).
class Prefetcher {
 public:
  Prefetcher(const Prefetch& pf, const uint8_t* group)
      : pf_(pf), next_(pf.begin ? pf.begin : std::max(*pf.ahead, group)) {}
  ~Prefetcher() {
    if (pf_.begin == nullptr) *pf_.ahead = next_;
  }
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;
  // Called before each sub-block, `pos` the first byte after it.
  HWY_INLINE void Advance(const uint8_t* pos) {
    if (pf_.begin == nullptr) {
      for (; next_ < pos + kPrefetchBytes; next_ += 64) _mm_prefetch(reinterpret_cast<const char*>(next_), _MM_HINT_T0);
    } else {
      for (int i = 0; i < pf_.lines_per_sub && next_ < pf_.end; ++i, next_ += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(next_), _MM_HINT_T0);
      }
    }
  }

 private:
  const Prefetch& pf_;
  const uint8_t* next_;
};

// One 16-row group of a block format against the MT tokens of a pass: per sub-block of 32,
// acc += dw * (dx * dot), and min * s for a format with mins. Where the stored codes carry an
// offset (unsigned codes of a symmetric format; signed values made unsigned for VNNI), the integer
// dot loses offset * sum first: one integer add per token, where a float term cost two operations
// on the multiply pipes that vpdpbusd needs. One loop over the blocks (a K-block's header holds
// one or two blocks' scales, a short last K-block a full header): GCC allocates registers worse
// across the nested loops of K-blocks and blocks.
template <class Fm, int MT>
HWY_NOINLINE void BlockTile(const uint8_t* group, int64_t cols, const PassActs& x, float* y, int64_t ldy,
                            int64_t stored, const Prefetch& pf) {
  constexpr PackedFormat F = Fm::F;
  constexpr int kOff = kOffset<Fm>;
  constexpr int kSubs = F.group / static_cast<int>(kSubWeights);  // sub-blocks per block
  constexpr int kPerK = F.kblock / F.group;                         // blocks per K-block: 1 or 2
  constexpr size_t kBlockCodes = static_cast<size_t>(kSubs) * F.sub_code_bytes();
  constexpr size_t kKStride = F.header_bytes + kPerK * kBlockCodes;
  static_assert(F.header_bytes_for(F.group) == F.header_bytes, "a short last K-block has a full header");
  static_assert(!F.min || kPerK == 1, "the mins follow the one block's scales");
  const int64_t n_blocks = cols / F.group;
  const VI table = CodeTable<Fm>();
  VF acc[MT];
  ForTokens<MT>([&]<int t>() RINGLM_INLINE { acc[t] = ZeroF(); });
  Prefetcher prefetch(pf, group);
  const int8_t* q = x.q;
  const float *d = x.d, *sums = x.s;
  const int32_t* isums = x.sum;
  for (int64_t j = 0; j < n_blocks; ++j) {
    const int b = kPerK == 1 ? 0 : static_cast<int>(j % kPerK);
    const uint8_t* header = group + static_cast<size_t>(j / kPerK) * kKStride;
    const uint8_t* p = header + F.header_bytes + static_cast<size_t>(b) * kBlockCodes;
    const VF dw = LoadScales<F.scale>(header + static_cast<size_t>(b) * kPackRows * F.value_bytes());
    VF mv = dw;
    if constexpr (F.min) mv = LoadScales<F.scale>(header + kPackRows * F.value_bytes());
    for (int s = 0; s < kSubs; ++s, p += F.sub_code_bytes()) {
      prefetch.Advance(p + F.sub_code_bytes());
      VI idot[MT][2];
      SubDots<Fm, MT>(p, q, kActBlock, table, idot);
      ForTokens<MT>([&]<int t>() RINGLM_INLINE {
        VI idot_t = idot[t][0];
        if constexpr (kOff != 0) idot_t = Add32(idot_t, Set32(-kOff * isums[t]));
        acc[t] = Fma(dw, Mul(Cvt(idot_t), Set1F(d[t])), acc[t]);
        if constexpr (F.min) acc[t] = Fma(mv, Set1F(sums[t]), acc[t]);
      });
      q += x.width * kActBlock;
      d += x.width;
      sums += x.width;
      isums += x.width;
    }
  }
  ForTokens<MT>([&]<int t>() RINGLM_INLINE { StoreF(y + t * ldy, acc[t], stored); });
}

// One 16-row group of a super format (K-quants, IQ4_XS): per 256 weights, the sub-block scales
// multiply the integer dots in integers, isum = sum_j sc_j * dot_j, and the mins (or the code
// offset times the scales) meet the activations' integer sums, imin = sum_j m_j * sum_j(x);
// then acc += d * dx * isum - dmin * dx * imin (offset formats: d * dx * (isum - offset * imin)).
template <class Fm, int MT>
HWY_NOINLINE void SuperTile(const uint8_t* group, int64_t cols, const PassActs& x, float* y, int64_t ldy,
                            int64_t stored, const Prefetch& pf) {
  constexpr PackedFormat F = Fm::F;
  constexpr int kOff = kOffset<Fm>;
  constexpr int kHalves = static_cast<int>(kSubWeights) / F.sub;  // sub-block scales per 32 weights
  constexpr bool kSums = F.min || kOff != 0;                      // imin needed
  constexpr bool kMinsApart = F.sub == 32;
  const int64_t nb = cols / kSuperBlock;
  const VI table = CodeTable<Fm>();
  VF acc[MT];
  ForTokens<MT>([&]<int t>() RINGLM_INLINE { acc[t] = ZeroF(); });
  Prefetcher prefetch(pf, group);
  const uint8_t* p = group;
  for (int64_t kb = 0; kb < nb; ++kb) {
    const uint8_t* header = p;
    p += F.header_bytes;
    VI isum[MT], imin[MT];
    ForTokens<MT>([&]<int t>() RINGLM_INLINE { isum[t] = imin[t] = ZeroI(); });
    for (int s = 0; s < 8; ++s, p += F.sub_code_bytes()) {
      prefetch.Advance(p + F.sub_code_bytes());
      VI idot[MT][2];
      SubDots<Fm, MT>(p, x.q + (kb * 8 + s) * x.width * kSubWeights, kSubWeights, table, idot);
      for (int h = 0; h < kHalves; ++h) {
        const int j = s * kHalves + h;
        const uint8_t* sc_bytes = header + F.scales_offset() + static_cast<size_t>(j) * kPackRows;
        VI sc = F.signed_scales ? LoadS8I32(sc_bytes) : LoadU8I32(sc_bytes);
        VI m = sc;
        if constexpr (F.nibble_scale_min) {
          m = Srli32<4>(sc);
          sc = And(sc, Set32(0x0F));
        } else if constexpr (F.min) {
          if constexpr (!kMinsApart) m = LoadU8I32(header + F.mins_offset() + static_cast<size_t>(j) * kPackRows);
        }
        ForTokens<MT>([&]<int t>() RINGLM_INLINE {
          isum[t] = Add32(isum[t], MulLo32(sc, idot[t][h]));
          if constexpr (kSums && !kMinsApart) {
            const int32_t* sums = F.sub == 16 ? x.sum16 : x.sum32;
            imin[t] = Add32(imin[t], MulLo32(m, Set32(sums[(kb * kHalves * 8 + j) * x.width + t])));
          }
        });
      }
    }
    // Formats with a scale per 32 (8-token passes): the mins (or the offset times the scales)
    // against the tokens' sums apart from the dots, whose registers they would need as well. (The
    // formats with scales per 16, 4-token passes, ran 7% slower so.)
    if constexpr (kSums && kMinsApart) {
      for (int j = 0; j < 8 * kHalves; ++j) {
        const uint8_t* sc_bytes = header + F.scales_offset() + static_cast<size_t>(j) * kPackRows;
        VI m = F.signed_scales ? LoadS8I32(sc_bytes) : LoadU8I32(sc_bytes);
        if constexpr (F.nibble_scale_min) {
          m = Srli32<4>(m);
        } else if constexpr (F.min) {
          m = LoadU8I32(header + F.mins_offset() + static_cast<size_t>(j) * kPackRows);
        }
        const int32_t* sums = (F.sub == 16 ? x.sum16 : x.sum32) + (kb * kHalves * 8 + j) * x.width;
        ForTokens<MT>([&]<int t>() RINGLM_INLINE { imin[t] = Add32(imin[t], MulLo32(m, Set32(sums[t]))); });
      }
    }
    const VF d = LoadHalf(header);
    ForTokens<MT>([&]<int t>() RINGLM_INLINE {
      const float dx = x.d[kb * x.width + t];
      if constexpr (F.min) {
        const VF dmin = LoadHalf(header + 32);
        acc[t] = Fma(Mul(d, Set1F(dx)), Cvt(isum[t]), acc[t]);
        acc[t] = Fma(Mul(dmin, Set1F(-dx)), Cvt(imin[t]), acc[t]);
      } else {
        if constexpr (kOff != 0) isum[t] = Sub32(isum[t], MulLo32(imin[t], Set32(kOff)));
        acc[t] = Fma(Mul(d, Set1F(dx)), Cvt(isum[t]), acc[t]);
      }
    });
  }
  ForTokens<MT>([&]<int t>() RINGLM_INLINE { StoreF(y + t * ldy, acc[t], stored); });
}

template <Codes C>
HWY_INLINE VF LoadWeights(const uint8_t* p) {
  if constexpr (C == Codes::kFloat) return LoadF32(p);
  if constexpr (C == Codes::kBf16) return LoadBf16(p);
  return LoadHalf(p);
}

// One 16-row group of F32/F16/BF16 weights against fp32 rows (x: cols apart): per weight k, the
// 16 rows' values times x[k] broadcast, in two chains (even and odd k) so that the multiply-adds
// of one token do not wait on each other.
template <class Fm, int MT>
HWY_NOINLINE void FloatTile(const uint8_t* group, int64_t cols, const float* x, int64_t m0, float* y, int64_t ldy,
                            int64_t stored, const Prefetch& pf) {
  constexpr PackedFormat F = Fm::F;
  constexpr size_t kStride = kPackRows * (F.codes == Codes::kFloat ? 4 : 2);  // bytes per weight k
  VF even[MT], odd[MT];
  ForTokens<MT>([&]<int t>() RINGLM_INLINE { even[t] = odd[t] = ZeroF(); });
  Prefetcher prefetch(pf, group);
  const uint8_t* p = group;
  for (int64_t k0 = 0; k0 < cols; k0 += kSubWeights) {
    prefetch.Advance(p + kSubWeights * kStride);
    for (int64_t k = k0; k < k0 + kSubWeights; k += 2, p += 2 * kStride) {
      const VF w0 = LoadWeights<F.codes>(p), w1 = LoadWeights<F.codes>(p + kStride);
      ForTokens<MT>([&]<int t>() RINGLM_INLINE {
        const float* xt = x + (m0 + t) * cols + k;
        even[t] = Fma(w0, Set1F(xt[0]), even[t]);
        odd[t] = Fma(w1, Set1F(xt[1]), odd[t]);
      });
    }
  }
  ForTokens<MT>([&]<int t>() RINGLM_INLINE { StoreF(y + t * ldy, AddF(even[t], odd[t]), stored); });
}

#else
// =============================================================================================
// Portable fallback (the baseline target: x86 without AVX2, other architectures): the same sums
// in scalar code, read through packed_format.h's accessors.

template <ScaleType S>
HWY_INLINE float ScaleAt(const uint8_t* p, int r) {
  uint32_t bits = 0;
  std::memcpy(&bits, p + (S == ScaleType::kF32 ? 4 : 2) * r, S == ScaleType::kF32 ? 4 : 2);
  if constexpr (S == ScaleType::kF32) return std::bit_cast<float>(bits);
  if constexpr (S == ScaleType::kBF16) return bf16_to_fp32(static_cast<bf16_bits>(bits));
  return fp16_to_fp32(static_cast<f16_bits>(bits));
}

// The signed integer weight of a code: code - offset, Q8_0's byte, or the code book's value.
template <class Fm>
HWY_INLINE int WeightOf(int code) {
  if constexpr (Fm::F.codes == Codes::kBytes) return static_cast<int8_t>(code);
  if constexpr (Fm::F.has_codebook()) return codebook_values(Fm::F.codebook)[code];
  return code - Fm::F.offset;
}

// A sub-block's signed weights, decoded once for every token of the tile: w[r][i] for row r.
// (Plain nibbles and bytes, the most common codes, are read a byte at a time; the others through
// code_at.)
template <class Fm>
HWY_INLINE void DecodeSub(const uint8_t* sub, int64_t stored, int8_t (*w)[kSubWeights]) {
  constexpr Codes C = Fm::F.codes;
  for (int r = 0; r < stored; ++r) {
    for (int chunk = 0; chunk < (C == Codes::kNib4 ? 4 : C == Codes::kBytes ? 8 : 0); ++chunk) {
      for (int j = 0; j < 4; ++j) {
        const int byte = sub[chunk_byte(static_cast<size_t>(chunk), r, j)];
        if constexpr (C == Codes::kNib4) {  // quads 2 chunk and 2 chunk + 1
          w[r][8 * chunk + j] = static_cast<int8_t>(WeightOf<Fm>(byte & 0x0F));
          w[r][8 * chunk + 4 + j] = static_cast<int8_t>(WeightOf<Fm>(byte >> 4));
        } else {  // quad `chunk`
          w[r][4 * chunk + j] = static_cast<int8_t>(WeightOf<Fm>(byte));
        }
      }
    }
    if constexpr (C != Codes::kNib4 && C != Codes::kBytes) {
      for (int i = 0; i < static_cast<int>(kSubWeights); ++i) w[r][i] = static_cast<int8_t>(WeightOf<Fm>(code_at(C, sub, r, i)));
    }
  }
}

// Integer dot of n weights with n activations.
HWY_INLINE int32_t Dot(const int8_t* w, const int8_t* q, int n) {
  int32_t dot = 0;
  for (int i = 0; i < n; ++i) dot += w[i] * q[i];
  return dot;
}

// The group's sub-blocks are decoded one at a time into w, then met by every row and token;
// each output sums its blocks in order, as the x86 kernels do.
template <class Fm, int MT>
HWY_NOINLINE void BlockTile(const uint8_t* group, int64_t cols, const PassActs& x, float* y, int64_t ldy,
                            int64_t stored, const Prefetch&) {
  constexpr PackedFormat F = Fm::F;
  float acc[MT][kPackRows] = {};
  int8_t w[kPackRows][kSubWeights];
  const uint8_t* p = group;
  for (int64_t k0 = 0; k0 < cols; k0 += F.kblock) {
    const int64_t n = std::min<int64_t>(F.kblock, cols - k0);
    const uint8_t* header = p;
    p += F.header_bytes_for(n);
    const int blocks = static_cast<int>(n / F.group);
    for (int b = 0; b < blocks; ++b) {
      for (int s = 0; s < F.group / static_cast<int>(kSubWeights); ++s, p += F.sub_code_bytes()) {
        DecodeSub<Fm>(p, stored, w);
        const int64_t ab = (k0 + b * F.group) / kActBlock + s;
        for (int r = 0; r < stored; ++r) {
          const float dw = ScaleAt<F.scale>(header + static_cast<size_t>(b) * kPackRows * F.value_bytes(), r);
          float mv = 0.0f;
          if constexpr (F.min) mv = ScaleAt<F.scale>(header + static_cast<size_t>(blocks + b) * kPackRows * F.value_bytes(), r);
          for (int t = 0; t < MT; ++t) {
            const int64_t at = ab * x.width + t;
            const int32_t dot = Dot(w[r], x.q + at * kActBlock, static_cast<int>(kSubWeights));
            acc[t][r] += dw * (static_cast<float>(dot) * x.d[at]);
            if constexpr (F.min) acc[t][r] += mv * x.s[at];
          }
        }
      }
    }
  }
  for (int t = 0; t < MT; ++t) std::copy(acc[t], acc[t] + stored, y + t * ldy);
}

template <class Fm, int MT>
HWY_NOINLINE void SuperTile(const uint8_t* group, int64_t cols, const PassActs& x, float* y, int64_t ldy,
                            int64_t stored, const Prefetch&) {
  constexpr PackedFormat F = Fm::F;
  constexpr int kHalves = static_cast<int>(kSubWeights) / F.sub;  // sub-block scales per 32 weights
  const int64_t nb = cols / kSuperBlock;
  float acc[MT][kPackRows] = {};
  int8_t w[kPackRows][kSubWeights];
  const uint8_t* p = group;
  for (int64_t kb = 0; kb < nb; ++kb) {
    const uint8_t* header = p;
    p += F.header_bytes;
    int32_t isum[MT][kPackRows] = {}, imin[MT][kPackRows] = {};
    for (int s = 0; s < 8; ++s, p += F.sub_code_bytes()) {
      DecodeSub<Fm>(p, stored, w);
      for (int r = 0; r < stored; ++r) {
        for (int t = 0; t < MT; ++t) {
          const int8_t* q = x.q + ((kb * 8 + s) * x.width + t) * kSubWeights;
          for (int h = 0; h < kHalves; ++h) {
            const int j = s * kHalves + h;
            const SubScale sm = sub_scale_at(F, header, j, r);
            isum[t][r] += sm.scale * Dot(w[r] + h * F.sub, q + h * F.sub, F.sub);
            const int32_t sum = F.sub == 16 ? x.sum16[(kb * 16 + j) * x.width + t] : x.sum32[(kb * 8 + j) * x.width + t];
            imin[t][r] += sm.min * sum;
          }
        }
      }
    }
    for (int r = 0; r < stored; ++r) {
      uint16_t d, dmin = 0;
      std::memcpy(&d, header + 2 * r, 2);
      if (F.min) std::memcpy(&dmin, header + 32 + 2 * r, 2);
      for (int t = 0; t < MT; ++t) {
        const float dx = x.d[kb * x.width + t];
        acc[t][r] += fp16_to_fp32(d) * dx * static_cast<float>(isum[t][r]) -
                     fp16_to_fp32(dmin) * dx * static_cast<float>(imin[t][r]);
      }
    }
  }
  for (int t = 0; t < MT; ++t) std::copy(acc[t], acc[t] + stored, y + t * ldy);
}

template <class Fm, int MT>
HWY_NOINLINE void FloatTile(const uint8_t* group, int64_t cols, const float* x, int64_t m0, float* y, int64_t ldy,
                            int64_t stored, const Prefetch&) {
  constexpr Codes C = Fm::F.codes;
  constexpr size_t vb = C == Codes::kFloat ? 4 : 2;
  for (int r = 0; r < stored; ++r) {
    for (int t = 0; t < MT; ++t) {
      float even = 0.0f, odd = 0.0f;
      for (int64_t k = 0; k < cols; ++k) {
        uint32_t bits = 0;
        std::memcpy(&bits, group + (static_cast<size_t>(k) * kPackRows + static_cast<size_t>(r)) * vb, vb);
        const float w = C == Codes::kFloat  ? std::bit_cast<float>(bits)
                        : C == Codes::kHalf ? fp16_to_fp32(static_cast<f16_bits>(bits))
                                            : bf16_to_fp32(static_cast<bf16_bits>(bits));
        (k % 2 == 0 ? even : odd) += w * x[(m0 + t) * cols + k];
      }
      y[t * ldy + r] = even + odd;
    }
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// Groups against every token, a pass of up to 8 tokens at a time: a group's bytes (36 KiB for
// Q4_0 at K = 4096) stay in L1/L2 while the passes go over them, so memory gives each weight
// byte once per call. A block format's pass reads its tokens' activations laid out side by side
// (PackedInput::passes): one stream instead of one per token, which measured 20-30% faster on
// prompt products (bench/README.md). An output's sum depends on its row and token only, not on
// the passes.

// The tile function of a format: one pass over a group for tokens [m0, m0 + MT) (block and
// super formats: the tokens of `pass`).
template <class Fm, int MT>
HWY_INLINE void Tile(const uint8_t* group, int64_t cols, const PackedInput& x, const PassActs& pass, int64_t m0,
                     float* y, int64_t ldy, int64_t stored, const Prefetch& pf) {
  if constexpr (Fm::F.acts == ActKind::kBlock32) {
    BlockTile<Fm, MT>(group, cols, pass, y, ldy, stored, pf);
  } else if constexpr (Fm::F.acts == ActKind::kSuper256) {
    SuperTile<Fm, MT>(group, cols, pass, y, ldy, stored, pf);
  } else {
    FloatTile<Fm, MT>(group, cols, x.f32, m0, y, ldy, stored, pf);
  }
}

// Tokens per pass of a format: 8 where 32 vector registers hold a block format's 8 integer
// and 8 float accumulators (AVX-512), or a super format's 8 sums, 8 dots and 8 float
// accumulators (sub-block scales per 32: one dot per token), so that a sub-block's codes,
// decoded once, serve twice the tokens; 4 otherwise.
template <class Fm>
constexpr int kTileFor =
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
    Fm::F.acts == ActKind::kBlock32 || (Fm::F.acts == ActKind::kSuper256 && Fm::F.sub == 32) ? 8 : kMaxTile;
#else
    kMaxTile;
#endif

// The activations laid out for the passes: the input's own (one token's are its rows), else a
// copy this thread makes (callers that did not lay them out: tests, benchmarks).
QuantizedActs PassLayout(const PackedInput& x, int64_t n_tokens) {
  if (n_tokens == 1) return x.block;
  if (x.passes.q != nullptr) return x.passes;
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d, s;
  thread_local std::vector<int32_t> sum;
  const auto size = static_cast<size_t>(n_tokens * x.block.k);
  if (q.size() < size) q.resize(size);
  if (d.size() < size / kActBlock) d.resize(size / kActBlock), s.resize(size / kActBlock), sum.resize(size / kActBlock);
  const QuantizedActs out{q.data(), d.data(), s.data(), sum.data(), x.block.k};
  for (int64_t m = 0; m < n_tokens; ++m) lay_out_for_passes(x.block, m, n_tokens, out);
  return out;
}
SuperActs SuperPassLayout(const PackedInput& x, int64_t n_tokens) {
  if (n_tokens == 1) return x.super;
  if (x.super_passes.q != nullptr) return x.super_passes;
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d;
  thread_local std::vector<int32_t> sum16, sum32;
  const auto size = static_cast<size_t>(n_tokens * x.super.k);
  if (q.size() < size) q.resize(size);
  if (d.size() < size / kSuperBlock) d.resize(size / kSuperBlock);
  if (sum16.size() < size / 16) sum16.resize(size / 16), sum32.resize(size / 32);
  const SuperActs out{q.data(), d.data(), sum16.data(), sum32.data(), x.super.k};
  for (int64_t m = 0; m < n_tokens; ++m) lay_out_for_passes(x.super, m, n_tokens, out);
  return out;
}

template <class Fm>
void GemmFmt(const PackedWeight& w, int64_t n_begin, int64_t n_end, const PackedInput& x, int64_t n_tokens, float* y,
             int64_t ldy) {
  constexpr int64_t kTile = kTileFor<Fm>;
  constexpr bool kBlock = Fm::F.acts == ActKind::kBlock32, kSuper = Fm::F.acts == ActKind::kSuper256;
  // Block and super formats: the passes of pass_size tokens (quantize_acts.h), each in calls of
  // at most kTile; the float formats: calls of kTile tokens.
  const int64_t size = kBlock || kSuper ? pass_size(n_tokens) : kTile;
  QuantizedActs passes;
  SuperActs super_passes;
  if constexpr (kBlock) passes = PassLayout(x, n_tokens);
  if constexpr (kSuper) super_passes = SuperPassLayout(x, n_tokens);
  const int64_t n32 = w.cols / kActBlock;
  int64_t calls = 0;
  for (int64_t m0 = 0; m0 < n_tokens; m0 += size) calls += (std::min(size, n_tokens - m0) + kTile - 1) / kTile;
  const size_t subs = static_cast<size_t>(std::max<int64_t>(1, w.cols / kSubWeights));
  const uint8_t* ahead = w.group(n_begin / kPackRows);  // single passes' prefetch cursor
  for (int64_t n = n_begin; n < n_end; n += kPackRows) {
    const uint8_t* group = w.group(n / kPackRows);
    const int64_t stored = std::min(kPackRows, n_end - n);
    int64_t i = 0;  // the call over this group
    for (int64_t m0 = 0; m0 < n_tokens; m0 += size) {
      const int64_t width = std::min(size, n_tokens - m0);
      for (int64_t t0 = 0; t0 < width; t0 += kTile, ++i) {
        PassActs pass;
        pass.width = width;
        if constexpr (kBlock) {
          pass.q = passes.q + (m0 * w.cols + t0 * kActBlock);
          pass.d = passes.d + (m0 * n32 + t0);
          pass.s = passes.s + (m0 * n32 + t0);
          pass.sum = passes.sum + (m0 * n32 + t0);
        }
        if constexpr (kSuper) {
          pass.q = super_passes.q + (m0 * w.cols + t0 * kActBlock);
          pass.d = super_passes.d + (m0 * (w.cols / kSuperBlock) + t0);
          pass.sum16 = super_passes.sum16 + (m0 * (w.cols / 16) + t0);
          pass.sum32 = super_passes.sum32 + (m0 * n32 + t0);
        }
        Prefetch pf;
        pf.ahead = &ahead;
#if HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
        if (calls > 1) {  // the calls share the prefetching of the next group
          const size_t share = (w.group_bytes + static_cast<size_t>(calls) - 1) / static_cast<size_t>(calls);
          pf.begin = group + w.group_bytes + share * static_cast<size_t>(i);
          pf.end = pf.begin + share;
          pf.lines_per_sub = static_cast<int>((share / 64 + subs) / subs);
        }
#else
        (void)subs;
#endif
        const int64_t m = m0 + t0;
        float* out = y + m * ldy + n;
        switch (std::min(kTile, width - t0)) {
          case 1: Tile<Fm, 1>(group, w.cols, x, pass, m, out, ldy, stored, pf); break;
          case 2: Tile<Fm, 2>(group, w.cols, x, pass, m, out, ldy, stored, pf); break;
          case 3: Tile<Fm, 3>(group, w.cols, x, pass, m, out, ldy, stored, pf); break;
          case 4: Tile<Fm, 4>(group, w.cols, x, pass, m, out, ldy, stored, pf); break;
          default:
            if constexpr (kTile == 8) {
              switch (width - t0) {
                case 5: Tile<Fm, 5>(group, w.cols, x, pass, m, out, ldy, stored, pf); break;
                case 6: Tile<Fm, 6>(group, w.cols, x, pass, m, out, ldy, stored, pf); break;
                case 7: Tile<Fm, 7>(group, w.cols, x, pass, m, out, ldy, stored, pf); break;
                default: Tile<Fm, 8>(group, w.cols, x, pass, m, out, ldy, stored, pf); break;
              }
            }
        }
      }
    }
  }
}

// Every type the packed kernels run, by id.
template <TensorType... Ts>
struct TypeList {};
using AllTypes =
    TypeList<TensorType::F32, TensorType::F16, TensorType::BF16, TensorType::Q4_0, TensorType::Q4_1, TensorType::Q5_0,
             TensorType::Q5_1, TensorType::Q8_0, TensorType::IQ4_NL, TensorType::MXFP4, TensorType::Q2_K, TensorType::Q3_K,
             TensorType::Q4_K, TensorType::Q5_K, TensorType::Q6_K, TensorType::IQ4_XS,
             static_cast<TensorType>(kInt4TypeBase + 0), static_cast<TensorType>(kInt4TypeBase + 1),
             static_cast<TensorType>(kInt4TypeBase + 2), static_cast<TensorType>(kInt4TypeBase + 3),
             static_cast<TensorType>(kInt4TypeBase + 4), static_cast<TensorType>(kInt4TypeBase + 5),
             static_cast<TensorType>(kInt4TypeBase + 6), static_cast<TensorType>(kInt4TypeBase + 7),
             static_cast<TensorType>(kInt4TypeBase + 8), static_cast<TensorType>(kInt4TypeBase + 9),
             static_cast<TensorType>(kInt4TypeBase + 10), static_cast<TensorType>(kInt4TypeBase + 11)>;

template <TensorType... Ts>
void Dispatch(TypeList<Ts...>, const PackedWeight& w, int64_t n_begin, int64_t n_end, const PackedInput& x,
              int64_t n_tokens, float* y, int64_t ldy) {
  // Exactly one type matches; pack_weight made nothing else.
  ((w.type == Ts ? GemmFmt<Fmt<Ts>>(w, n_begin, n_end, x, n_tokens, y, ldy) : void()), ...);
}

void GemmPacked(const PackedWeight& w, int64_t n_begin, int64_t n_end, const PackedInput& x, int64_t n_tokens,
                float* y, int64_t ldy) {
  Dispatch(AllTypes{}, w, n_begin, n_end, x, n_tokens, y, ldy);
}

}  // namespace HWY_NAMESPACE
}  // namespace ringlm::cpu
#undef RINGLM_VNNI
#undef RINGLM_INLINE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ringlm::cpu {

HWY_EXPORT(GemmPacked);

void gemm_packed(const PackedWeight& w, int64_t n_begin, int64_t n_end, const PackedInput& x, int64_t n_tokens,
                 float* y, int64_t ldy) {
  HWY_DYNAMIC_DISPATCH(GemmPacked)(w, n_begin, n_end, x, n_tokens, y, ldy);
}

}  // namespace ringlm::cpu
#endif  // HWY_ONCE
