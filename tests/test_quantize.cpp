// Quantization to ringlm's INT4 types and to GGML's Q4_0/Q4_1/Q8_0, the GGUF writer, and
// `ringlm quantize` end to end.
//
// The INT4 checks decode each group's stored scale (and min) from the block bytes themselves and
// judge every dequantized weight against that grid: round to nearest means the weight lands on
// the grid point nearest to it, which for the round-to-nearest baseline is at most half a step
// away. GGML's types are compared byte for byte with the `gguf` Python package's quantizer, and
// the writer's files are read back by ringlm's reader and by gguf.GGUFReader.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/gguf/gguf.h"
#include "core/gguf/gguf_writer.h"
#include "quant/formats.h"
#include "quant/int4.h"
#include "quant/quantize.h"
#include "tests/command_runner.h"

namespace ringlm {
namespace {

// --- Helpers ----------------------------------------------------------------------------------

using Result = test::CommandResult;
using test::slurp;

std::string work_dir() { return test::work_dir_for("test_quantize"); }

// A file name of this process's own: ctest -j runs the cases of this file as parallel processes.
std::string own_file(const std::string& name) { return work_dir() + "/" + std::to_string(::getpid()) + "." + name; }

Result run(const std::string& command, int timeout_s = 300) { return test::run_command(command, work_dir(), timeout_s); }

const std::string kGgufTool = std::string("python3 ") + RINGLM_SOURCE_DIR + "/tests/reference/gguf_tool.py";

TensorType int4_type(Int4Format f) { return static_cast<TensorType>(int4_type_id(f)); }

// Rows of Gaussian weights, each row with its own spread (weights of real layers differ by
// orders of magnitude), and a few outliers as real weight matrices have.
std::vector<float> gaussian_rows(int rows, int cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  static constexpr float kSpreads[] = {1.0f, 0.02f, 1e-3f, 30.0f};
  std::vector<float> w(static_cast<size_t>(rows) * static_cast<size_t>(cols));
  for (int r = 0; r < rows; ++r) {
    const float sigma = kSpreads[r % 4];
    for (int c = 0; c < cols; ++c) w[static_cast<size_t>(r * cols + c)] = sigma * normal(rng);
    w[static_cast<size_t>(r * cols + (r * 37) % cols)] *= 6.0f;  // an outlier
  }
  return w;
}

std::vector<uint8_t> quantize(TensorType type, const std::vector<float>& w, int cols, bool clip) {
  const int rows = static_cast<int>(w.size()) / cols;
  const size_t stride = row_bytes(type, cols);
  std::vector<uint8_t> q(stride * static_cast<size_t>(rows));
  QuantizeOptions o;
  o.clip_search = clip;
  for (int r = 0; r < rows; ++r) quantize_row(type, w.data() + r * cols, q.data() + r * stride, cols, o);
  return q;
}

std::vector<float> dequantize(TensorType type, const uint8_t* q, int64_t rows, int64_t cols) {
  std::vector<float> w(static_cast<size_t>(rows * cols));
  const size_t stride = row_bytes(type, cols);
  for (int64_t r = 0; r < rows; ++r) dequantize_row(type, q + r * stride, w.data() + r * cols, cols);
  return w;
}

// One group's grid, read from the block's own bytes: scale first, then (i4a) the min.
struct GroupGrid {
  float d = 0, m = 0;
  bool asymmetric = false;

  float point(int q) const { return asymmetric ? d * q + m : d * (q - 8); }
  float lo() const { return std::min(point(0), point(15)); }
  float hi() const { return std::max(point(0), point(15)); }
  // Distance from w to the nearest of the 16 points.
  double distance(float w) const {
    double best = INFINITY;
    for (int q = 0; q < 16; ++q) best = std::min(best, std::fabs(static_cast<double>(w) - point(q)));
    return best;
  }
};

float read_scale(const uint8_t* p, ScaleType s) {
  if (s == ScaleType::kF32) {
    float v;
    std::memcpy(&v, p, 4);
    return v;
  }
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return s == ScaleType::kBF16 ? bf16_to_fp32(bits) : fp16_to_fp32(bits);
}

GroupGrid read_grid(const uint8_t* block, Int4Format f) {
  GroupGrid g;
  g.asymmetric = f.asymmetric;
  g.d = read_scale(block, f.scale);
  if (f.asymmetric) g.m = read_scale(block + int4_scale_bytes(f.scale), f.scale);
  return g;
}

// Slack for float rounding in d * q + m and in the comparisons: a few ulps of the group's size.
double slack(const GroupGrid& g) { return 1e-6 * (std::fabs(g.d) * 16 + std::fabs(g.m)) + 1e-30; }

// Every weight of a quantized row set sits on the grid point nearest to it; returns the squared
// error of each group.
std::vector<double> check_nearest_grid_point(Int4Format f, const std::vector<float>& w, const std::vector<uint8_t>& q,
                                             int cols, const std::string& what) {
  const int rows = static_cast<int>(w.size()) / cols;
  const std::vector<float> back = dequantize(int4_type(f), q.data(), rows, cols);
  const size_t block_bytes = int4_block_bytes(f);
  std::vector<double> group_sse;
  int failures = 0;
  for (int r = 0; r < rows; ++r) {
    for (int g0 = 0; g0 < cols; g0 += f.group) {
      const uint8_t* block = q.data() + static_cast<size_t>(r) * row_bytes(int4_type(f), cols) +
                             static_cast<size_t>(g0 / f.group) * block_bytes;
      const GroupGrid grid = read_grid(block, f);
      double sse = 0;
      for (int j = g0; j < g0 + f.group; ++j) {
        const size_t i = static_cast<size_t>(r * cols + j);
        const double err = std::fabs(static_cast<double>(w[i]) - back[i]);
        sse += err * err;
        if (err > grid.distance(w[i]) + slack(grid) && failures++ < 5) {
          ADD_FAILURE() << what << " row " << r << " col " << j << ": " << w[i] << " became " << back[i]
                        << ", but the grid (d " << grid.d << ", m " << grid.m << ") has a point "
                        << grid.distance(w[i]) << " away";
        }
      }
      group_sse.push_back(sse);
    }
  }
  return group_sse;
}

// --- INT4 types: traits and names ---------------------------------------------------------------

class Int4Type : public ::testing::TestWithParam<uint32_t> {
 protected:
  Int4Format format() const { return *int4_format(GetParam()); }
  TensorType type() const { return static_cast<TensorType>(GetParam()); }
};

std::string int4_test_name(const ::testing::TestParamInfo<uint32_t>& info) {
  std::string name(int4_type_name(*int4_format(info.param)));
  for (char& c : name) c = c == '-' ? '_' : c;
  return name;
}

TEST_P(Int4Type, TraitsDescribeTheLayout) {
  const Int4Format f = format();
  const std::optional<TypeTraits> t = type_traits(GetParam());
  ASSERT_TRUE(t.has_value());
  EXPECT_TRUE(t->readable);
  EXPECT_EQ(t->block_elems, f.group);
  // Scale (and min) then G/2 bytes of nibbles, computed here from the format's description.
  const size_t scale = f.scale == ScaleType::kF32 ? 4 : 2;
  EXPECT_EQ(t->block_bytes, scale * (f.asymmetric ? 2 : 1) + static_cast<size_t>(f.group) / 2);
  const std::string expected = std::string(f.asymmetric ? "i4a" : "i4s") + "-g" + std::to_string(f.group) +
                               (f.scale == ScaleType::kBF16 ? "-bf16" : f.scale == ScaleType::kF32 ? "-f32" : "");
  EXPECT_EQ(t->name, expected);
  EXPECT_EQ(row_bytes(type(), 4 * f.group), 4 * t->block_bytes);
}

TEST_P(Int4Type, NameParsesBackToTheType) {
  const std::string name(type_traits(GetParam())->name);
  EXPECT_EQ(parse_quantize_type(name), type());
  std::string upper = name;
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  EXPECT_EQ(parse_quantize_type(upper), type()) << upper;
  if (format().scale == ScaleType::kF16) {
    EXPECT_EQ(parse_quantize_type(name + "-f16"), type());
  }
}

TEST(QuantizeTypeNames, GgmlNamesParseCaseInsensitivelyAndOthersDoNot) {
  EXPECT_EQ(parse_quantize_type("Q4_0"), TensorType::Q4_0);
  EXPECT_EQ(parse_quantize_type("q4_1"), TensorType::Q4_1);
  EXPECT_EQ(parse_quantize_type("q8_0"), TensorType::Q8_0);
  EXPECT_EQ(parse_quantize_type("f16"), TensorType::F16);
  EXPECT_EQ(parse_quantize_type("Bf16"), TensorType::BF16);
  EXPECT_EQ(parse_quantize_type("F32"), TensorType::F32);
  EXPECT_EQ(parse_quantize_type("Q5_0"), TensorType::Q5_0);
  EXPECT_EQ(parse_quantize_type("q5_1"), TensorType::Q5_1);
  EXPECT_EQ(parse_quantize_type("Q4_K"), TensorType::Q4_K);
  EXPECT_EQ(parse_quantize_type("q5_k"), TensorType::Q5_K);
  EXPECT_EQ(parse_quantize_type("Q6_K"), TensorType::Q6_K);
  // Mixes are the command's business, not tensor types; Q3_K, Q8_K, the IQ types and MXFP4 have no
  // quantizer.
  for (const char* bad : {"", "Q4_K_M", "Q5_K_S", "Q3_K", "Q8_K", "IQ4_NL", "MXFP4", "i4s", "i4s-g64", "i4x-g32",
                          "i4s-g32-f16-f16", "q4_0 ", "Q8_0-f16", "Q4_K-f16"}) {
    EXPECT_FALSE(parse_quantize_type(bad).has_value()) << "'" << bad << "'";
  }
  EXPECT_EQ(quantize_type_names().size(), 23u);
  for (const std::string_view name : quantize_type_names()) {
    EXPECT_TRUE(can_quantize(*parse_quantize_type(name))) << name;
  }
}

// --- INT4 types: quantization error -------------------------------------------------------------

constexpr int kCols = 512;
constexpr int kRows = 16;

// Round to nearest on the full-range grid: inside the grid's span a weight is at most half a step
// from its value. i4s maps the extreme weight to -8 steps, leaving +7 on the other side, so a
// weight of the opposite sign beyond 7.5 steps clamps to 7: at most one step off, as in Q4_0.
TEST_P(Int4Type, RoundToNearestIsWithinHalfAStepOfEachWeight) {
  const Int4Format f = format();
  const std::vector<float> w = gaussian_rows(kRows, kCols, 7);
  const std::vector<uint8_t> q = quantize(type(), w, kCols, /*clip=*/false);
  check_nearest_grid_point(f, w, q, kCols, "RTN");
  const std::vector<float> back = dequantize(type(), q.data(), kRows, kCols);
  int outside = 0, failures = 0;
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kCols; ++c) {
      const size_t i = static_cast<size_t>(r * kCols + c);
      const uint8_t* block = q.data() + static_cast<size_t>(r) * row_bytes(type(), kCols) +
                             static_cast<size_t>(c / f.group) * int4_block_bytes(f);
      const GroupGrid g = read_grid(block, f);
      const double err = std::fabs(static_cast<double>(w[i]) - back[i]);
      const double step = std::fabs(g.d);
      const bool inside = w[i] >= g.lo() - slack(g) && w[i] <= g.hi() + slack(g);
      outside += !inside;
      const double bound = (inside ? step / 2 : step) + slack(g);
      if (!(err <= bound) && failures++ < 5) {
        ADD_FAILURE() << "row " << r << " col " << c << ": |" << w[i] << " - " << back[i] << "| = " << err
                      << " > " << bound << " (d " << g.d << ", m " << g.m << ")";
      }
      if (f.asymmetric && !inside && failures++ < 5) {
        ADD_FAILURE() << "i4a's grid must cover its group: row " << r << " col " << c << " = " << w[i]
                      << " outside [" << g.lo() << ", " << g.hi() << "]";
      }
    }
  }
  if (!f.asymmetric) {
    EXPECT_LT(outside, kRows * kCols / 20) << "too many weights clamped at +7 steps";
  }
}

