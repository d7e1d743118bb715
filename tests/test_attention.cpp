// The CPU attention kernel against attention computed from its definition in float64:
// out[i][h] = sum_j softmax_j(q[i][h] · k[j][g] / sqrt(d)) v[j][g] over the tokens j <= n_past + i,
// g = h / group. Shapes cover MHA, GQA and MQA, prefill chunks that span several query tiles and
// key blocks, decode with the keys split across threads, and 1 or 2 threads; the cache layouts
// cover tokens in order, tokens scattered over a ring's slots in any order with empty slots
// between them, fp16 storage (the reference then reads the same fp16-rounded values), and slots
// split between a prefix run in memory of its own and the rest (the segment KV cache), which must
// give bit for bit what the same slots give in one run.
// The AVX-512 VNNI target too, which attention.cpp builds (its int8 scores of q8_0 keys).
#ifndef HWY_WANT_AVX3_DL
#define HWY_WANT_AVX3_DL
#endif
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <utility>
#include <vector>

#include "backends/cpu/attention.h"
#include "quant/formats.h"
#include "quant/quantize.h"
#include "hwy/targets.h"
#include "tests/only_target.h"

namespace ringlm::cpu {
namespace {

struct Case {
  int n_head, n_head_kv, head_dim, n_past, n_tokens;
  bool ring = false;  // tokens in shuffled slots, with empty slots among them
  bool f16 = false;   // keys and values stored as fp16
  int prefix = 0;     // slots [0, prefix) live in a separate prefix run (a shared prompt segment)
  int window = 0;     // sliding window: a query sees the last `window` positions (0: all)
  bool sinks = false;  // attention sinks (gpt-oss): a logit per head in every softmax's denominator
  int bits = 0;        // 8, 4: keys and values stored as q8_0, q4_0 blocks (instead of f16 / f32)
  int value_bits = -1;  // the values' own type (-ctv): 16 (f16), 8, 4; -1: the keys'
};

KvType type_of(const Case& c) {  // the keys'
  if (c.bits != 0) return c.bits == 8 ? KvType::kQ8_0 : KvType::kQ4_0;
  return c.f16 ? KvType::kF16 : KvType::kF32;
}
KvType value_type_of(const Case& c) {
  switch (c.value_bits) {
    case 16: return KvType::kF16;
    case 8: return KvType::kQ8_0;
    case 4: return KvType::kQ4_0;
    default: return type_of(c);
  }
}

// Rows of `width` fp32 values as a cache of `type` holds them.
std::vector<uint8_t> encode_rows(KvType type, const std::vector<float>& rows, int width) {
  const size_t n_rows = rows.size() / static_cast<size_t>(width), row_bytes = kv_bytes_of(type, width);
  std::vector<uint8_t> out(n_rows * row_bytes);
  for (size_t r = 0; r < n_rows; ++r) {
    const float* in = rows.data() + r * static_cast<size_t>(width);
    uint8_t* dst = out.data() + r * row_bytes;
    if (type == KvType::kF32) std::memcpy(dst, in, row_bytes);
    if (type == KvType::kF16) {
      for (int e = 0; e < width; ++e) {
        const uint16_t h = fp32_to_fp16(in[e]);
        std::memcpy(dst + 2 * e, &h, 2);
      }
    }
    if (kv_type_has_blocks(type)) quantize_row(kv_stored_type(type), in, dst, width);
  }
  return out;
}

// The values a cache of `type` gives back for rows (the reference sees what the cache holds).
void round_through(KvType type, std::vector<float>& rows, int width) {
  const std::vector<uint8_t> bytes = encode_rows(type, rows, width);
  const size_t row_bytes = kv_bytes_of(type, width);
  for (size_t r = 0; r < rows.size() / static_cast<size_t>(width); ++r) {
    dequantize_row(kv_stored_type(type), bytes.data() + r * row_bytes, rows.data() + r * static_cast<size_t>(width), width);
  }
}

// The sinks of a case's heads: around the scores' range, some above the largest score.
std::vector<float> sinks_of(const Case& c) {
  std::vector<float> sinks;
  for (int h = 0; h < c.n_head; ++h) sinks.push_back(c.sinks ? 2.5f * std::sin(1.7f * static_cast<float>(h) + 0.3f) + 1.0f : 0.0f);
  return sinks;
}

AttentionShape shape_of(const Case& c, const std::vector<float>& sinks) {
  return AttentionShape{c.n_head, c.n_head_kv, c.head_dim, c.window, 0.0f, c.sinks ? sinks.data() : nullptr};
}

// Where each token's keys and values live: slot_of[j] for token j, and per slot its position
// (-1: empty). In order, token j is slot j; as a ring, the tokens are shuffled over 1.5x as
// many slots.
struct Layout {
  std::vector<int> slot_of;
  std::vector<int64_t> positions;
};

Layout make_layout(const Case& c, std::mt19937& rng) {
  const int n_keys = c.n_past + c.n_tokens;
  const int n_slots = c.ring ? n_keys + n_keys / 2 + 1 : n_keys;
  std::vector<int> slots(static_cast<size_t>(n_slots));
  for (int i = 0; i < n_slots; ++i) slots[static_cast<size_t>(i)] = i;
  if (c.ring) std::shuffle(slots.begin(), slots.end(), rng);
  Layout l{std::vector<int>(slots.begin(), slots.begin() + n_keys), std::vector<int64_t>(static_cast<size_t>(n_slots), -1)};
  for (int j = 0; j < n_keys; ++j) l.positions[static_cast<size_t>(l.slot_of[static_cast<size_t>(j)])] = j;
  return l;
}

// With int8_queries, as the kernel scores q8_0 and q4_0 keys on AVX2 and AVX-512 VNNI
// (scores_block_keys_in_int8): each head's query row scaled by 1 / sqrt(d) in float, then rounded
// to q8_0 blocks as GGML rounds them; the scores are its dot products with the keys.
std::vector<double> reference(const Case& c, const std::vector<float>& q_in, const std::vector<float>& k,
                              const std::vector<float>& v, bool int8_queries = false) {
  const int group = c.n_head / c.n_head_kv, hd = c.head_dim, kv_w = c.n_head_kv * hd, q_w = c.n_head * hd;
  std::vector<double> out(static_cast<size_t>(c.n_tokens) * q_w);
  std::vector<float> q = q_in;
  double score_divisor = std::sqrt(static_cast<double>(hd));
  if (int8_queries) {
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    for (float& x : q) x *= scale;
    std::vector<uint8_t> blocks(kv_bytes_of(KvType::kQ8_0, hd));
    for (size_t row = 0; row < q.size(); row += static_cast<size_t>(hd)) {
      quantize_row(TensorType::Q8_0, q.data() + row, blocks.data(), hd);
      dequantize_row(TensorType::Q8_0, blocks.data(), q.data() + row, hd);
    }
    score_divisor = 1.0;
  }
  const std::vector<float> sinks = sinks_of(c);
  for (int i = 0; i < c.n_tokens; ++i) {
    for (int h = 0; h < c.n_head; ++h) {
      const int g = h / group, n_vis = c.n_past + i + 1;
      const int first = c.window > 0 ? std::max(0, n_vis - c.window) : 0;  // the window's first key
      std::vector<double> s(static_cast<size_t>(n_vis), -INFINITY);
      double mx = -INFINITY;
      for (int j = first; j < n_vis; ++j) {
        double dot = 0;
        for (int e = 0; e < hd; ++e) dot += static_cast<double>(q[static_cast<size_t>(i * q_w + h * hd + e)]) * k[static_cast<size_t>(j * kv_w + g * hd + e)];
        s[static_cast<size_t>(j)] = dot / score_divisor;
        mx = std::max(mx, s[static_cast<size_t>(j)]);
      }
      // A sink is one more logit in the softmax, with no value.
      const double sink = sinks[static_cast<size_t>(h)];
      if (c.sinks) mx = std::max(mx, sink);
      double sum = c.sinks ? std::exp(sink - mx) : 0.0;
      for (double& x : s) sum += (x = std::exp(x - mx));
      for (int e = 0; e < hd; ++e) {
        double acc = 0;
        for (int j = first; j < n_vis; ++j) acc += s[static_cast<size_t>(j)] * v[static_cast<size_t>(j * kv_w + g * hd + e)];
        out[static_cast<size_t>(i * q_w + h * hd + e)] = acc / sum;
      }
    }
  }
  return out;
}

// Every SIMD target the machine runs, each with 1 and 2 threads.
std::vector<std::pair<int64_t, int>> targets_and_threads() {
  std::vector<std::pair<int64_t, int>> runs;
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    for (int threads : {1, 2}) runs.emplace_back(target, threads);
  }
  return runs;
}

class Attention : public ::testing::TestWithParam<Case> {};

TEST_P(Attention, MatchesFloat64DefinitionWithOneAndTwoThreads) {
  const Case c = GetParam();
  std::mt19937 rng(static_cast<unsigned>(c.n_past * 31 + c.n_tokens));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int n_keys = c.n_past + c.n_tokens;
  const int kv_w = c.n_head_kv * c.head_dim;
  std::vector<float> q(static_cast<size_t>(c.n_tokens) * c.n_head * c.head_dim);
  std::vector<float> k(static_cast<size_t>(n_keys) * kv_w), v(k.size());
  // Scores of a few units: the softmax is neither flat nor one-hot.
  for (float& x : q) x = normal(rng) * 0.8f;
  for (float& x : k) x = normal(rng);
  for (float& x : v) x = normal(rng);
  round_through(type_of(c), k, kv_w);  // the reference sees what the cache holds
  round_through(value_type_of(c), v, kv_w);
  const std::vector<double> expected = reference(c, q, k, v);
  // Decode on q8_0 or q4_0 keys: the int8 queries' reference, for the targets that score so.
  const bool int8_case = kv_type_has_blocks(type_of(c)) && c.n_tokens == 1;
  const std::vector<double> expected_int8 = int8_case ? reference(c, q, k, v, true) : expected;
  const std::vector<float> sinks = sinks_of(c);

  // The cache: token j's row in slot slot_of[j]; empty slots hold garbage that must not count.
  const Layout layout = make_layout(c, rng);
  const size_t n_slots = layout.positions.size();
  std::vector<float> k_slots(n_slots * kv_w, 1e4f), v_slots(n_slots * kv_w, 1e4f);
  for (int j = 0; j < n_keys; ++j) {
    const size_t slot = static_cast<size_t>(layout.slot_of[static_cast<size_t>(j)]);
    std::copy_n(&k[static_cast<size_t>(j) * kv_w], kv_w, &k_slots[slot * kv_w]);
    std::copy_n(&v[static_cast<size_t>(j) * kv_w], kv_w, &v_slots[slot * kv_w]);
  }
  const std::vector<uint8_t> k_bytes = encode_rows(type_of(c), k_slots, kv_w);
  const std::vector<uint8_t> v_bytes = encode_rows(value_type_of(c), v_slots, kv_w);
  KvLayer kv;
  kv.keys = k_bytes.data();
  kv.values = v_bytes.data();
  kv.row_stride = kv_w;
  kv.key_type = type_of(c);
  kv.value_type = value_type_of(c);
  kv.positions = layout.positions.data();
  kv.n_slots = static_cast<int>(n_slots);
  // With a prefix, slots [0, prefix) move to memory of their own (copies), and kv keeps the rest.
  const size_t pre_keys = kv_bytes_of(type_of(c), int64_t{c.prefix} * kv_w);
  const size_t pre_values = kv_bytes_of(value_type_of(c), int64_t{c.prefix} * kv_w);
  std::vector<uint8_t> k_pre(pre_keys), v_pre(pre_values);
  const KvLayer whole = kv;
  KvLayer prefix = kv;
  if (c.prefix > 0) {
    std::memcpy(k_pre.data(), kv.keys, k_pre.size());
    std::memcpy(v_pre.data(), kv.values, v_pre.size());
    prefix.keys = k_pre.data();
    prefix.values = v_pre.data();
    prefix.n_slots = c.prefix;
    kv.keys = static_cast<const uint8_t*>(kv.keys) + pre_keys;
    kv.values = static_cast<const uint8_t*>(kv.values) + pre_values;
    kv.positions += c.prefix;
    kv.n_slots -= c.prefix;
    kv.prefix = &prefix;
  }
  for (const auto& [target, threads] : targets_and_threads()) {
    SCOPED_TRACE(hwy::TargetName(target));
    const test::OnlyTarget only(target);
    AttentionScratch scratch;
    std::vector<float> out(q.size(), NAN);
    attention_causal(shape_of(c, sinks), q.data(), kv, c.n_past, c.n_tokens, out.data(), scratch, threads);
    const bool int8 = int8_case && scores_block_keys_in_int8(c.head_dim);
    const std::vector<double>& want = int8 ? expected_int8 : expected;
    for (size_t i = 0; i < out.size(); ++i) {
      // Outputs are convex combinations of values of magnitude ~1: fp32 softmax and sums over
      // a few hundred keys stay well within 1e-5.
      ASSERT_NEAR(out[i], want[i], 1e-5) << "threads " << threads << " index " << i << (int8 ? " (int8 queries)" : "");
    }
    if (c.prefix > 0) {  // a prefix run is read as if its slots were the cache's first ones
      std::vector<float> out_whole(q.size(), NAN);
      attention_causal(shape_of(c, sinks), q.data(), whole, c.n_past, c.n_tokens, out_whole.data(), scratch, threads);
      for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], out_whole[i]) << "threads " << threads << " index " << i;
    }
  }
}

