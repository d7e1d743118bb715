// StreamingLLM's context shift on the ring KV cache, checked against identities that hold
// whatever the weights are:
//  - One layer: a token's key and value depend only on the token and its position, so after a
//    shift (sinks kept, n_discard dropped, the rest re-rotated by -n_discard) the next logits
//    must equal those of a fresh cache prefilled with exactly the kept tokens, which puts them at
//    the shifted positions. A shift that forgot to re-rotate must fail that comparison by far.
//  - Any depth: a ring that wrapped many times holds the same tokens as a compacted cache with
//    the same rows in order, so both give the same next logits.
//  - A prompt longer than the ring, run at once, shifts at the same moments as token by token.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <span>
#include <sstream>
#include <vector>

#include "backends/backend.h"
#include "backends/cpu/cpu_backend.h"
#include "core/kv/kv_cache.h"
#include "core/model/llama.h"
#include "tests/tiny_llama.h"

namespace ringlm {
namespace {

using test::LlamaSpec;
using test::TinyLlama;

constexpr int kVocab = 32;

LlamaSpec sharp_spec(uint32_t n_layer) {
  LlamaSpec spec;
  spec.n_layer = n_layer;
  spec.matrix_range = 0.5f;  // peaked attention: positions and rotations change the logits visibly
  return spec;
}

std::vector<int32_t> token_stream(int n, unsigned seed) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) t[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7 + seed * 13 + i * i) % kVocab);
  return t;
}

std::vector<float> run_tokens(LlamaModel& model, KvCache& cache, std::span<const int32_t> tokens, bool one_by_one) {
  std::vector<float> logits(kVocab);
  if (!one_by_one) {
    model.forward(tokens, cache, logits.data());
    return logits;
  }
  for (int32_t t : tokens) model.forward(std::span<const int32_t>(&t, 1), cache, logits.data());
  return logits;
}

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float d = 0.0f;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, std::fabs(a[i] - b[i]));
  return d;
}

float range_of(const std::vector<float>& v) {
  const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
  return *hi - *lo;
}

struct ShiftCase {
  int capacity, n_keep, n_discard;  // n_discard 0: half of the tokens after the sinks
  KvType type;
};

class ShiftIdentity : public ::testing::TestWithParam<ShiftCase> {};