TEST_P(Int4Type, ClipSearchNeverHasALargerGroupErrorThanRoundToNearest) {
  const Int4Format f = format();
  const std::vector<float> w = gaussian_rows(kRows, kCols, 11);
  const std::vector<double> rtn = check_nearest_grid_point(f, w, quantize(type(), w, kCols, false), kCols, "RTN");
  const std::vector<double> clip = check_nearest_grid_point(f, w, quantize(type(), w, kCols, true), kCols, "clip");
  ASSERT_EQ(rtn.size(), clip.size());
  int improved = 0;
  for (size_t g = 0; g < rtn.size(); ++g) {
    EXPECT_LE(clip[g], rtn[g] * (1 + 1e-6) + 1e-30) << "group " << g;
    improved += clip[g] < rtn[g] * (1 - 1e-3);
  }
  // The search must find something on Gaussian data, not just return the RTN grid.
  EXPECT_GT(improved, static_cast<int>(rtn.size()) / 4) << "the clipping search improved only " << improved << " of "
                                                        << rtn.size() << " groups";
}

// Weights already on a grid the format can store come back exactly, with or without the search.
TEST_P(Int4Type, ValuesOnTheGridRoundTripExactly) {
  const Int4Format f = format();
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> nibble(0, 15), step(1, 64), offset(-64, 64);
  std::vector<float> w(static_cast<size_t>(kRows * kCols));
  for (size_t g0 = 0; g0 < w.size(); g0 += static_cast<size_t>(f.group)) {
    // d = k / 256 and m = j / 32 are exact in fp16, bf16 and fp32 alike, and so is d * q + m.
    const float d = static_cast<float>(step(rng)) / 256 * ((g0 / f.group) % 2 && !f.asymmetric ? -1.0f : 1.0f);
    const float m = static_cast<float>(offset(rng)) / 32;
    for (int j = 0; j < f.group; ++j) {
      // The ends of the range must be present for the range to determine the grid.
      const int q = j == 5 ? 0 : (j == 9 && f.asymmetric) ? 15 : nibble(rng);
      w[g0 + static_cast<size_t>(j)] = f.asymmetric ? d * q + m : d * (q - 8);
    }
  }
  for (const bool clip : {false, true}) {
    const std::vector<float> back = dequantize(type(), quantize(type(), w, kCols, clip).data(), kRows, kCols);
    int mismatches = 0;
    for (size_t i = 0; i < w.size(); ++i) {
      if (back[i] != w[i] && mismatches++ < 5) ADD_FAILURE() << (clip ? "clip" : "RTN") << " [" << i << "]: " << w[i] << " -> " << back[i];
    }
  }
}