// Decode with FlashDecoding++'s asynchronized softmax: with the unified max learned from a
// previous step, and with maxima so wrong (100 too low: overflow risk; 100 too high: underflow)
// that every part must fall back to the exact softmax, the output is the same.
class AsyncSoftmax : public ::testing::TestWithParam<Case> {};

TEST_P(AsyncSoftmax, MatchesTheDefinitionAndFallsBack) {
  const Case c = GetParam();  // decode shapes: one token
  std::mt19937 rng(static_cast<unsigned>(c.n_past * 17 + 5));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int n_keys = c.n_past + 1, kv_w = c.n_head_kv * c.head_dim;
  std::vector<float> q(static_cast<size_t>(c.n_head) * c.head_dim), k(static_cast<size_t>(n_keys) * kv_w), v(k.size());
  for (float& x : q) x = normal(rng) * 2.0f;  // peaked scores: a wrong max would show
  for (float& x : k) x = normal(rng);
  for (float& x : v) x = normal(rng);
  const std::vector<double> expected = reference(c, q, k, v);
  const std::vector<float> sinks = sinks_of(c);
  std::vector<int64_t> positions(static_cast<size_t>(n_keys));
  for (int j = 0; j < n_keys; ++j) positions[static_cast<size_t>(j)] = j;
  KvLayer kv;
  kv.keys = k.data();
  kv.values = v.data();
  kv.row_stride = kv_w;
  kv.positions = positions.data();
  kv.n_slots = n_keys;
  for (int threads : {1, 2}) {
    AttentionScratch scratch;
    std::vector<float> phi(static_cast<size_t>(c.n_head), NAN);
    std::vector<float> out(q.size());
    attention_causal(shape_of(c, sinks), q.data(), kv, c.n_past, 1, out.data(), scratch, threads,
                     phi.data());  // learns phi
    for (float x : phi) ASSERT_TRUE(std::isfinite(x));
    const std::vector<float> learned = phi;
    // Every head's max off, or only the last head's (a decode unit of several heads then redoes
    // that one head alone).
    for (const bool last_head_only : {false, true}) {
      for (float offset : {0.0f, -100.0f, 100.0f, 3.0f}) {
        for (size_t h = 0; h < phi.size(); ++h) {
          phi[h] = learned[h] + (!last_head_only || h + 1 == phi.size() ? offset : 0.0f);
        }
        std::fill(out.begin(), out.end(), NAN);
        attention_causal(shape_of(c, sinks), q.data(), kv, c.n_past, 1, out.data(), scratch, threads, phi.data());
        for (size_t i = 0; i < out.size(); ++i) {
          ASSERT_NEAR(out[i], expected[i], 1e-5)
              << "threads " << threads << " phi offset " << offset << (last_head_only ? " (last head)" : "")
              << " index " << i;
        }
        for (size_t h = 0; h < phi.size(); ++h) ASSERT_FLOAT_EQ(phi[h], learned[h]) << "the observed max is returned";
      }
    }
  }
}

