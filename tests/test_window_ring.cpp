// Sliding-window layers keep their keys and values in a ring of their own (KvWindowRing): the
// window plus one pass's tokens, each new token written over the oldest. Checked here:
//  - the ring's bookkeeping (slots, positions, what a context shift drops and moves, memory);
//  - a model whose local layers read that ring gives the logits of the same model reading a
//    whole-context cache (the window masks the rest there): only the order of the attention
//    sums differs, over a prompt that wraps the ring mid-pass and many decode steps after it;
//  - StreamingLLM's identity on such a model: after a shift, the next logits equal a fresh
//    cache prefilled with the kept tokens (the window ring's keys re-rotated with the local
//    layers' own RoPE base, its dropped tokens gone);
//  - a sample reading a shared prompt whose window ring wrapped gets a whole cache's logits;
//  - Gemma 3 270M's cache at 8k tokens against a full one.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "backends/cpu/cpu_backend.h"
#include "core/gguf/gguf.h"
#include "core/kv/kv_cache.h"
#include "core/model/llama.h"
#include "core/model/loader.h"

namespace ringlm {
namespace {

// --- The ring's bookkeeping ---------------------------------------------------------------

// Layers 1 and 3 of 4 windowed (a window of 4), a window ring of `slots` slots.
KvWindowRing odd_layers_windowed(int slots) { return {{false, true, false, true}, 4, slots}; }

std::vector<int64_t> held_positions(std::span<const int64_t> positions) {
  std::vector<int64_t> held;
  for (int64_t p : positions) {
    if (p >= 0) held.push_back(p);
  }
  std::sort(held.begin(), held.end());
  return held;
}

TEST(WindowRing, LayersAreSplitBetweenTheRings) {
  KvCache cache(4, 32, 2, 8, {KvType::kF32, 0, 0, false}, odd_layers_windowed(8));
  ASSERT_TRUE(cache.has_window_ring());
  EXPECT_EQ(cache.place(0).ring, KvRing::kFull);
  EXPECT_EQ(cache.place(1).ring, KvRing::kWindow);
  EXPECT_EQ(cache.place(2).index, 1);  // the second layer of the full ring
  EXPECT_EQ(cache.place(3).index, 1);  // the second of the window ring
  EXPECT_EQ(cache.view(KvRing::kFull).n_layer, 2);
  EXPECT_EQ(cache.view(KvRing::kWindow).capacity, 8);
  // Reserved: 2 layers x 32 slots and 2 layers x 8 slots, keys and values, 16 floats a row.
  EXPECT_EQ(cache.bytes(), size_t{2} * 2 * (32 + 8) * 16 * 4);
  // Each layer's rows are its own.
  cache.append(1);
  EXPECT_NE(cache.key(1, 0), cache.key(3, 0));
  EXPECT_NE(cache.key(0, 0), cache.key(1, 0));
  EXPECT_NE(cache.key(1, 0), cache.value(1, 0));
}

TEST(WindowRing, NewTokensOverwriteTheOldestSlots) {
  KvCache cache(4, 32, 2, 8, {KvType::kF32, 0, 0, false}, odd_layers_windowed(8));
  EXPECT_EQ(cache.window_slot(), 0);
  cache.append(5);
  EXPECT_EQ(cache.window_slot(), 5);
  cache.append(5);  // positions 5..9: slots 5, 6, 7, then 0 and 1 again
  EXPECT_EQ(cache.window_slot(), 2);
  const std::vector<int64_t> expected{8, 9, 2, 3, 4, 5, 6, 7};
  const std::span<const int64_t> window = cache.view(KvRing::kWindow).positions;
  EXPECT_EQ(std::vector<int64_t>(window.begin(), window.end()), expected);
  EXPECT_EQ(cache.size(), 10);  // the full ring has them all
  // In use: 10 tokens in the full ring's 2 layers, 8 in the window ring's.
  EXPECT_EQ(cache.bytes_in_use(), size_t{2} * (10 + 8) * cache.slot_bytes());
  EXPECT_EQ(cache.bytes_for_tokens(10), cache.bytes_in_use());
  cache.clear();
  EXPECT_EQ(cache.window_slot(), 0);
  EXPECT_TRUE(cache.view(KvRing::kWindow).positions.empty());
  EXPECT_EQ(cache.bytes_in_use(), 0u);
}

TEST(WindowRing, AShiftDropsTheSameTokensInBothRings) {
  // 16 slots, 2 sinks; the window ring's 12 slots hold positions 4..15 when the cache is full.
  KvCache cache(4, 16, 2, 8, {KvType::kF32, 2, 7, true}, odd_layers_windowed(12));
  cache.append(8);
  cache.append(8);
  const KvDiscard moved = cache.discard(7);  // positions 2..8 go; 9..15 become 2..8
  EXPECT_EQ(moved.full.size(), 7u);
  EXPECT_EQ(moved.window.size(), 7u);  // of the window ring's 12, 5 were dropped
  for (int slot : moved.window) EXPECT_GE(cache.view(KvRing::kWindow).positions[static_cast<size_t>(slot)], 2);
  EXPECT_EQ(held_positions(cache.view(KvRing::kWindow).positions), (std::vector<int64_t>{2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(held_positions(cache.positions()), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(cache.next_position(), 9);
  EXPECT_EQ(cache.bytes_in_use(), size_t{2} * (9 + 7) * cache.slot_bytes());
  // The next token goes to the window ring's next slot: the oldest, whatever it holds.
  const int slot = cache.window_slot();
  cache.append(1);
  EXPECT_EQ(cache.view(KvRing::kWindow).positions[static_cast<size_t>(slot)], 9);
}

TEST(WindowRing, APrefixMustHaveTheSameRings) {
  auto with_ring = std::make_shared<KvCache>(4, 32, 2, 8, KvCacheOptions{}, odd_layers_windowed(8));
  auto other_ring = std::make_shared<KvCache>(4, 32, 2, 8, KvCacheOptions{}, odd_layers_windowed(12));
  with_ring->append(3);
  other_ring->append(3);
  KvCache sample(4, 32, 2, 8, {}, odd_layers_windowed(8));
  EXPECT_THROW(sample.attach_prefix(other_ring), std::invalid_argument);
  KvCache plain(4, 32, 2, 8);
  EXPECT_THROW(plain.attach_prefix(with_ring), std::invalid_argument);
  EXPECT_NO_THROW(sample.attach_prefix(with_ring));
}

TEST(WindowRing, BadShapesAreRefused) {
  EXPECT_THROW(KvCache(4, 32, 2, 8, {}, {{true, false}, 4, 8}), std::invalid_argument);  // not one flag per layer
  EXPECT_THROW(KvCache(4, 32, 2, 8, {}, {{true, true, true, true}, 4, 4}), std::invalid_argument);  // no room past the window
  EXPECT_THROW(KvCache(4, 32, 2, 8, {}, {{true, true, true, true}, 0, 8}), std::invalid_argument);  // no window
}

// --- A model reading the ring -------------------------------------------------------------

// Tiny Gemma 3 files (tests/CMakeLists.txt's fixture): 7 layers, 6 of them with a window of 4
// tokens; and one layer, windowed.
const std::string kTinyGemma = std::string(RINGLM_TEST_WORK_DIR) + "/tiny_gemma3_q8_0.gguf";
const std::string kTinyGemmaOneLayer = std::string(RINGLM_TEST_WORK_DIR) + "/tiny_gemma3_1layer_f32.gguf";

struct TinyGemma {
  explicit TinyGemma(const std::string& path = kTinyGemma) : gguf(GgufFile::open(path)), model(*gguf, *backend) {}
  std::unique_ptr<GgufFile> gguf;
  std::unique_ptr<Backend> backend = make_cpu_backend(2, ComputeType::kFp32);
  LlamaModel model;

  int n_vocab() const { return model.hparams().n_vocab; }
  // A cache whose every layer is in the whole-context ring: the window only masks there.
  KvCache whole_context_cache(int n_ctx, const KvCacheOptions& options) const {
    const LlamaHparams& hp = model.hparams();
    return KvCache(hp.n_layer, n_ctx, hp.n_head_kv, hp.head_dim, options);
  }
};

std::vector<int32_t> token_stream(int n, int n_vocab, unsigned seed) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) t[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919 + seed * 104729 + i * i) % n_vocab);
  return t;
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

class WindowRingModel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    for (const std::string& path : {kTinyGemma, kTinyGemmaOneLayer}) {
      ASSERT_TRUE(std::filesystem::exists(path)) << path << " is generated by CTest's fixture";
    }
  }
};

TEST_F(WindowRingModel, SameLogitsAsAWholeContextCache) {
  TinyGemma m;
  ASSERT_EQ(m.model.hparams().sliding_window, 4);
  const KvCacheOptions options{KvType::kF32, 0, 0, false};
  KvCache ring = m.model.make_cache(1024, options);
  KvCache whole = m.whole_context_cache(1024, options);
  ASSERT_TRUE(ring.has_window_ring());
  ASSERT_FALSE(whole.has_window_ring());
  const int slots = ring.window_slots();
  ASSERT_LT(slots, 300) << "the prompt must wrap the window ring";

  // A prompt that wraps the ring in the middle of a pass, then single decode steps.
  const std::vector<int32_t> tokens = token_stream(360, m.n_vocab(), 1);
  std::vector<float> a(static_cast<size_t>(m.n_vocab())), b(a.size());
  m.model.forward(std::span(tokens).first(300), ring, a.data());
  m.model.forward(std::span(tokens).first(300), whole, b.data());
  EXPECT_LE(max_abs_diff(a, b), 1e-5f * range_of(b));
  for (size_t i = 300; i < tokens.size(); ++i) {
    m.model.forward(std::span(tokens).subspan(i, 1), ring, a.data());
    m.model.forward(std::span(tokens).subspan(i, 1), whole, b.data());
    ASSERT_LE(max_abs_diff(a, b), 1e-5f * range_of(b)) << "after token " << i;
  }
  // The window ring holds only its slots' worth; the whole-context cache everything.
  EXPECT_LT(ring.bytes(), whole.bytes() / 2);
}

TEST_F(WindowRingModel, ShiftsLikeAWholeContextCache) {
  TinyGemma m;
  const KvCacheOptions options{KvType::kF32, 4, 0, /*context_shift=*/true};
  KvCache ring = m.model.make_cache(280, options);
  KvCache whole = m.whole_context_cache(280, options);
  ASSERT_TRUE(ring.has_window_ring());
  const std::vector<int32_t> tokens = token_stream(500, m.n_vocab(), 2);
  std::vector<float> a(static_cast<size_t>(m.n_vocab())), b(a.size());
  m.model.forward(std::span(tokens).first(270), ring, a.data());
  m.model.forward(std::span(tokens).first(270), whole, b.data());
  for (size_t i = 270; i < tokens.size(); ++i) {
    m.model.forward(std::span(tokens).subspan(i, 1), ring, a.data());
    m.model.forward(std::span(tokens).subspan(i, 1), whole, b.data());
    ASSERT_LE(max_abs_diff(a, b), 1e-4f * range_of(b)) << "after token " << i << ", " << ring.shifts() << " shifts";
  }
  EXPECT_GE(ring.shifts(), 2);
  EXPECT_EQ(ring.shifts(), whole.shifts());
}

// One layer, windowed: a token's key and value depend only on the token and its position, so
// after a shift (sinks kept, n_discard dropped, the rest re-rotated) the next logits equal
// those of a fresh cache prefilled with the kept tokens (test_context_shift's identity, here
// on the window ring and the local layers' RoPE base).
TEST_F(WindowRingModel, OneLayerAfterAShiftEqualsAFreshCacheOfTheKeptTokens) {
  TinyGemma m(kTinyGemmaOneLayer);
  ASSERT_EQ(m.model.hparams().n_layer, 1);
  constexpr int kContext = 300, kKeep = 4;
  const KvCacheOptions options{KvType::kF32, kKeep, 0, /*context_shift=*/true};
  KvCache cache = m.model.make_cache(kContext, options);
  ASSERT_TRUE(cache.has_window_ring());
  const std::vector<int32_t> tokens = token_stream(kContext + 1, m.n_vocab(), 5);
  std::vector<float> shifted(static_cast<size_t>(m.n_vocab())), fresh(shifted.size()), unrotated(shifted.size());
  m.model.forward(std::span(tokens).first(kContext), cache, shifted.data());
  const int n_discard = cache.shift_size();
  m.model.forward(std::span(tokens).last(1), cache, shifted.data());
  ASSERT_EQ(cache.shifts(), 1);

  std::vector<int32_t> kept(tokens.begin(), tokens.begin() + kKeep);
  kept.insert(kept.end(), tokens.begin() + kKeep + n_discard, tokens.end());
  KvCache fresh_cache = m.model.make_cache(kContext, {KvType::kF32, kKeep, 0, false});
  m.model.forward(kept, fresh_cache, fresh.data());
  const float tolerance = 1e-4f * range_of(fresh);
  EXPECT_LE(max_abs_diff(shifted, fresh), tolerance);

  // Renumbered positions without the re-rotation: what the comparison must tell apart.
  KvCache wrong = m.model.make_cache(kContext, options);
  m.model.forward(std::span(tokens).first(kContext), wrong, unrotated.data());
  wrong.discard(n_discard);
  m.model.forward(std::span(tokens).last(1), wrong, unrotated.data());
  EXPECT_GT(max_abs_diff(unrotated, fresh), 10 * tolerance);
}

TEST_F(WindowRingModel, ASampleReadingASharedPromptGetsAWholeCachesLogits) {
  TinyGemma m;
  const KvCacheOptions options{KvType::kF32, 0, 0, false};
  const std::vector<int32_t> prompt = token_stream(300, m.n_vocab(), 3);
  const std::vector<int32_t> reply = token_stream(20, m.n_vocab(), 4);
  std::vector<float> a(static_cast<size_t>(m.n_vocab())), b(a.size());

  auto shared = std::make_shared<KvCache>(m.model.make_cache(1024, options));
  m.model.forward(prompt, *shared, a.data());
  KvCache sample = m.model.make_cache(1024, options);
  sample.attach_prefix(shared);
  KvCache whole = m.model.make_cache(1024, options);
  m.model.forward(prompt, whole, b.data());
  for (int32_t t : reply) {
    const LlamaModel::SequenceTokens one[] = {{std::span(&t, 1), &sample, a.data()}};
    m.model.forward_batch(one);
    m.model.forward(std::span(&t, 1), whole, b.data());
    ASSERT_LE(max_abs_diff(a, b), 1e-5f * range_of(b));
  }
}

TEST_F(WindowRingModel, ASequenceReadingTheFirstTokensOfAPromptMatchesAWholeCache) {
  TinyGemma m;
  const KvCacheOptions options{KvType::kF32, 0, 0, false};
  const std::vector<int32_t> earlier = token_stream(300, m.n_vocab(), 6);
  std::vector<int32_t> later(earlier.begin(), earlier.begin() + 280);
  for (int32_t t : token_stream(30, m.n_vocab(), 7)) later.push_back(t);
  std::vector<float> a(static_cast<size_t>(m.n_vocab())), b(a.size());

  auto shared = std::make_shared<KvCache>(m.model.make_cache(1024, options));
  m.model.forward(earlier, *shared, a.data());
  KvCache reader = m.model.make_cache(1024, options);
  // The window ring of the earlier prompt holds its last 260 slots: the window before position
  // 280 is there, the one before position 20 long gone.
  ASSERT_TRUE(reader.can_read_prefix(*shared, 280));
  EXPECT_FALSE(reader.can_read_prefix(*shared, 20));
  reader.attach_prefix(shared, 280);
  KvCache whole = m.model.make_cache(1024, options);
  m.model.forward(std::span(later).first(280), whole, b.data());
  for (size_t i = 280; i < later.size(); ++i) {
    const LlamaModel::SequenceTokens one[] = {{std::span(later).subspan(i, 1), &reader, a.data()}};
    m.model.forward_batch(one);
    m.model.forward(std::span(later).subspan(i, 1), whole, b.data());
    ASSERT_LE(max_abs_diff(a, b), 1e-5f * range_of(b)) << "token " << i;
  }
}

// --- Gemma 3 270M at 8k tokens ----------------------------------------------------------------

TEST(WindowRingMemory, Gemma3At8kTokensHoldsAQuarterOfAFullCache) {
  const std::string path = RINGLM_GEMMA3_MODEL;
  ASSERT_TRUE(std::filesystem::exists(path)) << path << " is missing: run scripts/setup.sh";
  const LoadedModel m = load_model(path, 2);
  const LlamaHparams& hp = m.model->hparams();
  ASSERT_EQ(hp.sliding_window, 512);
  const KvCache ring = m.model->make_cache(8192);
  const KvCache full(hp.n_layer, 8192, hp.n_head_kv, hp.head_dim);  // every layer holding all 8192
  ASSERT_TRUE(ring.has_window_ring());
  EXPECT_LE(static_cast<double>(ring.bytes()) / static_cast<double>(full.bytes()), 0.25);
  // Once 8192 tokens were written, all of it is in use.
  EXPECT_EQ(ring.bytes_for_tokens(8192), ring.bytes());
}

}  // namespace
}  // namespace ringlm
