// Tiled causal attention (see attention.h). The kernels are compiled per Highway target; the
// tiling and the scheduling are plain code below HWY_ONCE.

// Also build the AVX-512 VNNI target (Highway 1.0.3 only does so on request): q8_0 keys are
// scored there with int8 queries (ScoreRowsQ8Int8).
#ifndef HWY_WANT_AVX3_DL
#define HWY_WANT_AVX3_DL
#endif
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "backends/cpu/attention.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>
#include <cstring>
#include <cmath>
#include <type_traits>

#include "backends/cpu/attention.h"
#include "quant/formats.h"
#include "quant/quantize.h"
#include "hwy/cache_control.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace ringlm::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// s[j] = exp(s[j] - shift) for j < n, masked scores (-inf) to 0; returns the sum.
HWY_INLINE float ExpShiftedRow(float* s, int64_t n, float shift) {
  const hn::ScalableTag<float> d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  const auto vshift = hn::Set(d, shift);
  const auto masked = hn::Set(d, -INFINITY);
  auto vsum = hn::Zero(d);
  int64_t j = 0;
  for (; j + lanes <= n; j += lanes) {
    const auto v = hn::LoadU(d, s + j);
    const auto e = hn::IfThenZeroElse(hn::Eq(v, masked), hn::Exp(d, hn::Sub(v, vshift)));
    hn::StoreU(e, d, s + j);
    vsum = hn::Add(vsum, e);
  }
  float sum = hn::GetLane(hn::SumOfLanes(d, vsum));
  for (; j < n; ++j) {
    s[j] = s[j] == -INFINITY ? 0.0f : std::exp(s[j] - shift);
    sum += s[j];
  }
  return sum;
}

// One row of a score block, masked scores set to -inf. Raises the running max *m to cover the
// visible ones, replaces them by exp(s - max) and the masked ones by 0, and returns the sum of
// the exponentials (0, with *m unchanged, when the whole row is masked).
float SoftmaxBlockRow(float* s, int64_t n, float* m) {
  // Causal masks leave the masked scores at the end of a row of an in-order cache: only the
  // visible prefix needs exponentials.
  const int64_t n_all = n;
  while (n > 0 && s[n - 1] == -INFINITY) s[--n] = 0.0f;
  float row_max = *m;
  for (int64_t j = 0; j < n; ++j) row_max = std::max(row_max, s[j]);
  if (row_max == -INFINITY) {
    std::fill(s, s + n_all, 0.0f);
    return 0.0f;
  }
  *m = row_max;
  return ExpShiftedRow(s, n, row_max);
}

// One row of a score block against a fixed max phi (FlashDecoding++'s unified max): replaces
// the scores by exp(s - phi), masked (-inf) ones by 0, and returns their sum. *block_max gets the
// largest score, for the caller's range check.
float ExpBlockRow(float* s, int64_t n, float phi, float* block_max) {
  const hn::ScalableTag<float> d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  auto vmax = hn::Set(d, -INFINITY);
  int64_t j = 0;
  for (; j + lanes <= n; j += lanes) vmax = hn::Max(vmax, hn::LoadU(d, s + j));
  float mx = hn::GetLane(hn::MaxOfLanes(d, vmax));
  for (; j < n; ++j) mx = std::max(mx, s[j]);
  *block_max = mx;
  return ExpShiftedRow(s, n, phi);
}

// Keys (values) a conversion asks for ahead of the one it converts. A sequence's head is a
// short strided stream (tens of keys, a few hundred bytes apart) that the hardware prefetcher
// barely starts on before it ends, and that the weights streamed through since the last step
// have pushed out of the caches: a miss costs about as much as converting 10-20 keys.
constexpr int kPrefetchKeys = 16;

#include "backends/cpu/f16_rows-inl.h"  // IWYU pragma: keep

HWY_INLINE void PrefetchRow(const uint16_t* row, int n) {
  const auto* bytes = reinterpret_cast<const char*>(row);
  for (size_t line = 0; line < n * sizeof(uint16_t); line += 64) hwy::Prefetch(bytes + line);
}

// k_out[j][0 .. n) = k[j * stride + 0 .. n) as fp32 for j < rows, and the same for v: a block
// of fp16 keys and values of one head, converted once for all the query rows that meet it.
// Both streams are prefetched from the start, so the values are on their way while the keys
// are converted. A side whose output is nullptr is left alone (a checking pass's scores are
// taken before its values are needed).
void F16KvRowsToF32(const uint16_t* k, const uint16_t* v, int64_t stride, int rows, int n, float* k_out,
                    float* v_out) {
  const auto prefetch = [&](int j) {
    if (k_out != nullptr) PrefetchRow(k + j * stride, n);
    if (v_out != nullptr) PrefetchRow(v + j * stride, n);
  };
  for (int j = 0; j < std::min(rows, kPrefetchKeys); ++j) prefetch(j);
  for (int j = 0; j < rows; ++j) {
    if (j + kPrefetchKeys < rows) prefetch(j + kPrefetchKeys);
    if (k_out != nullptr) F16RowToF32(k + j * stride, n, k_out + static_cast<int64_t>(j) * n);
  }
  for (int j = 0; v_out != nullptr && j < rows; ++j) F16RowToF32(v + j * stride, n, v_out + static_cast<int64_t>(j) * n);
}

// A vector of a cache row's elements as fp32: loaded (fp32) or loaded and widened (fp16, exact).
template <class D>
HWY_INLINE hn::Vec<D> LoadKv(D d, const float* p) {
  return hn::LoadU(d, p);
}
template <class D>
HWY_INLINE hn::Vec<D> LoadKv(D d, const uint16_t* p) {
  const hn::Rebind<hwy::float16_t, D> dh;
  return hn::PromoteTo(d, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(p)));
}
HWY_INLINE float KvValue(float x) { return x; }
HWY_INLINE float KvValue(uint16_t x) { return fp16_to_fp32(x); }

// Rows of a q8_0 or q4_0 cache (blocks of an fp16 scale and 32 codes of 8 or 4 bits: 34 or 18
// bytes) as the kernels read them, like a pointer to elements: `blocks` at a block's start (a
// head's slice of a row is one: head sizes are multiples of 32), `at` elements on. Vectors of up
// to 16 lanes at multiples of the lanes stay within a block, and (q4_0) within one half of it:
// element e of a q4_0 block is the low nibble of byte e, element e + 16 the high one.
template <int kBits>
struct BlockElements {
  static constexpr int kBlockBytes = 2 + 32 * kBits / 8;
  const uint8_t* blocks = nullptr;
  int64_t at = 0;  // < 32: whole blocks are folded into `blocks`

  BlockElements operator+(int64_t n) const {
    const auto total = static_cast<uint64_t>(at + n);
    return {blocks + total / 32 * kBlockBytes, static_cast<int64_t>(total % 32)};
  }
  const uint8_t* block() const { return blocks; }
  const uint8_t* codes() const { return blocks + 2; }
  // The block's scale, widened by the hardware where it can (F16C).
  float scale() const {
    const hn::CappedTag<hwy::float16_t, 1> dh;
    const hn::CappedTag<float, 1> df;
    return hn::GetLane(hn::PromoteTo(df, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(block()))));
  }
  int code(int64_t e) const {
    if constexpr (kBits == 8) return static_cast<int8_t>(codes()[e]);
    return (e < 16 ? codes()[e] & 15 : codes()[e - 16] >> 4) - 8;
  }
  float operator[](int64_t n) const {
    const BlockElements e = *this + n;
    return e.scale() * static_cast<float>(e.code(e.at));
  }
};
using Q8Elements = BlockElements<8>;
using Q4Elements = BlockElements<4>;

// Element c of a row on: the row's pointer moved by c (fp32, fp16), or for rows of blocks the
// block of c found by a shift, the row and c at multiples of the lanes.
template <class D, class T>
HWY_INLINE hn::Vec<D> LoadKvAt(D d, const T* row, int c) {
  return LoadKv(d, row + c);
}

// A vector of q8_0 or q4_0 codes (the elements over their block's scale) as fp32.
template <class D>
HWY_INLINE hn::Vec<D> LoadCodes(D d, Q8Elements p) {
  const hn::Rebind<int8_t, D> d8;
  const hn::Rebind<int32_t, D> d32;
  const auto* codes = reinterpret_cast<const int8_t*>(p.codes() + p.at);
  return hn::ConvertTo(d, hn::PromoteTo(d32, hn::LoadU(d8, codes)));
}
template <class D>
HWY_INLINE hn::Vec<D> LoadCodes(D d, Q4Elements p) {
  const hn::Rebind<uint8_t, D> d8;
  const hn::Rebind<int32_t, D> d32;
  const auto bytes = hn::PromoteTo(d32, hn::LoadU(d8, p.codes() + p.at % 16));
  const auto nibbles = p.at < 16 ? hn::And(bytes, hn::Set(d32, 15)) : hn::ShiftRight<4>(bytes);
  return hn::ConvertTo(d, hn::Sub(nibbles, hn::Set(d32, 8)));
}
// A vector of q8_0 or q4_0 elements as fp32: the codes widened, times their block's scale (exact
// for the products: code * scale is what the cache holds).
template <class D, int kBits>
HWY_INLINE hn::Vec<D> LoadKv(D d, BlockElements<kBits> p) {
  return hn::Mul(LoadCodes(d, p), hn::Set(d, p.scale()));
}
template <class D, int kBits>
HWY_INLINE hn::Vec<D> LoadKvAt(D d, BlockElements<kBits> row, int c) {
  const auto at = static_cast<unsigned>(row.at + c);
  return LoadKv(d, BlockElements<kBits>{row.blocks + at / 32 * BlockElements<kBits>::kBlockBytes,
                                        static_cast<int64_t>(at % 32)});
}

// The lanes of a float vector of this target, known when compiling (x86 and the emulated
// targets: 1 to 16).
constexpr int kFloatLanes = static_cast<int>(HWY_LANES(float));

// Rows of q8_0 or q4_0 blocks (a head's slice of each of `rows` rows, `stride` elements apart) as
// fp32 rows of n (a multiple of 32): the prefill tiles' gather, exact (code times scale).
template <int kBits>
HWY_INLINE void BlockKvRowsToF32Of(const uint8_t* k, int64_t stride, int rows, int n, float* out) {
  const hn::ScalableTag<float> d;
  const int lanes = static_cast<int>(hn::Lanes(d));
  const BlockElements<kBits> first{k, 0};
  for (int j = 0; j < rows; ++j) {
    const BlockElements<kBits> row = first + j * stride;
    float* dst = out + static_cast<int64_t>(j) * n;
    int c = 0;
    for (; c + lanes <= n; c += lanes) hn::StoreU(LoadKvAt(d, row, c), d, dst + c);
    for (; c < n; ++c) dst[c] = row[c];
  }
}
void Q8KvRowsToF32(const uint8_t* k, int64_t stride, int rows, int n, float* out) {
  BlockKvRowsToF32Of<8>(k, stride, rows, n, out);
}
void Q4KvRowsToF32(const uint8_t* k, int64_t stride, int rows, int n, float* out) {
  BlockKvRowsToF32Of<4>(k, stride, rows, n, out);
}

// A vector of KIVI's 2-bit codes (quant/kivi.h: element e in bits 2 (e % 4) of byte e / 4) as
// floats, from element e on: the lanes' bytes (at most 4: 16 lanes) read as one word, each lane
// shifting out its own two bits.
template <class D>
HWY_INLINE hn::Vec<D> KiviCodes(D d, const uint8_t* codes, int e) {
  const hn::RebindToSigned<D> di;
  const int lanes = static_cast<int>(hn::Lanes(d));
  static_assert(HWY_LANES(float) <= 16, "a vector's codes fit a 32-bit word");
  uint32_t word = 0;
  std::memcpy(&word, codes + e / 4, static_cast<size_t>(std::max(1, lanes / 4)));
  const auto shifts = hn::Add(hn::ShiftLeft<1>(hn::Iota(di, 0)), hn::Set(di, 2 * (e % 4)));
  // (an arithmetic shift: the copies of bit 31 it brings in lie above the two bits kept)
  return hn::ConvertTo(d, hn::And(hn::Shr(hn::Set(di, static_cast<int32_t>(word)), shifts), hn::Set(di, 3)));
}

// out[e] = min[e] + codes(e) * scale[e] for the n elements (a multiple of 4) of one row.
HWY_INLINE void KiviRowToF32(const uint8_t* codes, const float* scale, const float* min, int n, float* out) {
  const hn::ScalableTag<float> d;
  const int lanes = static_cast<int>(hn::Lanes(d));
  for (int e = 0; e < n; e += lanes) {
    hn::StoreU(hn::MulAdd(KiviCodes(d, codes, e), hn::LoadU(d, scale + e), hn::LoadU(d, min + e)), d, out + e);
  }
}

// `rows` KIVI key rows of one group (a head's codes from `codes`, rows code_ld bytes apart) as
// fp32 rows of n: each channel's grid, scale[e] and min[e].
void KiviKeysToF32(const uint8_t* codes, int64_t code_ld, int rows, const float* scale, const float* min, int n,
                   float* out) {
  for (int j = 0; j < rows; ++j) KiviRowToF32(codes + j * code_ld, scale, min, n, out + static_cast<int64_t>(j) * n);
}

// The same for a value block: one scale and min for all its elements.
HWY_INLINE void KiviBlockToF32(const uint8_t* codes, float scale, float min, int n, float* out) {
  const hn::ScalableTag<float> d;
  const int lanes = static_cast<int>(hn::Lanes(d));
  const auto step = hn::Set(d, scale), base = hn::Set(d, min);
  for (int e = 0; e < n; e += lanes) hn::StoreU(hn::MulAdd(KiviCodes(d, codes, e), step, base), d, out + e);
}

// `rows` KIVI value rows (row_bytes apart) as fp32 rows of n: elements [first, first + n) of
// each (first and n multiples of kKiviValueBlock), each block on its own grid.
void KiviValuesToF32(const uint8_t* values, int64_t row_bytes, int rows, int first, int n, float* out) {
  constexpr int kBlockBytes = 4 + kKiviValueBlock / 4;
  for (int j = 0; j < rows; ++j) {
    for (int b = 0; b < n / kKiviValueBlock; ++b) {
      const uint8_t* block = values + j * row_bytes + (first / kKiviValueBlock + b) * kBlockBytes;
      uint16_t scale16, min16;
      std::memcpy(&scale16, block, 2);
      std::memcpy(&min16, block + 2, 2);
      KiviBlockToF32(block + 4, KvValue(scale16), KvValue(min16), kKiviValueBlock,
                     out + static_cast<int64_t>(j) * n + b * kKiviValueBlock);
    }
  }
}



// Lane i of SumLanesOfEach's result holds the sum of vector BitReversed(i)'s lanes: the bits
// of i reversed (each level below puts one vector's sums in the lower, the other's in the upper
// part of the part it halves).
constexpr int BitReversed(int i, int lanes) {
  int r = 0;
  for (int bit = 1; bit < lanes; bit <<= 1) r = (r << 1) | ((i & bit) != 0 ? 1 : 0);
  return r;
}