// attention_batch: several sequences of one shape, each with its own cache (decode with split
// keys and without, a prefill chunk, a prefix run, the asynchronized softmax), in one call. Each
// job's output and learned maxima must be bit for bit those of attention_causal on it alone:
// batching must never change a sequence's result (greedy outputs whatever --parallel is).
struct Sequence {
  Sequence(int past, int tokens, int prefix_slots, bool async_softmax)
      : n_past(past), n_tokens(tokens), prefix(prefix_slots), async(async_softmax) {}
  int n_past, n_tokens, prefix;
  bool async;
  std::vector<float> q, k, v, out_alone, out_batched, phi_alone, phi_batched;
  std::vector<int64_t> positions;
  KvLayer prefix_layer, kv;
};

void fill_sequence(Sequence& s, const AttentionShape& sh, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int n_keys = s.n_past + s.n_tokens, kv_w = sh.n_head_kv * sh.head_dim;
  s.q.resize(static_cast<size_t>(s.n_tokens) * sh.n_head * sh.head_dim);
  s.k.resize(static_cast<size_t>(n_keys) * kv_w);
  s.v.resize(s.k.size());
  for (auto* vec : {&s.q, &s.k, &s.v}) {
    for (float& x : *vec) x = normal(rng);
  }
  s.positions.resize(static_cast<size_t>(n_keys));
  for (int j = 0; j < n_keys; ++j) s.positions[static_cast<size_t>(j)] = j;
  s.kv = KvLayer{s.k.data(), s.v.data(), kv_w, KvType::kF32, KvType::kF32, s.positions.data(), n_keys, nullptr};
  if (s.prefix > 0) {  // the first slots as a run of their own (same memory: reads only)
    s.prefix_layer = KvLayer{s.k.data(), s.v.data(), kv_w, KvType::kF32, KvType::kF32, s.positions.data(), s.prefix, nullptr};
    s.kv = KvLayer{s.k.data() + static_cast<size_t>(s.prefix) * kv_w, s.v.data() + static_cast<size_t>(s.prefix) * kv_w,
                   kv_w,  KvType::kF32, KvType::kF32, s.positions.data() + s.prefix, n_keys - s.prefix, &s.prefix_layer};
  }
  s.out_alone.assign(s.q.size(), NAN);
  s.out_batched.assign(s.q.size(), NAN);
  // Async jobs start from maxima a little off the true ones (as a previous step leaves them).
  s.phi_alone.assign(static_cast<size_t>(sh.n_head), s.async ? 2.5f : NAN);
  s.phi_batched = s.phi_alone;
}

