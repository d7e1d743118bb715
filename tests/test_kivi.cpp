// KIVI's 2-bit KV cache: the format (quant/kivi.h), KvCache's groups (which are open, in fp16,
// and which sealed in 2 bits), the CPU backend's store, shift and attention over them, each
// against what the definitions give computed here in double.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <cmath>
#include <random>
#include <span>
#include <stdexcept>
#include <vector>

#include "backends/backend.h"
#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/kv_rows.h"
#include "core/kv/kv_cache.h"
#include "hwy/targets.h"
#include "only_target.h"
#include "quant/formats.h"
#include "quant/kivi.h"

namespace ringlm {
namespace {

constexpr double kHalfUlp16 = 1.0 / 2048;  // fp16's relative rounding

std::vector<float> random_values(size_t n, std::mt19937& rng, float sigma = 1.0f) {
  std::normal_distribution<float> normal(0.0f, sigma);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// The largest error of a 2-bit asymmetric grid over [lo, hi]: half a step, plus the fp16
// rounding of the min and of the step (times the largest code, 3).
double grid_error(double lo, double hi) {
  const double step = (hi - lo) / 3;
  return step / 2 + (std::abs(lo) + 3 * step) * kHalfUlp16 + 1e-6;
}

// A key channel's grid may cut up to 0.3 of its range off either end (kKiviKeyCuts): a value
// there is clamped to the grid's end, and the others are within half the finer step.
double key_error(double lo, double hi) { return 0.3 * (hi - lo) + grid_error(lo, hi); }

// Attention by its definition, in double: one query head's vector q (hd elements) over the keys
// and values it sees (rows of row_width, the head's at element `at`), values given turned.
std::vector<double> attend_by_definition(const float* q, const std::vector<std::vector<float>>& keys,
                                         std::vector<std::vector<float>> values, int at, int n_kv_heads, int hd) {
  std::vector<double> score;
  for (const std::vector<float>& k : keys) {
    double dot = 0;
    for (int e = 0; e < hd; ++e) dot += double{q[e]} * k[static_cast<size_t>(at + e)];
    score.push_back(dot / std::sqrt(static_cast<double>(hd)));
  }
  const double mx = *std::max_element(score.begin(), score.end());
  double sum = 0;
  for (double& x : score) sum += (x = std::exp(x - mx));
  std::vector<double> out(static_cast<size_t>(hd));
  for (size_t j = 0; j < values.size(); ++j) {
    cpu::hadamard_heads(values[j].data(), n_kv_heads, hd);  // (its own inverse)
    for (int e = 0; e < hd; ++e) out[static_cast<size_t>(e)] += score[j] * values[j][static_cast<size_t>(at + e)] / sum;
  }
  return out;
}

TEST(KiviFormat, KeysAreQuantizedPerChannelOverTheLiveRowsOnly) {
  std::mt19937 rng(1);
  constexpr int kRows = kKiviGroup, kN = 128;
  std::vector<float> rows = random_values(static_cast<size_t>(kRows) * kN, rng);
  for (int i = 0; i < kRows; ++i) {
    for (int c = 0; c < kN; ++c) rows[static_cast<size_t>(i) * kN + c] *= c == 5 ? 40.0f : 0.1f * (1 + c % 7);  // an outlier channel
  }
  bool live[kRows];
  for (int i = 0; i < kRows; ++i) {
    live[i] = i % 5 != 3;
    if (!live[i]) std::fill_n(&rows[static_cast<size_t>(i) * kN], kN, 1e4f);  // must not widen any range
  }
  std::vector<uint8_t> codes(kRows * kivi_key_row_bytes(kN));
  std::vector<uint16_t> params(2 * kN);  // scales, then mins
  kivi_quantize_keys(rows.data(), kN, live, kRows, kN, codes.data(), static_cast<int64_t>(kivi_key_row_bytes(kN)),
                     params.data(), params.data() + kN);
  std::vector<float> back(rows.size());
  kivi_dequantize_keys(codes.data(), static_cast<int64_t>(kivi_key_row_bytes(kN)), kRows, params.data(), params.data() + kN, 0, kN,
                       back.data(), kN);
  for (int c = 0; c < kN; ++c) {
    double lo = INFINITY, hi = -INFINITY;
    for (int i = 0; i < kRows; ++i) {
      if (live[i]) lo = std::min(lo, double{rows[static_cast<size_t>(i) * kN + c]}), hi = std::max(hi, double{rows[static_cast<size_t>(i) * kN + c]});
    }
    // The grid lies within the live values' range, and gives them back with no more squared
    // error than the grid over the whole range would (the plain KIVI grid, computed here).
    const double min = fp16_to_fp32(params[kN + c]), step = fp16_to_fp32(params[c]);
    EXPECT_GE(min, lo - std::abs(lo) * kHalfUlp16) << c;
    EXPECT_LE(min + 3 * step, hi + (std::abs(hi) + std::abs(lo)) * kHalfUlp16 * 4) << c;
    const double plain_min = fp16_to_fp32(fp32_to_fp16(static_cast<float>(lo)));
    const double plain_step = fp16_to_fp32(fp32_to_fp16(static_cast<float>((hi - lo) / 3)));
    double error = 0, plain_error = 0;
    for (int i = 0; i < kRows; ++i) {
      if (!live[i]) continue;
      const size_t at = static_cast<size_t>(i) * kN + c;
      ASSERT_LE(std::abs(back[at] - rows[at]), key_error(lo, hi)) << "row " << i << " channel " << c;
      const double code = std::clamp(std::nearbyint((rows[at] - plain_min) / plain_step), 0.0, 3.0);
      plain_error += std::pow(plain_min + code * plain_step - rows[at], 2);
      error += std::pow(back[at] - rows[at], 2);
    }
    EXPECT_LE(error, plain_error * (1 + 1e-6) + 1e-9) << c;
    if (c == 5) {
      EXPECT_LT(error, plain_error * 0.95) << "an outlier channel's grid gains nothing from cutting its range";
    }
  }
  // A part of the rows reads the same elements.
  std::vector<float> part(static_cast<size_t>(3) * 64);
  kivi_dequantize_keys(codes.data() + 2 * kivi_key_row_bytes(kN), static_cast<int64_t>(kivi_key_row_bytes(kN)), 3, params.data(),
                       params.data() + kN, 64, 64, part.data(), 64);
  for (int i = 0; i < 3; ++i) {
    for (int e = 0; e < 64; ++e) ASSERT_EQ(part[static_cast<size_t>(i) * 64 + e], back[static_cast<size_t>(i + 2) * kN + 64 + e]);
  }
}

TEST(KiviFormat, ValuesAreQuantizedPerTokenInBlocks) {
  std::mt19937 rng(2);
  constexpr int kN = 3 * kKiviValueBlock;
  std::vector<float> row = random_values(kN, rng);
  for (int e = 0; e < kN; ++e) row[static_cast<size_t>(e)] *= e < kKiviValueBlock ? 0.01f : e < 2 * kKiviValueBlock ? 1.0f : 30.0f;
  std::vector<uint8_t> bytes(kivi_value_row_bytes(kN));
  ASSERT_EQ(bytes.size(), static_cast<size_t>(3 * (4 + kKiviValueBlock / 4)));
  kivi_quantize_value(row.data(), kN, bytes.data());
  std::vector<float> back(kN);
  kivi_dequantize_value(bytes.data(), 0, kN, back.data());
  for (int b = 0; b < 3; ++b) {
    const auto* x = &row[static_cast<size_t>(b) * kKiviValueBlock];
    const auto [lo, hi] = std::minmax_element(x, x + kKiviValueBlock);
    for (int e = 0; e < kKiviValueBlock; ++e) {
      const size_t at = static_cast<size_t>(b) * kKiviValueBlock + e;
      ASSERT_LE(std::abs(back[at] - row[at]), grid_error(*lo, *hi)) << at;
    }
  }
  std::vector<float> middle(kKiviValueBlock);
  kivi_dequantize_value(bytes.data(), kKiviValueBlock, kKiviValueBlock, middle.data());
  for (int e = 0; e < kKiviValueBlock; ++e) ASSERT_EQ(middle[static_cast<size_t>(e)], back[static_cast<size_t>(kKiviValueBlock + e)]);
}

TEST(KiviCache, RefusesOneSideAloneAndHeadsOfOtherSizes) {
  KvCacheOptions one_side;
  one_side.type = KvTypes(KvType::kKivi2, KvType::kF16);
  EXPECT_THROW(KvCache(1, 64, 1, 64, one_side), std::invalid_argument);
  KvCacheOptions both;
  both.type = KvType::kKivi2;
  EXPECT_THROW(KvCache(1, 64, 1, 32, both), std::invalid_argument);
  EXPECT_NO_THROW(KvCache(1, 64, 1, 128, both));
}

// A KIVI cache of 2 layers (heads of 64, turned values) filled with known rows through the CPU
// backend as the model fills it, and read back from its groups as their layout says.
class KiviCacheTest : public ::testing::Test {
 protected:
  static constexpr int kLayers = 2, kKvHeads = 2, kDim = 64, kWidth = kKvHeads * kDim;

  void make(int capacity, int n_keep, int residual, const KvWindowRing& window = {}) {
    KvCacheOptions options;
    options.type = KvType::kKivi2;
    options.n_keep = n_keep;
    options.context_shift = true;
    options.kivi_residual = residual;
    cache = std::make_unique<KvCache>(kLayers, capacity, kKvHeads, kDim, options, window);
    window_size = window.window;
  }

  // Appends n tokens with fresh random rows (remembered by position) and stores them in both
  // layers, each followed by its attention, as the model runs a pass (a prompt's groups are
  // quantized once the layer's attention has read them).
  void append(int n) {
    const int64_t pos0 = cache->next_position();
    const int window_slot = cache->window_slot();
    const int first = cache->append(n);
    std::vector<float> k = random_values(static_cast<size_t>(n) * kWidth, rng), v = random_values(k.size(), rng);
    for (int i = 0; i < n; ++i) {
      const auto at = static_cast<size_t>(original_position(pos0 + i));
      if (at >= keys.size()) keys.resize(at + 1), values.resize(at + 1);
      keys[at].assign(&k[static_cast<size_t>(i) * kWidth], &k[static_cast<size_t>(i + 1) * kWidth]);
      values[at].assign(&v[static_cast<size_t>(i) * kWidth], &v[static_cast<size_t>(i + 1) * kWidth]);
    }
    for (int layer = 0; layer < kLayers; ++layer) {
      const KvCache::LayerPlace place = cache->place(layer);
      const KvView view = cache->view(place.ring);
      if (place.ring == KvRing::kFull) {
        backend->store_kv(view, place.index, first, n, k.data(), v.data());
      } else {
        const int to_end = std::min(n, view.capacity - window_slot);
        backend->store_kv(view, place.index, window_slot, to_end, k.data(), v.data());
        if (to_end < n) {
          backend->store_kv(view, place.index, 0, n - to_end, k.data() + to_end * kWidth, v.data() + to_end * kWidth);
        }
      }
      attend(view, place.index, pos0, n, place.ring == KvRing::kWindow ? window_size : 0);
    }
  }

  // The attention of the n tokens from position pos0 (queries q of n_heads heads) over a ring's
  // layer, through the backend.
  std::vector<float> attend(const KvView& view, int index, const std::vector<float>& q, int64_t pos0, int n, int n_heads,
                            int window = 0) {
    std::vector<float> out(q.size(), NAN);
    AttentionCall call;
    call.q = q.data();
    call.n_tokens = n;
    call.pos0 = pos0;
    call.out = out.data();
    call.kv = &view;
    AttentionShape shape{n_heads, kKvHeads, kDim};
    shape.window = window;
    backend->attention(index, shape, std::span<const AttentionCall>(&call, 1));
    return out;
  }
  // The same with queries of no interest: the pass runs it (append), others check it.
  void attend(const KvView& view, int index, int64_t pos0, int n, int window) {
    attend(view, index, std::vector<float>(static_cast<size_t>(n) * 2 * kDim, 0.1f), pos0, n, 2, window);
  }

  // Slot `slot`'s row of keys or values (values as stored: turned) in layer `index` of a ring.
  static std::vector<float> read(const KvView& view, int index, int slot, bool value) {
    const KvKiviGroups& groups = *view.kivi;
    const int g = groups.group_of(slot);
    std::vector<float> row(kWidth);
    if (groups.staged[g] >= 0) {
      const uint16_t* staged = view.kivi_staged(index, groups.staged[g], slot - groups.first_slot(g), value);
      for (int e = 0; e < kWidth; ++e) row[static_cast<size_t>(e)] = fp16_to_fp32(staged[e]);
    } else if (value) {
      kivi_dequantize_value(view.value(index, slot), 0, kWidth, row.data());
    } else {
      kivi_dequantize_keys(view.key(index, slot), 0, 1, view.kivi_params(index, g), view.kivi_params(index, g) + kWidth, 0,
                           kWidth, row.data(), kWidth);
    }
    return row;
  }

  static std::vector<float> turned(std::vector<float> v) {
    cpu::hadamard_heads(v.data(), kKvHeads, kDim);
    return v;
  }

  // Every slot holding a token, in every layer: the tokens among the newest `residual` are in
  // open groups, exact in fp16; the others within the 2-bit grid of their rows' range (keys per
  // channel over the group, values per token). With `tolerance`, keys other than the newest
  // are allowed that much more (rows rotated and stored again).
  void expect_rows_held(int residual, double tolerance = 0) {
    const int64_t newest = cache->next_position() - 1;
    for (int layer = 0; layer < kLayers; ++layer) {
      const KvCache::LayerPlace place = cache->place(layer);
      const KvView view = cache->view(place.ring);
      if (view.kivi == nullptr) continue;  // (kivi2's window ring holds q4_0)
      const KvKiviGroups& groups = *view.kivi;
      for (int g = 0; g < groups.n_groups; ++g) {
        const int first = groups.first_slot(g), size = groups.group_size(g);
        const bool open = groups.staged[g] >= 0;
        if (place.ring == KvRing::kFull && groups.pinned(g)) {
          ASSERT_EQ(first + size, std::max(kKeep, 1)) << "the sinks are not a group of their own";
          ASSERT_TRUE(open) << "the sinks' group " << g << " is sealed";
        }
        for (int e = 0; e < kWidth; ++e) {
          double lo = INFINITY, hi = -INFINITY;
          for (int s = first; s < first + size; ++s) {
            if (s >= static_cast<int>(view.positions.size()) || view.positions[static_cast<size_t>(s)] < 0) continue;
            const double x = keys[static_cast<size_t>(original_position(view.positions[static_cast<size_t>(s)]))][static_cast<size_t>(e)];
            lo = std::min(lo, x), hi = std::max(hi, x);
          }
          for (int s = first; s < first + size; ++s) {
            if (s >= static_cast<int>(view.positions.size()) || view.positions[static_cast<size_t>(s)] < 0) continue;
            const int64_t position = view.positions[static_cast<size_t>(s)];
            SCOPED_TRACE(::testing::Message() << "layer " << layer << " slot " << s << " position " << position << " element " << e);
            const bool recent = newest - position < residual;
            ASSERT_TRUE(open || !recent) << "a token among the newest " << residual << " is sealed";
            const double key = keys[static_cast<size_t>(original_position(position))][static_cast<size_t>(e)];
            const float held = read(view, place.index, s, false)[static_cast<size_t>(e)];
            if (recent && tolerance == 0) {
              ASSERT_EQ(held, fp16_to_fp32(fp32_to_fp16(static_cast<float>(key))));
            } else {
              // An older token of an open group was sealed before, with the group's rows of then
              // (some since written over): twice the grid's reach.
              const double reach = (open ? 2 : 1) * key_error(lo, hi);
              ASSERT_LE(std::abs(held - key), reach + std::abs(key) * kHalfUlp16 + tolerance);
            }
          }
        }
        for (int s = first; s < first + size; ++s) {
          if (s >= static_cast<int>(view.positions.size()) || view.positions[static_cast<size_t>(s)] < 0) continue;
          const int64_t position = view.positions[static_cast<size_t>(s)];
          const bool recent = newest - position < residual;
          const std::vector<float> want = turned(values[static_cast<size_t>(original_position(position))]);
          const std::vector<float> held = read(view, place.index, s, true);
          for (int b = 0; b < kWidth / kKiviValueBlock; ++b) {
            const auto [lo, hi] = std::minmax_element(&want[static_cast<size_t>(b) * kKiviValueBlock],
                                                      &want[static_cast<size_t>(b + 1) * kKiviValueBlock]);
            for (int e = b * kKiviValueBlock; e < (b + 1) * kKiviValueBlock; ++e) {
              const double x = want[static_cast<size_t>(e)];
              if (recent) {
                ASSERT_EQ(held[static_cast<size_t>(e)], fp16_to_fp32(fp32_to_fp16(static_cast<float>(x)))) << s << " " << e;
              } else {  // (a value once sealed, open again, is its 2-bit row in fp16)
                ASSERT_LE(std::abs(held[static_cast<size_t>(e)] - x), grid_error(*lo, *hi) + std::abs(x) * kHalfUlp16) << s << " " << e;
              }
            }
          }
        }
      }
    }
  }

  // The token whose rows a position holds now: positions move back by what the shifts discarded.
  int64_t original_position(int64_t position) const { return position < kKeep ? position : position + discarded; }

  static constexpr int kKeep = 4;
  std::unique_ptr<Backend> backend = make_cpu_backend(2, ComputeType::kInt8);
  std::unique_ptr<KvCache> cache;
  std::mt19937 rng{11};
  std::vector<std::vector<float>> keys, values;  // by the position each token was appended at
  int64_t discarded = 0;
  int window_size = 0;  // the sliding-window layers'
};

TEST_F(KiviCacheTest, DecodeKeepsTheNewestTokensInFp16AndSealsOlderGroups) {
  make(512, kKeep, 64);
  for (int t = 0; t < 300; ++t) {
    append(1);
    if (t % 7 == 0 || t == 299) expect_rows_held(64);
  }
  // Most of the 300 tokens are sealed: only the residual's groups and the write's stay open.
  const KvView view = cache->view();
  int open = 0;
  for (int g = 0; g < view.kivi->n_groups; ++g) open += view.kivi->staged[g] >= 0;
  EXPECT_LE(open, 64 / kKiviGroup + 3);
  EXPECT_GE(open, 64 / kKiviGroup);
}

TEST_F(KiviCacheTest, APromptQuantizesItsOldGroupsAtOnceAndLaterWritesOpenThemAgain) {
  make(512, kKeep, 40);
  append(300);
  expect_rows_held(40);
  for (int t = 0; t < 50; ++t) append(1);
  expect_rows_held(40);
  append(70);
  expect_rows_held(40);
}

// A context shift drops tokens after the sinks and rotates the keys of the rest by -n: an open
// group's rows are rotated in fp32 and stored again in fp16, a sealed group's dequantized,
// rotated and quantized again; new tokens then go where the dropped ones were, opening groups
// that still hold older tokens.
TEST_F(KiviCacheTest, AShiftRotatesEveryGroupsKeysAndLaterTokensReopenItsGroups) {
  make(200, kKeep, 32);
  for (int t = 0; t < 200; ++t) append(1);
  const int n = 70;
  const KvDiscard moved = cache->discard(n);
  discarded += n;
  // Angles of a rotation by -n: the test's own, every pair at its own angle.
  std::vector<float> cos(kDim / 2), sin(kDim / 2);
  for (int i = 0; i < kDim / 2; ++i) {
    const double theta = -n * std::pow(10000.0, -2.0 * i / kDim);
    cos[static_cast<size_t>(i)] = static_cast<float>(std::cos(theta));
    sin[static_cast<size_t>(i)] = static_cast<float>(std::sin(theta));
  }
  const std::vector<int> layers = {0, 1};
  backend->shift_keys(cache->view(), layers, moved.full, RopeAngles{cos.data(), sin.data(), kDim, true}, kKvHeads, kDim);
  // What the moved tokens' keys should be now: rotated (pairs 2i, 2i + 1).
  for (int64_t p = kKeep + n; p < 200; ++p) {
    std::vector<float>& key = keys[static_cast<size_t>(p)];
    for (int h = 0; h < kKvHeads; ++h) {
      for (int i = 0; i < kDim / 2; ++i) {
        float& a = key[static_cast<size_t>(h * kDim + 2 * i)];
        float& b = key[static_cast<size_t>(h * kDim + 2 * i + 1)];
        const double c = cos[static_cast<size_t>(i)], s = sin[static_cast<size_t>(i)];
        const double a2 = a * c - b * s, b2 = a * s + b * c;
        a = static_cast<float>(a2), b = static_cast<float>(b2);
      }
    }
  }
  // A sealed key is quantized twice: before (an error up to its old grid's, turned with its
  // pair), and again now. The old grids of keys of unit spread are below 2.5 a step.
  expect_rows_held(32, /*tolerance=*/1.5);
  for (int t = 0; t < 60; ++t) append(1);
  expect_rows_held(32, 1.5);
}

// Attention reads what the cache holds: open groups' fp16 rows and sealed groups' 2-bit ones,
// across a shared prefix too, on every SIMD target, as the definition over those rows gives.
TEST_F(KiviCacheTest, AttentionReadsTheGroupsAsTheyAreHeld) {
  make(512, kKeep, 48);
  append(200);
  for (int t = 0; t < 40; ++t) append(1);
  constexpr int kHeads = 4;
  KvView view = cache->view();
  for (const int n_tokens : {1, 5}) {
    std::vector<float> q = random_values(static_cast<size_t>(n_tokens) * kHeads * kDim, rng, 0.3f);
    const int64_t pos0 = cache->next_position() - n_tokens;
    // The definition, over the rows read from the groups (values turned back).
    std::vector<double> want(q.size());
    for (int i = 0; i < n_tokens; ++i) {
      std::vector<std::vector<float>> seen_keys, seen_values;
      for (int s = 0; s < static_cast<int>(view.positions.size()); ++s) {
        const int64_t p = view.positions[static_cast<size_t>(s)];
        if (p < 0 || p > pos0 + i) continue;
        seen_keys.push_back(read(view, 1, s, false));
        seen_values.push_back(read(view, 1, s, true));
      }
      for (int h = 0; h < kHeads; ++h) {
        const int g = h / (kHeads / kKvHeads);
        const std::vector<double> head = attend_by_definition(&q[static_cast<size_t>((i * kHeads + h) * kDim)], seen_keys,
                                                              seen_values, g * kDim, kKvHeads, kDim);
        std::copy(head.begin(), head.end(), want.begin() + (i * kHeads + h) * kDim);
      }
    }
    for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
      SCOPED_TRACE(hwy::TargetName(target));
      const test::OnlyTarget only(target);
      const std::vector<float> out = attend(view, 1, q, pos0, n_tokens, kHeads);
      for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], want[i], 2e-5) << n_tokens << " tokens, output " << i;
    }
  }
}

