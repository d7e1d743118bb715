// Intel AMX (Advanced Matrix Extensions), the matrix engine of Xeons from Sapphire Rapids on
// (issue 32): whether this process may use it, the tile operations' exact semantics as a scalar
// emulation, and the packed products on the tiles (prompt chunks: from KernelTable::tiles_from
// tokens, 128 unless `ringlm tune` measured otherwise; tile_gemm-inl.h).
//
// A core holds eight tiles of up to 16 rows of up to 64 bytes, shaped by a configuration that
// each thread loads (LDTILECFG) before its first tile instruction. TDPBSSD multiplies int8 tiles:
// C (16 x 16 int32) += A (16 x 64 int8) B, B laid out as 16 rows of 64 bytes whose row k holds,
// for each of the 16 columns n, the 4 bytes of column n at depths 4k .. 4k + 3 ("VNNI" layout).
// EmulatedTiles does exactly that in plain C++, so that the packing, blocking and scaling code
// runs, and is tested against the AVX-512 kernels and the exact products, on any CPU; a machine
// with AMX runs the same code on the real instructions (amx_native.cpp).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "backends/cpu/kernel_packed.h"
#include "quant/formats.h"

namespace ringlm::cpu {

// --- Whether AMX can run here -------------------------------------------------------------

enum class AmxState {
  kOn,                  // the CPU has AMX-TILE and AMX-INT8, the kernel lets this process use them,
                        // and the tiles' products agreed with the emulation's at start
  kSelfCheckFailed,     // ... but they did not: the AVX-512 path is used
  kEmulated,            // RINGLM_AMX=emulate: the tile products on the scalar emulation, on any CPU
                        // (slow: to test the path end to end where no tiles are)
  kOffByUser,           // RINGLM_AMX=off
  kNotInCpu,            // CPUID says no AMX-TILE / AMX-INT8
  kNotOfferedByKernel,  // the OS does not enable the tile state, or refuses this process's request
};

// Decided once per process: RINGLM_AMX ("on" or unset, "off", "emulate"; anything else throws
// std::runtime_error naming the choices), CPUID leaf 7 (EDX bits 24 and 25), then the kernel's
// permission for the tile data (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), Linux 5.16
// on), asked for only when the CPU has AMX, then one small product of each kind (a block format,
// and K-quants of both depths) on the real tiles against the emulation.
AmxState amx_state();
// `ringlm devices`' words for a state: "on", "off (RINGLM_AMX=off)", "not in this CPU",
// "not offered by the kernel", "off (the tiles' results differed from the emulation's)",
// "emulated (RINGLM_AMX=emulate)".
std::string amx_state_words(AmxState state);
// Tests: makes amx_state() return `state` from now on (nullopt: what this machine decided), for
// the backends prepared after the call; as hwy::SetSupportedTargetsForTest does for SIMD targets.
void set_amx_state_for_test(std::optional<AmxState> state);

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

// --- The packed products on the tiles -----------------------------------------------------

// Whether the tiles multiply weights of this type: every int8 format of the packed layout (the
// block formats, the K-quants, IQ4_XS, ringlm's INT4 types), not the float ones.
bool tiles_multiply(TensorType type);

// The one tile configuration every product uses, loaded once per thread: four 16 x 16 int32
// results (64 tokens a pass), and an A tile (16 tokens) and a B tile (16 rows) of depth 32 and
// of depth 16 (the K-quants whose sub-blocks scale 16 weights).
TileConfig tile_product_config();

// The numbers of a product's tokens that a block format's products on the tiles read for every
// 16-row group, laid out block by block so that a pass reads its tokens' in a row. Per activation
// block of 32 and token: the scale dx; the block's integer sum, which a format of unsigned codes
// with an offset (Q4_0, Q5_0, symmetric INT4) takes off its integer dots, offset times; and s = dx
// * sum, which a format with mins multiplies by them. Signed values (Q8_0, IQ4_NL, MXFP4) need
// neither: the tiles multiply signed bytes, so their dots are already VNNI's less its 128 * sum.
// Made once per product, for the formats of all the weights it multiplies (the CPU backend's
// threads fill a share of the tokens each as they quantize them), then only read, by every thread
// and group. The super formats need none.
class TileTokenTerms {
 public:
  // An empty table for a product of `tokens` rows of `blocks` activation blocks.
  void reset(int64_t tokens, int64_t blocks);
  // Keeps the numbers that a weight of format f reads too (none for a super format).
  void add_format(const PackedFormat& f);
  bool empty() const { return dx_.empty(); }
  // Token m's numbers, from row m of x; threads may fill different tokens at once.
  void fill(const QuantizedActs& x, int64_t m);
  // reset, add_format and every token's fill: the table of a product of one weight.
  void make(const PackedFormat& f, const QuantizedActs& x, int64_t tokens);