// SetTableIndices' table that puts SumLanesOfEach's sums back in the vectors' order.
struct BitReversedLanes {
  int32_t lane[kFloatLanes] = {};
  constexpr BitReversedLanes() {
    for (int i = 0; i < kFloatLanes; ++i) lane[i] = BitReversed(i, kFloatLanes);
  }
};

// The sums of the lanes of kFloatLanes vectors v[i] at once (an AVX-512 register's 16 dot
// products finished together), in lane BitReversed(i) of the result. Each level adds two
// vectors' halves (then 128-bit blocks, pairs, lanes) into one: a blend and a shuffle per pair
// of vectors, about one shuffle per sum, against four for a sum of one vector's lanes. Each sum
// adds only its own vector's lanes, in a fixed order: a vector's sum is the same whatever the
// other vectors.
template <class D>
HWY_INLINE hn::Vec<D> SumLanesOfEach(D d, hn::Vec<D>* v) {
#if HWY_TARGET != HWY_SCALAR
  const hn::Repartition<uint64_t, D> d64;
  // [a.lo + a.hi | b.hi + b.lo]
  const auto halves = [d](hn::Vec<D> a, hn::Vec<D> b) {
    return hn::Add(hn::ConcatUpperLower(d, b, a), hn::ConcatLowerUpper(d, b, a));
  };
  // per 128-bit block pair: [u.b0 + u.b1, w.b1 + w.b0]
  const auto blocks = [](hn::Vec<D> u, hn::Vec<D> w) {
    return hn::Add(hn::OddEvenBlocks(w, u), hn::SwapAdjacentBlocks(hn::OddEvenBlocks(u, w)));
  };
  // per block: [x.q0 + x.q1, y.q1 + y.q0] (q: 64-bit pairs of lanes)
  const auto pairs = [d, d64](hn::Vec<D> x, hn::Vec<D> y) {
    const auto x64 = hn::BitCast(d64, x), y64 = hn::BitCast(d64, y);
    return hn::Add(hn::BitCast(d, hn::OddEven(y64, x64)), hn::BitCast(d, hn::Shuffle01(hn::OddEven(x64, y64))));
  };
  // [s0 + s1, t1 + t0, ...]
  const auto lanes = [](hn::Vec<D> s, hn::Vec<D> t) {
    return hn::Add(hn::OddEven(t, s), hn::Shuffle2301(hn::OddEven(s, t)));
  };
  // Each level with a constant count (unrolled: the vectors stay in registers).
  const auto level = [v](auto n, auto combine) {
    for (int i = 0; i < decltype(n)::value / 2; ++i) v[i] = combine(v[2 * i], v[2 * i + 1]);
  };
  using N16 = std::integral_constant<int, 16>;
  using N8 = std::integral_constant<int, 8>;
  using N4 = std::integral_constant<int, 4>;
  using N2 = std::integral_constant<int, 2>;
  if constexpr (kFloatLanes == 16) {
    level(N16{}, halves);
    level(N8{}, blocks);
    level(N4{}, pairs);
    level(N2{}, lanes);
  } else if constexpr (kFloatLanes == 8) {
    level(N8{}, halves);
    level(N4{}, pairs);
    level(N2{}, lanes);
  } else if constexpr (kFloatLanes == 4) {
    level(N4{}, pairs);
    level(N2{}, lanes);
  }
#endif
  (void)d;
  return v[0];
}

// sums[i] = the sum of acc[i]'s lanes, for the kFloatLanes accumulators (SumLanesOfEach, put
// back in the accumulators' order).
template <class D>
HWY_INLINE void StoreSumsInOrder(D d, hn::Vec<D>* acc, float* sums) {
  HWY_ALIGN static constexpr BitReversedLanes kOrder{};
  hn::Store(hn::TableLookupLanes(SumLanesOfEach(d, acc), hn::SetTableIndices(d, kOrder.lane)), d, sums);
}

// scores[r][j] = q[r] · k[j] for rows r < R of q and NK keys (pointers kr; nk of them kept):
// each key vector is loaded (and widened) once for all the rows, each (row, key) pair its own
// accumulator, a chain of hd / lanes dependent FMAs, whose lanes SumLanesOfEach adds together
// with up to lanes - 1 other pairs'. A pair's sum is the same whatever the other rows and keys
// of the call.
template <int R, int NK, class D, class P>
HWY_INLINE void ScoreRowsKeys(D d, const float* q, int hd, int vec_end, const P* kr, int nk, float* scores,
                              int scores_ld) {
  static_assert(R * NK <= kFloatLanes, "one SumLanesOfEach per call");
  const int lanes = static_cast<int>(hn::Lanes(d));
  hn::Vec<D> acc[kFloatLanes];
  for (int i = 0; i < kFloatLanes; ++i) acc[i] = hn::Zero(d);
  // Past the nk-th key, the call repeats the last: the work is thrown away, the loads stay valid.
  P keys[NK];
  for (int i = 0; i < NK; ++i) keys[i] = kr[std::min(i, nk - 1)];
  for (int c = 0; c < vec_end; c += lanes) {
    hn::Vec<D> qv[R];
    for (int r = 0; r < R; ++r) qv[r] = hn::LoadU(d, q + r * hd + c);
    for (int i = 0; i < NK; ++i) {
      const auto kv = LoadKvAt(d, keys[i], c);
      for (int r = 0; r < R; ++r) acc[r * NK + i] = hn::MulAdd(qv[r], kv, acc[r * NK + i]);
    }
  }
  // Back in the accumulators' order: lane r * NK + i holds row r's score of key i.
  HWY_ALIGN float sums[kFloatLanes];
  StoreSumsInOrder(d, acc, sums);
  for (int r = 0; r < R; ++r) {
    float* out = scores + r * scores_ld;
    if (nk == NK && vec_end == hd) {
      const hn::CappedTag<float, NK> dk;
      hn::StoreU(hn::LoadU(dk, sums + r * NK), dk, out);
      continue;
    }
    for (int i = 0; i < nk; ++i) {
      float dot = sums[r * NK + i];
      for (int c = vec_end; c < hd; ++c) dot += q[r * hd + c] * KvValue(keys[i][c]);
      out[i] = dot;
    }
  }
}

// The rows of a chunk rounded up to a power of two: each takes lanes / that many keys of a
// SumLanesOfEach.
constexpr int RowSlots(int rows) { return rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : 8; }

// Up to 4 rows of a call of ScoreRowsOf against keys kr[0 .. nk) (nk <= kFloatLanes / R, so
// that the rows x keys sums fill one SumLanesOfEach).
template <int R, class D, class P>
HWY_INLINE void ScoreRowChunk(D d, const float* q, int hd, int vec_end, const P* kr, int nk, float* scores,
                              int scores_ld) {
  constexpr int kKeys = kFloatLanes / RowSlots(R) > 0 ? kFloatLanes / RowSlots(R) : 1;
  if constexpr (R * kKeys <= kFloatLanes) {
    for (int i = 0; i < nk; i += kKeys) {
      ScoreRowsKeys<R, kKeys>(d, q, hd, vec_end, kr + i, std::min(kKeys, nk - i), scores + i, scores_ld);
    }
  } else {  // (a 1-lane target: one row at a time)
    for (int r = 0; r < R; ++r) ScoreRowChunk<1>(d, q + r * hd, hd, vec_end, kr, nk, scores + r * scores_ld, scores_ld);
  }
}

// scores[r][j] = q[r] · k[j] for rows r < n_rows of q ([n_rows][hd]) and keys j < n_keys (fp32,
// or fp16 read in place: the widening is exact, so the sums are the same; k_ld elements apart):
// the score block of a few query rows (decode), too few to fill the lanes of the tile path's row
// vectors. A group of keys (a vector's lanes of them) meets up to 4 rows at a time, lanes / rows
// keys per call of ScoreRowsKeys. A key's sum is the same whichever group it falls in, and
// whichever chunk its row.
template <class P>
HWY_INLINE void ScoreRowsOf(const float* q, int n_rows, int hd, P k, int64_t k_ld, int n_keys, float* scores,
                            int scores_ld) {
  const hn::ScalableTag<float> d;
  const int lanes = static_cast<int>(hn::Lanes(d));
  const int vec_end = hd / lanes * lanes;
  constexpr int kGroup = kFloatLanes;
  for (int j0 = 0; j0 < n_keys; j0 += kGroup) {
    const int nk = std::min(kGroup, n_keys - j0);
    // Past the last key, the group repeats it: the work is thrown away, the loads stay valid.
    P kr[kGroup];
    for (int i = 0; i < kGroup; ++i) kr[i] = k + (j0 + std::min(i, nk - 1)) * k_ld;
    for (int r0 = 0; r0 < n_rows;) {
      const float* qr = q + r0 * hd;
      float* sr = scores + r0 * scores_ld + j0;
      switch (std::min(n_rows - r0, 4)) {
        case 1: ScoreRowChunk<1>(d, qr, hd, vec_end, kr, nk, sr, scores_ld); r0 += 1; break;
        case 2: ScoreRowChunk<2>(d, qr, hd, vec_end, kr, nk, sr, scores_ld); r0 += 2; break;
        case 3: ScoreRowChunk<3>(d, qr, hd, vec_end, kr, nk, sr, scores_ld); r0 += 3; break;
        default: ScoreRowChunk<4>(d, qr, hd, vec_end, kr, nk, sr, scores_ld); r0 += 4; break;
      }
    }
  }
}

void ScoreRows(const float* q, int n_rows, int hd, const float* k, int64_t k_ld, int n_keys, float* scores,
               int scores_ld) {
  ScoreRowsOf(q, n_rows, hd, k, k_ld, n_keys, scores, scores_ld);
}
void ScoreRowsF16(const float* q, int n_rows, int hd, const uint16_t* k, int64_t k_ld, int n_keys, float* scores,
                  int scores_ld) {
  ScoreRowsOf(q, n_rows, hd, k, k_ld, n_keys, scores, scores_ld);
}
// (k: a head's slice of the first row, q8_0 or q4_0 blocks; k_ld in elements)
void ScoreRowsQ8(const float* q, int n_rows, int hd, const uint8_t* k, int64_t k_ld, int n_keys, float* scores,
                 int scores_ld) {
  ScoreRowsOf(q, n_rows, hd, Q8Elements{k, 0}, k_ld, n_keys, scores, scores_ld);
}
void ScoreRowsQ4(const float* q, int n_rows, int hd, const uint8_t* k, int64_t k_ld, int n_keys, float* scores,
                 int scores_ld) {
  ScoreRowsOf(q, n_rows, hd, Q4Elements{k, 0}, k_ld, n_keys, scores, scores_ld);
}

// --- q8_0 and q4_0 keys scored with int8 queries (AVX-512 VNNI, AVX2) ----------------------------
//
// A q8_0 key's codes meet the query quantized alike (GGML's q8_0 rounding of each block of 32 of
// the pre-scaled query row, as llama.cpp's flash attention converts Q to the keys' dot type): a
// 64-byte chunk of a head (two blocks) is one vpdpbusd per (row, key), its 16 int32 lanes (8 per
// block) then turned to float and weighted by the two blocks' scales (query's times key's). The
// keys are made unsigned (code + 128, vpdpbusd takes unsigned times signed), and the 128 * sum
// of each lane's four query codes is taken off by starting the lane's sum at its negative. No
// key is widened to float: against the float path, a score costs a third of the instructions.

// Whether this target scores q8_0 and q4_0 keys so, for heads of a multiple of 64: AVX-512 VNNI
// (two blocks a vpdpbusd) and AVX2 (a block a vpmaddubsw + vpmaddwd, below). AVX-512 without
// VNNI keeps the float path.
bool ScoresBlockKeysInInt8() { return HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX2; }

// scores[r][i] = the sum of the lanes of accumulator r * NK + i, for rows r < R and the first nk
// keys: the int8 kernels' ending.
template <int R, int NK, class D>
HWY_INLINE void StoreRowKeySums(D d, hn::Vec<D>* acc, int nk, float* scores, int scores_ld) {
  HWY_ALIGN float sums[kFloatLanes];
  StoreSumsInOrder(d, acc, sums);
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < nk; ++i) scores[r * scores_ld + i] = sums[r * NK + i];
  }
}

#if HWY_TARGET == HWY_AVX3_DL
HWY_INLINE __m512i DotUnsignedSigned(__m512i acc, __m512i u, __m512i s) {
  // (asm: Highway 1.0.3's AVX3_DL target does not enable the EVEX intrinsic; see kernel_packed.cpp)
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
}

// Two blocks' fp16 scales, each in 8 lanes: [a x 8, b x 8].
HWY_INLINE __m512 PairOfScales(const uint8_t* block_a, const uint8_t* block_b) {
  uint16_t a, b;
  std::memcpy(&a, block_a, 2);
  std::memcpy(&b, block_b, 2);
  const __m256i halves = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16(static_cast<short>(a))),
                                                 _mm_set1_epi16(static_cast<short>(b)), 1);
  return _mm512_cvtph_ps(halves);
}

// A 64-byte chunk of a key's head (blocks b and b + 1 from `block`) as unsigned bytes for
// vpdpbusd, and what each byte exceeds its code by: q8_0 codes + 128; q4_0 nibbles, which are
// their codes + 8 already (element e of a block is byte e's low nibble, e + 16 its high one).
template <int kBits>
HWY_INLINE __m512i UnsignedCodes(const uint8_t* block) {
  const uint8_t* next = block + BlockElements<kBits>::kBlockBytes;
  if constexpr (kBits == 8) {
    const __m512i codes = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(next + 2)), 1);
    return _mm512_xor_si512(codes, _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(next + 2));
    // [a, a, b, b] by 128-bit lanes: low nibbles from the first of each pair, high from the second.
    const __m512i pairs =
        _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_broadcastsi128_si256(a)), _mm256_broadcastsi128_si256(b), 1);
    const __m512i mask = _mm512_set1_epi8(0x0F);
    const __m512i low = _mm512_and_si512(pairs, mask);
    const __m512i high = _mm512_and_si512(_mm512_srli_epi16(pairs, 4), mask);
    return _mm512_mask_blend_epi64(0xCC, low, high);
  }
}
template <int kBits>
constexpr char kCodeOffset = kBits == 8 ? static_cast<char>(0x80) : 8;