TEST_P(Int4Type, ZeroAndConstantRowsStayFinite) {
  const std::vector<float> zeros(kCols, 0.0f), constant(kCols, -0.3f);
  for (const bool clip : {false, true}) {
    for (const float v : dequantize(type(), quantize(type(), zeros, kCols, clip).data(), 1, kCols)) ASSERT_EQ(v, 0.0f);
    for (const float v : dequantize(type(), quantize(type(), constant, kCols, clip).data(), 1, kCols)) {
      ASSERT_NEAR(v, -0.3f, 0.3f / 128) << (clip ? "clip" : "RTN");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllFormats, Int4Type, ::testing::Range(kInt4TypeBase, kInt4TypeBase + 12), int4_test_name);

// --- INT4 layout ---------------------------------------------------------------------------------

// Byte j of sub-block s holds weight 32s+j (low nibble) and 32s+j+16 (high nibble).
TEST(Int4Layout, NibblesComeInQ4_0SubBlocks) {
  BlockI4<128, true, ScaleType::kF32> block{};
  block.d = 0.5f;
  block.m = -1.0f;
  for (int s = 0; s < 4; ++s) {
    for (int j = 0; j < 16; ++j) block.qs[16 * s + j] = static_cast<uint8_t>(((j + s) % 16) | ((15 - j) << 4));
  }
  float w[128];
  dequantize_row(int4_type({128, true, ScaleType::kF32}), &block, w, 128);
  for (int s = 0; s < 4; ++s) {
    for (int j = 0; j < 16; ++j) {
      EXPECT_EQ(w[32 * s + j], 0.5f * ((j + s) % 16) - 1.0f) << s << "," << j;
      EXPECT_EQ(w[32 * s + j + 16], 0.5f * (15 - j) - 1.0f) << s << "," << j;
    }
  }
}

// i4s-g32 is Q4_0's layout and i4a-g32 is Q4_1's: the same bytes dequantize the same.
TEST(Int4Layout, G32Fp16TypesReadAsQ4_0AndQ4_1) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<uint8_t> q4_0(8 * sizeof(BlockQ4_0)), q4_1(8 * sizeof(BlockQ4_1));
  for (uint8_t& b : q4_0) b = static_cast<uint8_t>(byte(rng));
  for (uint8_t& b : q4_1) b = static_cast<uint8_t>(byte(rng));
  for (int b = 0; b < 8; ++b) {  // finite scales
    reinterpret_cast<BlockQ4_0*>(q4_0.data())[b].d = fp32_to_fp16(0.01f * (b + 1));
    reinterpret_cast<BlockQ4_1*>(q4_1.data())[b].d = fp32_to_fp16(0.02f * (b + 1));
    reinterpret_cast<BlockQ4_1*>(q4_1.data())[b].m = fp32_to_fp16(-0.1f * b);
  }
  EXPECT_EQ(dequantize(int4_type({32, false, ScaleType::kF16}), q4_0.data(), 1, 256),
            dequantize(TensorType::Q4_0, q4_0.data(), 1, 256));
  EXPECT_EQ(dequantize(int4_type({32, true, ScaleType::kF16}), q4_1.data(), 1, 256),
            dequantize(TensorType::Q4_1, q4_1.data(), 1, 256));
}

// --- GGML types against the gguf package -------------------------------------------------------

class GgmlQuantizer : public ::testing::TestWithParam<std::string> {};

TEST_P(GgmlQuantizer, MatchesTheGgufPackageByteForByte) {
  const std::string type_name = GetParam();
  const TensorType type = *parse_quantize_type(type_name);
  constexpr int kRowsG = 12, kColsG = 256;
  std::vector<float> w = gaussian_rows(kRowsG, kColsG, 21);
  // Edge rows: all zeros; all equal; values on Q4_0's half-steps (x/d + 8.5 exactly integral);
  // a negative extreme; ties in magnitude between a positive and a negative weight; values on
  // Q5_0's half-steps (extreme -1, d = 1/16, x/d + 16.5 integral).
  std::fill(w.begin(), w.begin() + kColsG, 0.0f);
  std::fill(w.begin() + kColsG, w.begin() + 2 * kColsG, 0.75f);
  for (int c = 0; c < kColsG; ++c) w[2 * kColsG + c] = 0.125f * static_cast<float>((c % 17) - 8) - 0.0625f;
  w[3 * kColsG + 3] = -40.0f;
  w[4 * kColsG + 1] = 2.5f;
  w[4 * kColsG + 2] = -2.5f;
  for (int c = 0; c < kColsG; ++c) {
    w[5 * kColsG + c] = c % 32 == 7 ? -1.0f : 0.0625f * (static_cast<float>(c % 32 - 16) + 0.5f);
  }

  const std::string in = work_dir() + "/ggml_" + type_name + ".f32", ref = work_dir() + "/ggml_" + type_name + ".ref";
  std::ofstream(in, std::ios::binary).write(reinterpret_cast<const char*>(w.data()), static_cast<std::streamsize>(w.size() * 4));
  std::filesystem::remove(ref);
  const Result r = run(kGgufTool + " quantize " + type_name + " " + in + " " + std::to_string(kColsG) + " " + ref);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string expected = slurp(ref);
  const std::vector<uint8_t> got = quantize(type, w, kColsG, true);
  ASSERT_EQ(expected.size(), got.size());
  const size_t stride = row_bytes(type, kColsG);
  for (int row = 0; row < kRowsG; ++row) {
    const bool same = std::memcmp(expected.data() + row * stride, got.data() + row * stride, stride) == 0;
    EXPECT_TRUE(same) << type_name << " row " << row << " differs from gguf.quants.quantize";
  }
}

std::string param_name(const ::testing::TestParamInfo<std::string>& info) { return info.param; }

INSTANTIATE_TEST_SUITE_P(Ggml, GgmlQuantizer, ::testing::Values("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1"), param_name);

// --- K-quants: Q4_K, Q5_K, Q6_K ------------------------------------------------------------------
//
// Any bytes of these layouts are valid, so ringlm's quantizer is judged by what its bytes mean:
// each sub-block's grid is read from the block by this test's own reading of the layout
// (quant/formats.h), and every weight must sit on the grid point nearest to it. How good the grids
// are is judged against the legacy types of about the same size.

// One sub-block's grid as stored: the values step * q - offset, q in [q_lo, q_hi], computed as the
// dequantizer computes them ((d * code) * q - (dmin * code)). `unit` is one code of the step.
struct KGrid {
  float step = 0, offset = 0, unit = 0;
  int q_lo = 0, q_hi = 0;

  float point(int q) const { return step * static_cast<float>(q) - offset; }
  float lo() const { return std::min(point(q_lo), point(q_hi)); }
  float hi() const { return std::max(point(q_lo), point(q_hi)); }
  double distance(float w) const {
    double best = INFINITY;
    for (int q = q_lo; q <= q_hi; ++q) best = std::min(best, std::fabs(static_cast<double>(w) - point(q)));
    return best;
  }
  double slack() const { return 1e-6 * (std::fabs(step) * 64 + std::fabs(offset)) + 1e-30; }
};

struct KLayout {
  int sub;  // weights per sub-block
  size_t block_bytes;
};

KLayout k_layout(TensorType type) {
  if (type == TensorType::Q6_K) return {16, 210};
  return {32, type == TensorType::Q4_K ? size_t{144} : size_t{176}};
}

float read_half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return fp16_to_fp32(bits);
}

// The 16 sub-block grids of a Q6_K block or the 8 of a Q4_K / Q5_K block.
std::vector<KGrid> read_k_grids(TensorType type, const uint8_t* block) {
  std::vector<KGrid> grids;
  if (type == TensorType::Q6_K) {
    // ql[128], qh[64], int8 scales[16], fp16 d: w = d * scale * (q - 32), q in [0, 63].
    const float d = read_half(block + 208);
    for (int s = 0; s < 16; ++s) {
      const float step = d * static_cast<float>(static_cast<int8_t>(block[192 + s]));
      grids.push_back({step, 32 * step, std::fabs(d), 0, 63});
    }
    return grids;
  }
  // fp16 d, fp16 dmin, 12 bytes of 6-bit codes: w = d * sc * q - dmin * m.
  const float d = read_half(block), dmin = read_half(block + 2);
  const uint8_t* c = block + 4;
  for (int j = 0; j < 8; ++j) {
    const int sc = j < 4 ? c[j] & 63 : (c[j + 4] & 15) | ((c[j - 4] >> 6) << 4);
    const int m = j < 4 ? c[j + 4] & 63 : (c[j + 4] >> 4) | ((c[j] >> 6) << 4);
    grids.push_back({d * static_cast<float>(sc), dmin * static_cast<float>(m), d, 0, type == TensorType::Q4_K ? 15 : 31});
  }
  return grids;
}

class KQuant : public ::testing::TestWithParam<std::string> {
 protected:
  TensorType type() const { return *parse_quantize_type(GetParam()); }
};

// Round to nearest on the stored grid: a weight inside the grid's span is at most half a step
// away, and no other value of the block's grid is nearer. The search may clip a sub-block's ends
// (its trial steps reach (nmax + 1)/nmax of the spanning one: about one step clipped), and the
// step's code rounding moves the ends by less than another step: a clipped weight is within two
// steps of its grid, and clipped weights are few.
TEST_P(KQuant, EveryWeightIsOnTheNearestPointOfItsStoredGrid) {
  const TensorType t = type();
  const KLayout layout = k_layout(t);
  const std::vector<float> w = gaussian_rows(kRows, kCols, 7);
  const std::vector<uint8_t> q = quantize(t, w, kCols, false);
  const std::vector<float> back = dequantize(t, q.data(), kRows, kCols);
  ASSERT_EQ(row_bytes(t, kCols), layout.block_bytes * kCols / 256);
  int failures = 0, clipped = 0;
  for (int r = 0; r < kRows; ++r) {
    for (int b = 0; b < kCols / 256; ++b) {
      const uint8_t* block = q.data() + static_cast<size_t>(r) * row_bytes(t, kCols) + static_cast<size_t>(b) * layout.block_bytes;
      const std::vector<KGrid> grids = read_k_grids(t, block);
      for (int e = 0; e < 256; ++e) {
        const KGrid& g = grids[static_cast<size_t>(e / layout.sub)];
        const size_t i = static_cast<size_t>(r * kCols + b * 256 + e);
        const double err = std::fabs(static_cast<double>(w[i]) - back[i]);
        const bool inside = w[i] >= g.lo() - g.slack() && w[i] <= g.hi() + g.slack();
        clipped += !inside;
        const double bound = inside ? std::fabs(g.step) / 2.0 : 2.0 * std::max(std::fabs(g.step), std::fabs(g.unit));
        if (!(err <= g.distance(w[i]) + g.slack() && err <= bound + g.slack()) && failures++ < 5) {
          ADD_FAILURE() << GetParam() << " row " << r << " col " << b * 256 + e << ": " << w[i] << " became " << back[i]
                        << "; nearest grid point " << g.distance(w[i]) << " away, bound " << bound << " (step "
                        << g.step << ", offset " << g.offset << (inside ? ", inside" : ", clipped") << ")";
        }
      }
    }
  }
  EXPECT_LT(clipped, kRows * kCols / 20) << "too many weights outside their sub-block's grid";
}

double squared_error(TensorType t, const std::vector<float>& w) {
  const std::vector<float> back = dequantize(t, quantize(t, w, kCols, false).data(), kRows, kCols);
  double sum = 0;
  for (size_t i = 0; i < w.size(); ++i) sum += (static_cast<double>(w[i]) - back[i]) * (static_cast<double>(w[i]) - back[i]);
  return sum;
}

// What the search buys, against legacy types of more bits per weight: Q4_K (4.5) against Q4_1 (5),
// Q5_K (5.5) and Q6_K (6.56) against Q5_1 (6). Ratios of squared error on this data (deterministic:
// the same float operations on every machine): ringlm 0.832 / 0.788 / 0.226; without the step
// search 0.867 / 0.906 / 0.235; without trying neighbouring codes 0.877 / 0.866 / 0.229; with
// neither (round to nearest on the spanning grid) 1.008 / 1.016 / 0.245. The limits sit between.
TEST_P(KQuant, ErrorIsBelowALegacyTypeOfMoreBits) {
  const std::vector<float> w = gaussian_rows(kRows, kCols, 11);
  const TensorType t = type();
  const TensorType legacy = t == TensorType::Q4_K ? TensorType::Q4_1 : TensorType::Q5_1;
  const double limit = t == TensorType::Q4_K ? 0.85 : t == TensorType::Q5_K ? 0.83 : 0.23;
  const double ratio = squared_error(t, w) / squared_error(legacy, w);
  EXPECT_LT(ratio, limit) << GetParam() << "'s squared error is " << ratio << " of " << type_traits(static_cast<uint32_t>(legacy))->name << "'s";
}