// A prompt's attention reads its own tokens as the pass computed them: the groups it fills whole
// (quantized only after the layer's attention) in fp32, the open ones in fp16, and the earlier
// tokens as the cache holds them; afterwards the filled groups are sealed.
TEST_F(KiviCacheTest, APromptAttendsToItsOwnTokensBeforeTheyAreQuantized) {
  make(512, kKeep, 40);
  append(100);
  constexpr int kHeads = 2, n = 150;
  const int64_t pos0 = cache->next_position();
  const int first = cache->append(n);  // (which seals the earlier groups that left the residual)
  const KvView view = cache->view();
  std::vector<std::vector<float>> held_k, held_v;  // the earlier tokens as held, by slot
  for (int s = 0; s < first; ++s) held_k.push_back(read(view, 0, s, false)), held_v.push_back(read(view, 0, s, true));
  std::vector<float> k = random_values(static_cast<size_t>(n) * kWidth, rng), v = random_values(k.size(), rng);
  backend->store_kv(view, 0, first, n, k.data(), v.data());
  const std::vector<float> q = random_values(static_cast<size_t>(n) * kHeads * kDim, rng, 0.3f);
  // What each slot holds as this pass reads it.
  const auto row_of = [&](int s, bool value) {
    if (s < first) return value ? held_v[static_cast<size_t>(s)] : held_k[static_cast<size_t>(s)];
    std::vector<float> row((value ? v : k).begin() + (s - first) * kWidth, (value ? v : k).begin() + (s - first + 1) * kWidth);
    if (value) row = turned(row);
    if (view.kivi->staged[view.kivi->group_of(s)] >= 0) {
      for (float& x : row) x = fp16_to_fp32(fp32_to_fp16(x));
    }
    return row;
  };
  const std::vector<float> out = attend(view, 0, q, pos0, n, kHeads);
  int sealed_in_pass = 0;
  for (int g = view.kivi->group_of(first); g <= view.kivi->group_of(first + n - 1); ++g) sealed_in_pass += view.kivi->staged[g] < 0;
  ASSERT_GT(sealed_in_pass, 1) << "the pass fills no group whole";
  for (int i = 0; i < n; i += 7) {
    std::vector<std::vector<float>> seen_keys, seen_values;
    for (int s = 0; s < first + n; ++s) {
      const int64_t p = s < first ? view.positions[static_cast<size_t>(s)] : pos0 + (s - first);
      if (p > pos0 + i) continue;
      seen_keys.push_back(row_of(s, false));
      seen_values.push_back(row_of(s, true));
    }
    for (int h = 0; h < kHeads; ++h) {
      const std::vector<double> want = attend_by_definition(&q[static_cast<size_t>((i * kHeads + h) * kDim)], seen_keys,
                                                            seen_values, h * kDim, kKvHeads, kDim);
      for (int e = 0; e < kDim; ++e) {
        ASSERT_NEAR(out[static_cast<size_t>((i * kHeads + h) * kDim + e)], want[static_cast<size_t>(e)], 2e-5)
            << "token " << i << " head " << h;
      }
    }
  }
  // The pass's filled groups are sealed now: within their grids of the rows stored.
  for (int s = first; s < first + n; ++s) {
    if (view.kivi->staged[view.kivi->group_of(s)] >= 0) continue;
    const std::vector<float> key = read(view, 0, s, false);
    for (int e = 0; e < kWidth; ++e) ASSERT_NEAR(key[static_cast<size_t>(e)], k[static_cast<size_t>(s - first) * kWidth + e], 2.0) << s;
  }
}