// scores[r][i] for R rows and NK keys (kr: a head's slice of each key's row), as ScoreRowsKeys
// lays them out and sums them (SumLanesOfEach), the dot products in int8.
template <int R, int NK, int kBits>
HWY_INLINE void ScoreRowsKeysInt8(const int8_t* q, const float* q_scales, int hd, const BlockElements<kBits>* kr,
                                  int nk, float* scores, int scores_ld) {
  static_assert(R * NK <= kFloatLanes, "one SumLanesOfEach per call");
  const hn::ScalableTag<float> d;
  hn::Vec<decltype(d)> acc[kFloatLanes];
  for (int i = 0; i < kFloatLanes; ++i) acc[i] = hn::Zero(d);
  const uint8_t* keys[NK];
  for (int i = 0; i < NK; ++i) keys[i] = kr[std::min(i, nk - 1)].blocks;
  const __m512i offset = _mm512_set1_epi8(kCodeOffset<kBits>);
  const int n_blocks = hd / 32;
  for (int b = 0; b < n_blocks; b += 2) {
    __m512i qv[R], start[R];
    __m512 qs[R];
    for (int r = 0; r < R; ++r) {
      qv[r] = _mm512_loadu_si512(q + static_cast<int64_t>(r) * hd + b * 32);
      // Each lane starts at minus the offset times its four query codes: the sum is then the codes'.
      start[r] = _mm512_sub_epi32(_mm512_setzero_si512(), DotUnsignedSigned(_mm512_setzero_si512(), offset, qv[r]));
      const float* s = q_scales + r * n_blocks + b;
      qs[r] = _mm512_insertf32x8(_mm512_set1_ps(s[0]), _mm256_set1_ps(s[1]), 1);
    }
    for (int i = 0; i < NK; ++i) {
      const uint8_t* block = keys[i] + static_cast<int64_t>(b) * BlockElements<kBits>::kBlockBytes;
      const __m512i codes = UnsignedCodes<kBits>(block);
      const __m512 ks = PairOfScales(block, block + BlockElements<kBits>::kBlockBytes);
      for (int r = 0; r < R; ++r) {
        const __m512 dot = _mm512_cvtepi32_ps(DotUnsignedSigned(start[r], codes, qv[r]));
        acc[r * NK + i].raw = _mm512_fmadd_ps(dot, _mm512_mul_ps(ks, qs[r]), acc[r * NK + i].raw);
      }
    }
  }
  StoreRowKeySums<R, NK>(d, acc, nk, scores, scores_ld);
}

#endif

#if HWY_TARGET == HWY_AVX2
// The same int8 scores on AVX2 (no VNNI), a block of 32 at a time: vpmaddubsw takes unsigned
// times signed bytes into int16 pairs, which vpmaddwd by ones sums into 8 int32 lanes.
// - q4_0 nibbles are unsigned already (codes + 8): the pairs are at most 2 * 15 * 127, and each
//   lane starts at minus 8 times its four query codes, as on VNNI.
// - q8_0 codes are signed: |k| meets q with k's sign (vpsignb), the pairs at most 2 * 127 * 127
//   (a quantized query is never -128). Codes + 128 would overflow the int16 pairs.
// Against the float path (each code widened to fp32 and scaled), a block of a score costs 5-6
// integer operations instead of 12.

// A key block's 32 codes in element order: q8_0's bytes; q4_0's low nibbles (elements 0-15)
// then its high ones (16-31).
template <int kBits>
HWY_INLINE __m256i BlockCodes(const uint8_t* block) {
  if constexpr (kBits == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
  } else {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), mask), _mm_and_si128(packed, mask));
  }
}

// A block's fp16 scale in every lane.
HWY_INLINE __m256 BlockScale(const uint8_t* block) {
  uint16_t h;
  std::memcpy(&h, block, 2);
  return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(h)));
}

// int32 lanes: the sums of each lane's four products of codes (a BlockCodes' bytes; `magnitude`
// their absolute values for q8_0) with the query's codes.
template <int kBits>
HWY_INLINE __m256i BlockDot(__m256i codes, __m256i magnitude, __m256i query, __m256i start) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (kBits == 8) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(query, codes)), ones);
  } else {
    return _mm256_add_epi32(start, _mm256_madd_epi16(_mm256_maddubs_epi16(codes, query), ones));
  }
}

template <int R, int NK, int kBits>
HWY_INLINE void ScoreRowsKeysInt8(const int8_t* q, const float* q_scales, int hd, const BlockElements<kBits>* kr,
                                  int nk, float* scores, int scores_ld) {
  static_assert(R * NK <= kFloatLanes, "one SumLanesOfEach per call");
  const hn::ScalableTag<float> d;
  hn::Vec<decltype(d)> acc[kFloatLanes];
  for (int i = 0; i < kFloatLanes; ++i) acc[i] = hn::Zero(d);
  const uint8_t* keys[NK];
  for (int i = 0; i < NK; ++i) keys[i] = kr[std::min(i, nk - 1)].blocks;
  const int n_blocks = hd / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int b = 0; b < n_blocks; ++b) {
    __m256i qv[R], start[R];
    __m256 qs[R];
    for (int r = 0; r < R; ++r) {
      qv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + static_cast<int64_t>(r) * hd + b * 32));
      start[r] = kBits == 8 ? _mm256_setzero_si256()
                            : _mm256_sub_epi32(_mm256_setzero_si256(),
                                               _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(8), qv[r]), ones));
      qs[r] = _mm256_set1_ps(q_scales[r * n_blocks + b]);
    }
    for (int i = 0; i < NK; ++i) {
      const uint8_t* block = keys[i] + static_cast<int64_t>(b) * BlockElements<kBits>::kBlockBytes;
      const __m256i codes = BlockCodes<kBits>(block);
      const __m256i magnitude = kBits == 8 ? _mm256_sign_epi8(codes, codes) : codes;
      const __m256 ks = BlockScale(block);
      for (int r = 0; r < R; ++r) {
        const __m256 dot = _mm256_cvtepi32_ps(BlockDot<kBits>(codes, magnitude, qv[r], start[r]));
        acc[r * NK + i].raw = _mm256_fmadd_ps(dot, _mm256_mul_ps(ks, qs[r]), acc[r * NK + i].raw);
      }
    }
  }
  StoreRowKeySums<R, NK>(d, acc, nk, scores, scores_ld);
}
#endif

#if HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX2
template <int R, int kBits>
HWY_INLINE void ScoreRowChunkInt8(const int8_t* q, const float* q_scales, int hd, const BlockElements<kBits>* kr,
                                  int nk, float* scores, int scores_ld) {
  constexpr int kKeys = kFloatLanes / RowSlots(R);
  for (int i = 0; i < nk; i += kKeys) {
    ScoreRowsKeysInt8<R, kKeys, kBits>(q, q_scales, hd, kr + i, std::min(kKeys, nk - i), scores + i, scores_ld);
  }
}

template <int kBits>
HWY_INLINE void ScoreRowsInt8Of(const int8_t* q, const float* q_scales, int n_rows, int hd, const uint8_t* k,
                                int64_t k_ld, int n_keys, float* scores, int scores_ld) {
  constexpr int kGroup = kFloatLanes;
  const int blocks_per_row = hd / 32;
  const BlockElements<kBits> first{k, 0};
  for (int j0 = 0; j0 < n_keys; j0 += kGroup) {
    const int nk = std::min(kGroup, n_keys - j0);
    BlockElements<kBits> kr[kGroup];
    for (int i = 0; i < kGroup; ++i) kr[i] = first + (j0 + std::min(i, nk - 1)) * k_ld;
    for (int r0 = 0; r0 < n_rows;) {
      const int8_t* qr = q + static_cast<int64_t>(r0) * hd;
      const float* sr = q_scales + r0 * blocks_per_row;
      float* out = scores + r0 * scores_ld + j0;
      switch (std::min(n_rows - r0, 4)) {
        case 1: ScoreRowChunkInt8<1, kBits>(qr, sr, hd, kr, nk, out, scores_ld); r0 += 1; break;
        case 2: ScoreRowChunkInt8<2, kBits>(qr, sr, hd, kr, nk, out, scores_ld); r0 += 2; break;
        case 3: ScoreRowChunkInt8<3, kBits>(qr, sr, hd, kr, nk, out, scores_ld); r0 += 3; break;
        default: ScoreRowChunkInt8<4, kBits>(qr, sr, hd, kr, nk, out, scores_ld); r0 += 4; break;
      }
    }
  }
}
#endif

// scores[r][j] = q[r] · k[j] with the int8 queries (quantize_query_rows) and q8_0 or q4_0
// keys (k: a head's slice of the first key's row, k_ld elements apart): ScoreRowsQ8's layout and
// cut of the keys and rows. Only on the targets ScoresBlockKeysInInt8 names (hd a multiple of
// 64); elsewhere nothing is written.
void ScoreRowsQ8Int8(const int8_t* q, const float* q_scales, int n_rows, int hd, const uint8_t* k, int64_t k_ld,
                     int n_keys, float* scores, int scores_ld) {
#if HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX2
  ScoreRowsInt8Of<8>(q, q_scales, n_rows, hd, k, k_ld, n_keys, scores, scores_ld);
#else
  (void)q, (void)q_scales, (void)n_rows, (void)hd, (void)k, (void)k_ld, (void)n_keys, (void)scores, (void)scores_ld;
#endif
}
void ScoreRowsQ4Int8(const int8_t* q, const float* q_scales, int n_rows, int hd, const uint8_t* k, int64_t k_ld,
                     int n_keys, float* scores, int scores_ld) {
#if HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX2
  ScoreRowsInt8Of<4>(q, q_scales, n_rows, hd, k, k_ld, n_keys, scores, scores_ld);
#else
  (void)q, (void)q_scales, (void)n_rows, (void)hd, (void)k, (void)k_ld, (void)n_keys, (void)scores, (void)scores_ld;
#endif
}

// acc[r][c0 .. c0 + NC vectors) += sum_j p[r][j] * v[j][c0 ..) for R rows, over the keys with a
// non-zero weight in some row: each value vector loaded (and widened) once for all the rows, the
// rows' columns held in R x NC registers across all the keys. Every element sums its keys in key
// order (a zero weight adds +0, which changes no sum of finite products).
template <class P>
constexpr bool kBlockValues = false;
template <int kBits>
constexpr bool kBlockValues<BlockElements<kBits>> = true;

// AccumulateRowsColumns on q8_0 or q4_0 values whose NC vectors are whole blocks from a block's
// start: per key, each block's scale is folded into the rows' weights (a multiply per row and
// block, where LoadKv spends one per vector) and the codes are only widened.
template <int R, int NC, class D, int kBits>
HWY_INLINE void AccumulateRowsBlockColumns(D d, const float* p, int p_ld, int n_keys, BlockElements<kBits> v,
                                           int64_t v_ld, int hd, float* acc) {
  constexpr int kVectorsPerBlock = 32 / kFloatLanes;
  static_assert(NC % kVectorsPerBlock == 0, "whole blocks");
  hn::Vec<D> a[R][NC];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < NC; ++c) a[r][c] = hn::LoadU(d, acc + r * hd + c * kFloatLanes);
  }
  for (int j = 0; j < n_keys; ++j) {
    bool any = false;
    for (int r = 0; r < R; ++r) any |= p[r * p_ld + j] != 0.0f;
    if (!any) continue;  // masked keys (empty slots may hold anything)
    const BlockElements<kBits> vj = v + j * v_ld;
    for (int c0 = 0; c0 < NC; c0 += kVectorsPerBlock) {
      const BlockElements<kBits> block = vj + c0 * kFloatLanes;
      const float scale = block.scale();
      hn::Vec<D> w[R];
      for (int r = 0; r < R; ++r) w[r] = hn::Set(d, p[r * p_ld + j] * scale);
      for (int c = 0; c < kVectorsPerBlock; ++c) {
        const auto codes = LoadCodes(d, BlockElements<kBits>{block.blocks, c * kFloatLanes});
        for (int r = 0; r < R; ++r) a[r][c0 + c] = hn::MulAdd(w[r], codes, a[r][c0 + c]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < NC; ++c) hn::StoreU(a[r][c], d, acc + r * hd + c * kFloatLanes);
  }
}

template <int R, int NC, class D, class P>
HWY_INLINE void AccumulateRowsColumns(D d, const float* p, int p_ld, int n_keys, P v, int64_t v_ld, int hd,
                                      float* acc) {
  if constexpr (kBlockValues<P> && kFloatLanes <= 32 && NC % (32 / kFloatLanes) == 0) {
    if (v.at == 0) return AccumulateRowsBlockColumns<R, NC>(d, p, p_ld, n_keys, v, v_ld, hd, acc);
  }
  const int lanes = static_cast<int>(hn::Lanes(d));
  hn::Vec<D> a[R][NC];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < NC; ++c) a[r][c] = hn::LoadU(d, acc + r * hd + c * lanes);
  }
  for (int j = 0; j < n_keys; ++j) {
    bool any = false;
    for (int r = 0; r < R; ++r) any |= p[r * p_ld + j] != 0.0f;
    if (!any) continue;  // masked keys (empty slots may hold anything)
    const P vj = v + j * v_ld;
    for (int c = 0; c < NC; ++c) {
      const auto vv = LoadKvAt(d, vj, c * lanes);
      for (int r = 0; r < R; ++r) a[r][c] = hn::MulAdd(hn::Set(d, p[r * p_ld + j]), vv, a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < NC; ++c) hn::StoreU(a[r][c], d, acc + r * hd + c * lanes);
  }
}

// acc[r] += sum_j p[r][j] * v[j] for rows r < n_rows (fp32 values, or fp16 read in place; v_ld
// apart): the value side of ScoreRows. Every element sums its keys in key order, so the result
// is the same for any cut of the keys into calls, and of the rows into chunks.
template <class P>
HWY_INLINE void AccumulateRowsOf(const float* p, int n_rows, int p_ld, P v, int64_t v_ld, int n_keys, int hd,
                                 float* acc) {
  const hn::ScalableTag<float> d;
  const int lanes = static_cast<int>(hn::Lanes(d));
  // Stretches of keys whose values the first chunk of rows and columns brings into L1 for the
  // others.
  constexpr int kKeysPerStretch = 32;
  for (int j0 = 0; j0 < n_keys; j0 += kKeysPerStretch) {
    const int nk = std::min(kKeysPerStretch, n_keys - j0);
    const P vs = v + j0 * v_ld;
    const float* ps = p + j0;
    for (int r0 = 0; r0 < n_rows; r0 += 4) {
      const int rn = std::min(4, n_rows - r0);
      const float* pr = ps + r0 * p_ld;
      float* ar = acc + r0 * hd;
      int c = 0;
      // Four vectors of columns beside up to 4 rows: 16 accumulators.
      for (; c + 4 * lanes <= hd; c += 4 * lanes) {
        switch (rn) {
          case 1: AccumulateRowsColumns<1, 4>(d, pr, p_ld, nk, vs + c, v_ld, hd, ar + c); break;
          case 2: AccumulateRowsColumns<2, 4>(d, pr, p_ld, nk, vs + c, v_ld, hd, ar + c); break;
          case 3: AccumulateRowsColumns<3, 4>(d, pr, p_ld, nk, vs + c, v_ld, hd, ar + c); break;
          default: AccumulateRowsColumns<4, 4>(d, pr, p_ld, nk, vs + c, v_ld, hd, ar + c); break;
        }
      }
      for (; c + lanes <= hd; c += lanes) {
        for (int r = 0; r < rn; ++r) AccumulateRowsColumns<1, 1>(d, pr + r * p_ld, p_ld, nk, vs + c, v_ld, hd, ar + r * hd + c);
      }
      for (; c < hd; ++c) {
        for (int r = 0; r < rn; ++r) {
          for (int j = 0; j < nk; ++j) {
            if (pr[r * p_ld + j] != 0.0f) ar[r * hd + c] += pr[r * p_ld + j] * KvValue(vs[j * v_ld + c]);
          }
        }
      }
    }
  }
}