// Weights already on a grid a block can store come back exactly: the super-block scales and codes
// are chosen so that every product is exact in float, each sub-block holds its grid's lowest and
// highest code (Q6_K: the code -32, its longest step), and the largest code is taken.
TEST_P(KQuant, ValuesOnTheGridRoundTripExactly) {
  const TensorType t = type();
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> pick(1, 1 << 20);
  std::vector<float> w(static_cast<size_t>(kRows * kCols));
  for (size_t b0 = 0; b0 < w.size(); b0 += 256) {
    float* x = w.data() + b0;
    if (t == TensorType::Q6_K) {
      const float d = static_cast<float>(pick(rng) % 64 + 1) / 2048;
      for (int s = 0; s < 16; ++s) {
        int sc = s == 0 ? -128 : pick(rng) % 255 - 127;
        if (sc == 0) sc = 1;
        for (int j = 0; j < 16; ++j) {
          const int l = j == 2 ? -32 : pick(rng) % 63 - 31;
          x[16 * s + j] = (d * static_cast<float>(sc)) * static_cast<float>(l);
        }
      }
    } else {
      const int nmax = t == TensorType::Q4_K ? 15 : 31;
      const float d = static_cast<float>(pick(rng) % 64 + 1) / 1024, dmin = static_cast<float>(pick(rng) % 64 + 1) / 1024;
      for (int s = 0; s < 8; ++s) {
        const int sc = s == 0 ? 63 : pick(rng) % 63 + 1, m = s == 1 ? 63 : pick(rng) % 64;
        for (int j = 0; j < 32; ++j) {
          const int q = j == 3 ? 0 : j == 7 ? nmax : pick(rng) % (nmax + 1);
          x[32 * s + j] = (d * static_cast<float>(sc)) * static_cast<float>(q) - dmin * static_cast<float>(m);
        }
      }
    }
  }
  const std::vector<float> back = dequantize(t, quantize(t, w, kCols, false).data(), kRows, kCols);
  int mismatches = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    if (back[i] != w[i] && mismatches++ < 5) ADD_FAILURE() << GetParam() << " [" << i << "]: " << w[i] << " -> " << back[i];
  }
}

TEST_P(KQuant, ZeroConstantAndTinyRowsStayFinite) {
  const TensorType t = type();
  const std::vector<float> zeros(kCols, 0.0f), constant(kCols, -0.3f), positive(kCols, 0.7f), tiny(kCols, 1e-20f);
  for (const float v : dequantize(t, quantize(t, zeros, kCols, false).data(), 1, kCols)) ASSERT_EQ(v, 0.0f);
  for (const float v : dequantize(t, quantize(t, constant, kCols, false).data(), 1, kCols)) ASSERT_NEAR(v, -0.3f, 0.3f / 64);
  for (const float v : dequantize(t, quantize(t, positive, kCols, false).data(), 1, kCols)) ASSERT_NEAR(v, 0.7f, 0.7f / 64);
  for (const float v : dequantize(t, quantize(t, tiny, kCols, false).data(), 1, kCols)) {
    ASSERT_TRUE(std::isfinite(v));
    ASSERT_LE(std::fabs(v), 1e-19f);
  }
}

INSTANTIATE_TEST_SUITE_P(KQuants, KQuant, ::testing::Values("Q4_K", "Q5_K", "Q6_K"), param_name);

// --- GGUF writer ---------------------------------------------------------------------------------

struct WrittenTensor {
  std::string name;
  std::vector<int64_t> shape;
  TensorType type;
  std::vector<uint8_t> data;
};

std::vector<uint8_t> pattern_bytes(size_t n, int seed) {
  std::vector<uint8_t> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>((i * 131 + static_cast<size_t>(seed) * 17 + 7) % 251);
  return b;
}

// Tensors whose sizes are not multiples of the alignment, so padding is exercised.
std::vector<WrittenTensor> writer_tensors() {
  std::vector<float> f(15);
  for (size_t i = 0; i < f.size(); ++i) f[i] = 0.25f * static_cast<float>(i) - 1.0f;
  std::vector<uint8_t> f_bytes(f.size() * 4);
  std::memcpy(f_bytes.data(), f.data(), f_bytes.size());
  std::vector<float> w = gaussian_rows(2, 64, 9);
  return {
      {"a.f32", {5, 3}, TensorType::F32, f_bytes},
      {"b.q8_0", {64, 2}, TensorType::Q8_0, quantize(TensorType::Q8_0, w, 64, false)},
      {"c.f16", {7}, TensorType::F16, pattern_bytes(14, 1)},
      {"d.q4_0", {32, 1, 1}, TensorType::Q4_0, quantize(TensorType::Q4_0, std::vector<float>(w.begin(), w.begin() + 32), 32, false)},
  };
}

const std::vector<std::string_view> kStrings = {"alpha", "", "ünïcödé", "with\nnewline"};
const std::vector<int64_t> kInts = {-3, 0, 7, 1000000};
const std::vector<double> kFloats = {0.5, -1.25, 1048576.0};

std::string write_test_file(const std::string& name, int64_t alignment) {
  const std::string path = work_dir() + "/" + name;
  GgufWriter w(path);
  w.set_string("general.architecture", "test");
  w.set_integer("t.u8", GgufValueType::UINT8, 200);
  w.set_integer("t.i8", GgufValueType::INT8, -100);
  w.set_integer("t.u16", GgufValueType::UINT16, 60000);
  w.set_integer("t.i16", GgufValueType::INT16, -30000);
  w.set_uint32("t.u32", 4000000000u);
  w.set_integer("t.i32", GgufValueType::INT32, -2000000000);
  w.set_integer("t.u64", GgufValueType::UINT64, static_cast<int64_t>(uint64_t{18000000000000000000u}));
  w.set_integer("t.i64", GgufValueType::INT64, -9000000000000000000);
  w.set_float("t.f32", GgufValueType::FLOAT32, 0.1);
  w.set_float("t.f64", GgufValueType::FLOAT64, 0.1);
  w.set_bool("t.bool", true);
  w.set_string("t.replaced", "first");
  w.set_string_array("t.strings", kStrings);
  w.set_integer_array("t.i32s", GgufValueType::INT32, kInts);
  w.set_integer_array("t.bools", GgufValueType::BOOL, std::vector<int64_t>{1, 0, 1});
  w.set_float_array("t.f32s", GgufValueType::FLOAT32, kFloats);
  w.set_string("t.removed", "gone");
  w.remove("t.removed");
  w.set_string("t.replaced", "second");
  if (alignment != 0) w.set_integer("general.alignment", GgufValueType::UINT32, alignment);
  for (const WrittenTensor& t : writer_tensors()) w.add_tensor(t.name, t.shape, t.type);
  w.write_header();
  for (const WrittenTensor& t : writer_tensors()) {
    // In two pieces: the writer must not care how the data arrives.
    w.write_data(t.data.data(), t.data.size() / 2);
    w.write_data(t.data.data() + t.data.size() / 2, t.data.size() - t.data.size() / 2);
  }
  w.finish();
  return path;
}

TEST(GgufWriter, RoundTripsThroughRinglmsReader) {
  for (const int64_t alignment : {int64_t{0}, int64_t{64}}) {
    const auto f = GgufFile::open(write_test_file("writer_" + std::to_string(alignment) + ".gguf", alignment));
    EXPECT_EQ(f->version(), 3u);
    EXPECT_EQ(f->alignment(), alignment == 0 ? 32u : 64u);
    EXPECT_EQ(f->require_string("general.architecture"), "test");
    EXPECT_EQ(f->find("t.u8")->type, GgufValueType::UINT8);
    EXPECT_EQ(f->get_uint("t.u8"), 200u);
    EXPECT_EQ(f->find("t.i8")->i, -100);
    EXPECT_EQ(f->find("t.i8")->type, GgufValueType::INT8);
    EXPECT_EQ(f->get_uint("t.u16"), 60000u);
    EXPECT_EQ(f->find("t.i16")->i, -30000);
    EXPECT_EQ(f->get_uint("t.u32"), 4000000000u);
    EXPECT_EQ(f->find("t.i32")->i, -2000000000);
    EXPECT_EQ(f->find("t.u64")->u, uint64_t{18000000000000000000u});
    EXPECT_EQ(f->find("t.i64")->i, -9000000000000000000);
    EXPECT_EQ(f->find("t.f32")->type, GgufValueType::FLOAT32);
    EXPECT_EQ(f->get_float("t.f32"), static_cast<double>(0.1f));
    EXPECT_EQ(f->get_float("t.f64"), 0.1);
    EXPECT_EQ(f->get_bool("t.bool"), true);
    EXPECT_EQ(f->get_string("t.replaced"), "second");
    EXPECT_EQ(f->find("t.removed"), nullptr);
    EXPECT_EQ(*f->get_string_array("t.strings"), kStrings);
    EXPECT_EQ(*f->get_int_array("t.i32s"), kInts);
    EXPECT_EQ(f->find("t.i32s")->array_type, GgufValueType::INT32);
    EXPECT_EQ(*f->get_int_array("t.bools"), (std::vector<int64_t>{1, 0, 1}));
    EXPECT_EQ(f->find("t.bools")->array_type, GgufValueType::BOOL);
    EXPECT_EQ(*f->get_float_array("t.f32s"), kFloats);  // all three are exact in float32
    // Insertion order, with the replaced key where it was first set.
    const std::vector<std::string>& keys = f->keys();
    ASSERT_GE(keys.size(), 3u);
    EXPECT_EQ(keys[0], "general.architecture");
    EXPECT_EQ(std::find(keys.begin(), keys.end(), "t.replaced") - keys.begin(), 12);

    const std::vector<WrittenTensor> expected = writer_tensors();
    ASSERT_EQ(f->tensors().size(), expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      const GgufTensorInfo& t = f->tensors()[i];
      EXPECT_EQ(t.name, expected[i].name);
      EXPECT_EQ(t.shape, expected[i].shape);
      EXPECT_EQ(t.type, expected[i].type);
      EXPECT_EQ(t.offset % f->alignment(), 0u);
      ASSERT_EQ(t.n_bytes, expected[i].data.size());
      EXPECT_EQ(std::vector<uint8_t>(t.data, t.data + t.n_bytes), expected[i].data) << t.name;
    }
  }
}