// A beam that forks copies its parent's rows, groups and staging buffers: it reads the same
// rows; and it goes on writing its own without touching the parent's.
TEST_F(KiviCacheTest, ACopyHoldsTheSameRowsAndWritesItsOwn) {
  make(512, kKeep, 48);
  append(150);
  for (int t = 0; t < 20; ++t) append(1);
  auto copy = std::make_unique<KvCache>(kLayers, 512, kKvHeads, kDim, cache->options());
  copy->copy_from(*cache);
  std::vector<std::vector<float>> parent_rows;
  for (int layer = 0; layer < kLayers; ++layer) {
    for (int slot = 0; slot < cache->extent(); ++slot) {
      for (const bool value : {false, true}) {
        parent_rows.push_back(read(cache->view(), layer, slot, value));
        ASSERT_EQ(parent_rows.back(), read(copy->view(), layer, slot, value)) << slot;
      }
    }
  }
  std::swap(cache, copy);  // the copy goes on as the test's cache: the rows it writes are checked
  for (int t = 0; t < 40; ++t) append(1);
  expect_rows_held(48);
  size_t i = 0;
  for (int layer = 0; layer < kLayers; ++layer) {
    for (int slot = 0; slot < 170; ++slot) {
      for (const bool value : {false, true}) ASSERT_EQ(read(copy->view(), layer, slot, value), parent_rows[i++]) << slot;
    }
  }
}