TEST(AttentionBatch, EachJobMatchesItsOwnCallBitForBit) {
  const AttentionShape sh{9, 3, 64};
  std::mt19937 rng(2024);
  std::vector<Sequence> seqs = {{600, 1, 0, false}, {14, 1, 0, true},  {200, 33, 0, false},
                                {700, 1, 300, true}, {0, 5, 0, false}, {40, 1, 20, false}};
  for (Sequence& s : seqs) fill_sequence(s, sh, rng);
  for (int threads : {1, 2}) {
    std::vector<AttentionJob> jobs;
    for (Sequence& s : seqs) {
      std::fill(s.out_batched.begin(), s.out_batched.end(), NAN);
      AttentionScratch alone;
      std::vector<float> phi = s.phi_alone;
      attention_causal(sh, s.q.data(), s.kv, s.n_past, s.n_tokens, s.out_alone.data(), alone, threads,
                       s.async ? phi.data() : nullptr);
      s.phi_batched = s.phi_alone;
      s.phi_alone = phi;
      jobs.push_back({s.q.data(), s.kv, s.n_past, s.n_tokens, s.out_batched.data(),
                      s.async ? s.phi_batched.data() : nullptr});
    }
    AttentionScratch scratch;
    attention_batch(sh, jobs, scratch, threads);
    for (size_t j = 0; j < seqs.size(); ++j) {
      const Sequence& s = seqs[j];
      for (size_t i = 0; i < s.out_alone.size(); ++i) {
        ASSERT_FALSE(std::isnan(s.out_batched[i])) << "job " << j << " index " << i << " not written";
        ASSERT_EQ(s.out_batched[i], s.out_alone[i]) << "threads " << threads << " job " << j << " index " << i;
      }
      if (s.async) {
        for (size_t h = 0; h < s.phi_alone.size(); ++h) ASSERT_EQ(s.phi_batched[h], s.phi_alone[h]) << "job " << j;
      }
    }
  }
}