TEST(GgufWriter, RoundTripsThroughTheGgufPackagesReader) {
  const std::string path = write_test_file("writer_py.gguf", 64);
  const Result r = run(kGgufTool + " dump " + path);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["alignment"], 64);
  const nlohmann::json& f = j["fields"];
  auto type_of = [&](const char* key) { return f[key]["types"][0].get<std::string>(); };
  EXPECT_EQ(f["general.architecture"]["value"], "test");
  EXPECT_EQ(f["t.u8"]["value"], 200);
  EXPECT_EQ(type_of("t.u8"), "UINT8");
  EXPECT_EQ(f["t.i8"]["value"], -100);
  EXPECT_EQ(type_of("t.i8"), "INT8");
  EXPECT_EQ(f["t.u16"]["value"], 60000);
  EXPECT_EQ(type_of("t.i16"), "INT16");
  EXPECT_EQ(f["t.i16"]["value"], -30000);
  EXPECT_EQ(f["t.u32"]["value"], 4000000000u);
  EXPECT_EQ(f["t.i32"]["value"], -2000000000);
  EXPECT_EQ(f["t.u64"]["value"].get<uint64_t>(), uint64_t{18000000000000000000u});
  EXPECT_EQ(f["t.i64"]["value"].get<int64_t>(), -9000000000000000000);
  EXPECT_EQ(type_of("t.f32"), "FLOAT32");
  EXPECT_EQ(f["t.f32"]["value"].get<double>(), static_cast<double>(0.1f));
  EXPECT_EQ(f["t.f64"]["value"].get<double>(), 0.1);
  EXPECT_EQ(f["t.bool"]["value"], true);
  EXPECT_EQ(f["t.replaced"]["value"], "second");
  EXPECT_FALSE(f.contains("t.removed"));
  std::vector<std::string> strings;
  for (const auto& s : f["t.strings"]["value"]) strings.push_back(s.get<std::string>());
  EXPECT_EQ(strings, std::vector<std::string>(kStrings.begin(), kStrings.end()));
  EXPECT_EQ(f["t.i32s"]["types"], nlohmann::json({"ARRAY", "INT32"}));
  EXPECT_EQ(f["t.i32s"]["value"].get<std::vector<int64_t>>(), kInts);
  EXPECT_EQ(f["t.f32s"]["value"].get<std::vector<double>>(), kFloats);
  EXPECT_EQ(f["general.alignment"]["value"], 64);

  const std::vector<WrittenTensor> expected = writer_tensors();
  ASSERT_EQ(j["tensors"].size(), expected.size());
  static const char* kTypeNames[] = {"F32", "Q8_0", "F16", "Q4_0"};
  for (size_t i = 0; i < expected.size(); ++i) {
    const nlohmann::json& t = j["tensors"][i];
    EXPECT_EQ(t["name"], expected[i].name);
    EXPECT_EQ(t["type"], kTypeNames[i]);
    EXPECT_EQ(t["shape"].get<std::vector<int64_t>>(), expected[i].shape);
    std::string hex;
    for (const uint8_t b : expected[i].data) {
      char buf[3];
      std::snprintf(buf, sizeof buf, "%02x", b);
      hex += buf;
    }
    EXPECT_EQ(t["data_hex"], hex) << expected[i].name;
  }
}

TEST(GgufWriter, RejectsMisuse) {
  const std::string path = work_dir() + "/writer_misuse.gguf";
  {
    GgufWriter w(path);
    EXPECT_THROW(w.set_integer("general.alignment", GgufValueType::UINT32, 48), GgufError);
    EXPECT_THROW(w.add_tensor("bad", {30}, TensorType::Q4_0), GgufError);  // not a multiple of 32
    w.add_tensor("t", {4}, TensorType::F32);
    EXPECT_THROW(w.add_tensor("t", {4}, TensorType::F32), GgufError);  // duplicate
    EXPECT_THROW(w.write_data("x", 1), GgufError);                      // before the header
    w.write_header();
    EXPECT_THROW(w.set_string("late", "x"), GgufError);
    const float v[4] = {1, 2, 3, 4};
    w.write_data(v, 8);
    EXPECT_THROW(w.finish(), GgufError);  // half a tensor
  }
  {
    GgufWriter w(path);
    w.add_tensor("t", {2}, TensorType::F32);
    w.write_header();
    const float v[3] = {1, 2, 3};
    EXPECT_THROW(w.write_data(v, sizeof v), GgufError);  // more than declared
  }
  EXPECT_THROW(GgufWriter(work_dir() + "/no/such/dir/x.gguf"), GgufError);
}

// --- ringlm quantize end to end ------------------------------------------------------------------

const std::string kVocab = std::string(RINGLM_SHARED_DATA) + "/vocab/ggml-vocab-starcoder.gguf";

std::string quantize_cmd(const std::string& args) { return std::string(RINGLM_BINARY) + " quantize " + args; }

class QuantizeCommand : public ::testing::Test {
 protected:
  // Tiny Llamas with F32 weights: rows of 128 (every group size fits) and rows of 64 (g128 does not).
  static void SetUpTestSuite() {
    // Written under a name of this process's own, then renamed into place: a parallel case never
    // reads a half-written model (all processes write the same deterministic bytes).
    for (const auto& [path, args] : {std::pair{model128(), std::string("--n-embd 128 --n-ff 256")},
                                     std::pair{model64(), std::string("--n-embd 64 --n-ff 128")}}) {
      const std::string tmp = own_file("model.gguf");
      const Result r = run("python3 " RINGLM_SOURCE_DIR "/tests/reference/make_tiny_gguf.py " + tmp + " --vocab " +
                           kVocab + " --type F32 --seed 4 " + args);
      ASSERT_EQ(r.exit_code, 0) << r.err;
      std::filesystem::rename(tmp, path);
    }
  }
  static std::string model128() { return work_dir() + "/tiny_f32_128.gguf"; }
  static std::string model64() { return work_dir() + "/tiny_f32_64.gguf"; }
};

bool is_matrix(const GgufTensorInfo& t) {
  return t.shape.size() == 2 && t.name.find("norm") == std::string::npos && t.name.ends_with(".weight");
}

// Every tensor of `out` against the F32 tensor of `in`: same shape; the expected type; values
// within the type's rounding of the input (INT4: the nearest grid point; Q8_0: half a step, plus
// its scale's fp16 rounding).
void check_quantized_model(const GgufFile& in, const GgufFile& out, TensorType matrices, TensorType embeddings) {
  ASSERT_EQ(in.tensors().size(), out.tensors().size());
  for (const GgufTensorInfo& t : in.tensors()) {
    SCOPED_TRACE(t.name);
    const GgufTensorInfo* q = out.find_tensor(t.name);
    ASSERT_NE(q, nullptr);
    ASSERT_EQ(q->shape, t.shape);
    ASSERT_EQ(t.type, TensorType::F32);
    const bool embedding = t.name == "token_embd.weight" || t.name == "output.weight";
    const TensorType want = !is_matrix(t) ? TensorType::F32 : embedding ? embeddings : matrices;
    ASSERT_EQ(q->type, want);
    const auto* w = reinterpret_cast<const float*>(t.data);
    const std::vector<float> wv(w, w + t.n_elements());
    if (want == TensorType::F32) {
      EXPECT_EQ(std::memcmp(t.data, q->data, t.n_bytes), 0);
    } else if (const std::optional<Int4Format> f = int4_format(static_cast<uint32_t>(want))) {
      check_nearest_grid_point(*f, wv, std::vector<uint8_t>(q->data, q->data + q->n_bytes), static_cast<int>(t.cols()),
                               t.name);
    } else {
      ASSERT_EQ(want, TensorType::Q8_0);
      const std::vector<float> back = dequantize(want, q->data, t.rows(), t.cols());
      const auto* blocks = reinterpret_cast<const BlockQ8_0*>(q->data);
      int failures = 0;
      for (size_t i = 0; i < wv.size(); ++i) {
        // GGML rounds with the unrounded scale, then stores it as fp16: up to 127 steps of an
        // fp16 rounding error (2^-11 relative) come on top of half a step.
        const double d = fp16_to_fp32(blocks[i / 32].d);
        if (!(std::fabs(wv[i] - back[i]) <= d * (0.5 + 127.0 / 2048) + 1e-30) && failures++ < 5) {
          ADD_FAILURE() << "[" << i << "] " << wv[i] << " -> " << back[i] << " (d " << d << ")";
        }
      }
    }
  }
}