// Sliding-window layers keep their own ring, in q4_0 on both sides (KvCache::ring_type): the
// full ring's layers keep their KIVI groups, the window ring's layers hold each token's rows
// (turned by the Walsh-Hadamard matrix) in q4_0 blocks, written around its end.
TEST_F(KiviCacheTest, TheWindowRingHoldsQ4_0) {
  KvWindowRing window;
  window.layers = {false, true};
  window.window = 96;
  window.slots = 96 + 40;
  make(512, kKeep, 32, window);
  EXPECT_EQ(cache->ring_type(KvRing::kFull), (KvTypes{KvType::kKivi2, KvType::kKivi2}));
  EXPECT_EQ(cache->ring_type(KvRing::kWindow), (KvTypes{KvType::kQ4_0, KvType::kQ4_0}));
  append(30);
  for (int t = 0; t < 150; ++t) append(1 + t % 3);
  append(40);
  const KvView view = cache->view(KvRing::kWindow);
  ASSERT_EQ(view.kivi, nullptr);
  ASSERT_EQ(view.key_type, KvType::kQ4_0);
  ASSERT_EQ(view.key_row_bytes(), static_cast<size_t>(kWidth / 32 * 18));
  const int index = cache->place(1).index;
  int held = 0;
  for (int s = 0; s < view.capacity; ++s) {
    const int64_t position = view.positions[static_cast<size_t>(s)];
    if (position < 0) continue;
    ++held;
    for (const bool value : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "slot " << s << " position " << position << (value ? " values" : " keys"));
      std::vector<float> row(kWidth);
      dequantize_row(TensorType::Q4_0, value ? view.value(index, s) : view.key(index, s), row.data(), kWidth);
      const std::vector<float>& stored = (value ? values : keys)[static_cast<size_t>(original_position(position))];
      const std::vector<float> want = turned(stored);
      for (int b = 0; b < kWidth / 32; ++b) {
        float absmax = 0;
        for (int e = b * 32; e < (b + 1) * 32; ++e) absmax = std::max(absmax, std::abs(want[static_cast<size_t>(e)]));
        // q4_0's step is at most absmax / 7 (GGML's grid, its mirror), and a clipped grid leaves
        // out at most a fifth of the span: no value is further than that from its code.
        for (int e = b * 32; e < (b + 1) * 32; ++e) {
          ASSERT_LE(std::abs(row[static_cast<size_t>(e)] - want[static_cast<size_t>(e)]), 0.25f * absmax + 1e-6f) << e;
        }
      }
    }
  }
  EXPECT_EQ(held, window.slots);  // every slot written: the ring has gone round
  expect_rows_held(32);           // (the full ring's layer)
}

}  // namespace
}  // namespace ringlm