TEST_P(ShiftIdentity, NextLogitsEqualAFreshCacheOfTheKeptTokens) {
  const ShiftCase c = GetParam();
  const TinyLlama file{sharp_spec(1)};
  auto backend = make_cpu_backend(1);
  LlamaModel model(file.gguf(), *backend);
  const KvCacheOptions options{c.type, c.n_keep, c.n_discard, /*context_shift=*/true};

  // Fill the ring exactly, then one more token: the shift happens before it is appended.
  const std::vector<int32_t> tokens = token_stream(c.capacity + 1, 3);
  KvCache cache = model.make_cache(c.capacity, options);
  run_tokens(model, cache, std::span(tokens).first(static_cast<size_t>(c.capacity)), false);
  const int n_discard = cache.shift_size();
  const std::vector<float> shifted = run_tokens(model, cache, std::span(tokens).last(1), false);
  ASSERT_EQ(cache.shifts(), 1);
  ASSERT_EQ(cache.size(), c.capacity + 1 - n_discard);

  // The same tokens minus the discarded ones, from position 0 in a fresh cache.
  std::vector<int32_t> kept(tokens.begin(), tokens.begin() + c.n_keep);
  kept.insert(kept.end(), tokens.begin() + c.n_keep + n_discard, tokens.end());
  KvCache fresh_cache = model.make_cache(c.capacity, {c.type, c.n_keep, 0, false});
  const std::vector<float> fresh = run_tokens(model, fresh_cache, kept, false);

  // What a shift without the re-rotation would give: the sensitivity of this comparison.
  KvCache unrotated = model.make_cache(c.capacity, options);
  run_tokens(model, unrotated, std::span(tokens).first(static_cast<size_t>(c.capacity)), false);
  unrotated.discard(n_discard);  // positions renumbered, keys left as they were
  const std::vector<float> wrong = run_tokens(model, unrotated, std::span(tokens).last(1), false);

  // fp32: two rotations against one, in float: ~1e-6 of the range. fp16: the re-rotated keys
  // are rounded to fp16 a second time.
  const float range = range_of(fresh);
  const float tolerance = (c.type == KvType::kF32 ? 1e-4f : 3e-3f) * range;
  EXPECT_LE(max_abs_diff(shifted, fresh), tolerance) << "range " << range;
  // (Discarding every token after the sinks leaves no key to re-rotate.)
  if (n_discard < c.capacity - c.n_keep) {
    EXPECT_GT(max_abs_diff(wrong, fresh), 10 * tolerance) << "the test cannot tell a missing re-rotation apart";
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, ShiftIdentity,
                         ::testing::Values(ShiftCase{16, 4, 0, KvType::kF32}, ShiftCase{16, 0, 0, KvType::kF32},
                                           ShiftCase{16, 4, 1, KvType::kF32}, ShiftCase{16, 0, 1, KvType::kF32},
                                           ShiftCase{16, 3, 13, KvType::kF32}, ShiftCase{24, 4, 5, KvType::kF16},
                                           ShiftCase{16, 4, 0, KvType::kF16}),
                         [](const auto& info) {
                           const ShiftCase& c = info.param;
                           std::ostringstream name;
                           name << "ctx" << c.capacity << "_keep" << c.n_keep << "_discard" << c.n_discard
                                << (c.type == KvType::kF32 ? "_f32" : "_f16");
                           return name.str();
                         });

// A copy of the ring's tokens, in position order, in slots 0.. of a fresh cache.
KvCache compacted(const LlamaModel& model, const KvCache& ring, int n_layer) {
  const std::span<const int64_t> pos = ring.positions();
  std::vector<int> slots;
  for (int s = 0; s < static_cast<int>(pos.size()); ++s) {
    if (pos[static_cast<size_t>(s)] >= 0) slots.push_back(s);
  }
  std::sort(slots.begin(), slots.end(), [&](int a, int b) { return pos[static_cast<size_t>(a)] < pos[static_cast<size_t>(b)]; });
  KvCache out = model.make_cache(ring.capacity(), {ring.type(), ring.n_keep(), 0, false});
  const int first = out.append(static_cast<int>(slots.size()));
  for (int layer = 0; layer < n_layer; ++layer) {
    for (size_t i = 0; i < slots.size(); ++i) {
      std::memcpy(out.key(layer, first + static_cast<int>(i)), ring.key(layer, slots[i]), ring.key_row_bytes());
      std::memcpy(out.value(layer, first + static_cast<int>(i)), ring.value(layer, slots[i]), ring.value_row_bytes());
    }
  }
  return out;
}

TEST(ContextShift, RingWrappedManyTimesEqualsCompactedCache) {
  for (KvType type : {KvType::kF32, KvType::kF16}) {
    const TinyLlama file{sharp_spec(2)};
    auto backend = make_cpu_backend(1);
    LlamaModel model(file.gguf(), *backend);
    KvCache ring = model.make_cache(16, {type, 2, 3, true});
    const std::vector<int32_t> tokens = token_stream(90, 5);
    run_tokens(model, ring, tokens, true);
    ASSERT_GE(ring.shifts(), 20) << "the ring must have wrapped many times";
    // Positions after many shifts are still 0 .. size-1: nothing drifts.
    std::vector<int64_t> held;
    for (int64_t p : ring.positions()) {
      if (p >= 0) held.push_back(p);
    }
    std::sort(held.begin(), held.end());
    std::vector<int64_t> expected(held.size());
    std::iota(expected.begin(), expected.end(), 0);
    ASSERT_EQ(held, expected);
    ASSERT_EQ(ring.next_position(), static_cast<int64_t>(held.size()));

    KvCache flat = compacted(model, ring, 2);
    const int32_t next = 11;
    const std::vector<float> a = run_tokens(model, ring, std::span(&next, 1), true);
    const std::vector<float> b = run_tokens(model, flat, std::span(&next, 1), true);
    // Only the order of the attention sums differs.
    EXPECT_LE(max_abs_diff(a, b), 1e-5f * range_of(b)) << (type == KvType::kF32 ? "f32" : "f16");
  }
}

TEST(ContextShift, LongPromptShiftsLikeTokenByToken) {
  const TinyLlama file{sharp_spec(2)};
  auto backend = make_cpu_backend(2);
  LlamaModel model(file.gguf(), *backend);
  const std::vector<int32_t> tokens = token_stream(70, 9);
  KvCache at_once = model.make_cache(20, {KvType::kF32, 4, 0, true});
  KvCache stepped = model.make_cache(20, {KvType::kF32, 4, 0, true});
  const std::vector<float> a = run_tokens(model, at_once, tokens, false);
  const std::vector<float> b = run_tokens(model, stepped, tokens, true);
  EXPECT_EQ(at_once.shifts(), stepped.shifts());
  EXPECT_GT(at_once.shifts(), 0);
  EXPECT_LE(max_abs_diff(a, b), 1e-4f * range_of(b));
}

TEST(ContextShift, WithoutShiftAFullCacheRefusesMoreTokens) {
  const TinyLlama file{sharp_spec(1)};
  auto backend = make_cpu_backend(1);
  LlamaModel model(file.gguf(), *backend);
  KvCache cache = model.make_cache(8, {KvType::kF16, 4, 0, false});
  const std::vector<int32_t> tokens = token_stream(8, 1);
  run_tokens(model, cache, tokens, false);
  const int32_t more = 1;
  std::vector<float> logits(kVocab);
  EXPECT_THROW(model.forward(std::span(&more, 1), cache, logits.data()), std::length_error);
  EXPECT_EQ(cache.size(), 8);
}

// With RoPE scaling the shift is still a pure rotation: YaRN's and LongRoPE's magnitude factor,
// which the keys got from their own RoPE, must not be applied again (the keys would carry it
// twice), and LongRoPE's factors must be the ones the forward pass chose by the cache's size.
TEST(ContextShift, ScaledRopeShiftIsAPureRotation) {
  LlamaSpec yarn = sharp_spec(1);
  yarn.extra_strings["llama.rope.scaling.type"] = "yarn";
  yarn.extra_floats["llama.rope.scaling.factor"] = 4.0f;
  yarn.extra_uints["llama.rope.scaling.original_context_length"] = 8;
  yarn.extra_floats["llama.rope.scaling.attn_factor"] = 1.25f;
  LlamaSpec long_rope = sharp_spec(1);
  long_rope.arch = "phi3";
  long_rope.extra_uints["phi3.rope.scaling.original_context_length"] = 8;  // caches of 16: the long factors
  long_rope.extra_floats["phi3.rope.scaling.attn_factor"] = 1.25f;
  long_rope.extra_tensors["rope_factors_short.weight"] = {8};
  long_rope.extra_tensors["rope_factors_long.weight"] = {8};
  for (const LlamaSpec& spec : {yarn, long_rope}) {
    SCOPED_TRACE(spec.arch);
    const TinyLlama file{spec};
    auto backend = make_cpu_backend(1);
    LlamaModel model(file.gguf(), *backend);
    const std::vector<int32_t> tokens = token_stream(17, 5);
    KvCache cache = model.make_cache(16, {KvType::kF32, 4, 0, true});
    run_tokens(model, cache, std::span(tokens).first(16), false);
    const int n_discard = cache.shift_size();
    const std::vector<float> shifted = run_tokens(model, cache, std::span(tokens).last(1), false);
    ASSERT_EQ(cache.shifts(), 1);
    std::vector<int32_t> kept(tokens.begin(), tokens.begin() + 4);
    kept.insert(kept.end(), tokens.begin() + 4 + n_discard, tokens.end());
    KvCache fresh_cache = model.make_cache(16, {KvType::kF32, 4, 0, false});
    const std::vector<float> fresh = run_tokens(model, fresh_cache, kept, false);
    EXPECT_LE(max_abs_diff(shifted, fresh), 1e-4f * range_of(fresh)) << "range " << range_of(fresh);
  }
}

TEST(KvCacheRing, MemoryIsAllocatedOnceAndOptionsAreChecked) {
  KvCache cache(2, 8, 2, 4, {KvType::kF16, 2, 0, true});
  EXPECT_EQ(cache.bytes(), size_t{2} * 2 * 8 * 2 * 4 * 2);
  EXPECT_EQ(KvCache(2, 8, 2, 4, {KvType::kF32, 2, 0, true}).bytes(), size_t{2} * 2 * 8 * 2 * 4 * 4);
  EXPECT_THROW(KvCache(2, 8, 2, 4, {KvType::kF16, 8, 0, true}), std::invalid_argument);   // keep >= ctx
  EXPECT_THROW(KvCache(2, 8, 2, 4, {KvType::kF16, -1, 0, true}), std::invalid_argument);  // negative keep
  EXPECT_THROW(KvCache(2, 8, 2, 4, {KvType::kF16, 2, 7, true}), std::invalid_argument);   // discard > ctx - keep
  // A full ring discards half of the 6 tokens after the sinks by default, and frees their slots.
  cache.append(8);
  EXPECT_EQ(cache.contiguous_free(), 0);
  EXPECT_EQ(cache.shift_size(), 3);
  const std::vector<int> moved = cache.discard(3).full;
  EXPECT_EQ(moved, (std::vector<int>{5, 6, 7}));
  EXPECT_EQ(cache.size(), 5);
  EXPECT_EQ(cache.contiguous_free(), 3);
  EXPECT_EQ(cache.append(3), 2);  // the freed slots 2..4, right after the sinks
  EXPECT_EQ(cache.next_position(), 8);
}

}  // namespace
}  // namespace ringlm
