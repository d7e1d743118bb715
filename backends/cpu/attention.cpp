// Tiled causal attention (see attention.h). The softmax block step is compiled per Highway
// target; the tiling and the sgemm calls are plain code below HWY_ONCE.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "backends/cpu/attention.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>
#include <cmath>

#include "backends/cpu/attention.h"
#include "quant/formats.h"
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
  float mx = -INFINITY;
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
  *block_max = mx;
  return ExpShiftedRow(s, n, phi);
}

// dst[j][0 .. n) = src[j * src_stride + 0 .. n) as fp32, for j < rows: a block of fp16 keys or
// values of one head, converted once for all the query rows that meet it.
void F16RowsToF32(const uint16_t* src, int64_t src_stride, int rows, int n, float* dst) {
  const hn::ScalableTag<float> df;
  const hn::Rebind<hwy::float16_t, decltype(df)> dh;
  const int lanes = static_cast<int>(hn::Lanes(df));
  for (int j = 0; j < rows; ++j) {
    const auto* in = reinterpret_cast<const hwy::float16_t*>(src + j * src_stride);
    float* o = dst + static_cast<int64_t>(j) * n;
    int c = 0;
    for (; c + lanes <= n; c += lanes) hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, in + c)), df, o + c);
    for (; c < n; ++c) o[c] = fp16_to_fp32(src[j * src_stride + c]);
  }
}

// scores[r][j] = q[r] · k[j] for rows r < n_rows of q ([n_rows][hd]) and keys j < n_keys (k_ld
// floats apart): the score block of a few query rows (decode), where sgemm's packing of its
// operands costs more than the products.
void ScoreRows(const float* q, int n_rows, int hd, const float* k, int64_t k_ld, int n_keys, float* scores,
               int scores_ld) {
  const hn::ScalableTag<float> d;
  const int lanes = static_cast<int>(hn::Lanes(d));
  for (int j = 0; j < n_keys; ++j) {
    const float* kj = k + j * k_ld;
    for (int r = 0; r < n_rows; ++r) {
      const float* qr = q + r * hd;
      auto sum = hn::Zero(d);
      int c = 0;
      for (; c + lanes <= hd; c += lanes) sum = hn::MulAdd(hn::LoadU(d, qr + c), hn::LoadU(d, kj + c), sum);
      float dot = hn::GetLane(hn::SumOfLanes(d, sum));
      for (; c < hd; ++c) dot += qr[c] * kj[c];
      scores[r * scores_ld + j] = dot;
    }
  }
}

