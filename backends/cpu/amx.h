// Intel AMX (Advanced Matrix Extensions), the matrix engine of Xeons from Sapphire Rapids on
// (issue 32): whether this process may use it, the tile operations' exact semantics as a scalar
// emulation, and the tile layout of int8 weights with the product that runs on it.
//
// A core holds eight tiles of up to 16 rows of up to 64 bytes, shaped by a configuration that
// each thread loads (LDTILECFG) before its first tile instruction. TDPBSSD multiplies int8 tiles:
// C (16 x 16 int32) += A (16 x 64 int8) B, B laid out as 16 rows of 64 bytes whose row k holds,
// for each of the 16 columns n, the 4 bytes of column n at depths 4k .. 4k + 3 ("VNNI" layout).
// EmulatedTiles does exactly that in plain C++, so that the packing, blocking and scaling code
// runs, and is tested against the exact integer products, on any CPU; a machine with AMX runs
// the same code on the real instructions.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "quant/formats.h"

namespace ringlm::cpu {

// --- Whether AMX can run here -------------------------------------------------------------

enum class AmxState {
  kOffered,             // the CPU has AMX-TILE and AMX-INT8, and the kernel lets this process use them
  kOffByUser,           // RINGLM_AMX=off
  kNotInCpu,            // CPUID says no AMX-TILE / AMX-INT8
  kNotOfferedByKernel,  // the OS does not enable the tile state, or refuses this process's request
};

// Decided once per process: CPUID leaf 7 (EDX bits 24 and 25), then the kernel's permission
// for the tile data (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), Linux 5.16 on), asked
// for only when the CPU has AMX and RINGLM_AMX is not "off".
AmxState amx_state();
// `ringlm devices`' words for a state: "offered", "off (RINGLM_AMX=off)", "not in this CPU",
// "not offered by the kernel".
std::string amx_state_words(AmxState state);

// --- The tiles ----------------------------------------------------------------------------

inline constexpr int kTiles = 8;
inline constexpr int kTileRows = 16;
inline constexpr int kTileBytes = 64;  // per row

struct TileShape {
  int rows = 0;   // 0: the tile is not configured
  int colsb = 0;  // bytes per row
};
using TileConfig = std::array<TileShape, kTiles>;

// One thread's tiles, emulated. Every operation checks what the CPU checks (shapes against the
// configuration; a violation raises #UD there, std::logic_error here).
class EmulatedTiles {
 public:
  // LDTILECFG: takes the shapes and zeroes every tile. TILERELEASE: back to unconfigured.
  void load_config(const TileConfig& config);
  void release();
  bool configured() const { return configured_; }

  // TILELOADD / TILESTORED: row r of tile t from / to base + r * stride, colsb bytes each.
  void load(int t, const void* base, int64_t stride);
  void store(int t, void* base, int64_t stride) const;
  void zero(int t);  // TILEZERO
  // TDPBSSD: C[m][n] += sum_k sum_i A[m][4k + i] * B[k][4n + i] (int8 x int8, int32 sums that
  // wrap around), m < rows(c), n < colsb(c) / 4, k < colsb(a) / 4; rows(a) = rows(c),
  // rows(b) = colsb(a) / 4, colsb(b) = colsb(c).
  void dpbssd(int c, int a, int b);
  // TDPBUSD: the same with A's bytes unsigned.
  void dpbusd(int c, int a, int b);

 private:
  template <bool kSignedA>
  void dot_product(int c, int a, int b);
  const TileShape& shape(int t) const;

  TileConfig config_{};
  bool configured_ = false;
  std::array<std::array<uint8_t, kTileRows * kTileBytes>, kTiles> data_{};
};

// --- Int8 weights in the tile layout ------------------------------------------------------

// A matrix of a format with blocks of 32 weights (rows x cols, cols a multiple of 32), each weight
// d * c + m for an int8 code c and the block's scale d and min m (0 for the symmetric formats),
// repacked for the tile multiply: per group of 16 output rows and per block of 32 inputs, the
// codes as one B tile of 8 rows of 64 bytes (row k: for each of the 16 outputs n, its codes
// 4k .. 4k + 3 of the block), the 16 scales and the 16 mins. A last group of fewer rows is padded
// with zero codes, scales and mins. The codes: Q8_0's bytes, Q4_0's nibbles - 8, Q5_0's 5 bits -
// 16, Q4_1's nibbles and Q5_1's 5 bits (with their mins), IQ4_NL's code book values.
struct TilePackedBlocks {
  int64_t rows = 0, cols = 0;
  bool has_min = false;       // Q4_1, Q5_1
  std::vector<int8_t> codes;  // [groups][blocks][8][64]
  std::vector<float> scales;  // [groups][blocks][16]
  std::vector<float> mins;    // [groups][blocks][16], when has_min
  int64_t groups() const { return (rows + kTileRows - 1) / kTileRows; }
  int64_t blocks() const { return cols / 32; }
};
// Throws std::invalid_argument for another type, or cols not a multiple of 32.
TilePackedBlocks pack_blocks_for_tiles(TensorType type, const uint8_t* data, int64_t rows, int64_t cols);

// y[m][n] = sum over blocks b of wd[n][b] * xd[m][b] * (the integer dot of block b of output n's
// codes and token m's) + wm[n][b] * xs[m][b], for m_count tokens of int8 activations quantized
// per 32 (xq [m][cols], xd and xs [m][cols / 32], xs the block's xd * sum of its codes, as
// QuantizedActs holds them; xs may be null without mins); y is [m_count][ldy]. Per 16 tokens and
// 16 outputs: each block's integer dots in one TDPBSSD (A: 16 tokens x 32 codes, B: the packed
// block), then scaled into float accumulators in block order. Tokens past m_count in a last tile
// of 16 are zero rows.
template <class Tiles>
void tile_gemm_blocks(Tiles& tiles, const TilePackedBlocks& w, const int8_t* xq, const float* xd, const float* xs,
                      int64_t m_count, float* y, int64_t ldy);

}  // namespace ringlm::cpu