void AccumulateRows(const float* p, int n_rows, int p_ld, const float* v, int64_t v_ld, int n_keys, int hd,
                    float* acc) {
  AccumulateRowsOf(p, n_rows, p_ld, v, v_ld, n_keys, hd, acc);
}
void AccumulateRowsF16(const float* p, int n_rows, int p_ld, const uint16_t* v, int64_t v_ld, int n_keys, int hd,
                       float* acc) {
  AccumulateRowsOf(p, n_rows, p_ld, v, v_ld, n_keys, hd, acc);
}
void AccumulateRowsQ8(const float* p, int n_rows, int p_ld, const uint8_t* v, int64_t v_ld, int n_keys, int hd,
                      float* acc) {
  AccumulateRowsOf(p, n_rows, p_ld, Q8Elements{v, 0}, v_ld, n_keys, hd, acc);
}
void AccumulateRowsQ4(const float* p, int n_rows, int p_ld, const uint8_t* v, int64_t v_ld, int n_keys, int hd,
                      float* acc) {
  AccumulateRowsOf(p, n_rows, p_ld, Q4Elements{v, 0}, v_ld, n_keys, hd, acc);
}

// The tile path of prefill attention: a tile's query rows sit in the lanes of vectors, so that
// each key (each value element) is one broadcast met by whole vectors of rows, and the online
// softmax runs down the rows' lanes instead of along a row. qT [hd][ld], sT [nb][ld] and accT
// [hd][ld] hold row r in column r; m and l are [ld]; ld is the tile's rows rounded up to whole
// vectors. AVX-512 holds 4 x 4 accumulators of 16 rows, AVX2 (16 registers) 4 x 2 of 8.
constexpr int kTileRowVectors = HWY_TARGET <= HWY_AVX3 ? 4 : 2;

// sT[jj][rows] = k[jj] · qT[.][rows] for NK keys and NV vectors of rows (pointers at the first).
template <int NK, int NV, class D>
HWY_INLINE void ScoreKeys(D d, const float* qT, int ld, int hd, const float* k, int64_t ldk, float* sT) {
  const size_t lanes = hn::Lanes(d);
  hn::Vec<D> acc[NK][NV];
  for (int jj = 0; jj < NK; ++jj) {
    for (int i = 0; i < NV; ++i) acc[jj][i] = hn::Zero(d);
  }
  for (int c = 0; c < hd; ++c) {
    hn::Vec<D> qv[NV];
    for (int i = 0; i < NV; ++i) qv[i] = hn::LoadU(d, qT + c * ld + i * lanes);
    for (int jj = 0; jj < NK; ++jj) {
      const auto kb = hn::Set(d, k[jj * ldk + c]);
      for (int i = 0; i < NV; ++i) acc[jj][i] = hn::MulAdd(kb, qv[i], acc[jj][i]);
    }
  }
  for (int jj = 0; jj < NK; ++jj) {
    for (int i = 0; i < NV; ++i) hn::StoreU(acc[jj][i], d, sT + jj * ld + i * lanes);
  }
}

// accT[cc][rows] += sum_j v[j][cc] * sT[j][rows] for NC value columns and NV vectors of rows.
template <int NC, int NV, class D>
HWY_INLINE void AccumulateValues(D d, const float* sT, int ld, int nb, const float* v, int64_t ldv, float* accT) {
  const size_t lanes = hn::Lanes(d);
  hn::Vec<D> acc[NC][NV];
  for (int cc = 0; cc < NC; ++cc) {
    for (int i = 0; i < NV; ++i) acc[cc][i] = hn::LoadU(d, accT + cc * ld + i * lanes);
  }
  for (int j = 0; j < nb; ++j) {
    hn::Vec<D> p[NV];
    for (int i = 0; i < NV; ++i) p[i] = hn::LoadU(d, sT + j * ld + i * lanes);
    for (int cc = 0; cc < NC; ++cc) {
      const auto vb = hn::Set(d, v[j * ldv + cc]);
      for (int i = 0; i < NV; ++i) acc[cc][i] = hn::MulAdd(vb, p[i], acc[cc][i]);
    }
  }
  for (int cc = 0; cc < NC; ++cc) {
    for (int i = 0; i < NV; ++i) hn::StoreU(acc[cc][i], d, accT + cc * ld + i * lanes);
  }
}

// One row vector's online softmax over a block of scores: raises m to the block's max, turns
// the scores into exp(s - m) (masked -inf ones into 0), and rescales l and accT by exp(m_old -
// m_new). A row that has seen nothing yet keeps m = -inf, l = 0.
template <class D>
HWY_INLINE void SoftmaxRowVector(D d, float* sT, int ld, int nb, float* m, float* l, float* accT, int hd) {
  const auto neg_inf = hn::Set(d, -INFINITY);
  const auto m_old = hn::LoadU(d, m);
  auto m_new = m_old;
  for (int j = 0; j < nb; ++j) m_new = hn::Max(m_new, hn::LoadU(d, sT + j * ld));
  const auto shift = hn::IfThenZeroElse(hn::Eq(m_new, neg_inf), m_new);
  auto sum = hn::Zero(d);
  for (int j = 0; j < nb; ++j) {
    const auto s = hn::LoadU(d, sT + j * ld);
    const auto e = hn::IfThenZeroElse(hn::Eq(s, neg_inf), hn::Exp(d, hn::Sub(s, shift)));
    hn::StoreU(e, d, sT + j * ld);
    sum = hn::Add(sum, e);
  }
  hn::StoreU(m_new, d, m);
  const auto same = hn::Eq(m_old, m_new);
  if (hn::AllTrue(d, same)) {
    hn::StoreU(hn::Add(hn::LoadU(d, l), sum), d, l);
    return;
  }
  const auto alpha = hn::IfThenElse(same, hn::Set(d, 1.0f),
                                    hn::IfThenZeroElse(hn::Eq(m_old, neg_inf), hn::Exp(d, hn::Sub(m_old, shift))));
  hn::StoreU(hn::MulAdd(hn::LoadU(d, l), alpha, sum), d, l);
  for (int c = 0; c < hd; ++c) hn::StoreU(hn::Mul(hn::LoadU(d, accT + c * ld), alpha), d, accT + c * ld);
}

// A tile of query rows (ld of them, transposed as above) meets a block of nb keys and values
// (fp32 rows, ldk / ldv apart). Rows [visible_from[j], visible_to[j]) may see key j, the others
// get a -inf score (nullptr: every row sees every key).
void TileMeetBlock(const float* qT, int ld, int hd, const float* k, int64_t ldk, const float* v, int64_t ldv, int nb,
                   const int* visible_from, const int* visible_to, float* sT, float* m, float* l, float* accT) {
  const hn::ScalableTag<float> d;
  const int lanes = static_cast<int>(hn::Lanes(d));
  constexpr int NV = kTileRowVectors;
  for (int r0 = 0; r0 < ld;) {
    const bool wide = ld - r0 >= NV * lanes;
    int j = 0;
    for (; j + 4 <= nb; j += 4) {
      if (wide) {
        ScoreKeys<4, NV>(d, qT + r0, ld, hd, k + j * ldk, ldk, sT + j * ld + r0);
      } else {
        ScoreKeys<4, 1>(d, qT + r0, ld, hd, k + j * ldk, ldk, sT + j * ld + r0);
      }
    }
    for (; j < nb; ++j) {
      if (wide) {
        ScoreKeys<1, NV>(d, qT + r0, ld, hd, k + j * ldk, ldk, sT + j * ld + r0);
      } else {
        ScoreKeys<1, 1>(d, qT + r0, ld, hd, k + j * ldk, ldk, sT + j * ld + r0);
      }
    }
    r0 += wide ? NV * lanes : lanes;
  }
  if (visible_from != nullptr) {
    for (int j = 0; j < nb; ++j) {
      std::fill_n(sT + j * ld, visible_from[j], -INFINITY);
      std::fill(sT + j * ld + visible_to[j], sT + (j + 1) * ld, -INFINITY);
    }
  }
  for (int r0 = 0; r0 < ld; r0 += lanes) SoftmaxRowVector(d, sT + r0, ld, nb, m + r0, l + r0, accT + r0, hd);
  for (int r0 = 0; r0 < ld;) {
    const bool wide = ld - r0 >= NV * lanes;
    int c = 0;
    for (; c + 4 <= hd; c += 4) {
      if (wide) {
        AccumulateValues<4, NV>(d, sT + r0, ld, nb, v + c, ldv, accT + c * ld + r0);
      } else {
        AccumulateValues<4, 1>(d, sT + r0, ld, nb, v + c, ldv, accT + c * ld + r0);
      }
    }
    for (; c < hd; ++c) {
      if (wide) {
        AccumulateValues<1, NV>(d, sT + r0, ld, nb, v + c, ldv, accT + c * ld + r0);
      } else {
        AccumulateValues<1, 1>(d, sT + r0, ld, nb, v + c, ldv, accT + c * ld + r0);
      }
    }
    r0 += wide ? NV * lanes : lanes;
  }
}

// The tile's row width: rows rounded up to whole vectors of the target.
int TileRowWidth(int rows) {
  const hn::ScalableTag<float> d;
  const int lanes = static_cast<int>(hn::Lanes(d));
  return (rows + lanes - 1) / lanes * lanes;
}

}  // namespace HWY_NAMESPACE
}  // namespace ringlm::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <omp.h>

namespace ringlm::cpu {

HWY_EXPORT(SoftmaxBlockRow);
HWY_EXPORT(F16KvRowsToF32);
HWY_EXPORT(Q8KvRowsToF32);
HWY_EXPORT(Q4KvRowsToF32);
HWY_EXPORT(KiviKeysToF32);
HWY_EXPORT(KiviValuesToF32);
HWY_EXPORT(ExpBlockRow);
HWY_EXPORT(ScoreRows);
HWY_EXPORT(ScoreRowsF16);
HWY_EXPORT(ScoreRowsQ8);
HWY_EXPORT(ScoreRowsQ4);
HWY_EXPORT(ScoresBlockKeysInInt8);
HWY_EXPORT(ScoreRowsQ8Int8);
HWY_EXPORT(ScoreRowsQ4Int8);
HWY_EXPORT(AccumulateRows);
HWY_EXPORT(AccumulateRowsF16);
HWY_EXPORT(AccumulateRowsQ8);
HWY_EXPORT(AccumulateRowsQ4);
HWY_EXPORT(TileMeetBlock);
HWY_EXPORT(TileRowWidth);

bool scores_block_keys_in_int8(int head_dim) {
  return head_dim % 64 == 0 && HWY_DYNAMIC_DISPATCH(ScoresBlockKeysInInt8)();
}

namespace {

constexpr int kQueryRows = 64;  // rows of a query tile (query heads of a group x tokens)
constexpr int kKeyBlock = 128;  // keys per block: a block's scores stay in L1 / L2
constexpr int kMinKeysPerSplit = 256;  // decode: fewer keys per thread cost more to merge than they save
constexpr int kMaxSplits = 64;
// Tiles of at most this many query rows (decode: one token's heads of a group) take the row path;
// larger ones the tile path, whose row vectors they fill.
constexpr int kDirectRows = 8;
// Asynchronized softmax: every block's exponentials are taken against one unified max, set
// kAsyncLead below the previous step's largest score. exp(s - max) is safe while every score is
// at most max + kAsyncHigh (with 2^17 keys the sums stay below 1e27, far from fp32's range) and
// the largest at least max + kAsyncLow (its exponential, above e^-80, is a normal float: full
// precision). Outside that, the unit is run again with the exact online softmax. The lead puts
// more of the window below the last maximum than above it: on a file of random weights (the 1B
// shape at depth 4096) 70% of the decode units were redone with the window [-60, +30] around the
// last maximum, every one because its maximum had fallen by 60-110 (none had risen by 60); on
// SmolLM2 and Gemma 3 none was.
constexpr float kAsyncLead = 20.0f;
constexpr float kAsyncHigh = 50.0f;
constexpr float kAsyncLow = -80.0f;

// The unified max of row r of a decode unit, from the previous step's maxima phi.
float unified_max(const float* phi, int r) { return phi[r] - kAsyncLead; }

// A tile's running state: per row the max and the sum of exponentials, and the weighted values.
struct TileState {
  float* m;    // [rows]
  float* l;    // [rows]
  float* acc;  // [rows][head_dim]
};

// Which rows, tokens and keys one unit of work covers: KV heads kv_head .. kv_head + n_kv_heads
// (a decode unit takes every head of its keys; others one), their query heads' rows for tokens
// token_begin .. token_end.
struct Unit {
  int kv_head;
  int token_begin, token_end;  // queries of the chunk
  int key_begin, key_end;      // cache indices (keys beyond a row's causal limit are masked)
  int n_kv_heads = 1;