// attention_steps (a speculative draft's checking pass): every row, and the maxima it leaves,
// bit for bit what the decode calls of its tokens give one after the other (attention_causal of
// one token, its phi the one the row before left). Cases: in order and as a ring, fp16, a
// prefix, a window, keys split across threads (past 512), the exact softmax (no phi; NaN: the
// first step, then the learned maxima), and shapes that go row by row (a group too large for
// the row path).
struct StepsCase {
  AttentionShape shape;
  Case layout;  // n_past, n_tokens (the checking rows), ring, f16, prefix of the same Case
  bool async;   // a phi to start from (else the exact softmax throughout)
  float phi0;   // the first row's phi (NaN: not known yet)
};

class AttentionSteps : public ::testing::TestWithParam<StepsCase> {};

TEST_P(AttentionSteps, EveryRowIsItsDecodeStepBitForBit) {
  const StepsCase sc = GetParam();
  const Case& c = sc.layout;
  const AttentionShape& sh = sc.shape;
  std::mt19937 rng(static_cast<unsigned>(c.n_past * 31 + c.n_tokens));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const Layout l = make_layout(c, rng);
  const int n_slots = static_cast<int>(l.positions.size()), kv_w = sh.n_head_kv * sh.head_dim;
  const int64_t q_w = static_cast<int64_t>(sh.n_head) * sh.head_dim;
  std::vector<float> q(static_cast<size_t>(c.n_tokens * q_w)), k(static_cast<size_t>(n_slots) * kv_w), v(k.size());
  for (auto* vec : {&q, &k, &v}) {
    for (float& x : *vec) x = normal(rng) * 1.5f;
  }
  const std::vector<uint8_t> k_bytes = encode_rows(type_of(c), k, kv_w), v_bytes = encode_rows(value_type_of(c), v, kv_w);
  const uint8_t* keys = k_bytes.data();
  const uint8_t* values = v_bytes.data();
  const size_t pre_keys = kv_bytes_of(type_of(c), int64_t{c.prefix} * kv_w);
  const size_t pre_values = kv_bytes_of(value_type_of(c), int64_t{c.prefix} * kv_w);
  KvLayer prefix{keys, values, kv_w, type_of(c), value_type_of(c), l.positions.data(), c.prefix, nullptr};
  KvLayer kv{keys + pre_keys, values + pre_values, kv_w, type_of(c), value_type_of(c), l.positions.data() + c.prefix,
             n_slots - c.prefix, c.prefix > 0 ? &prefix : nullptr};
  const int64_t pos0 = c.n_past;
  for (int threads : {1, 2}) {
    // The decode steps, one call per row.
    std::vector<float> want(q.size(), NAN), phi(static_cast<size_t>(sh.n_head), sc.phi0);
    std::vector<std::vector<float>> want_rows;
    AttentionScratch one;
    for (int i = 0; i < c.n_tokens; ++i) {
      attention_causal(sh, q.data() + i * q_w, kv, pos0 + i, 1, want.data() + i * q_w, one, threads,
                       sc.async ? phi.data() : nullptr);
      want_rows.push_back(phi);
    }
    // The checking pass.
    std::vector<float> got(q.size(), NAN), got_phi(static_cast<size_t>(sh.n_head), sc.phi0);
    std::vector<std::vector<float>> got_rows(static_cast<size_t>(c.n_tokens), std::vector<float>(got_phi.size(), NAN));
    std::vector<float*> row_ptrs;
    for (auto& r : got_rows) row_ptrs.push_back(r.data());
    AttentionScratch scratch;
    const AttentionJob job{q.data(), kv, pos0, c.n_tokens, got.data(), sc.async ? got_phi.data() : nullptr,
                           sc.async ? row_ptrs.data() : nullptr};
    attention_steps(sh, job, scratch, threads);
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i]))
          << "threads " << threads << " row " << i / static_cast<size_t>(q_w) << " element " << i % static_cast<size_t>(q_w)
          << ": " << got[i] << " vs " << want[i];
    }
    if (!sc.async) continue;
    for (int i = 0; i < c.n_tokens; ++i) {
      for (int h = 0; h < sh.n_head; ++h) {
        ASSERT_EQ(got_rows[static_cast<size_t>(i)][static_cast<size_t>(h)], want_rows[static_cast<size_t>(i)][static_cast<size_t>(h)])
            << "row " << i << " head " << h;
      }
    }
    ASSERT_EQ(got_phi, want_rows.back());
  }
}