// acc[r] += sum_j p[r][j] * v[j] for rows r < n_rows: the value side of ScoreRows.
void AccumulateRows(const float* p, int n_rows, int p_ld, const float* v, int64_t v_ld, int n_keys, int hd,
                    float* acc) {
  const hn::ScalableTag<float> d;
  const int lanes = static_cast<int>(hn::Lanes(d));
  for (int j = 0; j < n_keys; ++j) {
    const float* vj = v + j * v_ld;
    for (int r = 0; r < n_rows; ++r) {
      const float w = p[r * p_ld + j];
      if (w == 0.0f) continue;
      float* ar = acc + r * hd;
      const auto vw = hn::Set(d, w);
      int c = 0;
      for (; c + lanes <= hd; c += lanes) hn::StoreU(hn::MulAdd(vw, hn::LoadU(d, vj + c), hn::LoadU(d, ar + c)), d, ar + c);
      for (; c < hd; ++c) ar[c] += w * vj[c];
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace ringlm::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <cblas.h>
#include <omp.h>

namespace ringlm::cpu {

HWY_EXPORT(SoftmaxBlockRow);
HWY_EXPORT(F16RowsToF32);
HWY_EXPORT(ExpBlockRow);
HWY_EXPORT(ScoreRows);
HWY_EXPORT(AccumulateRows);

namespace {

constexpr int kQueryRows = 64;  // rows of a query tile (query heads of a group x tokens)
constexpr int kKeyBlock = 128;  // keys per block: a block's scores stay in L1 / L2
constexpr int kMinKeysPerSplit = 256;  // decode: fewer keys per thread cost more to merge than they save
constexpr int kMaxSplits = 64;
// Tiles of at most this many query rows (decode: one token's heads of a group) multiply directly;
// larger ones through sgemm, whose operand packing pays off only then.
constexpr int kDirectRows = 8;
// Asynchronized softmax: exp(s - phi) is safe while every score is at most phi + kAsyncHigh (the
// sums stay far from fp32's range) and the largest at least phi + kAsyncLow (its exponential
// keeps full precision). Outside that, the unit is run again with the exact online softmax.
constexpr float kAsyncHigh = 30.0f;
constexpr float kAsyncLow = -60.0f;

// A tile's running state: per row the max and the sum of exponentials, and the weighted values.
struct TileState {
  float* m;    // [rows]
  float* l;    // [rows]
  float* acc;  // [rows][head_dim]
};

// Which rows, tokens and keys one unit of work covers.
struct Unit {
  int kv_head;
  int token_begin, token_end;  // queries of the chunk
  int key_begin, key_end;      // cache indices (keys beyond a row's causal limit are masked)
};

// Per-thread buffers of a unit: its query rows, a score block, and (fp16 caches) one block of
// keys and one of values in fp32.
struct UnitBuffers {
  float* qt;      // [rows][hd]
  float* scores;  // [rows][kKeyBlock]
  float* kbuf;    // [kKeyBlock][hd]
  float* vbuf;    // [kKeyBlock][hd]
};

// Slots [j0, j0 + nb) of one KV head as fp32 rows: in place (fp32 cache, `ld` apart) or
// converted into `buf` (hd apart).
const float* head_block(const void* base, const KvLayer& kv, int kv_head, int hd, int j0, int nb, float* buf,
                        int64_t* ld) {
  const int64_t offset = j0 * kv.row_stride + static_cast<int64_t>(kv_head) * hd;
  if (!kv.f16) {
    *ld = kv.row_stride;
    return static_cast<const float*>(base) + offset;
  }
  HWY_DYNAMIC_DISPATCH(F16RowsToF32)(static_cast<const uint16_t*>(base) + offset, kv.row_stride, nb, hd, buf);
  *ld = hd;
  return buf;
}

// Runs one unit: gathers its query rows (pre-scaled by 1/sqrt(d)), then meets the slots a block
// at a time. Row r is token token_begin + r / group (position q_pos0 + that), query head
// kv_head * group + r % group. Scores of slots the row may not see are -inf.
// With `phi` (decode: one unified max per row, [rows]), each block's exponentials are taken
// against phi and nothing is ever rescaled; the unit's state then carries m = phi, so the merge
// of split parts is a plain sum. Returns false, leaving the state to be discarded, when a score
// leaves [phi + kAsyncLow, phi + kAsyncHigh]. seen_max[r] gets row r's largest visible score.
bool run_unit(const AttentionShape& sh, const float* q, const KvLayer& kv, int64_t q_pos0, const Unit& u,
              const UnitBuffers& buf, const TileState& st, const float* phi, float* seen_max) {
  const int group = sh.n_head / sh.n_head_kv, hd = sh.head_dim;
  const int rows = (u.token_end - u.token_begin) * group;
  const int64_t q_stride = static_cast<int64_t>(sh.n_head) * hd;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  float* qt = buf.qt;
  float* scores = buf.scores;
  for (int r = 0; r < rows; ++r) {
    const float* src = q + (u.token_begin + r / group) * q_stride + (u.kv_head * group + r % group) * hd;
    for (int c = 0; c < hd; ++c) qt[r * hd + c] = src[c] * scale;
    st.m[r] = phi != nullptr ? phi[r] : -INFINITY;
    st.l[r] = 0.0f;
    seen_max[r] = -INFINITY;
    std::fill(st.acc + r * hd, st.acc + (r + 1) * hd, 0.0f);
  }
  const int64_t first_pos = q_pos0 + u.token_begin, last_pos = q_pos0 + u.token_end - 1;
  // Meets slots [j0, j0 + nb) of one run of slots; false when the asynchronized softmax must
  // give up (see above).
  const auto meet_block = [&](const KvLayer& seg, int j0, int nb) {
    const int64_t* pos = seg.positions + j0;
    // A block no row of the tile can see (empty slots, or the future of a prefill) costs nothing.
    bool any_visible = false;
    bool all_visible = true;  // to every row: no mask to apply
    for (int j = 0; j < nb; ++j) {
      any_visible |= pos[j] >= 0 && pos[j] <= last_pos;
      all_visible &= pos[j] >= 0 && pos[j] <= first_pos;
    }
    if (!any_visible) return true;
    int64_t ldk = 0, ldv = 0;
    const float* k = head_block(seg.keys, seg, u.kv_head, hd, j0, nb, buf.kbuf, &ldk);
    const float* v = head_block(seg.values, seg, u.kv_head, hd, j0, nb, buf.vbuf, &ldv);
    // scores[rows][nb] = qt · Kᵀ
    if (rows <= kDirectRows) {
      HWY_DYNAMIC_DISPATCH(ScoreRows)(qt, rows, hd, k, ldk, nb, scores, kKeyBlock);
    } else {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, nb, hd, 1.0f, qt, hd, k, static_cast<int>(ldk), 0.0f,
                  scores, kKeyBlock);
    }
    for (int r = 0; r < rows; ++r) {
      float* s = scores + r * kKeyBlock;
      if (!all_visible) {
        const int64_t row_pos = q_pos0 + u.token_begin + r / group;
        for (int j = 0; j < nb; ++j) {
          if (pos[j] < 0 || pos[j] > row_pos) s[j] = -INFINITY;
        }
      }
      if (phi != nullptr) {
        float block_max = -INFINITY;
        st.l[r] += HWY_DYNAMIC_DISPATCH(ExpBlockRow)(s, nb, phi[r], &block_max);
        seen_max[r] = std::max(seen_max[r], block_max);
        if (block_max > phi[r] + kAsyncHigh) return false;
        continue;
      }
      const float m_old = st.m[r];
      float m_new = m_old;
      const float sum = HWY_DYNAMIC_DISPATCH(SoftmaxBlockRow)(s, nb, &m_new);
      seen_max[r] = m_new;
      // Rescale what the row has gathered so far to the new max (exp(-inf) = 0 on the first block).
      const float alpha = m_old == m_new ? 1.0f : std::exp(m_old - m_new);
      st.m[r] = m_new;
      st.l[r] = st.l[r] * alpha + sum;
      if (alpha != 1.0f) {
        for (int c = 0; c < hd; ++c) st.acc[r * hd + c] *= alpha;
      }
    }
    // acc[rows][hd] += P · V
    if (rows <= kDirectRows) {
      HWY_DYNAMIC_DISPATCH(AccumulateRows)(scores, rows, kKeyBlock, v, ldv, nb, hd, st.acc);
    } else {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, hd, nb, 1.0f, scores, kKeyBlock, v,
                  static_cast<int>(ldv), 1.0f, st.acc, hd);
    }
    return true;
  };
  // The unit's key range [key_begin, key_end) numbers the prefix's slots first, then the own ones.
  const int n_prefix = kv.prefix != nullptr ? kv.prefix->n_slots : 0;
  const KvLayer* runs[] = {kv.prefix, &kv};
  const int run_first[] = {0, n_prefix};
  for (int ri = 0; ri < 2; ++ri) {
    if (runs[ri] == nullptr) continue;
    const int lo = std::max(u.key_begin - run_first[ri], 0);
    const int hi = std::min(u.key_end - run_first[ri], runs[ri]->n_slots);
    for (int j0 = lo; j0 < hi; j0 += kKeyBlock) {
      if (!meet_block(*runs[ri], j0, std::min(kKeyBlock, hi - j0))) return false;
    }
  }
  if (phi != nullptr) {
    for (int r = 0; r < rows; ++r) {
      // A row that saw keys, all far below phi: its exponentials lost precision.
      if (seen_max[r] != -INFINITY && seen_max[r] < phi[r] + kAsyncLow) return false;
    }
  }
  return true;
}

// Writes a finished tile to the output: acc / l per row.
void store_unit(const AttentionShape& sh, const Unit& u, const TileState& st, float* out) {
  const int group = sh.n_head / sh.n_head_kv, hd = sh.head_dim;
  const int rows = (u.token_end - u.token_begin) * group;
  for (int r = 0; r < rows; ++r) {
    float* dst = out + (u.token_begin + r / group) * static_cast<int64_t>(sh.n_head) * hd + (u.kv_head * group + r % group) * hd;
    const float inv = st.l[r] > 0 ? 1.0f / st.l[r] : 0.0f;
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

void attention_causal(const AttentionShape& sh, const float* q, const KvLayer& kv, int64_t q_pos0, int n_tokens,
                      float* out, AttentionScratch& scratch, int n_threads, float* softmax_phi) {
  // sgemm runs inside our threads, never with threads of its own.
  static const bool blas_single_threaded = (openblas_set_num_threads(1), true);
  (void)blas_single_threaded;
  const int group = sh.n_head / sh.n_head_kv, hd = sh.head_dim;
  const int tokens_per_tile = std::max(1, kQueryRows / group);
  const int token_tiles = (n_tokens + tokens_per_tile - 1) / tokens_per_tile;
  const int n_keys = kv.n_slots + (kv.prefix != nullptr ? kv.prefix->n_slots : 0);
  // Decode: split the keys so that every thread has work even with few KV heads.
  int splits = 1;
  if (n_tokens == 1 && sh.n_head_kv < 2 * n_threads) {
    splits = std::clamp((2 * n_threads + sh.n_head_kv - 1) / sh.n_head_kv, 1,
                        std::clamp(n_keys / kMinKeysPerSplit, 1, kMaxSplits));
  }
  const int rows_max = tokens_per_tile * group;
  const size_t state_floats = static_cast<size_t>(rows_max) * (2 + hd);
  const int n_units = sh.n_head_kv * token_tiles * splits;
  // Buffers are sized before the parallel region: growing them inside would race.
  float* partials = splits > 1 ? scratch.partials(static_cast<size_t>(n_units) * (state_floats + rows_max)) : nullptr;
  float* unit_max = splits > 1 ? partials + static_cast<size_t>(n_units) * state_floats : nullptr;  // [units][rows]
  // Asynchronized softmax for decode, once the previous step has given every head its max.
  bool async = softmax_phi != nullptr && n_tokens == 1;
  for (int h = 0; async && h < sh.n_head; ++h) async = std::isfinite(softmax_phi[h]);
  const size_t thread_floats =
      static_cast<size_t>(rows_max) * (hd + kKeyBlock + 1) + 2 * static_cast<size_t>(kKeyBlock) * hd + state_floats;
  for (int t = 0; t < n_threads; ++t) scratch.thread_buffer(t, thread_floats);

  const auto state_at = [&](float* base) { return TileState{base, base + rows_max, base + 2 * rows_max}; };
  const auto unit_at = [&](int index) {
    const int split = index % splits, tile = (index / splits) % token_tiles, g = index / splits / token_tiles;
    Unit u{g, tile * tokens_per_tile, std::min(n_tokens, (tile + 1) * tokens_per_tile), 0, n_keys};
    if (splits > 1) {
      const int per = (n_keys + splits - 1) / splits;
      u.key_begin = std::min(n_keys, split * per);
      u.key_end = std::min(n_keys, (split + 1) * per);
    }
    return u;
  };
#pragma omp parallel num_threads(n_threads)
  {
    const int t = omp_get_thread_num();
    float* buf = scratch.thread_buffer(t, thread_floats);
    UnitBuffers ub;
    ub.qt = buf;
    ub.scores = ub.qt + rows_max * hd;
    ub.kbuf = ub.scores + rows_max * kKeyBlock;
    ub.vbuf = ub.kbuf + kKeyBlock * hd;
    float* own_state = ub.vbuf + kKeyBlock * hd;
    float* own_max = own_state + state_floats;
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < n_units; ++i) {
      const Unit u = unit_at(i);
      const TileState st = state_at(splits > 1 ? partials + static_cast<size_t>(i) * state_floats : own_state);
      float* seen = splits > 1 ? unit_max + static_cast<size_t>(i) * rows_max : own_max;
      const float* phi = async ? softmax_phi + u.kv_head * group : nullptr;
      if (!run_unit(sh, q, kv, q_pos0, u, ub, st, phi, seen)) run_unit(sh, q, kv, q_pos0, u, ub, st, nullptr, seen);
      if (splits == 1) {
        store_unit(sh, u, st, out);
        if (softmax_phi != nullptr && n_tokens == 1) std::copy_n(seen, group, softmax_phi + u.kv_head * group);
      }
    }
    if (splits > 1) {
#pragma omp for schedule(static)
      for (int g = 0; g < sh.n_head_kv; ++g) {
        TileState parts[kMaxSplits];
        for (int p = 0; p < splits; ++p) parts[p] = state_at(partials + static_cast<size_t>(g * splits + p) * state_floats);
        merge_splits(parts, splits, group, hd);
        store_unit(sh, unit_at(g * splits), parts[0], out);
        if (softmax_phi != nullptr) {  // the next step's unified max: this step's, over every part
          for (int r = 0; r < group; ++r) {
            float m = -INFINITY;
            for (int p = 0; p < splits; ++p) m = std::max(m, unit_max[static_cast<size_t>(g * splits + p) * rows_max + r]);
            softmax_phi[g * group + r] = m;
          }
        }
      }
    }
  }
}

}  // namespace ringlm::cpu
#endif  // HWY_ONCE