  // Rows per KV head: the query heads of its group, for each token.
  int rows_per_head(int group) const { return (token_end - token_begin) * group; }
  // Row r's query head and token: the rows of each KV head in turn, token by token, each
  // token's query heads of the group.
  int head_of_row(int group, int r) const { return (kv_head + r / rows_per_head(group)) * group + r % group; }
  int token_of_row(int group, int r) const { return token_begin + r % rows_per_head(group) / group; }
};

// Decode units take at most this many KV heads (bits of a mask of the heads to redo).
constexpr int kMaxUnitHeads = 64;

// State rows [first, first + n) of a unit's state (one KV head's rows).
TileState state_rows(const TileState& st, int first, int hd) {
  return TileState{st.m + first, st.l + first, st.acc + static_cast<int64_t>(first) * hd};
}

// Per-thread buffers of a unit: its query rows, a score block, (fp16 caches) one block of keys
// and one of values in fp32, and the tile path's transposed state. The row path uses qt and
// scores as [rows][hd] and [rows][kKeyBlock], the tile path as [hd][ld] and [kKeyBlock][ld].
struct UnitBuffers {
  float* qt;      // [rows_cap * hd]
  int8_t* q8;        // [rows_cap * hd]: qt as q8_0 codes, when q8_0 keys are scored in int8
  float* q8_scales;  // [rows_cap * hd / 32]
  float* scores;  // [rows_cap * kKeyBlock]
  float* kbuf;    // [kKeyBlock][hd]
  float* vbuf;    // [kKeyBlock][hd]
  float* acc_t;   // [hd][ld]
  float* m_t;     // [ld]
  float* l_t;     // [ld]
};

// Floats of a thread's buffer that hold `rows` query rows as q8_0 codes and scales.
size_t query_codes_floats(int rows, int hd) {
  return static_cast<size_t>(rows) * hd / sizeof(float) + static_cast<size_t>(rows) * hd / 32 + 1;
}
// Points ub's query codes and scales at `at` (query_codes_floats(rows, hd) floats).
void place_query_codes(UnitBuffers& ub, float* at, int rows, int hd) {
  ub.q8_scales = at;
  ub.q8 = reinterpret_cast<int8_t*>(at + static_cast<size_t>(rows) * hd / 32);
}

// Whether a unit scores its keys with int8 queries (ScoreRowsQ8Int8, ScoreRowsQ4Int8): q8_0 or
// q4_0 keys, heads of a multiple of 64, a target that scores so (ScoresBlockKeysInInt8: AVX-512 VNNI, AVX2).
bool scores_in_int8(const KvLayer& kv, int hd) { return kv_type_has_blocks(kv.key_type) && scores_block_keys_in_int8(hd); }

// The int8 scores of n q8_0 or q4_0 keys read in place (k: a head's slice of the first key's row).
void score_in_int8(KvType type, const uint8_t* k, int64_t ldk, int n, const int8_t* q8, const float* q8_scales,
                   int rows, int hd, float* scores, int scores_ld) {
  if (type == KvType::kQ8_0) {
    HWY_DYNAMIC_DISPATCH(ScoreRowsQ8Int8)(q8, q8_scales, rows, hd, k, ldk, n, scores, scores_ld);
  } else {
    HWY_DYNAMIC_DISPATCH(ScoreRowsQ4Int8)(q8, q8_scales, rows, hd, k, ldk, n, scores, scores_ld);
  }
}

// Query rows of hd floats as q8_0 blocks (GGML's rounding, quantize_row: the scale rounded to
// fp16 as a block stores it): codes [rows][hd] and scales [rows][hd / 32].
void quantize_query_rows(const float* q, int n_rows, int hd, int8_t* codes, float* scales) {
  uint8_t block[34];
  for (int r = 0; r < n_rows; ++r) {
    for (int b = 0; b < hd / 32; ++b) {
      const int64_t at = static_cast<int64_t>(r) * hd + b * 32;
      quantize_row(TensorType::Q8_0, q + at, block, 32);
      uint16_t scale;
      std::memcpy(&scale, block, 2);
      scales[r * (hd / 32) + b] = fp16_to_fp32(scale);
      std::memcpy(codes + at, block + 2, 32);
    }
  }
}

// Rows [j0, j0 + nb) of one side of a head (keys or values: `rows` of `type`, `stride`
// elements apart) as fp32 rows of hd; nothing when `out` is null.
void gather_side(KvType type, const void* rows, int64_t offset, int64_t stride, int nb, int hd, float* out) {
  if (out == nullptr) return;
  if (kv_type_has_blocks(type)) {
    const uint8_t* first = static_cast<const uint8_t*>(rows) + kv_bytes_of(type, offset);
    if (type == KvType::kQ8_0) {
      HWY_DYNAMIC_DISPATCH(Q8KvRowsToF32)(first, stride, nb, hd, out);
    } else {
      HWY_DYNAMIC_DISPATCH(Q4KvRowsToF32)(first, stride, nb, hd, out);
    }
    return;
  }
  if (type == KvType::kF16) {
    HWY_DYNAMIC_DISPATCH(F16KvRowsToF32)(static_cast<const uint16_t*>(rows) + offset, nullptr, stride, nb, hd, out,
                                          nullptr);
    return;
  }
  for (int j = 0; j < nb; ++j) std::copy_n(static_cast<const float*>(rows) + offset + j * stride, hd, out + j * hd);
}

// Slots [j0, j0 + nb) of one KV head's keys and values as fp32 rows written into kbuf and vbuf
// (hd apart; nullptr: that side is not wanted), whatever each side's type (a block whose slots
// come from two runs is gathered piece by piece).
// gather_block of a KIVI cache: each group's slots from its staging buffer (fp16) while it is
// open, from the pass's rows while a prompt's group waits to be quantized, else its keys' codes
// against the group's channel scales and its values' rows.
void gather_kivi_block(const KvLayer& kv, int kv_head, int hd, int j0, int nb, float* kbuf, float* vbuf) {
  const KvKiviGroups& groups = *kv.kivi;
  const int64_t head = static_cast<int64_t>(kv_head) * hd;
  const size_t key_bytes = kv_bytes_of(KvType::kKivi2, kv.row_stride);
  const size_t value_bytes = kv_value_bytes_of(KvType::kKivi2, kv.row_stride);
  for (int slot = j0; slot < j0 + nb;) {
    const int g = groups.group_of(slot), first = groups.first_slot(g);
    const int count = std::min(j0 + nb, first + groups.group_size(g)) - slot;
    const int64_t out = static_cast<int64_t>(slot - j0) * hd;
    const int buffer = groups.staged[g];
    const KvLayer::KiviPending* pending = nullptr;
    for (const KvLayer::KiviPending& p : kv.kivi_pending) {
      if (buffer < 0 && slot >= p.first_slot && slot < p.first_slot + p.n) pending = &p;
    }
    if (pending != nullptr) {
      for (int i = 0; i < count; ++i) {
        const int64_t row = static_cast<int64_t>(slot + i - pending->first_slot) * kv.row_stride + head;
        if (kbuf != nullptr) std::copy_n(pending->k + row, hd, kbuf + out + static_cast<int64_t>(i) * hd);
        if (vbuf != nullptr) std::copy_n(pending->v + row, hd, vbuf + out + static_cast<int64_t>(i) * hd);
      }
    } else if (buffer >= 0) {
      const uint16_t* staged = kv.kivi_staging + (static_cast<size_t>(2 * kKiviGroup) * buffer + (slot - first)) *
                                                     static_cast<size_t>(kv.row_stride);
      const int64_t values_at = static_cast<int64_t>(kKiviGroup) * kv.row_stride;
      HWY_DYNAMIC_DISPATCH(F16KvRowsToF32)(staged + head, staged + values_at + head, kv.row_stride, count, hd,
                                            kbuf != nullptr ? kbuf + out : nullptr, vbuf != nullptr ? vbuf + out : nullptr);
    } else {
      if (kbuf != nullptr) {
        const uint16_t* scales = kv.kivi_params + static_cast<size_t>(g) * kv.row_stride * 2 + head;
        float scale[kKiviMaxHead], min[kKiviMaxHead];
        HWY_DYNAMIC_DISPATCH(F16KvRowsToF32)(scales, scales + kv.row_stride, 0, 1, hd, scale, min);
        HWY_DYNAMIC_DISPATCH(KiviKeysToF32)(static_cast<const uint8_t*>(kv.keys) + slot * key_bytes + head / 4,
                                             static_cast<int64_t>(key_bytes), count, scale, min, hd, kbuf + out);
      }
      if (vbuf != nullptr) {
        HWY_DYNAMIC_DISPATCH(KiviValuesToF32)(static_cast<const uint8_t*>(kv.values) + slot * value_bytes,
                                               static_cast<int64_t>(value_bytes), count, static_cast<int>(head), hd, vbuf + out);
      }
    }
    slot += count;
  }
}

void gather_block(const KvLayer& kv, int kv_head, int hd, int j0, int nb, float* kbuf, float* vbuf) {
  if (kv.kivi != nullptr) return gather_kivi_block(kv, kv_head, hd, j0, nb, kbuf, vbuf);
  const int64_t offset = j0 * kv.row_stride + static_cast<int64_t>(kv_head) * hd;
  if (kv.key_type == KvType::kF16 && kv.value_type == KvType::kF16) {  // both streams on their way at once
    HWY_DYNAMIC_DISPATCH(F16KvRowsToF32)(static_cast<const uint16_t*>(kv.keys) + offset,
                                          static_cast<const uint16_t*>(kv.values) + offset, kv.row_stride, nb, hd,
                                          kbuf, vbuf);
    return;
  }
  gather_side(kv.key_type, kv.keys, offset, kv.row_stride, nb, hd, kbuf);
  gather_side(kv.value_type, kv.values, offset, kv.row_stride, nb, hd, vbuf);
}

// How far back a query sees: the sliding window, or (none) further than any position goes,
// with room to add a position to it.
int64_t window_of(const AttentionShape& sh) { return sh.window > 0 ? sh.window : int64_t{1} << 62; }

// What a checking pass (attention_steps) computed once for all its rows: the scores of a unit's
// query rows (row r's score of key j, in the unit numbering of the keys, at scores[r * scores_ld
// + j]), so that its blocks need only their values.
struct StepsInput {
  const float* scores = nullptr;
  int64_t scores_ld = 0;
};

// Which sides of a block view_block gives.
enum class KvSides { kBoth, kKeys, kValues };

// Where a stretch of a block's keys is read: head 0's slice of its first key's row, ldk and ldv
// elements apart. fp32 rows (k, v: in place, or gathered into a unit's buffers), or an fp16,
// q8_0 or q4_0 cache's rows read in place by the row path's kernels (k16, v16 or kblocks,
// vblocks: blocks of `key_blocks` / `value_blocks`, a head's slice of a row at element 0). Each
// side has its own type.
struct KvRowsAt {
  const float* k = nullptr;
  const float* v = nullptr;
  const uint16_t* k16 = nullptr;
  const uint16_t* v16 = nullptr;
  const uint8_t* kblocks = nullptr;
  const uint8_t* vblocks = nullptr;
  KvType key_blocks = KvType::kQ8_0, value_blocks = KvType::kQ8_0;
  int64_t ldk = 0, ldv = 0;

  bool in_place(const UnitBuffers& buf) const {
    return k16 != nullptr || v16 != nullptr || vblocks != nullptr || kblocks != nullptr ||
           (v != nullptr && v != buf.vbuf) || (k != nullptr && k != buf.kbuf);
  }
  // The same rows, `heads` KV heads (heads * hd elements) on.
  KvRowsAt moved_by(int heads, int hd) const {
    const int64_t at = static_cast<int64_t>(heads) * hd;
    KvRowsAt r = *this;
    if (r.k16 != nullptr) r.k16 += at;
    if (r.v16 != nullptr) r.v16 += at;
    if (r.kblocks != nullptr) r.kblocks += kv_bytes_of(key_blocks, at);
    if (r.vblocks != nullptr) r.vblocks += kv_bytes_of(value_blocks, at);
    if (r.k != nullptr) r.k += at;
    if (r.v != nullptr) r.v += at;
    return r;
  }
};

// One block of a unit's keys as the products read them: one stretch of rows, or (a block across
// a shared prefix's last keys and the cache's first, read in place) two: keys [0, split) in
// part[0], [split, nb) in part[1].
struct BlockView {
  KvRowsAt part[2];
  int split = 0;                 // == nb with one part
  int nb = 0;                    // keys, trimmed after the last one some row of the unit may see
  const int64_t* pos = nullptr;  // [nb]: each key's position, -1 for an empty slot
  bool all_visible = false;      // every row sees every key: no mask to apply