// Every metadata key of the input is in the output with the same value, plus ringlm.quantization.
void check_metadata_copied(const GgufFile& in, const GgufFile& out, const std::string& type_name) {
  for (const std::string& key : in.keys()) {
    if (key == "general.file_type") continue;  // rewritten for the new type
    SCOPED_TRACE(key);
    const GgufValue* a = in.find(key);
    const GgufValue* b = out.find(key);
    ASSERT_NE(b, nullptr);
    EXPECT_EQ(a->type, b->type);
    EXPECT_EQ(a->array_type, b->array_type);
    EXPECT_EQ(a->i, b->i);
    EXPECT_EQ(a->f, b->f);
    EXPECT_EQ(a->str, b->str);
    EXPECT_EQ(a->ints, b->ints);
    EXPECT_EQ(a->floats, b->floats);
    EXPECT_EQ(a->strings, b->strings);
  }
  EXPECT_EQ(out.get_string("ringlm.quantization"), type_name);
}

TEST_F(QuantizeCommand, I4sG32AndI4aG128ModelsLoadAndStayOnTheirGrids) {
  for (const std::string type : {"i4s-g32", "i4a-g128"}) {
    SCOPED_TRACE(type);
    const std::string out = work_dir() + "/tiny_" + type + ".gguf";
    std::filesystem::remove(out);
    const Result q = run(quantize_cmd(model128() + " " + out + " --type " + type + " --keep-8bit-embeddings -t 2"));
    ASSERT_EQ(q.exit_code, 0) << q.err;
    EXPECT_FALSE(std::filesystem::exists(out + ".tmp"));
    // A progress line per tensor, naming both types, and the size summary.
    EXPECT_NE(q.out.find("blk.1.ffn_down.weight"), std::string::npos) << q.out;
    EXPECT_NE(q.out.find("F32    -> " + type), std::string::npos) << q.out;
    EXPECT_NE(q.out.find("MiB ->"), std::string::npos) << q.out;

    const auto in = GgufFile::open(model128());
    const auto quantized = GgufFile::open(out);
    check_metadata_copied(*in, *quantized, type);
    check_quantized_model(*in, *quantized, *parse_quantize_type(type), TensorType::Q8_0);

    const Result gen = run(std::string(RINGLM_BINARY) + " run -m " + out + " -p hi -n 4 --temp 0 -t 2");
    EXPECT_EQ(gen.exit_code, 0) << gen.err;
    EXPECT_FALSE(gen.out.empty());
  }
}

TEST_F(QuantizeCommand, Q4_0FileIsReadByTheGgufPackage) {
  const std::string out = work_dir() + "/tiny_q4_0.gguf";
  const Result q = run(quantize_cmd(model128() + " " + out + " --type Q4_0 -t 2"));
  ASSERT_EQ(q.exit_code, 0) << q.err;
  const Result r = run(kGgufTool + " dump " + out + " --no-data");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["fields"]["ringlm.quantization"]["value"], "Q4_0");
  EXPECT_EQ(j["fields"]["general.file_type"]["value"], 2);  // LLAMA_FTYPE_MOSTLY_Q4_0
  const auto in = GgufFile::open(model128());
  ASSERT_EQ(j["tensors"].size(), in->tensors().size());
  for (const nlohmann::json& t : j["tensors"]) {
    const GgufTensorInfo* src = in->find_tensor(t["name"].get<std::string>());
    ASSERT_NE(src, nullptr);
    EXPECT_EQ(t["shape"].get<std::vector<int64_t>>(), src->shape);
    EXPECT_EQ(t["type"], is_matrix(*src) ? "Q4_0" : "F32") << src->name;
  }
  // And ringlm's own loader agrees on the quantized values (same bound as the Q4_0 grid).
  const auto quantized = GgufFile::open(out);
  const GgufTensorInfo* q_attn = quantized->find_tensor("blk.0.attn_q.weight");
  const std::vector<uint8_t> ours = quantize(
      TensorType::Q4_0,
      std::vector<float>(reinterpret_cast<const float*>(in->find_tensor("blk.0.attn_q.weight")->data),
                         reinterpret_cast<const float*>(in->find_tensor("blk.0.attn_q.weight")->data) + 128 * 128),
      128, false);
  EXPECT_EQ(std::vector<uint8_t>(q_attn->data, q_attn->data + q_attn->n_bytes), ours);
}

TEST_F(QuantizeCommand, RowsThatDoNotSplitIntoGroupsFallBackWithANotice) {
  const std::string out = work_dir() + "/tiny_fallback.gguf";
  const Result q = run(quantize_cmd(model64() + " " + out + " --type i4s-g128 -t 2"));
  ASSERT_EQ(q.exit_code, 0) << q.err;
  const std::string all = q.out + q.err;
  EXPECT_NE(all.find("blk.0.attn_q.weight: row length 64 is not a multiple of the i4s-g128 block size 128; using Q8_0"),
            std::string::npos)
      << all;
  const auto f = GgufFile::open(out);
  EXPECT_EQ(f->find_tensor("blk.0.attn_q.weight")->type, TensorType::Q8_0);
  EXPECT_EQ(f->find_tensor("token_embd.weight")->type, TensorType::Q8_0);
  // ffn_down's rows are n_ff = 128 long: they take the group of 128.
  EXPECT_EQ(f->find_tensor("blk.0.ffn_down.weight")->type, *parse_quantize_type("i4s-g128"));
  const Result gen = run(std::string(RINGLM_BINARY) + " run -m " + out + " -p hi -n 4 --temp 0 -t 2");
  EXPECT_EQ(gen.exit_code, 0) << gen.err;
}

