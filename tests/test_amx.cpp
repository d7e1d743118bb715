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

// Random Q8_0 rows: a finite fp16 scale and 32 codes per block.
std::vector<uint8_t> random_q8_0(int64_t rows, int64_t cols, std::mt19937& rng) {
  std::vector<uint8_t> bytes(static_cast<size_t>(rows * (cols / 32) * 34));
  std::uniform_real_distribution<float> scale(0.001f, 0.05f);
  for (size_t at = 0; at < bytes.size(); at += 34) {
    const uint16_t d = fp32_to_fp16(scale(rng));
    std::memcpy(bytes.data() + at, &d, 2);
    for (int i = 0; i < 32; ++i) bytes[at + 2 + static_cast<size_t>(i)] = static_cast<uint8_t>(static_cast<int8_t>(rng() % 255 - 127));
  }
  return bytes;
}

TEST(TileGemm, Q8_0IsTheExactProductOfTheQuantizedOperands) {
  std::mt19937 rng(11);
  struct Shape {
    int64_t rows, cols, tokens;
  };
  // Whole tiles, a last group of fewer than 16 outputs, tokens short of a tile, one token, 512.
  for (const Shape s : {Shape{16, 32, 16}, Shape{40, 96, 17}, Shape{33, 64, 1}, Shape{48, 128, 100}, Shape{16, 64, 512},
                        Shape{7, 32, 31}}) {
    const std::vector<uint8_t> w = random_q8_0(s.rows, s.cols, rng);
    const int64_t blocks = s.cols / 32;
    std::vector<int8_t> xq(static_cast<size_t>(s.tokens * s.cols));
    std::vector<float> xd(static_cast<size_t>(s.tokens * blocks));
    for (auto& q : xq) q = static_cast<int8_t>(rng() % 255 - 127);
    std::uniform_real_distribution<float> scale(0.001f, 0.1f);
    for (auto& d : xd) d = scale(rng);
    const TilePackedQ8 packed = pack_q8_0_for_tiles(w.data(), s.rows, s.cols);
    const int64_t ldy = s.rows + 3;
    std::vector<float> y(static_cast<size_t>(s.tokens * ldy), NAN);
    EmulatedTiles tiles;
    tile_gemm_q8(tiles, packed, xq.data(), xd.data(), s.tokens, y.data(), ldy);
    EXPECT_FALSE(tiles.configured()) << "the tiles are released after the product";
    for (int64_t m = 0; m < s.tokens; ++m) {
      for (int64_t n = 0; n < s.rows; ++n) {
        double want = 0, magnitude = 0;
        for (int64_t b = 0; b < blocks; ++b) {
          const uint8_t* block = w.data() + (n * blocks + b) * 34;
          uint16_t d = 0;
          std::memcpy(&d, block, 2);
          int64_t dot = 0;
          for (int i = 0; i < 32; ++i) dot += static_cast<int8_t>(block[2 + i]) * xq[static_cast<size_t>(m * s.cols + b * 32 + i)];
          const double term = static_cast<double>(fp16_to_fp32(d)) * xd[static_cast<size_t>(m * blocks + b)] * static_cast<double>(dot);
          want += term;
          magnitude += std::fabs(term);
        }
        const float got = y[static_cast<size_t>(m * ldy + n)];
        ASSERT_NEAR(got, want, 1e-6 * magnitude + 1e-30)
            << s.rows << "x" << s.cols << " with " << s.tokens << " tokens: token " << m << " output " << n;
      }
      for (int64_t n = s.rows; n < ldy; ++n) ASSERT_TRUE(std::isnan(y[static_cast<size_t>(m * ldy + n)])) << "past the rows";
    }
  }
  EXPECT_THROW(pack_q8_0_for_tiles(nullptr, 1, 48), std::invalid_argument);
}

}  // namespace
}  // namespace ringlm::cpu