  const KvRowsAt& rows() const { return part[0]; }  // (one part: gathered, or the tile path's)
  BlockView moved_by(int heads, int hd) const {
    BlockView b = *this;
    for (KvRowsAt& p : b.part) p = p.moved_by(heads, hd);
    return b;
  }
  // Calls f(part, first key of the part's own, keys, first key in the block) for each part's
  // share of keys [j_begin, j_end).
  template <class F>
  void for_parts(int j_begin, int j_end, F&& f) const {
    for (int i = 0; i < 2; ++i) {
      const int from = i == 0 ? 0 : split, to = i == 0 ? split : nb;
      const int lo = std::max(j_begin, from), hi = std::min(j_end, to);
      if (lo < hi) f(part[i], lo - from, hi - lo, lo);
    }
  }
};

// A run's rows of keys from `slot` on, for head 0 of `kv_head`'s offset, read in place.
KvRowsAt rows_in_place(const KvLayer& run, int slot, int kv_head, int hd) {
  const int64_t offset = slot * run.row_stride + static_cast<int64_t>(kv_head) * hd;
  KvRowsAt r;
  if (kv_type_has_blocks(run.key_type)) {
    r.kblocks = static_cast<const uint8_t*>(run.keys) + kv_bytes_of(run.key_type, offset);
    r.key_blocks = run.key_type;
  } else if (run.key_type == KvType::kF16) {
    r.k16 = static_cast<const uint16_t*>(run.keys) + offset;
  } else {
    r.k = static_cast<const float*>(run.keys) + offset;
  }
  if (kv_type_has_blocks(run.value_type)) {
    r.vblocks = static_cast<const uint8_t*>(run.values) + kv_bytes_of(run.value_type, offset);
    r.value_blocks = run.value_type;
  } else if (run.value_type == KvType::kF16) {
    r.v16 = static_cast<const uint16_t*>(run.values) + offset;
  } else {
    r.v = static_cast<const float*>(run.values) + offset;
  }
  r.ldk = r.ldv = run.row_stride;
  return r;
}

// Keys [j0, j0 + nb) of the unit's numbering as the products read them: in place (an fp32 cache
// in one run), or converted and gathered into the unit's buffers, piece by piece. The unit's keys
// are numbered across the runs, the prefix's slots first, and cut into blocks in that numbering:
// a sequence reading a shared prefix meets exactly the blocks (and rounds exactly as) a sequence
// holding the same slots in one cache. Keys after the last one a row can see are dropped (in an
// in-order cache, the future of a prefill's diagonal block): they would only add zeros.
// Returns false when no row of the unit (positions first_pos .. last_pos) sees any key.
// With in_place (the row path), the rows of any cache type are given as they are, a block across
// the prefix and the cache as its two parts, for the row path's kernels to widen as they read:
// no step copies a cache.
bool view_block(const KvLayer& kv, int kv_head, int hd, int j0, int nb, int64_t first_pos, int64_t last_pos,
                int64_t window, const UnitBuffers& buf, int64_t* pos_buf, BlockView* view,
                KvSides sides = KvSides::kBoth, bool in_place = false) {
  const int n_prefix = kv.prefix != nullptr ? kv.prefix->n_slots : 0;
  // The block's pieces: at most one per run, each its run, first slot, length and column.
  struct Piece {
    const KvLayer* run;
    int slot, count, column;
  };
  Piece pieces[2] = {};
  int n_pieces = 0;
  if (j0 < n_prefix) pieces[n_pieces++] = {kv.prefix, j0, std::min(nb, n_prefix - j0), 0};
  if (j0 + nb > n_prefix) {
    const int column = std::max(0, n_prefix - j0);
    pieces[n_pieces++] = {&kv, j0 + column - n_prefix, nb - column, column};
  }
  const int64_t* pos = pieces[0].run->positions + pieces[0].slot;
  if (n_pieces == 2) {
    for (const Piece& p : pieces) std::copy_n(p.run->positions + p.slot, p.count, pos_buf + p.column);
    pos = pos_buf;
  }
  int visible_end = 0;  // one past the last key some row sees
  bool all_visible = true;
  for (int j = 0; j < nb; ++j) {
    // Some row sees it: it is not in the future of the last row, nor out of the first row's window.
    if (pos[j] >= 0 && pos[j] <= last_pos && first_pos - pos[j] < window) visible_end = j + 1;
    all_visible &= pos[j] >= 0 && pos[j] <= first_pos && last_pos - pos[j] < window;
  }
  if (visible_end == 0) return false;
  nb = visible_end;
  while (n_pieces > 0 && pieces[n_pieces - 1].column >= nb) --n_pieces;
  pieces[n_pieces - 1].count = std::min(pieces[n_pieces - 1].count, nb - pieces[n_pieces - 1].column);

  *view = BlockView{};
  view->nb = nb;
  view->split = nb;
  view->pos = pos;
  view->all_visible = all_visible;
  const bool f32 = pieces[0].run->key_type == KvType::kF32 && pieces[0].run->value_type == KvType::kF32;
  const bool kivi = pieces[0].run->kivi != nullptr;  // (read only gathered)
  if (!kivi && (in_place || (n_pieces == 1 && f32))) {
    for (int i = 0; i < n_pieces; ++i) view->part[i] = rows_in_place(*pieces[i].run, pieces[i].slot, kv_head, hd);
    if (n_pieces == 2) view->split = pieces[1].column;
    return true;
  }
  for (int i = 0; i < n_pieces; ++i) {
    const Piece& p = pieces[i];
    gather_block(*p.run, kv_head, hd, p.slot, p.count, sides == KvSides::kValues ? nullptr : buf.kbuf + p.column * hd,
                 sides == KvSides::kKeys ? nullptr : buf.vbuf + p.column * hd);
  }
  view->part[0].k = sides == KvSides::kValues ? nullptr : buf.kbuf;
  view->part[0].v = sides == KvSides::kKeys ? nullptr : buf.vbuf;
  view->part[0].ldk = view->part[0].ldv = hd;
  return true;
}

// Query row r of a unit (Unit::head_of_row, Unit::token_of_row).
const float* query_row(const AttentionShape& sh, const float* q, const Unit& u, int r) {
  const int group = sh.n_head / sh.n_head_kv;
  const int64_t q_stride = static_cast<int64_t>(sh.n_head) * sh.head_dim;
  return q + u.token_of_row(group, r) * q_stride + static_cast<int64_t>(u.head_of_row(group, r)) * sh.head_dim;
}

// Reads a byte of every cache line of the whole rows (every KV head's) of the values, and keys, of
// the unit's keys [from, to), bringing them into the caches: returns their sum, for keep_loaded.
// (Loads, not prefetch instructions: on the Zen 5 machines measured, prefetches of these rows
// changed nothing.)
uint32_t pull_rows(const KvLayer& kv, int from, int to, bool keys) {
  const int n_prefix = kv.prefix != nullptr ? kv.prefix->n_slots : 0;
  uint32_t sum = 0;
  for (int j = from; j < to; ++j) {
    const KvLayer& run = j < n_prefix ? *kv.prefix : kv;
    const int slot = j < n_prefix ? j : j - n_prefix;
    if (slot >= run.n_slots) break;
    const size_t key_bytes = kv_bytes_of(run.key_type, run.row_stride);
    const size_t value_bytes = kv_bytes_of(run.value_type, run.row_stride);
    const auto* k = static_cast<const uint8_t*>(run.keys) + slot * key_bytes;
    const auto* v = static_cast<const uint8_t*>(run.values) + slot * value_bytes;
    for (size_t line = 0; keys && line < key_bytes; line += 64) sum += k[line];
    for (size_t line = 0; line < value_bytes; line += 64) sum += v[line];
  }
  return sum;
}

// Makes the loads that gave `sum` count (the compiler may not drop them).
void keep_loaded(uint32_t sum) { asm volatile("" : : "r"(sum)); }

// The heads of a unit (bit h: KV head kv_head + h) whose asynchronized softmax gave up.
using HeadMask = uint64_t;

// The row path of a unit (decode, and tiles of a few rows): gathers its query rows (pre-scaled by
// the score scale), then meets the slots a block at a time, a row of scores per query row. Scores of
// slots a row may not see are -inf. A unit of several KV heads meets each block with every head
// in turn, so that its keys' and values' rows are read whole, in memory order (a head's share of
// a row is a strided stream that wastes most of what the memory sends).
// With `phi` (decode: the previous step's maxima, [rows]), each block's exponentials are taken
// against one unified max per row (unified_max) and nothing is ever rescaled; the unit's state
// then carries m = that max, so the merge of split parts is a plain sum. A head whose scores leave
// the window (kAsyncLow, kAsyncHigh) around it stops there: its bit in the returned mask says that
// its rows of the state are to be discarded (and the head redone exactly: redo_exact).
// seen_max[r] gets row r's largest visible score.
HeadMask run_unit_rows(const AttentionShape& sh, const float* q, const KvLayer& kv, int64_t q_pos0, const Unit& u,
                       const UnitBuffers& buf, const TileState& st, const float* phi, float* seen_max,
                       const StepsInput* pre = nullptr) {
  const int group = sh.n_head / sh.n_head_kv, hd = sh.head_dim;
  const int head_rows = u.rows_per_head(group);
  const int rows = head_rows * u.n_kv_heads;
  const float scale = sh.score_scale();
  float* scores = buf.scores;
  for (int r = 0; r < rows; ++r) {
    if (pre == nullptr) {  // (a checking pass took the scores already)
      const float* src = query_row(sh, q, u, r);
      for (int c = 0; c < hd; ++c) buf.qt[r * hd + c] = src[c] * scale;
    }
    st.m[r] = phi != nullptr ? unified_max(phi, r) : -INFINITY;
    st.l[r] = 0.0f;
    seen_max[r] = -INFINITY;
    std::fill(st.acc + r * hd, st.acc + (r + 1) * hd, 0.0f);
  }
  const bool int8 = pre == nullptr && scores_in_int8(kv, hd);
  if (int8) quantize_query_rows(buf.qt, rows, hd, buf.q8, buf.q8_scales);
  const int64_t first_pos = q_pos0 + u.token_begin, last_pos = q_pos0 + u.token_end - 1;
  const int64_t window = window_of(sh);
  int64_t pos_buf[kKeyBlock];
  HeadMask gave_up = 0;
  uint32_t pulled = 0;
  const auto gives_up = [&](int h) { return (gave_up >> h & 1) != 0; };
  // Head h's rows and their state.
  const auto scores_of = [&](int h) { return scores + h * head_rows * kKeyBlock; };
  const auto qt_of = [&](int h) { return buf.qt + h * head_rows * hd; };
  // scores[rows][j_begin .. j_end) of head h = qt · Kᵀ (a checking pass took them already: the
  // same sums).
  const auto score_keys = [&](int h, const BlockView& b, int j0, int j_begin, int j_end) {
    if (pre != nullptr) {
      float* s = scores_of(h) + j_begin;
      for (int r = 0; r < head_rows; ++r) {
        std::copy_n(pre->scores + (h * head_rows + r) * pre->scores_ld + j0 + j_begin, j_end - j_begin, s + r * kKeyBlock);
      }
      return;
    }
    b.for_parts(j_begin, j_end, [&](const KvRowsAt& at, int first, int n, int column) {
      float* s = scores_of(h) + column;
      if (int8 && at.kblocks != nullptr) {
        score_in_int8(at.key_blocks, at.kblocks + kv_bytes_of(at.key_blocks, first * at.ldk), at.ldk, n,
                      buf.q8 + h * head_rows * hd, buf.q8_scales + h * head_rows * (hd / 32), head_rows, hd, s, kKeyBlock);
      } else if (at.kblocks != nullptr) {
        const uint8_t* k = at.kblocks + kv_bytes_of(at.key_blocks, first * at.ldk);
        if (at.key_blocks == KvType::kQ8_0) {
          HWY_DYNAMIC_DISPATCH(ScoreRowsQ8)(qt_of(h), head_rows, hd, k, at.ldk, n, s, kKeyBlock);
        } else {
          HWY_DYNAMIC_DISPATCH(ScoreRowsQ4)(qt_of(h), head_rows, hd, k, at.ldk, n, s, kKeyBlock);
        }
      } else if (at.k16 != nullptr) {
        HWY_DYNAMIC_DISPATCH(ScoreRowsF16)(qt_of(h), head_rows, hd, at.k16 + first * at.ldk, at.ldk, n, s, kKeyBlock);
      } else {
        HWY_DYNAMIC_DISPATCH(ScoreRows)(qt_of(h), head_rows, hd, at.k + first * at.ldk, at.ldk, n, s, kKeyBlock);
      }
    });
  };
  // Head h's scores of the block masked and turned into weights, its state brought up to them;
  // false when its asynchronized softmax must give up (see above).
  const auto soften = [&](int h, const BlockView& b) {
    const int r0 = h * head_rows;
    for (int r = 0; r < head_rows; ++r) {
      float* s = scores_of(h) + r * kKeyBlock;
      if (!b.all_visible) {
        const int64_t row_pos = q_pos0 + u.token_begin + r / group;
        for (int j = 0; j < b.nb; ++j) {
          if (b.pos[j] < 0 || b.pos[j] > row_pos || row_pos - b.pos[j] >= window) s[j] = -INFINITY;
        }
      }
      if (phi != nullptr) {
        float block_max = -INFINITY;
        st.l[r0 + r] += HWY_DYNAMIC_DISPATCH(ExpBlockRow)(s, b.nb, unified_max(phi, r0 + r), &block_max);
        seen_max[r0 + r] = std::max(seen_max[r0 + r], block_max);
        if (block_max > unified_max(phi, r0 + r) + kAsyncHigh) return false;
        continue;
      }
      const float m_old = st.m[r0 + r];
      float m_new = m_old;
      const float sum = HWY_DYNAMIC_DISPATCH(SoftmaxBlockRow)(s, b.nb, &m_new);
      seen_max[r0 + r] = m_new;
      // Rescale what the row has gathered so far to the new max (exp(-inf) = 0 on the first block).
      const float alpha = m_old == m_new ? 1.0f : std::exp(m_old - m_new);
      st.m[r0 + r] = m_new;
      st.l[r0 + r] = st.l[r0 + r] * alpha + sum;
      if (alpha != 1.0f) {
        for (int c = 0; c < hd; ++c) st.acc[(r0 + r) * hd + c] *= alpha;
      }
    }
    return true;
  };
  // acc[rows of head h][hd] += P · V over keys [j_begin, j_end) of the block.
  const auto accumulate_values = [&](int h, const BlockView& b, int j_begin, int j_end) {
    float* acc = st.acc + h * head_rows * hd;
    b.for_parts(j_begin, j_end, [&](const KvRowsAt& at, int first, int n, int column) {
      const float* p = scores_of(h) + column;
      if (at.vblocks != nullptr) {
        const uint8_t* v = at.vblocks + kv_bytes_of(at.value_blocks, first * at.ldv);
        if (at.value_blocks == KvType::kQ8_0) {
          HWY_DYNAMIC_DISPATCH(AccumulateRowsQ8)(p, head_rows, kKeyBlock, v, at.ldv, n, hd, acc);
        } else {
          HWY_DYNAMIC_DISPATCH(AccumulateRowsQ4)(p, head_rows, kKeyBlock, v, at.ldv, n, hd, acc);
        }
      } else if (at.v16 != nullptr) {
        HWY_DYNAMIC_DISPATCH(AccumulateRowsF16)(p, head_rows, kKeyBlock, at.v16 + first * at.ldv, at.ldv, n, hd, acc);
      } else {
        HWY_DYNAMIC_DISPATCH(AccumulateRows)(p, head_rows, kKeyBlock, at.v + first * at.ldv, at.ldv, n, hd, acc);
      }
    });
  };
  // Every head of the unit meets keys [j0, j0 + nb). Read in place, the block's rows are read in
  // memory order, every head's share of a few keys' rows at a time: the keys for the scores,
  // then the values for the sums (each key's sum, and each output's sum over the keys in key
  // order, is the same whatever the cut). Gathered (a block across two runs), head by head.
  const auto meet_block = [&](int j0, int nb) {
    BlockView b0;
    const KvSides sides = pre != nullptr ? KvSides::kValues : KvSides::kBoth;
    if (!view_block(kv, u.kv_head, hd, j0, nb, first_pos, last_pos, window, buf, pos_buf, &b0, sides,
                    /*in_place=*/true)) {
      return;  // (the same slots for every head)
    }
    const bool in_place = b0.part[0].in_place(buf);
    if (!in_place || u.n_kv_heads == 1) {
      for (int h = 0; h < u.n_kv_heads; ++h) {
        if (gives_up(h)) continue;
        BlockView b = b0;
        if (h > 0) view_block(kv, u.kv_head + h, hd, j0, nb, first_pos, last_pos, window, buf, pos_buf, &b, sides, true);
        score_keys(h, b, j0, 0, b.nb);
        if (!soften(h, b)) {
          gave_up |= HeadMask{1} << h;
          continue;
        }
        accumulate_values(h, b, 0, b.nb);
      }
      return;
    }
    constexpr int kScoreKeys = 16, kValueKeys = 32;
    // The next block's rows are read ahead, all at once: at depth the cache comes from memory,
    // and a burst of loads keeps many more lines on their way than the prefetchers do on this
    // access (about 1.4-1.8x the decode attention's speed on a Zen 5 pair; see bench/README.md).
    pulled += pull_rows(kv, std::min(j0 + kKeyBlock, u.key_end), std::min(j0 + 2 * kKeyBlock, u.key_end), pre == nullptr);
    for (int j = 0; j < b0.nb; j += kScoreKeys) {
      for (int h = 0; h < u.n_kv_heads; ++h) {
        if (!gives_up(h)) score_keys(h, b0.moved_by(h, hd), j0, j, std::min(b0.nb, j + kScoreKeys));
      }
    }
    for (int h = 0; h < u.n_kv_heads; ++h) {
      if (!gives_up(h) && !soften(h, b0)) gave_up |= HeadMask{1} << h;
    }
    for (int j = 0; j < b0.nb; j += kValueKeys) {
      for (int h = 0; h < u.n_kv_heads; ++h) {
        if (!gives_up(h)) accumulate_values(h, b0.moved_by(h, hd), j, std::min(b0.nb, j + kValueKeys));
      }
    }
  };
  for (int j0 = u.key_begin; j0 < u.key_end; j0 += kKeyBlock) meet_block(j0, std::min(kKeyBlock, u.key_end - j0));
  keep_loaded(pulled);
  if (phi != nullptr) {
    for (int r = 0; r < rows; ++r) {
      const int h = r / head_rows;
      if (gave_up >> h & 1) continue;
      // A row that saw keys, all far below phi: its exponentials lost precision.
      if (seen_max[r] != -INFINITY && seen_max[r] < unified_max(phi, r) + kAsyncLow) gave_up |= HeadMask{1} << h;
      // A row that saw no key (a split part all empty slots or out of the window) holds nothing:
      // its max is none, not phi, so that a merge with exact parts does not scale to phi.
      if (seen_max[r] == -INFINITY) st.m[r] = -INFINITY;
    }
  }
  return gave_up;
}

// Runs again, with the exact online softmax, the heads of unit u that its asynchronized run gave
// up on (run_unit_rows' mask), each alone into its rows of the state.
void redo_exact(const AttentionShape& sh, const float* q, const KvLayer& kv, int64_t q_pos0, const Unit& u,
                const UnitBuffers& buf, const TileState& st, float* seen_max, HeadMask gave_up,
                const StepsInput* pre = nullptr) {
  const int head_rows = u.rows_per_head(sh.n_head / sh.n_head_kv);
  for (int h = 0; h < u.n_kv_heads; ++h) {
    if ((gave_up >> h & 1) == 0) continue;
    Unit one = u;
    one.kv_head = u.kv_head + h;
    one.n_kv_heads = 1;
    StepsInput head_pre;
    if (pre != nullptr) head_pre = StepsInput{pre->scores + h * head_rows * pre->scores_ld, pre->scores_ld};
    run_unit_rows(sh, q, kv, q_pos0, one, buf, state_rows(st, h * head_rows, sh.head_dim), nullptr,
                  seen_max + h * head_rows, pre != nullptr ? &head_pre : nullptr);
  }
}

// The tile path of a unit (prefill): the same online softmax with the query rows in vector
// lanes (TileMeetBlock), the tile's state held transposed in buf's tile buffers and written to
// `st` in its usual layout at the end.
void run_unit_tile(const AttentionShape& sh, const float* q, const KvLayer& kv, int64_t q_pos0, const Unit& u,
                   const UnitBuffers& buf, const TileState& st, float* seen_max) {
  const int group = sh.n_head / sh.n_head_kv, hd = sh.head_dim;
  const int rows = (u.token_end - u.token_begin) * group;
  const int ld = HWY_DYNAMIC_DISPATCH(TileRowWidth)(rows);
  const float scale = sh.score_scale();
  float* qT = buf.qt;
  std::fill_n(qT, static_cast<size_t>(hd) * ld, 0.0f);
  std::fill_n(buf.acc_t, static_cast<size_t>(hd) * ld, 0.0f);
  std::fill_n(buf.m_t, ld, -INFINITY);
  std::fill_n(buf.l_t, ld, 0.0f);
  for (int r = 0; r < rows; ++r) {
    const float* src = query_row(sh, q, u, r);
    for (int c = 0; c < hd; ++c) qT[c * ld + r] = src[c] * scale;
  }
  const int64_t first_pos = q_pos0 + u.token_begin, last_pos = q_pos0 + u.token_end - 1;
  const int64_t window = window_of(sh);
  int64_t pos_buf[kKeyBlock];
  int visible_from[kKeyBlock], visible_to[kKeyBlock];
  for (int j0 = u.key_begin; j0 < u.key_end; j0 += kKeyBlock) {
    BlockView b;
    if (!view_block(kv, u.kv_head, hd, j0, std::min(kKeyBlock, u.key_end - j0), first_pos, last_pos, window, buf,
                    pos_buf, &b)) {
      continue;
    }
    // Row r (token r / group, at position first_pos + r / group) sees key j from r = (pos[j] -
    // first_pos) * group on, until its window has passed the key: r = (pos[j] + window -
    // first_pos) * group.
    for (int j = 0; !b.all_visible && j < b.nb; ++j) {
      // The first row of a token, clamped to the tile (the token first: no window's end overflows).
      const auto row_at = [&](int64_t token) { return static_cast<int>(std::min<int64_t>(std::clamp<int64_t>(token, 0, ld) * group, ld)); };
      visible_from[j] = b.pos[j] < 0 ? ld : row_at(b.pos[j] - first_pos);
      visible_to[j] = b.pos[j] < 0 ? ld : row_at(b.pos[j] + window - first_pos);
    }
    HWY_DYNAMIC_DISPATCH(TileMeetBlock)(qT, ld, hd, b.rows().k, b.rows().ldk, b.rows().v, b.rows().ldv, b.nb, b.all_visible ? nullptr : visible_from,
                                        b.all_visible ? nullptr : visible_to, buf.scores, buf.m_t, buf.l_t, buf.acc_t);
  }
  for (int r = 0; r < rows; ++r) {
    st.m[r] = seen_max[r] = buf.m_t[r];
    st.l[r] = buf.l_t[r];
    for (int c = 0; c < hd; ++c) st.acc[r * hd + c] = buf.acc_t[c * ld + r];
  }
}

// Runs one unit into `st` (see run_unit_rows): tiles of more than kDirectRows rows (per KV head)
// take the tile path, unless the asynchronized softmax (decode) asks for the row path's fixed
// max. Returns the heads the asynchronized softmax gave up on.
HeadMask run_unit(const AttentionShape& sh, const float* q, const KvLayer& kv, int64_t q_pos0, const Unit& u,
                  const UnitBuffers& buf, const TileState& st, const float* phi, float* seen_max) {
  if (phi == nullptr && u.rows_per_head(sh.n_head / sh.n_head_kv) > kDirectRows) {
    run_unit_tile(sh, q, kv, q_pos0, u, buf, st, seen_max);
    return 0;
  }
  return run_unit_rows(sh, q, kv, q_pos0, u, buf, st, phi, seen_max);
}

// Writes a finished tile to the output: acc / l per row. A head's sink (gpt-oss) adds its term to
// the denominator, exp(sink - m) in the row's own scale (m: the max its sums are relative to).
void store_unit(const AttentionShape& sh, const Unit& u, const TileState& st, float* out) {
  const int group = sh.n_head / sh.n_head_kv, hd = sh.head_dim;
  const int rows = u.rows_per_head(group) * u.n_kv_heads;
  for (int r = 0; r < rows; ++r) {
    const int head = u.head_of_row(group, r);
    float* dst = out + u.token_of_row(group, r) * static_cast<int64_t>(sh.n_head) * hd + head * hd;
    float l = st.l[r];
    if (sh.sinks != nullptr && st.m[r] != -INFINITY) l += std::exp(sh.sinks[head] - st.m[r]);
    const float inv = l > 0 ? 1.0f / l : 0.0f;
    for (int c = 0; c < hd; ++c) dst[c] = st.acc[r * hd + c] * inv;
  }
}

// Merges the split partial states of one KV head's decode row r into `first` (the standard
// rescaling merge: every part is brought to the common max before summing).
void merge_splits(const TileState* parts, int n_parts, int rows, int hd) {
  const TileState& first = parts[0];
  for (int r = 0; r < rows; ++r) {
    float m = -INFINITY;
    for (int p = 0; p < n_parts; ++p) m = std::max(m, parts[p].m[r]);
    if (m == -INFINITY) continue;
    float l = 0.0f;
    for (int p = 0; p < n_parts; ++p) {
      const float w = parts[p].m[r] == -INFINITY ? 0.0f : std::exp(parts[p].m[r] - m);
      l += parts[p].l[r] * w;
      for (int c = 0; c < hd; ++c) {
        const float scaled = parts[p].acc[r * hd + c] * w;
        first.acc[r * hd + c] = p == 0 ? scaled : first.acc[r * hd + c] + scaled;
      }
    }
    first.m[r] = m;
    first.l[r] = l;
  }
}

}  // namespace

float* AttentionScratch::thread_buffer(int thread, size_t floats) {
  if (per_thread_.size() <= static_cast<size_t>(thread)) per_thread_.resize(static_cast<size_t>(thread) + 1);
  std::vector<float>& b = per_thread_[static_cast<size_t>(thread)];
  if (b.size() < floats) b.resize(floats);
  return b.data();
}

float* AttentionScratch::partials(size_t floats) {
  if (partials_.size() < floats) partials_.resize(floats);
  return partials_.data();
}

float* AttentionScratch::steps(size_t floats) {
  if (steps_.size() < floats) steps_.resize(floats);
  return steps_.data();
}

namespace {

AttentionPlan plan_job(const AttentionShape& sh, const AttentionJob& job, int tokens_per_tile, int n_threads) {
  AttentionPlan p;
  p.token_tiles = (job.n_tokens + tokens_per_tile - 1) / tokens_per_tile;
  p.n_keys = job.kv.n_slots + (job.kv.prefix != nullptr ? job.kv.prefix->n_slots : 0);
  // Decode: split the keys so that every thread has work even with few KV heads. The split
  // depends on this job alone (never on the others of a batch): its result does too.
  // With keys enough for every thread, each split is a unit of all the KV heads (reading the
  // cache's rows whole), two per thread; otherwise a unit is one head's split.
  const int most_splits = std::clamp(p.n_keys / kMinKeysPerSplit, 1, kMaxSplits);
  const int group = sh.n_head / sh.n_head_kv;
  if (job.n_tokens == 1 && group <= kDirectRows && sh.n_head_kv <= kMaxUnitHeads && most_splits >= n_threads) {
    p.whole_heads = true;
    p.splits = std::min(2 * n_threads, most_splits);
  } else if (job.n_tokens == 1 && sh.n_head_kv < 2 * n_threads) {
    p.splits = std::clamp((2 * n_threads + sh.n_head_kv - 1) / sh.n_head_kv, 1, most_splits);
  }
  // Asynchronized softmax for decode, once the previous step has given every head its max.
  p.async = job.softmax_phi != nullptr && job.n_tokens == 1;
  for (int h = 0; p.async && h < sh.n_head; ++h) p.async = std::isfinite(job.softmax_phi[h]);
  return p;
}

}  // namespace

void attention_causal(const AttentionShape& sh, const float* q, const KvLayer& kv, int64_t q_pos0, int n_tokens,
                      float* out, AttentionScratch& scratch, int n_threads, float* softmax_phi) {
  const AttentionJob job{q, kv, q_pos0, n_tokens, out, softmax_phi};
  attention_batch(sh, std::span<const AttentionJob>(&job, 1), scratch, n_threads);
}

void attention_batch(const AttentionShape& sh, std::span<const AttentionJob> jobs, AttentionScratch& scratch,
                     int n_threads) {
  const int group = sh.n_head / sh.n_head_kv, hd = sh.head_dim;
  const int tokens_per_tile = std::max(1, kQueryRows / group);
  // A unit's rows: a prefill tile's, or a decode unit's of every head.
  const int rows_max = std::max(tokens_per_tile * group, sh.n_head);
  // Room for a tile's rows rounded up to whole vectors of any target (TileRowWidth).
  const int rows_cap = (rows_max + 63) / 64 * 64;
  const size_t state_floats = static_cast<size_t>(rows_max) * (2 + hd);

  // Every job's units in one numbering (job_of_unit: the job of each); split units' partial
  // states in one buffer.
  std::vector<AttentionPlan>& plans = scratch.plans;
  plans.resize(jobs.size());
  std::vector<int>& job_of_unit = scratch.job_of_unit;
  job_of_unit.clear();
  size_t n_split_units = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    plans[i] = plan_job(sh, jobs[i], tokens_per_tile, n_threads);
    plans[i].first_unit = static_cast<int>(job_of_unit.size());
    plans[i].first_partial = n_split_units;
    const int units = (plans[i].whole_heads ? 1 : sh.n_head_kv) * plans[i].token_tiles * plans[i].splits;
    job_of_unit.insert(job_of_unit.end(), static_cast<size_t>(units), static_cast<int>(i));
    if (plans[i].splits > 1) n_split_units += static_cast<size_t>(units);
  }
  const int n_units = static_cast<int>(job_of_unit.size());
  // Buffers are sized before the parallel region: growing them inside would race.
  float* partials = n_split_units > 0 ? scratch.partials(n_split_units * (state_floats + rows_max)) : nullptr;
  float* unit_max = partials != nullptr ? partials + n_split_units * state_floats : nullptr;  // [units][rows]
  const size_t thread_floats =
      static_cast<size_t>(rows_cap) * (2 * hd + kKeyBlock + 2) + 2 * static_cast<size_t>(kKeyBlock) * hd +
      state_floats + rows_max + query_codes_floats(rows_cap, hd);
  for (int t = 0; t < n_threads; ++t) scratch.thread_buffer(t, thread_floats);