INSTANTIATE_TEST_SUITE_P(
    Passes, AttentionSteps,
    ::testing::Values(StepsCase{{9, 3, 64}, Case{9, 3, 64, 150, 9}, true, 4.0f},
                      StepsCase{{9, 3, 64}, Case{9, 3, 64, 150, 9}, true, NAN},
                      StepsCase{{9, 3, 64}, Case{9, 3, 64, 150, 9}, false, NAN},
                      StepsCase{{9, 3, 64}, Case{9, 3, 64, 300, 5, true, true}, true, 3.0f},
                      StepsCase{{9, 3, 64}, Case{9, 3, 64, 600, 9, false, true}, true, 3.0f},  // split keys
                      StepsCase{{9, 3, 64}, Case{9, 3, 64, 600, 4, true, false, 200}, true, 100.0f},  // phi too high: exact
                      StepsCase{{8, 2, 32, 64}, Case{8, 2, 32, 300, 6, false, true}, true, 2.0f},    // a window
                      StepsCase{{4, 1, 16}, Case{4, 1, 16, 127, 3}, true, 2.0f},                      // across a block's end
                      StepsCase{{16, 1, 64}, Case{16, 1, 64, 200, 4, false, true}, true, NAN},       // row by row
                      // q8_0 caches: split keys, a ring with a prefix
                      StepsCase{{9, 3, 64}, Case{9, 3, 64, 600, 9, false, false, 0, 0, false, 8}, true, 3.0f},
                      StepsCase{{9, 3, 64}, Case{9, 3, 64, 600, 4, true, false, 200, 0, false, 8}, true, NAN},
                      StepsCase{{9, 3, 64}, Case{9, 3, 64, 600, 9, false, false, 0, 0, false, 4}, true, 3.0f}),
    [](const auto& info) {
      const StepsCase& s = info.param;
      std::ostringstream name;
      name << "H" << s.shape.n_head << "_KV" << s.shape.n_head_kv << "_past" << s.layout.n_past << "_rows" << s.layout.n_tokens
           << (s.layout.ring ? "_ring" : "") << (s.layout.f16 ? "_f16" : "") << (s.layout.bits == 8 ? "_q8_0" : s.layout.bits == 4 ? "_q4_0" : "");
      if (s.layout.prefix > 0) name << "_prefix" << s.layout.prefix;
      if (s.shape.window > 0) name << "_window" << s.shape.window;
      name << (s.async ? (std::isnan(s.phi0) ? "_phi_learned" : "_phi") : "_exact") << "_" << info.index;
      return name.str();
    });

