// AMX's tile operations as emulated (backends/cpu/amx.h), against their definitions written
// independently: the tile dot product as the plain matrix product of A (M x K) and B unpacked
// from its 4-byte groups (K x N); loads and stores as byte copies with strides; and the Q8_0
// tile product against the exact sums of the quantized operands, in float64.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "backends/cpu/amx.h"
#include "quant/formats.h"

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

// Random rows of a block format: per block of 32 a finite fp16 scale (and min), random codes.
std::vector<uint8_t> random_blocks(TensorType type, int64_t rows, int64_t cols, std::mt19937& rng) {
  const auto traits = type_traits(static_cast<uint32_t>(type));
  const size_t block = traits->block_bytes;
  std::vector<uint8_t> bytes(static_cast<size_t>(rows * (cols / 32)) * block);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> scale(0.001f, 0.05f), min(-0.1f, 0.1f);
  const bool has_min = type == TensorType::Q4_1 || type == TensorType::Q5_1;
  for (size_t at = 0; at < bytes.size(); at += block) {
    const uint16_t d = fp32_to_fp16(scale(rng)), m = fp32_to_fp16(min(rng));
    std::memcpy(bytes.data() + at, &d, 2);
    if (has_min) std::memcpy(bytes.data() + at + 2, &m, 2);
  }
  return bytes;
}

// Every block-32 format against its own dequantization (dequantize_row, itself tested against the
// gguf package's): y[m][n] = sum_k w[n][k] * xd[m][k / 32] * xq[m][k], summed in double.
TEST(TileGemm, BlockFormatsAreTheExactProductOfTheQuantizedOperands) {
  std::mt19937 rng(11);
  struct Shape {
    int64_t rows, cols, tokens;
  };
  for (const TensorType type : {TensorType::Q8_0, TensorType::Q4_0, TensorType::Q4_1, TensorType::Q5_0,
                                TensorType::Q5_1, TensorType::IQ4_NL}) {
    // Whole tiles, a last group of fewer than 16 outputs, tokens short of a tile, one token, 512.
    for (const Shape s : {Shape{16, 32, 16}, Shape{40, 96, 17}, Shape{33, 64, 1}, Shape{48, 128, 100},
                          Shape{16, 64, 512}, Shape{7, 32, 31}}) {
      SCOPED_TRACE(std::string(type_traits(static_cast<uint32_t>(type))->name) + " " + std::to_string(s.rows) + "x" +
                   std::to_string(s.cols) + " with " + std::to_string(s.tokens) + " tokens");
      const std::vector<uint8_t> w = random_blocks(type, s.rows, s.cols, rng);
      const int64_t blocks = s.cols / 32;
      std::vector<int8_t> xq(static_cast<size_t>(s.tokens * s.cols));
      std::vector<float> xd(static_cast<size_t>(s.tokens * blocks)), xs(xd.size());
      for (auto& q : xq) q = static_cast<int8_t>(rng() % 255 - 127);
      std::uniform_real_distribution<float> scale(0.001f, 0.1f);
      for (auto& d : xd) d = scale(rng);
      for (int64_t m = 0; m < s.tokens; ++m) {  // QuantizedActs' sums: d * the block's code sum
        for (int64_t b = 0; b < blocks; ++b) {
          int sum = 0;
          for (int i = 0; i < 32; ++i) sum += xq[static_cast<size_t>(m * s.cols + b * 32 + i)];
          xs[static_cast<size_t>(m * blocks + b)] = xd[static_cast<size_t>(m * blocks + b)] * static_cast<float>(sum);
        }
      }
      const TilePackedBlocks packed = pack_blocks_for_tiles(type, w.data(), s.rows, s.cols);
      const int64_t ldy = s.rows + 3;
      std::vector<float> y(static_cast<size_t>(s.tokens * ldy), NAN);
      EmulatedTiles tiles;
      tile_gemm_blocks(tiles, packed, xq.data(), xd.data(), xs.data(), s.tokens, y.data(), ldy);
      EXPECT_FALSE(tiles.configured()) << "the tiles are released after the product";
      const size_t row_bytes = w.size() / static_cast<size_t>(s.rows);
      std::vector<float> weights(static_cast<size_t>(s.cols));
      for (int64_t n = 0; n < s.rows; ++n) {
        dequantize_row(type, w.data() + static_cast<size_t>(n) * row_bytes, weights.data(), s.cols);
        for (int64_t m = 0; m < s.tokens; ++m) {
          double want = 0, magnitude = 0;
          for (int64_t k = 0; k < s.cols; ++k) {
            const double term = static_cast<double>(weights[static_cast<size_t>(k)]) * xd[static_cast<size_t>(m * blocks + k / 32)] *
                                xq[static_cast<size_t>(m * s.cols + k)];
            want += term;
            magnitude += std::fabs(term);
          }
          ASSERT_NEAR(y[static_cast<size_t>(m * ldy + n)], want, 2e-6 * magnitude + 1e-30) << "token " << m << " output " << n;
        }
      }
      for (int64_t m = 0; m < s.tokens; ++m) {
        for (int64_t n = s.rows; n < ldy; ++n) ASSERT_TRUE(std::isnan(y[static_cast<size_t>(m * ldy + n)])) << "past the rows";
      }
    }
  }
  EXPECT_THROW(pack_blocks_for_tiles(TensorType::Q8_0, nullptr, 1, 48), std::invalid_argument);
  EXPECT_THROW(pack_blocks_for_tiles(TensorType::Q4_K, nullptr, 1, 256), std::invalid_argument);
  const std::vector<uint8_t> q4_1 = random_blocks(TensorType::Q4_1, 16, 32, rng);
  const TilePackedBlocks with_mins = pack_blocks_for_tiles(TensorType::Q4_1, q4_1.data(), 16, 32);
  std::vector<int8_t> xq(32);
  std::vector<float> xd(1, 1.0f), y(16);
  EmulatedTiles tiles;
  EXPECT_THROW(tile_gemm_blocks(tiles, with_mins, xq.data(), xd.data(), nullptr, 1, y.data(), 16), std::invalid_argument)
      << "mins without the activations' sums";
}

}  // namespace
}  // namespace ringlm::cpu