  int64_t tokens() const { return tokens_; }
  // Whether the numbers format f reads were kept (add_format).
  bool has(const PackedFormat& f) const;
  // Block ab's numbers from token m on: the scales, the integer sums (kept for a format with an
  // offset), s (kept for a format with mins).
  const float* dx_at(int64_t ab, int64_t m) const { return dx_.data() + ab * tokens_ + m; }
  const int32_t* sum_at(int64_t ab, int64_t m) const { return sum_.data() + ab * tokens_ + m; }
  const float* s_at(int64_t ab, int64_t m) const { return s_.data() + ab * tokens_ + m; }

 private:
  int64_t tokens_ = 0, blocks_ = 0;
  std::vector<float> dx_;     // [block][token]
  std::vector<int32_t> sum_;  // [block][token]; empty unless a format with an offset was added
  std::vector<float> s_;      // [block][token]; empty unless a format with mins was added
};

// gemm_packed (kernel_packed.h) with each integer dot of 16 tokens x 16 rows x 32 (or 16)
// weights taken by one tile multiply, on tiles configured with tile_product_config(): the
// same bits as gemm_packed on AVX-512 VNNI (tile_gemm-inl.h says how). w's type must satisfy
// tiles_multiply. `terms`: the product's, with w's format added (without: made for this call).
void tile_gemm_packed(EmulatedTiles& tiles, const PackedWeight& w, int64_t n_begin, int64_t n_end,
                      const PackedInput& x, const TileTokenTerms& terms, int64_t n_tokens, float* y, int64_t ldy);
void tile_gemm_packed(EmulatedTiles& tiles, const PackedWeight& w, int64_t n_begin, int64_t n_end,
                      const PackedInput& x, int64_t n_tokens, float* y, int64_t ldy);

// The same on this CPU's tiles (amx_native.cpp), in the calling thread, which loads the
// configuration before its first tile instruction and releases it when it exits. Throws
// std::logic_error unless amx_state() is kOn (a tile instruction would kill the process).
void amx_gemm_packed(const PackedWeight& w, int64_t n_begin, int64_t n_end, const PackedInput& x,
                     const TileTokenTerms& terms, int64_t n_tokens, float* y, int64_t ldy);
void amx_gemm_packed(const PackedWeight& w, int64_t n_begin, int64_t n_end, const PackedInput& x, int64_t n_tokens,
                     float* y, int64_t ldy);

// Where a weight's products of many tokens run (from KernelTable::tiles_from on; decode and
// small batches read the weights once on AVX-512), decided when the backend prepares it (from
// amx_state() then, so that a weight keeps its path).
enum class TilePath { kNone, kCpu, kEmulated };
TilePath tile_path_for(TensorType type);
// The product on the tiles of `path` (not kNone): this CPU's, or the emulation, each calling
// thread with its own configured tiles; `terms` as tile_gemm_packed's.
void gemm_on_tiles(TilePath path, const PackedWeight& w, int64_t n_begin, int64_t n_end, const PackedInput& x,
                   const TileTokenTerms& terms, int64_t n_tokens, float* y, int64_t ldy);
// Calls of gemm_on_tiles on the emulation so far in this process (a test's evidence that the
// path ran).
int64_t emulated_tile_products();

// amx_state's last step, once the kernel granted the tiles: products of a block format and of
// K-quants of both depths (70 tokens: every result tile, a second pass, a part tile; a part
// group) on this CPU's tiles and on the emulation, which must agree bit for bit. False on a
// build without AMX code, or when the check itself fails.
bool amx_agrees_with_emulation();

}  // namespace ringlm::cpu
