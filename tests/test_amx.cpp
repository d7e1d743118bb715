// AMX's tile operations as emulated (backends/cpu/amx.h), against their definitions written
// independently: the tile dot product as the plain matrix product of A (M x K) and B unpacked
// from its 4-byte groups (K x N); loads and stores as byte copies with strides; and the packed
// products on the tiles, every int8 type, against the AVX-512 VNNI kernels' bits and the exact
// product of the quantized operands in float64.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <algorithm>
#include <stdexcept>
#include <vector>

#include "backends/cpu/amx.h"
#include "backends/cpu/kernel_packed.h"
#include "core/model/loader.h"
#include "hwy/targets.h"
#include "quant/formats.h"
#include "tests/build_scale.h"
#include "tests/only_target.h"
#include "tests/packed_input.h"
#include "tests/weight_formats.h"

namespace ringlm::cpu {
namespace {

std::vector<uint8_t> random_bytes(size_t n, std::mt19937& rng) {
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// C (rows x n_cols) += A (rows x depth) times B, B given as the tile holds it (depth / 4 rows of
// n_cols * 4 bytes): element (k, n) of the unpacked B is byte 4 * n + k % 4 of row k / 4.
std::vector<int64_t> reference_product(const std::vector<uint8_t>& a, bool a_signed, const std::vector<uint8_t>& b,
                                       int rows, int depth, int n_cols) {
  std::vector<int64_t> c(static_cast<size_t>(rows * n_cols), 0);
  for (int m = 0; m < rows; ++m) {
    for (int n = 0; n < n_cols; ++n) {
      for (int k = 0; k < depth; ++k) {
        const uint8_t ab = a[static_cast<size_t>(m * kTileBytes + k)];
        const int64_t x = a_signed ? static_cast<int8_t>(ab) : ab;
        const int64_t y = static_cast<int8_t>(b[static_cast<size_t>((k / 4) * kTileBytes + 4 * n + k % 4)]);
        c[static_cast<size_t>(m * n_cols + n)] += x * y;
      }
    }
  }
  return c;
}

TEST(EmulatedTiles, DotProductsAreMatrixProducts) {
  std::mt19937 rng(7);
  struct Shape {
    int rows, depth, n_cols;
  };
  for (const Shape s : {Shape{16, 64, 16}, Shape{5, 12, 3}, Shape{1, 4, 1}, Shape{16, 32, 16}, Shape{9, 64, 7}}) {
    for (const bool a_signed : {true, false}) {
      TileConfig config{};
      config[0] = {s.rows, 4 * s.n_cols};
      config[1] = {s.rows, s.depth};
      config[2] = {s.depth / 4, 4 * s.n_cols};
      EmulatedTiles tiles;
      tiles.load_config(config);
      const std::vector<uint8_t> a = random_bytes(kTileRows * kTileBytes, rng), b = random_bytes(kTileRows * kTileBytes, rng);
      tiles.load(1, a.data(), kTileBytes);
      tiles.load(2, b.data(), kTileBytes);
      // Twice into C: the products accumulate.
      for (int i = 0; i < 2; ++i) a_signed ? tiles.dpbssd(0, 1, 2) : tiles.dpbusd(0, 1, 2);
      std::vector<int32_t> c(static_cast<size_t>(s.rows * s.n_cols));
      tiles.store(0, c.data(), 4 * s.n_cols);
      const std::vector<int64_t> want = reference_product(a, a_signed, b, s.rows, s.depth, s.n_cols);
      for (size_t i = 0; i < c.size(); ++i) {
        ASSERT_EQ(c[i], 2 * want[i]) << s.rows << "x" << s.depth << "x" << s.n_cols << (a_signed ? " signed" : " unsigned")
                                     << " element " << i;
      }
    }
  }
}

TEST(EmulatedTiles, LoadsAndStoresFollowTheirStrides) {
  std::mt19937 rng(3);
  TileConfig config{};
  config[5] = {3, 10};
  EmulatedTiles tiles;
  tiles.load_config(config);
  const std::vector<uint8_t> src = random_bytes(3 * 100, rng);
  tiles.load(5, src.data(), 100);
  std::vector<uint8_t> dst(3 * 17, 0xAB);
  tiles.store(5, dst.data(), 17);
  for (int r = 0; r < 3; ++r) {
    for (int i = 0; i < 17; ++i) {
      const uint8_t want = i < 10 ? src[static_cast<size_t>(r * 100 + i)] : 0xAB;  // past colsb: untouched
      ASSERT_EQ(dst[static_cast<size_t>(r * 17 + i)], want) << "row " << r << " byte " << i;
    }
  }
  tiles.zero(5);
  tiles.store(5, dst.data(), 17);
  EXPECT_EQ(dst[0], 0);
  EXPECT_EQ(dst[2 * 17 + 9], 0);
}

TEST(EmulatedTiles, RefusesWhatTheCpuRefuses) {
  EmulatedTiles tiles;
  std::vector<uint8_t> buf(kTileRows * kTileBytes);
  EXPECT_THROW(tiles.zero(0), std::logic_error) << "no configuration loaded";
  TileConfig bad{};
  bad[0] = {17, 64};
  EXPECT_THROW(tiles.load_config(bad), std::logic_error) << "more than 16 rows";
  TileConfig config{};
  config[0] = {16, 64};
  config[1] = {16, 64};
  config[2] = {8, 64};  // 8 rows: A's 64 bytes need 16
  tiles.load_config(config);
  EXPECT_THROW(tiles.load(3, buf.data(), 64), std::logic_error) << "an unconfigured tile";
  EXPECT_THROW(tiles.dpbssd(0, 1, 2), std::logic_error) << "B's rows do not match A's depth";
  tiles.release();
  EXPECT_FALSE(tiles.configured());
  EXPECT_THROW(tiles.load(0, buf.data(), 64), std::logic_error) << "released";
}

// The packed products on the tiles, every int8 type: the same bits as the AVX-512 VNNI kernels
// (where this CPU runs them: the tile products repeat their float operations on the same exact
// integers), within rounding of the exact double product of the operands as the kernels see them
// (the tolerance of test_cpu_packed), and, where this CPU has AMX, the real tiles' bits equal
// the emulation's. Token counts of whole and part tiles, passes of 64 and more; rows not a
// multiple of 16, split on 16-row boundaries.
class TileProduct : public ::testing::TestWithParam<std::pair<TensorType, std::string>> {};

bool runs_vnni() { return test::packed_kernel_targets().front() == HWY_AVX3_DL; }

TEST_P(TileProduct, SameBitsAsTheVnniKernelsAndWithinRoundingOfTheExactProduct) {
  const TensorType type = GetParam().first;
  const test::Acts acts = test::acts_of(type);
  std::mt19937 rng(static_cast<unsigned>(type) + 17);
  struct Shape {
    int64_t m, n, k;
  };
  const int64_t unit = acts == test::Acts::kPer256 ? 256 : std::max<int64_t>(test::block_elems(type), 32);
  std::vector<Shape> shapes = {{16, 17, unit}, {33, 40, 2 * unit}, {69, 16, unit}};
  if (type == TensorType::Q4_0 || type == TensorType::Q4_K || type == TensorType::Q6_K) shapes.push_back({512, 20, unit});
  for (const Shape s : shapes) {
    SCOPED_TRACE("M" + std::to_string(s.m) + " N" + std::to_string(s.n) + " K" + std::to_string(s.k));
    const std::vector<uint8_t> file = test::random_weights(type, s.n, s.k, rng);
    const PackedWeight w = pack_weight(type, file.data(), row_bytes(type, s.k), s.n, s.k);
    test::Input x(test::random_acts(s.m, s.k, rng), s.m, s.k);
    const int64_t ldy = s.n + 3;
    std::vector<float> tiled(static_cast<size_t>(s.m * ldy), NAN);
    EmulatedTiles tiles;
    tiles.load_config(tile_product_config());
    tile_gemm_packed(tiles, w, 16, s.n, x.packed(), s.m, tiled.data(), ldy);  // rows split on 16
    tile_gemm_packed(tiles, w, 0, std::min<int64_t>(16, s.n), x.packed(), s.m, tiled.data(), ldy);

    const std::vector<float> wf = test::dequantize(type, file, s.n, s.k);
    const std::vector<float> off = test::offset_magnitudes(type, file, s.n, s.k);
    const double terms = 2.0 * (static_cast<double>(s.k / kActBlock) + 8);
    for (int64_t m = 0; m < s.m; ++m) {
      for (int64_t n = 0; n < ldy; ++n) {
        const float got = tiled[static_cast<size_t>(m * ldy + n)];
        if (n >= s.n) {
          ASSERT_TRUE(std::isnan(got)) << "stored past the rows: token " << m << " row " << n;
          continue;
        }
        double exact = 0, magnitude = 0;
        for (int64_t k = 0; k < s.k; ++k) {
          const double a = x.seen(acts, m, k);
          const auto at = static_cast<size_t>(n * s.k + k);
          exact += wf[at] * a;
          magnitude += (std::fabs(wf[at]) + off[at]) * std::fabs(a);
        }
        ASSERT_NEAR(got, exact, terms * std::ldexp(1.0, -24) * magnitude + 1e-30) << "token " << m << " row " << n;
      }
    }

    if (runs_vnni()) {
      const test::OnlyTarget only(HWY_AVX3_DL);
      std::vector<float> vnni(tiled.size(), NAN);
      gemm_packed(w, 0, s.n, x.packed(), s.m, vnni.data(), ldy);
      ASSERT_EQ(0, std::memcmp(vnni.data(), tiled.data(), vnni.size() * sizeof(float))) << "bits differ from AVX-512 VNNI's";
    }
    if (amx_state() == AmxState::kOn) {
      std::vector<float> real(tiled.size(), NAN);
      amx_gemm_packed(w, 0, s.n, x.packed(), s.m, real.data(), ldy);
      ASSERT_EQ(0, std::memcmp(real.data(), tiled.data(), real.size() * sizeof(float))) << "the real tiles differ";
    }
  }
}

std::vector<std::pair<TensorType, std::string>> int8_types() {
  std::vector<std::pair<TensorType, std::string>> out;
  for (const auto& t : test::packed_types()) {
    if (test::acts_of(t.first) != test::Acts::kFloat) out.push_back(t);
  }
  return out;
}
INSTANTIATE_TEST_SUITE_P(Int8Types, TileProduct, ::testing::ValuesIn(int8_types()),
                         [](const auto& info) { return info.param.second; });

TEST(TileProduct, OnlyInt8TypesRunOnTheTiles) {
  for (const auto& [type, name] : test::packed_types()) {
    EXPECT_EQ(tiles_multiply(type), test::acts_of(type) != test::Acts::kFloat) << name;
  }
  const std::vector<uint8_t> f32(16 * 32 * 4, 0);
  const PackedWeight w = pack_weight(TensorType::F32, f32.data(), 32 * 4, 16, 32);
  std::vector<float> y(16 * 16);
  std::vector<float> acts(16 * 32, 0.0f);
  EmulatedTiles tiles;
  tiles.load_config(tile_product_config());
  EXPECT_THROW(tile_gemm_packed(tiles, w, 0, 16, PackedInput{{}, {}, acts.data(), {}, {}}, 16, y.data(), 16), std::invalid_argument);
}

// Models' prompts through the tiles, emulated so that this runs on any CPU: the backend sends
// every int8 product of 128 tokens or more there (KernelTable::kDefaultTilesFrom;
// emulated_tile_products() counts them), and the logits are those of the packed kernels, bit for
// bit where those run AVX-512 VNNI (elsewhere Q8_0, IQ4_NL and MXFP4 sum through another float
// formula: within 1e-4 of the largest logit). Block formats, K-quants of both depths, IQ4_XS,
// MXFP4, Gemma 3's window ring; prompts of 150-odd tokens. The sanitizer build runs three of
// the eight models (tests/build_scale.h).
TEST(TileProduct, ModelsGiveThePackedKernelsLogitsThroughTheEmulatedTiles) {
  std::string text;
  for (int i = 0; i < 12; ++i) text += "The quick brown fox jumps over the lazy dog by the river bank. ";
  std::vector<std::string> models = {"tiny_q4_0", "tiny_q3_k", "tiny_gemma3_q8_0"};  // block, depth 16, signed
  if (!test::kSanitizedBuild) {
    for (const char* more : {"tiny_q5_1", "tiny_q4_k", "tiny_iq4_nl", "tiny_iq4_xs", "tiny_mxfp4"}) models.push_back(more);
  }
  for (const std::string& name : models) {
    SCOPED_TRACE(name);
    const auto last_logits = [&](AmxState state) {
      set_amx_state_for_test(state);
      LoadedModel m = load_model(std::string(RINGLM_TEST_WORK_DIR) + "/" + name + ".gguf", 2);
      set_amx_state_for_test(std::nullopt);
      const std::vector<int32_t> tokens = m.tokenizer->encode(text, m.tokenizer->add_bos_by_default(), true);
      KvCache cache = m.model->make_cache(static_cast<int>(tokens.size()) + 1);
      std::vector<float> logits(static_cast<size_t>(m.model->hparams().n_vocab));
      m.model->forward(tokens, cache, logits.data());
      return logits;
    };
    const int64_t before = emulated_tile_products();
    const std::vector<float> tiled = last_logits(AmxState::kEmulated);
    const int64_t after = emulated_tile_products();
    EXPECT_GT(after, before) << "no product ran on the tiles";
    const std::vector<float> packed = last_logits(AmxState::kOffByUser);
    EXPECT_EQ(emulated_tile_products(), after) << "RINGLM_AMX=off still used the tiles";
    ASSERT_EQ(tiled.size(), packed.size());
    if (runs_vnni()) {
      ASSERT_EQ(0, std::memcmp(tiled.data(), packed.data(), tiled.size() * sizeof(float)));
    } else {
      float largest = 0;
      for (const float v : packed) largest = std::max(largest, std::fabs(v));
      for (size_t i = 0; i < tiled.size(); ++i) ASSERT_NEAR(tiled[i], packed[i], 1e-4f * largest) << "logit " << i;
    }
  }
}

}  // namespace
}  // namespace ringlm::cpu