void expect_one_error_line(const Result& r) {
  EXPECT_TRUE(test::exited_with_error(r));
  EXPECT_EQ(r.err.rfind("ringlm: error: ", 0), 0u) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

TEST_F(QuantizeCommand, MissingInputIsAClearError) {
  const std::string out = work_dir() + "/never.gguf";
  const Result r = run(quantize_cmd(work_dir() + "/no-such-model.gguf " + out + " --type Q4_0"));
  expect_one_error_line(r);
  EXPECT_NE(r.err.find("no-such-model.gguf"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(out));
}

TEST_F(QuantizeCommand, UnknownTypeNamesTheValidOnes) {
  const Result r = run(quantize_cmd(model64() + " " + work_dir() + "/never.gguf --type q3_k"));
  expect_one_error_line(r);
  EXPECT_NE(r.err.find("'q3_k'"), std::string::npos) << r.err;
  for (const char* name : {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "i4s-g32", "i4s-g32-bf16", "i4s-g32-f32",
                           "i4a-g32", "i4a-g32-bf16", "i4a-g32-f32", "i4s-g128", "i4s-g128-bf16", "i4s-g128-f32",
                           "i4a-g128", "i4a-g128-bf16", "i4a-g128-f32", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
                           "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M"}) {
    EXPECT_NE(r.err.find(name), std::string::npos) << name << " missing from: " << r.err;
  }
}

TEST_F(QuantizeCommand, UnwritableOutputIsAClearErrorAndLeavesNothing) {
  const std::string out = work_dir() + "/no-such-dir/out.gguf";
  const Result r = run(quantize_cmd(model64() + " " + out + " --type Q8_0"));
  expect_one_error_line(r);
  EXPECT_NE(r.err.find("no-such-dir/out.gguf"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(out));
}

// --- ringlm quantize: K-quants and llama.cpp's mixes ----------------------------------------------

// A Llama-shaped F32 model for the mix rules, written with ringlm's writer: the names, row lengths
// and layer count of a real one, but only 4 rows per matrix and a vocabulary of 8 (the rules read
// nothing else; the command never loads the model). Another family's name changes the keys'
// prefix; "phi3" also Phi-3's fused matrices (attn_qkv, ffn_up holding gate and up).
struct LlamaShape {
  int n_layer = 16, n_embd = 64, n_ff = 256, n_head = 4, n_head_kv = 2;
  bool untied = false;
  int n_expert = 0;  // written as <arch>.expert_count when set
  std::string arch = "llama";
};

std::string write_llama_shaped(const std::string& name, const LlamaShape& s) {
  const std::string path = own_file(name);
  GgufWriter w(path);
  const std::string p = s.arch + ".";
  w.set_string("general.architecture", s.arch);
  w.set_uint32(p + "block_count", static_cast<uint32_t>(s.n_layer));
  w.set_uint32(p + "context_length", 256);
  w.set_uint32(p + "embedding_length", static_cast<uint32_t>(s.n_embd));
  w.set_uint32(p + "feed_forward_length", static_cast<uint32_t>(s.n_ff));
  w.set_uint32(p + "attention.head_count", static_cast<uint32_t>(s.n_head));
  w.set_uint32(p + "attention.head_count_kv", static_cast<uint32_t>(s.n_head_kv));
  w.set_float(p + "attention.layer_norm_rms_epsilon", GgufValueType::FLOAT32, 1e-5);
  w.set_uint32("general.file_type", 0);
  if (s.n_expert > 0) w.set_uint32(p + "expert_count", static_cast<uint32_t>(s.n_expert));
  const std::vector<const char*> matrices =
      s.arch == "phi3" ? std::vector<const char*>{"attn_qkv", "attn_output", "ffn_up"}
                       : std::vector<const char*>{"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up"};
  std::vector<std::pair<std::string, std::vector<int64_t>>> tensors = {{"token_embd.weight", {s.n_embd, 8}},
                                                                       {"output_norm.weight", {s.n_embd}}};
  if (s.untied) tensors.push_back({"output.weight", {s.n_embd, 8}});
  for (int l = 0; l < s.n_layer; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    for (const char* m : matrices) tensors.push_back({b + m + ".weight", {s.n_embd, 4}});
    tensors.push_back({b + "ffn_down.weight", {s.n_ff, 4}});
    tensors.push_back({b + "attn_norm.weight", {s.n_embd}});
    tensors.push_back({b + "ffn_norm.weight", {s.n_embd}});
  }
  for (const auto& [n, shape] : tensors) w.add_tensor(n, shape, TensorType::F32);
  w.write_header();
  uint32_t seed = 1;
  for (const auto& [n, shape] : tensors) {
    const int cols = static_cast<int>(shape[0]), rows = shape.size() > 1 ? static_cast<int>(shape[1]) : 1;
    const std::vector<float> v = gaussian_rows(rows, cols, seed++);
    w.write_data(v.data(), v.size() * sizeof(float));
  }
  w.finish();
  return path;
}

// llama.cpp's use_more_bits layers of a 16-layer model (i < 2, i >= 14, (i - 2) % 3 == 2), one
// character per layer.
constexpr std::string_view kMoreBits16 = "MM..M..M..M..MMM";

// The type of every matrix of a 16-layer model: `by_kind` maps "attn_v" / "ffn_down" to the type in
// the more_bits layers and in the others ("Q6_K/Q4_K"), or to one type for all layers; other
// layer matrices get `rest`.
std::map<std::string, std::string> expected_types(const std::string& token_embd, const std::string& output,
                                                  const std::string& rest,
                                                  const std::map<std::string, std::vector<std::string>>& by_layer) {
  std::map<std::string, std::string> e = {{"token_embd.weight", token_embd}, {"output_norm.weight", "F32"}};
  if (!output.empty()) e["output.weight"] = output;
  for (int l = 0; l < 16; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    for (const char* m : {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}) {
      const auto it = by_layer.find(m);
      e[b + m + ".weight"] = it == by_layer.end() ? rest : it->second[static_cast<size_t>(l)];
    }
    e[b + "attn_norm.weight"] = "F32";
    e[b + "ffn_norm.weight"] = "F32";
  }
  return e;
}

// Per layer: `more` in the more_bits layers, `other` elsewhere.
std::vector<std::string> by_more_bits(const std::string& more, const std::string& other) {
  std::vector<std::string> v;
  for (const char c : kMoreBits16) v.push_back(c == 'M' ? more : other);
  return v;
}

// Per layer: `first` in the first n layers, `other` after.
std::vector<std::string> first_layers(int n, const std::string& first, const std::string& other) {
  std::vector<std::string> v;
  for (int l = 0; l < 16; ++l) v.push_back(l < n ? first : other);
  return v;
}

struct QuantizedModel {
  std::string path;
  Result result;
};

QuantizedModel quantize_model(const std::string& in, const std::string& args, const std::string& name) {
  QuantizedModel q{own_file(name), {}};
  std::filesystem::remove(q.path);
  q.result = run(quantize_cmd(in + " " + q.path + " " + args + " -t 2"));
  return q;
}

// Every tensor's type as ringlm's reader and as the gguf package read the file, against `expected`.
void check_types(const std::string& path, const std::map<std::string, std::string>& expected) {
  const auto f = GgufFile::open(path);
  ASSERT_EQ(f->tensors().size(), expected.size());
  for (const GgufTensorInfo& t : f->tensors()) {
    ASSERT_TRUE(expected.contains(t.name)) << t.name;
    EXPECT_EQ(type_traits(static_cast<uint32_t>(t.type))->name, expected.at(t.name)) << t.name;
  }
  const Result r = run(kGgufTool + " dump " + path + " --no-data");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json dump = nlohmann::json::parse(r.out);
  ASSERT_EQ(dump["tensors"].size(), expected.size());
  for (const nlohmann::json& t : dump["tensors"]) {
    EXPECT_EQ(t["type"], expected.at(t["name"].get<std::string>())) << t["name"];
  }
}

uint64_t file_type_of(const std::string& path) { return GgufFile::open(path)->get_uint("general.file_type").value_or(999); }

// A tied model whose 64-wide rows do not split into blocks of 256 (as SmolLM2's 576): llama-quantize's
// Q4_K_M falls back to Q5_0 (Q4_K) and Q8_0 (Q6_K) there, and gives the tied embeddings Q8_0.
// llama-quantize (llama.cpp from llama-cpp-python 0.3.36) writes these same types for this file.
TEST(QuantizeMix, Q4_K_MOnRowsThatDoNotSplitInto256FallsBackAsLlamaCpp) {
  const std::string in = write_llama_shaped("mix64.gguf", {});
  const QuantizedModel q = quantize_model(in, "--type Q4_K_M", "mix64.Q4_K_M.gguf");
  ASSERT_EQ(q.result.exit_code, 0) << q.result.err;
  check_types(q.path, expected_types("Q8_0", "", "Q5_0",
                                     {{"attn_v", by_more_bits("Q8_0", "Q5_0")}, {"ffn_down", by_more_bits("Q6_K", "Q4_K")}}));
  EXPECT_EQ(file_type_of(q.path), 15u);  // LLAMA_FTYPE_MOSTLY_Q4_K_M
  EXPECT_EQ(GgufFile::open(q.path)->get_string("ringlm.quantization"), "Q4_K_M");
  EXPECT_NE(q.result.err.find("blk.0.attn_q.weight: row length 64 is not a multiple of the Q4_K block size 256; using Q5_0"),
            std::string::npos)
      << q.result.err;
  EXPECT_NE(q.result.err.find("blk.0.attn_v.weight: row length 64 is not a multiple of the Q6_K block size 256; using Q8_0"),
            std::string::npos)
      << q.result.err;
}

// An untied 256-wide model: every mix's own choices, no fallback.
TEST(QuantizeMix, EachMixGivesLlamaCppsTypePerTensor) {
  const std::string in = write_llama_shaped("mix256.gguf", {.n_embd = 256, .n_ff = 512, .untied = true});
  struct Case {
    const char* mix;
    uint64_t file_type;
    std::map<std::string, std::string> types;
  };
  const Case cases[] = {
      {"Q4_K_M", 15, expected_types("Q4_K", "Q6_K", "Q4_K", {{"attn_v", by_more_bits("Q6_K", "Q4_K")},
                                                            {"ffn_down", by_more_bits("Q6_K", "Q4_K")}})},
      {"q5_k_m", 17, expected_types("Q5_K", "Q6_K", "Q5_K", {{"attn_v", by_more_bits("Q6_K", "Q5_K")},
                                                            {"ffn_down", by_more_bits("Q6_K", "Q5_K")}})},
      // Q4_K_S: Q5_K for the first four attn_v and the first eighth of ffn_down.
      {"Q4_K_S", 14, expected_types("Q4_K", "Q6_K", "Q4_K", {{"attn_v", first_layers(4, "Q5_K", "Q4_K")},
                                                            {"ffn_down", first_layers(2, "Q5_K", "Q4_K")}})},
      {"Q5_K_S", 16, expected_types("Q5_K", "Q6_K", "Q5_K", {})},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.mix);
    const QuantizedModel q = quantize_model(in, std::string("--type ") + c.mix, std::string("mix256.") + c.mix + ".gguf");
    ASSERT_EQ(q.result.exit_code, 0) << q.result.err;
    EXPECT_EQ(q.result.err.find("note:"), std::string::npos) << q.result.err;
    check_types(q.path, c.types);
    EXPECT_EQ(file_type_of(q.path), c.file_type);
  }
}

// llama.cpp's 70B rule, a type its loader gives by family: a llama of 80 layers with grouped-query
// attention, or any qwen2 of 80 layers, gets Q5_K instead of Q4_K for attn_v; a llama with as many
// KV heads as query heads (a 65B) or a qwen3 of 80 layers does not.
TEST(QuantizeMix, SeventyBGetsQ5_KForAttnVOutsideTheMoreBitsLayers) {
  for (const auto& [arch, n_head_kv, is_70b] : {std::tuple{"llama", 2, true}, std::tuple{"llama", 4, false},
                                                std::tuple{"qwen2", 4, true}, std::tuple{"qwen3", 2, false}}) {
    SCOPED_TRACE(std::string(arch) + " " + std::to_string(n_head_kv));
    const std::string in =
        write_llama_shaped("mix80.gguf", {.n_layer = 80, .n_embd = 256, .n_head_kv = n_head_kv, .arch = arch});
    const QuantizedModel q = quantize_model(in, "--type Q4_K_M", "mix80.Q4_K_M.gguf");
    ASSERT_EQ(q.result.exit_code, 0) << q.result.err;
    const auto f = GgufFile::open(q.path);
    const auto type_of = [&](const std::string& n) { return f->find_tensor(n)->type; };
    // more_bits(i, 80): i < 10, i >= 70, (i - 10) % 3 == 2.
    EXPECT_EQ(type_of("blk.10.attn_v.weight"), is_70b ? TensorType::Q5_K : TensorType::Q4_K);
    EXPECT_EQ(type_of("blk.12.attn_v.weight"), TensorType::Q6_K);
    EXPECT_EQ(type_of("blk.10.ffn_down.weight"), TensorType::Q4_K);
    EXPECT_EQ(type_of("blk.10.attn_q.weight"), TensorType::Q4_K);
  }
}

// Phi-3's fused matrices: attn_qkv takes attn_v's rules and counters (llama-quant.cpp tests for
// attn_v-like tensors before its attn_qkv branch), ffn_up holding gate and up the base type, the tied
// token_embd the output's Q6_K. llama-quantize (llama.cpp from llama-cpp-python 0.3.36) wrote these
// same types, tensor for tensor, for a phi3 file of this shape (make_tiny_gguf.py --arch phi3
// --n-embd 256 --n-ff 512 --n-layer 16) with each of the three mixes.
TEST(QuantizeMix, Phi3FusedMatricesFollowLlamaCppsRules) {
  const std::string in = write_llama_shaped("phi3.gguf", {.n_embd = 256, .n_ff = 512, .arch = "phi3"});
  struct Case {
    const char* mix;
    std::vector<std::string> attn_qkv, ffn_down;
  };
  const Case cases[] = {
      {"Q4_K_M", by_more_bits("Q6_K", "Q4_K"), by_more_bits("Q6_K", "Q4_K")},
      {"Q5_K_M", by_more_bits("Q6_K", "Q5_K"), by_more_bits("Q6_K", "Q5_K")},
      {"Q4_K_S", first_layers(4, "Q5_K", "Q4_K"), first_layers(2, "Q5_K", "Q4_K")},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.mix);
    const std::string base = std::string(c.mix).substr(0, 4);
    std::map<std::string, std::string> e = {{"token_embd.weight", "Q6_K"}, {"output_norm.weight", "F32"}};
    for (int l = 0; l < 16; ++l) {
      const std::string b = "blk." + std::to_string(l) + ".";
      e[b + "attn_qkv.weight"] = c.attn_qkv[static_cast<size_t>(l)];
      e[b + "ffn_down.weight"] = c.ffn_down[static_cast<size_t>(l)];
      e[b + "attn_output.weight"] = e[b + "ffn_up.weight"] = base;
      e[b + "attn_norm.weight"] = e[b + "ffn_norm.weight"] = "F32";
    }
    const QuantizedModel q = quantize_model(in, std::string("--type ") + c.mix, std::string("phi3.") + c.mix + ".gguf");
    ASSERT_EQ(q.result.exit_code, 0) << q.result.err;
    check_types(q.path, e);
  }
}

// --embd-type and --keep-8bit-embeddings override the mix for token_embd and output, as
// llama-quantize's --token-embedding-type and --output-tensor-type do.
TEST(QuantizeMix, EmbeddingFlagsOverrideTheMix) {
  const std::string in = write_llama_shaped("mix256e.gguf", {.n_embd = 256, .n_ff = 512, .untied = true});
  const QuantizedModel q = quantize_model(in, "--type Q4_K_M --keep-8bit-embeddings", "mix256e.gguf.out");
  ASSERT_EQ(q.result.exit_code, 0) << q.result.err;
  const auto f = GgufFile::open(q.path);
  EXPECT_EQ(f->find_tensor("token_embd.weight")->type, TensorType::Q8_0);
  EXPECT_EQ(f->find_tensor("output.weight")->type, TensorType::Q8_0);
  EXPECT_EQ(f->find_tensor("blk.0.attn_v.weight")->type, TensorType::Q6_K);
}

// llama.cpp's rules for models with experts are not implemented: a mix refuses them, plainly.
TEST(QuantizeMix, MixOfAModelWithExpertsIsAClearError) {
  const std::string in = write_llama_shaped("experts.gguf", {.n_layer = 2, .n_expert = 8});
  const QuantizedModel q = quantize_model(in, "--type Q4_K_M", "experts.out.gguf");
  expect_one_error_line(q.result);
  EXPECT_NE(q.result.err.find("experts"), std::string::npos) << q.result.err;
  EXPECT_FALSE(std::filesystem::exists(q.path));
  EXPECT_EQ(quantize_model(in, "--type Q4_K", "experts.out.gguf").result.exit_code, 0);
}

// Plain K-quant types on rows that do not split into 256: llama-quantize's fallbacks, or
// --fallback-type when given; and every plain type's general.file_type.
TEST(QuantizeMix, PlainTypesFallBackAsLlamaCppAndNameTheirFileType) {
  const std::string in = write_llama_shaped("plain64.gguf", {.n_layer = 2});
  struct Case {
    std::string args, matrices, ffn_down;
    uint64_t file_type;
  };
  const Case cases[] = {
      {"--type Q4_K", "Q5_0", "Q4_K", 15}, {"--type Q5_K", "Q5_1", "Q5_K", 17},
      {"--type Q6_K", "Q8_0", "Q6_K", 18}, {"--type Q4_K --fallback-type Q8_0", "Q8_0", "Q4_K", 15},
      {"--type Q5_0", "Q5_0", "Q5_0", 8},  {"--type Q5_1", "Q5_1", "Q5_1", 9},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    const QuantizedModel q = quantize_model(in, c.args, "plain64.out.gguf");
    ASSERT_EQ(q.result.exit_code, 0) << q.result.err;
    const auto f = GgufFile::open(q.path);
    EXPECT_EQ(type_traits(static_cast<uint32_t>(f->find_tensor("blk.1.attn_q.weight")->type))->name, c.matrices);
    EXPECT_EQ(type_traits(static_cast<uint32_t>(f->find_tensor("token_embd.weight")->type))->name, c.matrices);
    EXPECT_EQ(type_traits(static_cast<uint32_t>(f->find_tensor("blk.1.ffn_down.weight")->type))->name, c.ffn_down);
    EXPECT_EQ(f->get_uint("general.file_type"), c.file_type);
  }
}

// The files ringlm writes in the new types, read by the gguf package: its dequantizer on the
// written bytes gives what ringlm's dequantize_row gives, and those bytes are quantize_row's of the
// input rows (the command puts each tensor's data where its info says).
TEST(QuantizeMix, NewTypesAreReadByTheGgufPackageAsRinglmReadsThem) {
  const std::string in64 = write_llama_shaped("read64.gguf", {.n_layer = 2});
  const std::string in256 = write_llama_shaped("read256.gguf", {.n_layer = 2, .n_embd = 256, .n_ff = 512, .untied = true});
  const auto source64 = GgufFile::open(in64), source256 = GgufFile::open(in256);
  int checked[64] = {};
  for (const auto& [in, source, type] : {std::tuple{in64, source64.get(), "Q4_K_M"}, std::tuple{in256, source256.get(), "Q5_K_M"},
                                         std::tuple{in64, source64.get(), "Q5_1"}, std::tuple{in256, source256.get(), "Q5_K"}}) {
    SCOPED_TRACE(type);
    const QuantizedModel q = quantize_model(in, std::string("--type ") + type, "read.out.gguf");
    ASSERT_EQ(q.result.exit_code, 0) << q.result.err;
    const std::string dir = own_file("dequantized");
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    const Result r = run(kGgufTool + " dequantize " + q.path + " " + dir);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto f = GgufFile::open(q.path);
    for (const GgufTensorInfo& t : f->tensors()) {
      SCOPED_TRACE(t.name);
      const std::string theirs = slurp(dir + "/" + t.name + ".f32");
      ASSERT_EQ(theirs.size(), static_cast<size_t>(t.n_elements()) * 4);
      const std::vector<float> ours = dequantize(t.type, t.data, t.rows(), t.cols());
      int mismatches = 0;
      for (size_t i = 0; i < ours.size(); ++i) {
        float want;
        std::memcpy(&want, theirs.data() + 4 * i, 4);
        if (!(std::fabs(ours[i] - want) <= 1e-6f * std::max(1.0f, std::fabs(want))) && mismatches++ < 3) {
          ADD_FAILURE() << "[" << i << "] ringlm " << ours[i] << ", gguf " << want;
        }
      }
      const GgufTensorInfo* src = source->find_tensor(t.name);
      ASSERT_NE(src, nullptr);
      if (t.type != TensorType::F32) {
        const auto* x = reinterpret_cast<const float*>(src->data);
        const std::vector<uint8_t> expected =
            quantize(t.type, std::vector<float>(x, x + src->n_elements()), static_cast<int>(src->cols()), false);
        EXPECT_TRUE(std::equal(expected.begin(), expected.end(), t.data, t.data + t.n_bytes)) << "bytes differ from quantize_row's";
        ++checked[static_cast<int>(t.type) % 64];
      }
    }
  }
  for (const TensorType t : {TensorType::Q5_0, TensorType::Q5_1, TensorType::Q4_K, TensorType::Q5_K, TensorType::Q6_K, TensorType::Q8_0}) {
    EXPECT_GT(checked[static_cast<int>(t)], 0) << type_traits(static_cast<uint32_t>(t))->name << " not covered";
  }
}

}  // namespace
}  // namespace ringlm