INSTANTIATE_TEST_SUITE_P(Shapes, Attention,
                         ::testing::Values(Case{4, 4, 16, 0, 1}, Case{4, 4, 16, 0, 9}, Case{9, 3, 64, 0, 130},
                                           Case{9, 3, 64, 200, 33}, Case{8, 1, 32, 1000, 1}, Case{8, 2, 32, 700, 1},
                                           Case{9, 3, 64, 600, 1}, Case{6, 3, 8, 129, 70}, Case{2, 2, 64, 255, 2},
                                           Case{4, 2, 36, 50, 3}, Case{9, 3, 64, 200, 33, true},
                                           Case{9, 3, 64, 600, 1, true}, Case{8, 2, 32, 300, 1, true, true},
                                           Case{6, 3, 8, 129, 70, true, true}, Case{4, 4, 16, 0, 9, false, true},
                                           // a shared prompt segment: block-aligned or not, decode
                                           // (split keys) and prefill, in order and as a ring
                                           Case{9, 3, 64, 600, 1, false, true, 300},
                                           Case{8, 2, 32, 700, 1, false, false, 128},
                                           Case{9, 3, 64, 200, 33, false, true, 77},
                                           Case{9, 3, 64, 600, 1, true, false, 450},
                                           Case{4, 2, 36, 50, 3, false, false, 53},
                                           Case{9, 3, 64, 14, 1, false, true, 14},
                                           // tiles whose head size is no multiple of 4 or of a
                                           // vector, and a decode group too large for the row path
                                           Case{4, 2, 36, 50, 20}, Case{6, 3, 8, 3, 40, true},
                                           Case{16, 1, 36, 300, 1}, Case{16, 1, 64, 1200, 1, true, true},
                                           // sliding windows: shorter than a tile, across key
                                           // blocks, decode with split keys, a ring, a prefix
                                           Case{9, 3, 64, 200, 33, false, false, 0, 7},
                                           Case{9, 3, 64, 100, 130, false, true, 0, 150},
                                           Case{4, 4, 16, 0, 9, false, false, 0, 1},
                                           Case{8, 2, 32, 700, 1, false, false, 0, 300},
                                           Case{6, 3, 8, 129, 70, true, true, 0, 40},
                                           Case{9, 3, 64, 200, 33, false, true, 77, 120},
                                           // attention sinks: tiles, decode with split keys, a
                                           // window on a ring, a prefix
                                           Case{9, 3, 64, 200, 33, false, false, 0, 0, true},
                                           Case{8, 1, 32, 1000, 1, false, false, 0, 0, true},
                                           Case{6, 3, 8, 129, 70, true, true, 0, 40, true},
                                           Case{9, 3, 64, 600, 1, false, true, 300, 128, true},
                                           // q8_0 and q4_0 caches: decode with split keys (in
                                           // place), a prefill tile (gathered), a ring with a
                                           // prefix, a window, sinks, MQA
                                           Case{9, 3, 64, 600, 1, false, false, 0, 0, false, 8},
                                           Case{9, 3, 64, 200, 33, false, false, 0, 0, false, 8},
                                           Case{9, 3, 64, 600, 1, true, false, 300, 0, false, 8},
                                           Case{8, 2, 32, 700, 1, false, false, 0, 300, false, 8},
                                           Case{9, 3, 64, 200, 33, true, false, 77, 120, true, 8},
                                           Case{8, 1, 32, 1000, 1, false, false, 0, 0, false, 8},
                                           Case{9, 3, 64, 600, 1, false, false, 0, 0, false, 4},
                                           Case{9, 3, 64, 200, 33, false, false, 0, 0, false, 4},
                                           Case{9, 3, 64, 600, 1, true, false, 300, 0, false, 4},
                                           Case{8, 2, 32, 700, 1, false, false, 0, 300, false, 4},
                                           Case{8, 1, 32, 1000, 1, false, false, 0, 0, true, 4},
                                           // keys and values of different types (-ctk, -ctv):
                                           // decode in place (and across a prefix), a prefill tile
                                           Case{9, 3, 64, 600, 1, false, false, 0, 0, false, 8, 4},
                                           Case{9, 3, 64, 600, 1, true, false, 300, 0, false, 8, 16},
                                           Case{9, 3, 64, 200, 33, false, true, 0, 0, false, 0, 8},
                                           Case{8, 2, 32, 700, 1, false, true, 128, 0, false, 0, 4}),
                         [](const auto& info) {
                           const Case& c = info.param;
                           std::ostringstream name;  // (not operator+: GCC 12 reports a false -Wrestrict on it)
                           name << "H" << c.n_head << "_KV" << c.n_head_kv << "_D" << c.head_dim << "_past" << c.n_past
                                << "_n" << c.n_tokens << (c.ring ? "_ring" : "") << (c.f16 ? "_f16" : "")
                                << (c.bits == 8 ? "_q8_0" : c.bits == 4 ? "_q4_0" : "");
                           if (c.prefix > 0) name << "_prefix" << c.prefix;
                           if (c.window > 0) name << "_window" << c.window;
                           if (c.sinks) name << "_sinks";
                           if (c.value_bits > 0) name << "_values" << kv_type_name(value_type_of(c));
                           return name.str();
                         });

// Decode shapes with and without split keys (SmolLM2's 9/3 heads past 512 keys split in two).
INSTANTIATE_TEST_SUITE_P(DecodeShapes, AsyncSoftmax,
                         ::testing::Values(Case{4, 4, 16, 0, 1}, Case{8, 1, 32, 1000, 1}, Case{8, 2, 32, 700, 1},
                                           Case{9, 3, 64, 600, 1}, Case{9, 3, 64, 2047, 1}, Case{32, 32, 64, 300, 1},
                                           Case{9, 3, 64, 2047, 1, false, false, 0, 600},
                                           Case{9, 3, 64, 600, 1, false, false, 0, 0, true}),
                         [](const auto& info) {
                           const Case& c = info.param;
                           std::ostringstream name;
                           name << "H" << c.n_head << "_KV" << c.n_head_kv << "_D" << c.head_dim << "_past" << c.n_past;
                           if (c.window > 0) name << "_window" << c.window;
                           if (c.sinks) name << "_sinks";
                           return name.str();
                         });

}  // namespace
}  // namespace ringlm::cpu