  const auto state_at = [&](float* base) { return TileState{base, base + rows_max, base + 2 * rows_max}; };
  // Unit `index` of its job: KV head, token tile and key split.
  const auto unit_at = [&](const AttentionPlan& p, const AttentionJob& job, int index) {
    // The last tokens of a prefill see the most keys: their tiles (of every KV head) come first,
    // so that the dynamic schedule ends on the cheapest units.
    const int heads = p.whole_heads ? 1 : sh.n_head_kv;
    const int split = index % p.splits, g = (index / p.splits) % heads;
    const int tile = p.token_tiles - 1 - index / p.splits / heads;
    Unit u{g, tile * tokens_per_tile, std::min(job.n_tokens, (tile + 1) * tokens_per_tile), 0, p.n_keys};
    if (p.whole_heads) u.n_kv_heads = sh.n_head_kv;
    if (p.splits > 1) {
      const int per = (p.n_keys + p.splits - 1) / p.splits;
      u.key_begin = std::min(p.n_keys, split * per);
      u.key_end = std::min(p.n_keys, (split + 1) * per);
    }
    return u;
  };
  // A split job's KV head g, merged: (job, g) pairs in one numbering.
  std::vector<std::pair<int, int>>& merges = scratch.merges;
  merges.clear();
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (plans[i].splits == 1) continue;
    for (int g = 0; g < sh.n_head_kv; ++g) merges.emplace_back(static_cast<int>(i), g);
  }
