// The CPU backend's layer ops beside the products (backends/backend.h: rope, store_kv,
// shift_keys, add, add_row, rms_norm), called through the Backend interface as the model calls
// them, against their definitions computed here in double, with 1 and 2 threads (the threads
// share the rows from a few on).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "backends/backend.h"
#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/kv_rows.h"
#include "core/model/key_scales.h"
#include "quant/formats.h"
#include "quant/quantize.h"

namespace ringlm {
namespace {

constexpr int kHeads = 3, kHeadDim = 8, kRot = 6;  // a partial rotation: 2 elements stay

std::vector<float> random_values(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// Angles of `rows` rows: pair i of row r at (r + 1) * 0.37 / (i + 1).
void make_angles(int rows, std::vector<float>& cos, std::vector<float>& sin) {
  cos.clear(), sin.clear();
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < kRot / 2; ++i) {
      const double theta = (r + 1) * 0.37 / (i + 1);
      cos.push_back(static_cast<float>(std::cos(theta)));
      sin.push_back(static_cast<float>(std::sin(theta)));
    }
  }
}

// The rotation of one head by the pairs' angles, in double: pair i is (2i, 2i + 1) or (i, i + n_rot / 2).
std::vector<double> rotated(const float* head, const float* cos, const float* sin, bool adjacent, int dim = kHeadDim) {
  std::vector<double> out(head, head + dim);
  for (int i = 0; i < kRot / 2; ++i) {
    const int a = adjacent ? 2 * i : i, b = adjacent ? 2 * i + 1 : i + kRot / 2;
    out[a] = static_cast<double>(head[a]) * cos[i] - static_cast<double>(head[b]) * sin[i];
    out[b] = static_cast<double>(head[a]) * sin[i] + static_cast<double>(head[b]) * cos[i];
  }
  return out;
}

class LayerOps : public ::testing::TestWithParam<int> {
 protected:
  std::unique_ptr<Backend> backend = make_cpu_backend(GetParam(), ComputeType::kInt8);
  std::mt19937 rng{7};
};

TEST_P(LayerOps, RopeRotatesEveryHeadOfEveryRowByItsRowsAngles) {
  for (const bool adjacent : {true, false}) {
    const int rows = 5;
    const std::vector<float> x0 = random_values(static_cast<size_t>(rows) * kHeads * kHeadDim, rng);
    std::vector<float> cos, sin;
    make_angles(rows, cos, sin);
    std::vector<float> x = x0;
    backend->rope(x.data(), rows, kHeads, kHeadDim, RopeAngles{cos.data(), sin.data(), kRot, adjacent});
    for (int r = 0; r < rows; ++r) {
      for (int h = 0; h < kHeads; ++h) {
        const size_t at = (static_cast<size_t>(r) * kHeads + h) * kHeadDim;
        const std::vector<double> want = rotated(&x0[at], &cos[r * kRot / 2], &sin[r * kRot / 2], adjacent);
        for (int e = 0; e < kHeadDim; ++e) EXPECT_NEAR(x[at + e], want[e], 1e-6) << r << " " << h << " " << e;
      }
    }
  }
}

// A cache of 2 layers and 6 slots, as core/kv lays it out.
struct Cache {
  Cache(KvTypes types, int row_width, int capacity = 6)
      : rows(2 * static_cast<size_t>(capacity) * (kv_bytes_of(types.keys, row_width) + kv_bytes_of(types.values, row_width))) {
    view.rows = rows.data();
    view.n_layer = 2;
    view.capacity = capacity;
    view.row_width = row_width;
    view.key_type = types.keys;
    view.value_type = types.values;
  }
  float read(int layer, int slot, bool value, int e) const {
    const uint8_t* row = value ? view.value(layer, slot) : view.key(layer, slot);
    const KvType type = value ? view.value_type : view.key_type;
    if (type == KvType::kF32) return reinterpret_cast<const float*>(row)[e];
    if (type == KvType::kF16) return fp16_to_fp32(reinterpret_cast<const uint16_t*>(row)[e]);
    std::vector<float> all(static_cast<size_t>(view.row_width));
    dequantize_row(kv_stored_type(type), row, all.data(), view.row_width);
    return all[static_cast<size_t>(e)];
  }
  std::vector<uint8_t> rows;
  KvView view;
};

TEST_P(LayerOps, StoreKvWritesRowsIntoTheirSlotsInTheCachesType) {
  for (const bool f16 : {false, true}) {
    Cache cache(f16 ? KvType::kF16 : KvType::kF32, kHeads * kHeadDim);
    const int n = 4, first_slot = 1, layer = 1;
    const std::vector<float> k = random_values(static_cast<size_t>(n) * cache.view.row_width, rng);
    const std::vector<float> v = random_values(k.size(), rng);
    backend->store_kv(cache.view, layer, first_slot, n, k.data(), v.data());
    for (int i = 0; i < n; ++i) {
      for (int e = 0; e < cache.view.row_width; ++e) {
        const size_t at = static_cast<size_t>(i) * cache.view.row_width + e;
        const float want_k = f16 ? fp16_to_fp32(fp32_to_fp16(k[at])) : k[at];
        const float want_v = f16 ? fp16_to_fp32(fp32_to_fp16(v[at])) : v[at];
        ASSERT_EQ(cache.read(layer, first_slot + i, false, e), want_k);
        ASSERT_EQ(cache.read(layer, first_slot + i, true, e), want_v);
      }
    }
    // The other layer's slots and the slot before are untouched (zero).
    EXPECT_EQ(cache.read(0, first_slot, false, 0), 0.0f);
    EXPECT_EQ(cache.read(layer, 0, true, 0), 0.0f);
  }
}

// The blocks a cache of `type` holds for a row of n values: GGML's q8_0; q4_0 with the steps the
// clip search chooses (backends/cpu/kv_rows.h).
void kv_blocks(KvType type, const float* row, void* out, int64_t n) {
  if (type == KvType::kQ4_0) return cpu::quantize_q4_0_searched(row, static_cast<uint8_t*>(out), n);
  quantize_row(kv_stored_type(type), row, out, n);
}

// Keys and values of different types (-ctk, -ctv): each side stored in its own type, in its own
// rows (a layer's keys of one size, then its values of another), each within its rounding.
TEST_P(LayerOps, StoreKvWritesEachSideInItsOwnType) {
  constexpr int kWidth = kHeads * 32;  // heads of 32: blocks, not turned
  for (const KvTypes types : {KvTypes(KvType::kQ8_0, KvType::kF16), KvTypes(KvType::kF32, KvType::kQ4_0)}) {
    SCOPED_TRACE(kv_types_name(types));
    Cache cache(types, kWidth);
    const std::vector<float> k = random_values(6 * static_cast<size_t>(kWidth), rng), v = random_values(k.size(), rng);
    for (int layer = 0; layer < 2; ++layer) backend->store_kv(cache.view, layer, 0, 6, k.data(), v.data());
    std::vector<float> want_k(kWidth), want_v(kWidth);
    std::vector<uint8_t> block(std::max(kv_bytes_of(types.keys, kWidth), kv_bytes_of(types.values, kWidth)));
    const auto stored = [&](KvType type, const float* row, std::vector<float>& out) {
      if (type == KvType::kF32) return std::copy_n(row, kWidth, out.begin()), void();
      kv_blocks(type, row, block.data(), kWidth);
      dequantize_row(kv_stored_type(type), block.data(), out.data(), kWidth);
    };
    for (int layer = 0; layer < 2; ++layer) {
      for (int slot = 0; slot < 6; ++slot) {
        stored(types.keys, &k[static_cast<size_t>(slot) * kWidth], want_k);
        stored(types.values, &v[static_cast<size_t>(slot) * kWidth], want_v);
        for (int e = 0; e < kWidth; ++e) {
          ASSERT_EQ(cache.read(layer, slot, false, e), want_k[static_cast<size_t>(e)]) << layer << " " << slot;
          ASSERT_EQ(cache.read(layer, slot, true, e), want_v[static_cast<size_t>(e)]) << layer << " " << slot;
        }
      }
    }
  }
}

TEST_P(LayerOps, ShiftKeysRotatesTheKeysOfTheSlotsInTheLayersAndNothingElse) {
  Cache cache(KvType::kF32, kHeads * kHeadDim);
  const std::vector<float> k = random_values(6 * static_cast<size_t>(cache.view.row_width), rng);
  for (int layer = 0; layer < 2; ++layer) backend->store_kv(cache.view, layer, 0, 6, k.data(), k.data());
  std::vector<float> cos, sin;
  make_angles(1, cos, sin);
  const std::vector<int> slots = {4, 2}, layers = {1};
  backend->shift_keys(cache.view, layers, slots, RopeAngles{cos.data(), sin.data(), kRot, false}, kHeads, kHeadDim);
  for (int layer = 0; layer < 2; ++layer) {
    for (int slot = 0; slot < 6; ++slot) {
      const bool moved = layer == 1 && (slot == 2 || slot == 4);
      for (int h = 0; h < kHeads; ++h) {
        const float* head = &k[(static_cast<size_t>(slot) * kHeads + h) * kHeadDim];
        const std::vector<double> want = moved ? rotated(head, cos.data(), sin.data(), false)
                                               : std::vector<double>(head, head + kHeadDim);
        for (int e = 0; e < kHeadDim; ++e) {
          EXPECT_NEAR(cache.read(layer, slot, false, h * kHeadDim + e), want[e], 1e-6) << layer << " " << slot;
          EXPECT_EQ(cache.read(layer, slot, true, h * kHeadDim + e), head[e]);  // values never turn
        }
      }
    }
  }
}

// The largest error of a cache's rounding of a block whose largest magnitude is amax. q8_0,
// GGML's: half a step (amax / 127). q4_0, a grid clipped to 80-100% of GGML's (step 0.8 amax / 8
// at the least): a value opposite the largest, at amax, is 0.3 amax from the grid's top, 7 steps.
// Both plus the step's own rounding to fp16 (2^-11 of it) times the largest code.
double block_error(KvType type, double amax) {
  return type == KvType::kQ8_0 ? amax / 127 * (0.5 + 127.0 / 2048) : amax * (0.3 + 0.1 * 8.0 / 2048);
}

// A q8_0 or q4_0 cache (heads of 32: a block each, not turned): rows are stored as kv_blocks makes them,
// each element within the rounding's error of what was stored; a shift rotates the keys it held
// in fp32 and stores them again, within that error of the exact rotation.
class QuantizedCache : public ::testing::TestWithParam<KvType> {
 protected:
  std::unique_ptr<Backend> backend = make_cpu_backend(2, ComputeType::kInt8);
  std::mt19937 rng{7};
};

TEST_P(QuantizedCache, StoresBlocksAndShiftsWithinTheRoundingsError) {
  const KvType type = GetParam();
  constexpr int kDim = 32, kWidth = kHeads * kDim;
  Cache cache(type, kWidth);
  const std::vector<float> k = random_values(6 * static_cast<size_t>(kWidth), rng), v = random_values(k.size(), rng);
  for (int layer = 0; layer < 2; ++layer) backend->store_kv(cache.view, layer, 0, 6, k.data(), v.data());
  const auto half_step = [type](const auto* x) {
    double amax = 0;
    for (int e = 0; e < kDim; ++e) amax = std::max(amax, std::abs(static_cast<double>(x[e])));
    return block_error(type, amax) + 1e-7;
  };
  std::vector<uint8_t> blocks(kv_bytes_of(type, kWidth));
  std::vector<float> held(6 * static_cast<size_t>(kWidth));  // the keys as stored
  for (int slot = 0; slot < 6; ++slot) {
    const float* row = &k[static_cast<size_t>(slot) * kWidth];
    kv_blocks(type, row, blocks.data(), kWidth);
    ASSERT_EQ(std::memcmp(cache.view.key(1, slot), blocks.data(), blocks.size()), 0) << slot;
    for (int h = 0; h < kHeads; ++h) {
      for (int e = 0; e < kDim; ++e) {
        const int at = h * kDim + e;
        held[static_cast<size_t>(slot) * kWidth + at] = cache.read(1, slot, false, at);
        ASSERT_LE(std::abs(cache.read(1, slot, false, at) - row[at]), half_step(row + h * kDim));
        ASSERT_LE(std::abs(cache.read(1, slot, true, at) - v[static_cast<size_t>(slot) * kWidth + at]),
                  half_step(&v[static_cast<size_t>(slot) * kWidth + h * kDim]));
      }
    }
  }
  std::vector<float> cos, sin;
  make_angles(1, cos, sin);
  const std::vector<int> slots = {4, 2}, layers = {1};
  backend->shift_keys(cache.view, layers, slots, RopeAngles{cos.data(), sin.data(), kRot, false}, kHeads, kDim);
  for (int slot = 0; slot < 6; ++slot) {
    const bool moved = slot == 2 || slot == 4;
    for (int h = 0; h < kHeads; ++h) {
      const float* head = &held[(static_cast<size_t>(slot) * kHeads + h) * kDim];
      const std::vector<double> want = moved ? rotated(head, cos.data(), sin.data(), false, kDim)
                                             : std::vector<double>(head, head + kDim);
      for (int e = 0; e < kDim; ++e) {
        EXPECT_LE(std::abs(cache.read(1, slot, false, h * kDim + e) - want[static_cast<size_t>(e)]), half_step(want.data()))
            << slot << " " << h << " " << e;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Types, QuantizedCache, ::testing::Values(KvType::kQ8_0, KvType::kQ4_0),
                         [](const auto& info) { return std::string(kv_type_name(info.param)); });

// A quantized cache with heads of 64 keeps them turned by the Walsh-Hadamard matrix
// (kv_turns_heads): the rows it holds are GGML's blocks of the turned keys and values, and
// attention through the backend (queries turned alike, outputs turned back) gives what the
// same keys and values give from an fp32 cache, within the rounding's reach; so does attention
// after a shift, which turns the keys back for RoPE and again after.
TEST_P(QuantizedCache, HeadsOf64AreTurnedAndAttentionMatchesAnFp32Cache) {
  const KvType type = GetParam();
  constexpr int kDim = 64, kKv = 2, kQueryHeads = 4, kWidth = kKv * kDim, kSlots = 6;
  Cache turned(type, kWidth), plain(KvType::kF32, kWidth);
  turned.view.head_dim = plain.view.head_dim = kDim;
  ASSERT_TRUE(kv_turns_heads(type, kDim));
  const std::vector<float> k = random_values(static_cast<size_t>(kSlots) * kWidth, rng), v = random_values(k.size(), rng);
  for (Cache* c : {&turned, &plain}) backend->store_kv(c->view, 1, 0, kSlots, k.data(), v.data());
  // What the cache holds: the blocks of the turned rows.
  std::vector<float> row(k.begin(), k.begin() + kWidth);
  cpu::hadamard_heads(row.data(), kKv, kDim);
  std::vector<uint8_t> blocks(kv_bytes_of(type, kWidth));
  kv_blocks(type, row.data(), blocks.data(), kWidth);
  ASSERT_EQ(std::memcmp(turned.view.key(1, 0), blocks.data(), blocks.size()), 0);

  std::vector<int64_t> positions(kSlots);
  for (int i = 0; i < kSlots; ++i) positions[static_cast<size_t>(i)] = i;
  turned.view.positions = plain.view.positions = positions;
  const AttentionShape shape{kQueryHeads, kKv, kDim};
  const std::vector<float> q = random_values(static_cast<size_t>(kQueryHeads) * kDim, rng);
  // q8_0 moves these outputs (averages of values of magnitude ~1) by about 0.01, q4_0 by about
  // 0.1; an unturned query or output moves them by about 1.
  const double tolerance = type == KvType::kQ8_0 ? 0.03 : 0.3;
  const auto expect_same_attention = [&](const char* when) {
    std::vector<float> out_turned(q.size()), out_plain(q.size());
    for (auto [cache, out] : {std::pair{&turned, &out_turned}, std::pair{&plain, &out_plain}}) {
      AttentionCall call;
      call.q = q.data();
      call.n_tokens = 1;
      call.pos0 = kSlots - 1;
      call.out = out->data();
      call.kv = &cache->view;
      backend->attention(1, shape, std::span<const AttentionCall>(&call, 1));
    }
    for (size_t i = 0; i < q.size(); ++i) EXPECT_NEAR(out_turned[i], out_plain[i], tolerance) << when << " " << i;
  };
  expect_same_attention("stored");
  std::vector<float> cos, sin;
  make_angles(1, cos, sin);
  const std::vector<int> slots = {1, 3, 4}, layers = {1};
  for (Cache* c : {&turned, &plain}) {
    backend->shift_keys(c->view, layers, slots, RopeAngles{cos.data(), sin.data(), kRot, false}, kKv, kDim);
  }
  expect_same_attention("shifted");
}

// Key scales (KvView::key_scales) on a turned cache whose key channels are out of balance with
// the queries' (large keys where the queries are small, as Gemma 3's QK-norm leaves them): the
// cache holds the blocks of the turned keys divided by the scales, attention gives what an fp32
// cache of the unscaled keys gives (the scores are the same) with a smaller error than the same
// cache without scales, and so it does after a shift, which multiplies the keys back to rotate them.
TEST_P(QuantizedCache, KeyScalesKeepTheScoresAndShrinkTheError) {
  const KvType type = GetParam();
  constexpr int kDim = 64, kKv = 2, kQueryHeads = 4, kWidth = kKv * kDim, kSlots = 48;
  // Values in fp32: what the outputs lose is the keys'.
  const KvTypes types{type, KvType::kF32};
  Cache scaled(types, kWidth, kSlots), unscaled(types, kWidth, kSlots), plain(KvType::kF32, kWidth, kSlots);
  std::vector<float> k = random_values(static_cast<size_t>(kSlots) * kWidth, rng), v = random_values(k.size(), rng);
  std::vector<float> q = random_values(static_cast<size_t>(kSlots) * kQueryHeads * kDim, rng);
  const auto key_size = [](int c) { return c % 8 == 0 ? 6.0f : 0.4f; };  // and the queries' 1 / 4 of its inverse
  for (size_t i = 0; i < k.size(); ++i) k[i] *= key_size(static_cast<int>(i % kDim));
  for (size_t i = 0; i < q.size(); ++i) q[i] *= 0.25f / key_size(static_cast<int>(i % kDim));
  const std::vector<float> scales = calibrate_key_scales(q, k, kSlots, KeyScaleShape{kQueryHeads, kKv, kDim});
  EXPECT_GT(scales[0] / scales[1], 3.0f);  // sqrt(6 / 0.4) squared over the halves' ratio: about 15
  std::vector<float> all_layers(2 * static_cast<size_t>(kWidth), 1.0f);  // [layer][channel]: layer 1's set
  std::copy(scales.begin(), scales.end(), all_layers.begin() + kWidth);
  scaled.view.key_scales = all_layers.data();
  std::vector<int64_t> positions(kSlots);
  for (int i = 0; i < kSlots; ++i) positions[static_cast<size_t>(i)] = i;
  for (Cache* c : {&scaled, &unscaled, &plain}) {
    c->view.head_dim = kDim;
    c->view.positions = positions;
    backend->store_kv(c->view, 1, 0, kSlots, k.data(), v.data());
  }
  std::vector<float> row(k.begin(), k.begin() + kWidth);
  for (int c = 0; c < kWidth; ++c) row[static_cast<size_t>(c)] /= scales[static_cast<size_t>(c)];
  cpu::hadamard_heads(row.data(), kKv, kDim);
  std::vector<uint8_t> blocks(kv_bytes_of(type, kWidth));
  kv_blocks(type, row.data(), blocks.data(), kWidth);
  ASSERT_EQ(std::memcmp(scaled.view.key(1, 0), blocks.data(), blocks.size()), 0);

  const AttentionShape shape{kQueryHeads, kKv, kDim};
  const auto attend = [&](Cache& cache) {  // the last slot's query over every slot
    std::vector<float> out(static_cast<size_t>(kQueryHeads) * kDim);
    AttentionCall call;
    call.q = q.data() + static_cast<size_t>(kSlots - 1) * kQueryHeads * kDim;
    call.n_tokens = 1;
    call.pos0 = kSlots - 1;
    call.out = out.data();
    call.kv = &cache.view;
    backend->attention(1, shape, std::span<const AttentionCall>(&call, 1));
    return out;
  };
  const auto expect_smaller_error = [&](const char* when) {
    const std::vector<float> want = attend(plain), with = attend(scaled), without = attend(unscaled);
    double error_with = 0, error_without = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      error_with += std::abs(with[i] - want[i]);
      error_without += std::abs(without[i] - want[i]);
      EXPECT_NEAR(with[i], want[i], type == KvType::kQ8_0 ? 0.03 : 0.3) << when << " " << i;
    }
    EXPECT_LT(error_with, 0.5 * error_without) << when;
  };
  expect_smaller_error("stored");
  std::vector<float> cos, sin;
  make_angles(1, cos, sin);
  const std::vector<int> slots = {1, 3, 4, 20}, layers = {1};
  for (Cache* c : {&scaled, &unscaled, &plain}) {
    backend->shift_keys(c->view, layers, slots, RopeAngles{cos.data(), sin.data(), kRot, false}, kKv, kDim);
  }
  expect_smaller_error("shifted");
}

// calibrate_key_scales against its definition: s = (E[k²] / E[q²])^(1/4) per key channel, the
// queries of a group's heads pooled, each head's scales over their geometric mean, clamped.
TEST(KeyScales, BalanceEachChannelsKeysAgainstItsGroupsQueries) {
  constexpr int kDim = 4, kKv = 2, kQueryHeads = 4, kRows = 2;
  // Keys of constant magnitude per channel: head 0 (1, 4, 16, 1/4), head 1 (1, 1, 0, 1).
  const float key[kKv * kDim] = {1, 4, 16, 0.25f, 1, 1, 0, 1};
  std::vector<float> k, q;
  for (int r = 0; r < kRows; ++r) {
    for (float x : key) k.push_back(r % 2 == 0 ? x : -x);
    // Queries 1 everywhere, but channel 3 of key head 1's heads (2 and 3) is 3 and 5: E[q²] = 17.
    for (int h = 0; h < kQueryHeads; ++h) {
      for (int i = 0; i < kDim; ++i) q.push_back(i == 3 && h == 2 ? 3.0f : i == 3 && h == 3 ? 5.0f : 1.0f);
    }
  }
  const std::vector<float> s = calibrate_key_scales(q, k, kRows, KeyScaleShape{kQueryHeads, kKv, kDim});
  ASSERT_EQ(s.size(), static_cast<size_t>(kKv * kDim));
  // Head 0: sqrt(|k|) = 1, 2, 4, 1/2, geometric mean sqrt(2).
  const double m0 = std::sqrt(2.0);
  EXPECT_NEAR(s[0], 1 / m0, 1e-5);
  EXPECT_NEAR(s[1], 2 / m0, 1e-5);
  EXPECT_NEAR(s[2], 4 / m0, 1e-5);
  EXPECT_NEAR(s[3], 0.5 / m0, 1e-5);
  // Head 1: 1, 1, none (1), 17^(-1/4); geometric mean 17^(-1/16).
  const double m1 = std::pow(17.0, -1.0 / 16), c3 = std::pow(17.0, -0.25);
  EXPECT_NEAR(s[4], 1 / m1, 1e-5);
  EXPECT_NEAR(s[6], 1 / m1, 1e-5);
  EXPECT_NEAR(s[7], c3 / m1, 1e-5);
  // Far out of balance: clamped.
  std::vector<float> far_k(k), far_q(q);
  far_k[0] = far_k[kKv * kDim] = 1e6f;
  const std::vector<float> clamped = calibrate_key_scales(far_q, far_k, kRows, KeyScaleShape{kQueryHeads, kKv, kDim});
  EXPECT_EQ(clamped[0], kKeyScaleLimit);
  EXPECT_THROW(calibrate_key_scales(q, k, kRows + 1, KeyScaleShape{kQueryHeads, kKv, kDim}), std::invalid_argument);
  EXPECT_THROW(calibrate_key_scales(q, k, kRows, KeyScaleShape{3, kKv, kDim}), std::invalid_argument);
}

// Rows measured before RoPE, each rotary pair carried over the cache's positions, give the
// scales of the same rows rotated to every one of those positions by the backend's RoPE and
// measured as they are (the mean of cos², sin² and sin cos over the positions in closed form,
// against the positions one by one). Both pair layouts, a head whose last channels do not turn,
// and a pair turning by π per position (where the closed form divides by sin π).
TEST(KeyScales, PairsCarriedOverThePositionsAreTheRowsRotatedToEachOfThem) {
  constexpr int kDim = 8, kRot = 6, kKv = 2, kQueryHeads = 4, kRows = 5, kPositions = 37;
  const std::vector<double> inv_freq = {1.0, M_PI, 0.01};
  std::mt19937 gen(5);
  std::normal_distribution<float> normal;
  std::vector<float> q(kRows * kQueryHeads * kDim), k(kRows * kKv * kDim);
  for (float& x : q) x = normal(gen);
  // Keys with a large channel pair and a correlation between the two channels of pair 2.
  for (int r = 0; r < kRows; ++r) {
    for (int e = 0; e < kKv * kDim; ++e) k[static_cast<size_t>(r * kKv * kDim + e)] = normal(gen) * (e % kDim == 1 ? 6.0f : 1.0f);
  }
  for (const cpu::RopePairs pairs : {cpu::RopePairs::kAdjacent, cpu::RopePairs::kHalves}) {
    SCOPED_TRACE(pairs == cpu::RopePairs::kAdjacent ? "adjacent pairs" : "halves");
    std::vector<float> q_all, k_all;
    for (int p = 0; p < kPositions; ++p) {
      std::vector<float> cos(kRot / 2), sin(kRot / 2), cos_x(kRot), sin_x(kRot);
      for (int i = 0; i < kRot / 2; ++i) {
        cos[static_cast<size_t>(i)] = static_cast<float>(std::cos(p * inv_freq[static_cast<size_t>(i)]));
        sin[static_cast<size_t>(i)] = static_cast<float>(std::sin(p * inv_freq[static_cast<size_t>(i)]));
      }
      cpu::expand_rope_angles(cos.data(), sin.data(), kRot, pairs, cos_x.data(), sin_x.data());
      std::vector<float> qp(q), kp(k);
      cpu::rotate_heads(qp.data(), kRows * kQueryHeads, kDim, kRot, pairs, cos_x.data(), sin_x.data());
      cpu::rotate_heads(kp.data(), kRows * kKv, kDim, kRot, pairs, cos_x.data(), sin_x.data());
      q_all.insert(q_all.end(), qp.begin(), qp.end());
      k_all.insert(k_all.end(), kp.begin(), kp.end());
    }
    const KeyScaleShape shape{kQueryHeads, kKv, kDim};
    const std::vector<float> want = calibrate_key_scales(q_all, k_all, kRows * kPositions, shape);
    KeyScaleRope rope;
    rope.inv_freq = inv_freq;
    rope.n_rot = kRot;
    rope.adjacent_pairs = pairs == cpu::RopePairs::kAdjacent;
    rope.n_positions = kPositions;
    const std::vector<float> got = calibrate_key_scales(q, k, kRows, shape, rope);
    ASSERT_EQ(got.size(), want.size());
    for (size_t c = 0; c < want.size(); ++c) EXPECT_NEAR(got[c], want[c], 1e-4 * want[c]) << "channel " << c;
    // Unturned, the rows alone say something else: the carrying over is what the test sees.
    const std::vector<float> unturned = calibrate_key_scales(q, k, kRows, shape);
    double most = 0;
    for (size_t c = 0; c < want.size(); ++c) most = std::max(most, std::abs(unturned[c] / want[c] - 1.0));
    EXPECT_GT(most, 0.05);
  }
  KeyScaleRope odd;
  odd.inv_freq = inv_freq;
  odd.n_rot = 5;
  odd.n_positions = kPositions;
  EXPECT_THROW(calibrate_key_scales(q, k, kRows, KeyScaleShape{kQueryHeads, kKv, kDim}, odd), std::invalid_argument);
}

TEST_P(LayerOps, ScaleAddAndAddRowAreElementwise) {
  for (const int64_t rows : {1, 40000}) {  // below and above the size the threads share
    const int64_t width = 3;
    const std::vector<float> x0 = random_values(static_cast<size_t>(rows * width), rng);
    const std::vector<float> delta = random_values(x0.size(), rng), bias = random_values(width, rng);
    std::vector<float> x = x0;
    backend->add(x.data(), delta.data(), rows * width);
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(x[i], x0[i] + delta[i]);
    x = x0;
    backend->add_row(x.data(), bias.data(), rows, width);
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(x[i], x0[i] + bias[i % width]);
    x = x0;
    backend->scale(x.data(), rows * width, 25.3f);
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(x[i], x0[i] * 25.3f);
  }
}

TEST_P(LayerOps, RmsNormNormalisesEachRowAndScalesIt) {
  const int64_t rows = 7, width = 16;
  const float eps = 1e-6f;
  const std::vector<float> x0 = random_values(static_cast<size_t>(rows * width), rng);
  const std::vector<float> weight = random_values(width, rng);
  std::vector<float> x = x0;
  backend->rms_norm(x.data(), rows, width, weight.data(), eps);
  for (int64_t r = 0; r < rows; ++r) {
    double sum_sq = 0;
    for (int64_t c = 0; c < width; ++c) sum_sq += static_cast<double>(x0[r * width + c]) * x0[r * width + c];
    const double scale = 1.0 / std::sqrt(sum_sq / width + eps);
    for (int64_t c = 0; c < width; ++c) {
      EXPECT_NEAR(x[r * width + c], x0[r * width + c] * scale * weight[c], 1e-5) << r << " " << c;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Threads, LayerOps, ::testing::Values(1, 2));

}  // namespace
}  // namespace ringlm