#pragma omp parallel num_threads(n_threads)
  {
    const int t = omp_get_thread_num();
    float* buf = scratch.thread_buffer(t, thread_floats);
    UnitBuffers ub;
    ub.qt = buf;
    ub.scores = ub.qt + rows_cap * hd;
    ub.kbuf = ub.scores + rows_cap * kKeyBlock;
    ub.vbuf = ub.kbuf + kKeyBlock * hd;
    float* own_state = ub.vbuf + kKeyBlock * hd;
    float* own_max = own_state + state_floats;
    ub.acc_t = own_max + rows_max;
    ub.m_t = ub.acc_t + rows_cap * hd;
    ub.l_t = ub.m_t + rows_cap;
    place_query_codes(ub, ub.l_t + rows_cap, rows_cap, hd);
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < n_units; ++i) {
      const AttentionJob& job = jobs[static_cast<size_t>(job_of_unit[static_cast<size_t>(i)])];
      const AttentionPlan& p = plans[static_cast<size_t>(job_of_unit[static_cast<size_t>(i)])];
      const int local = i - p.first_unit;
      const Unit u = unit_at(p, job, local);
      const size_t split_index = p.first_partial + static_cast<size_t>(local);
      const TileState st = state_at(p.splits > 1 ? partials + split_index * state_floats : own_state);
      float* seen = p.splits > 1 ? unit_max + split_index * rows_max : own_max;
      const float* phi = p.async ? job.softmax_phi + u.kv_head * group : nullptr;
      const HeadMask gave_up = run_unit(sh, job.q, job.kv, job.q_pos0, u, ub, st, phi, seen);
      if (gave_up != 0 && u.n_kv_heads == 1) {
        run_unit(sh, job.q, job.kv, job.q_pos0, u, ub, st, nullptr, seen);
      } else if (gave_up != 0) {
        redo_exact(sh, job.q, job.kv, job.q_pos0, u, ub, st, seen, gave_up);
      }
      if (p.splits == 1) {
        store_unit(sh, u, st, job.out);
        if (job.softmax_phi != nullptr && job.n_tokens == 1) {
          std::copy_n(seen, group * u.n_kv_heads, job.softmax_phi + u.kv_head * group);
        }
      }
    }
    if (!merges.empty()) {
#pragma omp for schedule(static)
      for (size_t m = 0; m < merges.size(); ++m) {
        const auto [ji, g] = merges[m];
        const AttentionJob& job = jobs[static_cast<size_t>(ji)];
        const AttentionPlan& p = plans[static_cast<size_t>(ji)];
        // Head g's split parts: units of their own, or rows of every split's whole-heads unit.
        const size_t first = p.first_partial + static_cast<size_t>(p.whole_heads ? 0 : g * p.splits);
        const int row0 = p.whole_heads ? g * group : 0;
        TileState parts[kMaxSplits];
        for (int s = 0; s < p.splits; ++s) parts[s] = state_rows(state_at(partials + (first + s) * state_floats), row0, hd);
        merge_splits(parts, p.splits, group, hd);
        store_unit(sh, Unit{g, 0, 1, 0, p.n_keys}, parts[0], job.out);
        if (job.softmax_phi != nullptr) {  // the next step's unified max: this step's, over every part
          for (int r = 0; r < group; ++r) {
            float mx = -INFINITY;
            for (int s = 0; s < p.splits; ++s) mx = std::max(mx, unit_max[(first + s) * rows_max + row0 + r]);
            job.softmax_phi[g * group + r] = mx;
          }
        }
      }
    }
  }
}

namespace {

// attention_steps' shared buffers (every row's scores) may take this much; a longer checking
// pass runs its rows as decode calls one after the other (the same results).
constexpr size_t kMaxStepsBytes = size_t{64} << 20;

// attention_steps the plain way: each row a decode call of its own.
void attention_steps_one_by_one(const AttentionShape& sh, const AttentionJob& job, AttentionScratch& scratch,
                                int n_threads) {
  const int64_t q_stride = static_cast<int64_t>(sh.n_head) * sh.head_dim;
  for (int i = 0; i < job.n_tokens; ++i) {
    const AttentionJob row{job.q + i * q_stride, job.kv, job.q_pos0 + i, 1, job.out + i * q_stride, job.softmax_phi};
    attention_batch(sh, std::span<const AttentionJob>(&row, 1), scratch, n_threads);
    if (job.softmax_phi != nullptr && job.step_phi != nullptr) std::copy_n(job.softmax_phi, sh.n_head, job.step_phi[i]);
  }
}

// Positions of the keys in the unit numbering (the prefix's slots first).
void number_positions(const KvLayer& kv, std::vector<int64_t>& pos) {
  const int n_prefix = kv.prefix != nullptr ? kv.prefix->n_slots : 0;
  pos.resize(static_cast<size_t>(n_prefix + kv.n_slots));
  if (n_prefix > 0) std::copy_n(kv.prefix->positions, n_prefix, pos.begin());
  std::copy_n(kv.positions, kv.n_slots, pos.begin() + n_prefix);
}

// One checking pass of attention_steps: its sizes, where its shared numbers lie (every row's
// scores per KV head, each row's maxima, the split units' partial states) and its steps, each
// the body of an `omp for` (so that every thread runs its share).
struct StepsPass {
  const AttentionShape& sh;
  const AttentionJob& job;
  int group, hd, n_kv, n_rows, n_keys, splits;
  int rows_all;  // one KV head's query rows, every token's
  size_t score_floats, unit_state, n_units, shared;
  int64_t q_stride, window;
  int n_blocks;
  float* base = nullptr;      // [n_kv][rows_all][n_keys]: every row's scores
  float* row_max = nullptr;   // [n_rows][n_head]: each row's maxima
  float* partials = nullptr;  // [n_units][unit_state]: the split units' states
  float* unit_max = nullptr;  // [n_units][group]
  const int64_t* pos = nullptr;   // the keys' positions, in the unit numbering
  char* row_async = nullptr;      // [n_rows]: whether a row's phi is known

  // A row as attention_batch plans its decode step: every row the same, over the same cache.
  StepsPass(const AttentionShape& shape, const AttentionJob& pass, const AttentionPlan& plan)
      : sh(shape), job(pass), group(sh.n_head / sh.n_head_kv), hd(sh.head_dim), n_kv(sh.n_head_kv),
        n_rows(job.n_tokens), n_keys(plan.n_keys), splits(plan.splits), rows_all(n_rows * group),
        score_floats(static_cast<size_t>(rows_all) * n_keys), unit_state(static_cast<size_t>(group) * (2 + hd)),
        n_units(static_cast<size_t>(n_kv) * n_rows * splits),
        shared(n_kv * score_floats + static_cast<size_t>(n_rows) * sh.n_head +
               (splits > 1 ? n_units * (unit_state + group) : 0)),
        q_stride(static_cast<int64_t>(sh.n_head) * hd), window(window_of(sh)),
        n_blocks((n_keys + kKeyBlock - 1) / kKeyBlock) {}

  // Exact-path decode units of more than kDirectRows rows take the tile path, whose scores
  // (and maxima) round otherwise than these: such shapes, and long passes, go row by row.
  bool runs_rows_together() const {
    return n_rows != 1 && group <= kDirectRows && shared * sizeof(float) <= kMaxStepsBytes;
  }
  size_t thread_floats() const {
    return static_cast<size_t>(rows_all) * hd + 2 * static_cast<size_t>(kKeyBlock) * hd +
           static_cast<size_t>(group) * kKeyBlock + unit_state + group + query_codes_floats(rows_all, hd);
  }

  // Lays the shared numbers out in the scratch, and sizes every thread's buffer.
  void bind(AttentionScratch& scratch, int n_threads) {
    base = scratch.steps(shared);
    row_max = base + n_kv * score_floats;
    partials = row_max + static_cast<size_t>(n_rows) * sh.n_head;
    unit_max = partials + n_units * unit_state;
    number_positions(job.kv, scratch.step_positions);
    pos = scratch.step_positions.data();
    scratch.step_async.assign(static_cast<size_t>(n_rows), 0);
    row_async = scratch.step_async.data();
    for (int t = 0; t < n_threads; ++t) scratch.thread_buffer(t, thread_floats());
  }

  float* scores_of(int g) const { return base + static_cast<size_t>(g) * score_floats; }
  TileState state_at(float* at) const { return TileState{at, at + group, at + 2 * group}; }
  // A row's phi: the caller's for the first row, the row before's maxima for the others.
  const float* phi_of(int row) const {
    return row == 0 ? job.softmax_phi : row_max + static_cast<size_t>(row - 1) * sh.n_head;
  }
  Unit split_unit(int g, int s) const {
    Unit u{g, 0, 1, 0, n_keys};
    if (splits > 1) {
      const int per = (n_keys + splits - 1) / splits;
      u.key_begin = std::min(n_keys, s * per);
      u.key_end = std::min(n_keys, (s + 1) * per);
    }
    return u;
  }

  // 1. For KV head and block of keys i: every row's scores, the keys converted once for them all.
  void score_block(int i, const UnitBuffers& ub, int64_t* pos_buf) const {
    const int g = i / n_blocks, j0 = (i % n_blocks) * kKeyBlock;
    BlockView b;
    if (!view_block(job.kv, g, hd, j0, std::min(kKeyBlock, n_keys - j0), job.q_pos0, job.q_pos0 + n_rows - 1, window,
                    ub, pos_buf, &b, KvSides::kKeys)) {
      return;
    }
    const Unit all{g, 0, n_rows, 0, n_keys};
    const float scale = sh.score_scale();
    for (int r = 0; r < rows_all; ++r) {
      const float* src = query_row(sh, job.q, all, r);
      for (int c = 0; c < hd; ++c) ub.qt[r * hd + c] = src[c] * scale;
    }
    if (!scores_in_int8(job.kv, hd)) {
      HWY_DYNAMIC_DISPATCH(ScoreRows)(ub.qt, rows_all, hd, b.rows().k, b.rows().ldk, b.nb, scores_of(g) + j0, n_keys);
      return;
    }
    // The decode path's int8 scores (run_unit_rows), on the q8_0 rows in place: the same sums.
    quantize_query_rows(ub.qt, rows_all, hd, ub.q8, ub.q8_scales);
    view_block(job.kv, g, hd, j0, std::min(kKeyBlock, n_keys - j0), job.q_pos0, job.q_pos0 + n_rows - 1, window, ub,
               pos_buf, &b, KvSides::kKeys, /*in_place=*/true);
    b.for_parts(0, b.nb, [&](const KvRowsAt& at, int first, int n, int column) {
      score_in_int8(at.key_blocks, at.kblocks + kv_bytes_of(at.key_blocks, first * at.ldk), at.ldk, n, ub.q8,
                    ub.q8_scales, rows_all, hd, scores_of(g) + j0 + column, n_keys);
    });
  }

  // 2. Row i's (of a KV head) maxima over the keys it sees: the phi of the next row's
  // asynchronized softmax.
  void row_maxima(int i) const {
    const int g = i / n_rows, row = i % n_rows;
    const int64_t row_pos = job.q_pos0 + row;
    const float* scores = scores_of(g) + static_cast<size_t>(row) * group * n_keys;
    for (int r = 0; r < group; ++r) {
      float mx = -INFINITY;
      for (int j = 0; j < n_keys; ++j) {
        const int64_t p = pos[static_cast<size_t>(j)];
        if (p >= 0 && p <= row_pos && row_pos - p < window) mx = std::max(mx, scores[r * n_keys + j]);
      }
      row_max[static_cast<size_t>(row) * sh.n_head + g * group + r] = mx;
    }
  }
  // Which rows run the asynchronized softmax: those whose phi is known and finite throughout.
  void mark_async_rows() const {
    for (int row = 0; row < n_rows; ++row) {
      const float* phi = phi_of(row);
      bool known = job.softmax_phi != nullptr;
      for (int h = 0; known && h < sh.n_head; ++h) known = std::isfinite(phi[h]);
      row_async[static_cast<size_t>(row)] = known ? 1 : 0;
    }
  }

  // 3. Decode unit i of every row's (a row's split parts as attention_batch cuts them), reading
  // the values as its decode step does and its scores from step 1; `own`: this thread's state
  // and maxima where the unit is not split.
  void run_unit(size_t i, const UnitBuffers& ub, float* own_state, float* own_max) const {
    const int s = static_cast<int>(i % splits), row = static_cast<int>(i / splits % n_rows);
    const int g = static_cast<int>(i / splits / n_rows);
    const Unit u = split_unit(g, s);
    const StepsInput pre{scores_of(g) + static_cast<size_t>(row) * group * n_keys, n_keys};
    const float* phi = phi_of(row);
    const TileState st = state_at(splits > 1 ? partials + i * unit_state : own_state);
    float* seen = splits > 1 ? unit_max + i * group : own_max;
    const float* q_row = job.q + row * q_stride;
    const int64_t row_pos = job.q_pos0 + row;
    const bool async = row_async[static_cast<size_t>(row)] != 0;
    if (run_unit_rows(sh, q_row, job.kv, row_pos, u, ub, st, async ? phi + g * group : nullptr, seen, &pre) != 0) {
      run_unit_rows(sh, q_row, job.kv, row_pos, u, ub, st, nullptr, seen, &pre);
    }
    if (splits == 1) store_unit(sh, u, st, job.out + row * q_stride);
  }
  // 4. (Split units only) row i's (of a KV head) parts merged into its output.
  void merge_row(int i) const {
    const int g = i / n_rows, row = i % n_rows;
    const size_t first = static_cast<size_t>(i) * splits;
    TileState parts[kMaxSplits];
    for (int s = 0; s < splits; ++s) parts[s] = state_at(partials + (first + s) * unit_state);
    merge_splits(parts, splits, group, hd);
    store_unit(sh, split_unit(g, 0), parts[0], job.out + row * q_stride);
  }

  // The maxima the rows leave: the last row's for the caller's next step, every row's for a
  // rollback.
  void hand_back_phi() const {
    if (job.softmax_phi == nullptr) return;
    std::copy_n(row_max + static_cast<size_t>(n_rows - 1) * sh.n_head, sh.n_head, job.softmax_phi);
    for (int row = 0; job.step_phi != nullptr && row < n_rows; ++row) {
      std::copy_n(row_max + static_cast<size_t>(row) * sh.n_head, sh.n_head, job.step_phi[row]);
    }
  }
};

}  // namespace

void attention_steps(const AttentionShape& sh, const AttentionJob& job, AttentionScratch& scratch, int n_threads) {
  AttentionJob first_row = job;
  first_row.n_tokens = 1;
  StepsPass pass(sh, job, plan_job(sh, first_row, 1, n_threads));
  if (!pass.runs_rows_together()) return attention_steps_one_by_one(sh, job, scratch, n_threads);
  pass.bind(scratch, n_threads);
  const int n_heads_rows = pass.n_kv * pass.n_rows;

#pragma omp parallel num_threads(n_threads)
  {
    float* const buf = scratch.thread_buffer(omp_get_thread_num(), pass.thread_floats());
    UnitBuffers ub{};
    ub.qt = buf;
    ub.kbuf = buf + static_cast<size_t>(pass.rows_all) * pass.hd;
    ub.vbuf = ub.kbuf + static_cast<size_t>(kKeyBlock) * pass.hd;
    ub.scores = ub.vbuf + static_cast<size_t>(kKeyBlock) * pass.hd;
    float* const own_state = ub.scores + static_cast<size_t>(pass.group) * kKeyBlock;
    float* const own_max = own_state + pass.unit_state;
    place_query_codes(ub, own_max + pass.group, pass.rows_all, pass.hd);
    int64_t pos_buf[kKeyBlock];

#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < pass.n_kv * pass.n_blocks; ++i) pass.score_block(i, ub, pos_buf);
#pragma omp for schedule(static)
    for (int i = 0; i < n_heads_rows; ++i) pass.row_maxima(i);
#pragma omp single
    pass.mark_async_rows();
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < pass.n_units; ++i) pass.run_unit(i, ub, own_state, own_max);
    if (pass.splits > 1) {
#pragma omp for schedule(static)
      for (int i = 0; i < n_heads_rows; ++i) pass.merge_row(i);
    }
  }
  pass.hand_back_phi();
}

}  // namespace ringlm::cpu
#endif  // HWY_ONCE
