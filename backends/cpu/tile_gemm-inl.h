// The packed products (kernel_packed.h) with every integer dot product of 16 tokens x 16 rows x
// 32 (or 16) weights taken by one AMX tile multiply (TDPBSSD), written once for any `Tiles`:
// amx.cpp instantiates it on EmulatedTiles (any CPU: the tests), amx_native.cpp on the real
// instructions, bench/tile_overhead.cpp on tiles that cost nothing (to time the rest). No include
// guard: each of those files includes it once, after defining
// RINGLM_TILE_NAMESPACE, so that the two copies, compiled with different instruction sets, never
// share a symbol (the linker would otherwise keep one of them for both).
//
// Why these steps: the packed layout is already the tile layout. A sub-block of a 16-row group
// (packed_format.h) keeps, per 64-byte chunk, 4 bytes for each of the 16 rows, and a B tile is
// rows of 64 bytes holding 4 consecutive weights of each of 16 output columns. Q8_0's chunks are
// the B tile's rows as they lie; 4-, 5-, 6-, 2- and 3-bit codes are widened to bytes, one group at
// a time (16 rows x K bytes, in L2), and reused by every pass of 64 tokens. So decode keeps
// reading the 4-bit copy once, and no second copy of the weights is made.
//
// Why the same bits as the AVX-512 VNNI kernels: each output's sum is the kernels' own sequence of
// float operations on the same integers (the tiles give exact integer dots: unsigned codes times
// signed activations, and signed values plus 128 times the block's activation sum where VNNI makes
// them unsigned), so a prompt gives the logits it gives there, whatever the token count, and
// everything that relies on that (speculative decoding's greedy identity, batch against single
// runs) holds with AMX on.
//
// Why the loops look as they do: that float work, with the widening, is most of a product's time
// (a tile multiply is 8-16 cycles; the cores' work around it was 60-100 at 512 tokens when it
// was written: bench/README.md, "Intel AMX: the work around the tiles"). So each format's formula
// is a template argument, a token's 16 rows are one vector (`omp simd`), and everything that does
// not depend on the group (the tokens' scales and sums: TileTokenTerms, amx.h) is made once per
// product, by the caller, and shared by all its groups and threads.
#ifndef RINGLM_TILE_NAMESPACE
#error "define RINGLM_TILE_NAMESPACE before including tile_gemm-inl.h"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "backends/cpu/amx.h"
#include "backends/cpu/kernel_packed.h"
#include "backends/cpu/packed_format.h"
#include "quant/formats.h"

namespace ringlm::cpu::RINGLM_TILE_NAMESPACE {

// The tiles of tile_product_config(): four int32 results (64 tokens), and an A and B tile for
// each depth.
enum TileIndex : int { kC0 = 0, kA32 = 4, kB32 = 5, kA16 = 6, kB16 = 7 };
constexpr int kPassTiles = 4;                       // token tiles per pass over a group
constexpr int64_t kPassTokens = kPassTiles * kTileRows;
constexpr size_t kSubTileBytes = 8 * kTileBytes;    // a sub-block's codes widened: 8 rows of 64

// Whether a format's weights are signed values (Q8_0's bytes, IQ4's and MXFP4's code books)
// rather than unsigned codes; VNNI adds 128 to those and subtracts 128 times the activations' sum.
constexpr bool signed_values(const PackedFormat& f) { return f.codes == Codes::kBytes || f.has_codebook(); }

// 64 bytes as one value of the compilers' vector extension (GCC, Clang): element-wise integer
// operations that each copy of this file compiles for its own instruction set (SSE2 for the
// emulation, AVX-512 for the tiles), with the same results. Only ever a local variable: no
// function takes or returns one, so no calling convention depends on the instruction set.
using Bytes64 = uint64_t __attribute__((vector_size(64)));
constexpr uint64_t kEveryByte = 0x0101010101010101ull;

// A tile row from a chunk's bit field: out[i] = ((p[i] >> shift) & mask) << up, or with `add`
// out[i] |= that, for the 64 bytes of the row.
inline void put_field(const uint8_t* p, int shift, uint64_t mask, int up, bool add, uint8_t* out) {
  Bytes64 v;
  std::memcpy(&v, p, sizeof v);
  v = ((v >> shift) & (mask * kEveryByte)) << up;  // shifts of 64-bit lanes; the mask drops what crossed a byte
  if (add) {
    Bytes64 o;
    std::memcpy(&o, out, sizeof o);
    v |= o;
  }
  std::memcpy(out, &v, sizeof v);
}

// Sub-block `sub` (16 rows x 32 weights of the packed layout) as a B tile: row k holds, for each
// row r, its weights 4k .. 4k + 3 as bytes (unsigned codes, or the signed values).
inline void widen_sub_block(const PackedFormat& f, const uint8_t* sub, int8_t* tile) {
  auto* out = reinterpret_cast<uint8_t*>(tile);
  const auto chunk = [sub](int c) { return sub + static_cast<size_t>(c) * kChunkBytes; };
  if (f.codes == Codes::kBytes) {
    std::memcpy(out, sub, kSubTileBytes);  // Q8_0's chunks are the tile's rows
    return;
  }
  for (int k = 0; k < 8; ++k) {
    uint8_t* row = out + k * kTileBytes;
    switch (f.codes) {
      case Codes::kNib4:
      case Codes::kNib4Hb1:
      case Codes::kNib4Hb2:
        put_field(chunk(k / 2), 4 * (k % 2), 0x0F, 0, false, row);  // low nibbles: quad 2c, high: quad 2c + 1
        if (f.codes == Codes::kNib4Hb1) put_field(chunk(4), k, 0x01, 4, true, row);  // bit k of the fifth-bit plane
        if (f.codes == Codes::kNib4Hb2) put_field(chunk(4 + k / 4), 2 * (k % 4), 0x03, 4, true, row);  // bits 4-5
        break;
      case Codes::kCrumb2:
      case Codes::kCrumb2Hb1:
        put_field(chunk(k / 4), 2 * (k % 4), 0x03, 0, false, row);  // bits 2(k % 4) .. +1: quad k
        if (f.codes == Codes::kCrumb2Hb1) put_field(chunk(2), k, 0x01, 2, true, row);  // quad k's bit 2
        break;
      default:
        return;  // float formats never come here
    }
    if (f.has_codebook()) {
      const int8_t* values = codebook_values(f.codebook);
      for (int i = 0; i < kTileBytes; ++i) row[i] = static_cast<uint8_t>(values[row[i]]);
    }
  }
}

// The 16 rows' float scales (or mins) at p, as the format stores them.
inline void read_row_scales(const uint8_t* p, ScaleType type, float* out) {
  if (type == ScaleType::kF16) return fp16x16_to_fp32(p, out);  // the common case, in vectors
  const size_t bytes = type == ScaleType::kF32 ? 4 : 2;
  for (int r = 0; r < kTileRows; ++r) out[r] = scale_at(p + static_cast<size_t>(r) * bytes, type);
}

// One 16-row group, made ready for every pass of tokens over it: its codes widened to B tiles, and
// its scales read out of the headers into plain arrays (read again by every pass, so read once).
struct WidenedGroup {
  std::vector<int8_t> tiles;  // [cols / 32][8][64]
  // Block formats: per weight block, the 16 rows' float scales and mins.
  std::vector<float> dw, mv;  // [cols / group][16]
  // Super formats: per sub-block, the 16 rows' integer scales and mins (mins: the scales, for
  // formats with an offset instead); per super-block, the float scales d and dmin.
  std::vector<int32_t> sc, mn;  // [cols / sub][16]
  std::vector<float> d, dmin;   // [cols / 256][16]

  void widen(const PackedFormat& f, const uint8_t* group, int64_t cols) {
    tiles.resize(static_cast<size_t>(cols / kSubWeights) * kSubTileBytes);
    if (f.super()) {
      sc.resize(static_cast<size_t>(cols / f.sub * kTileRows));
      mn.resize(sc.size());
      d.resize(static_cast<size_t>(cols / kSuperBlock * kTileRows));
      dmin.resize(d.size());
    } else {
      dw.resize(static_cast<size_t>(cols / f.group * kTileRows));
      mv.resize(dw.size());
    }
    const uint8_t* p = group;
    int64_t sub = 0;
    for (int64_t k0 = 0; k0 < cols; k0 += f.kblock) {
      const int64_t n = std::min<int64_t>(f.kblock, cols - k0);
      if (f.super()) {
        read_super_scales(f, p, k0 / kSuperBlock);
      } else {
        read_block_scales(f, p, k0 / f.group, n / f.group);
      }
      p += f.header_bytes_for(n);
      for (int64_t s = 0; s < n / kSubWeights; ++s, ++sub, p += f.sub_code_bytes()) {
        widen_sub_block(f, p, tiles.data() + static_cast<size_t>(sub) * kSubTileBytes);
      }
    }
  }
  const int8_t* sub_tile(int64_t sub) const { return tiles.data() + static_cast<size_t>(sub) * kSubTileBytes; }

 private:
  // A block format's header: `blocks` scales of the 16 rows, then as many mins.
  void read_block_scales(const PackedFormat& f, const uint8_t* header, int64_t first, int64_t blocks) {
    const size_t field = kPackRows * f.value_bytes();  // one block's 16 values
    for (int64_t b = 0; b < blocks; ++b) {
      read_row_scales(header + static_cast<size_t>(b) * field, f.scale, dw.data() + (first + b) * kTileRows);
      if (f.min) {
        read_row_scales(header + static_cast<size_t>(blocks + b) * field, f.scale, mv.data() + (first + b) * kTileRows);
      } else {
        std::fill_n(mv.data() + (first + b) * kTileRows, kTileRows, 0.0f);
      }
    }
  }
  // A super format's header: fp16 d (and dmin), then the sub-block scales (and mins).
  void read_super_scales(const PackedFormat& f, const uint8_t* header, int64_t kb) {
    read_row_scales(header, ScaleType::kF16, d.data() + kb * kTileRows);
    if (f.min) {
      read_row_scales(header + 32, ScaleType::kF16, dmin.data() + kb * kTileRows);
    } else {
      std::fill_n(dmin.data() + kb * kTileRows, kTileRows, 0.0f);
    }
    const int subs = static_cast<int>(kSuperBlock / f.sub);
    for (int j = 0; j < subs; ++j) {
      const size_t at = static_cast<size_t>((kb * subs + j) * kTileRows);
      for (int r = 0; r < kTileRows; ++r) {
        const SubScale v = sub_scale_at(f, header, j, r);
        sc[at + static_cast<size_t>(r)] = v.scale;
        mn[at + static_cast<size_t>(r)] = f.min ? v.min : v.scale;  // offset formats: the offset meets sum_j sc_j * sum_j
      }
    }
  }
};

// The activations of a pass: kPassTiles tiles of 16 tokens from m0 on; a last tile short of 16
// tokens reads a copy padded with zero rows (its results are never stored).
class PassActs {
 public:
  PassActs(const int8_t* q, int64_t k, int64_t m0, int64_t tokens) : q_(q), k_(k), m0_(m0), tokens_(tokens) {}
  int tiles() const { return static_cast<int>((tokens_ + kTileRows - 1) / kTileRows); }
  int tokens() const { return static_cast<int>(tokens_); }
  // Tile t's `depth` activations from column k on, and the stride between its rows.
  const int8_t* at(int t, int64_t k, int depth, int64_t& stride) {
    const int64_t first = m0_ + t * kTileRows;
    const int rows = static_cast<int>(std::min<int64_t>(kTileRows, tokens_ - t * kTileRows));
    if (rows == kTileRows) {
      stride = k_;
      return q_ + first * k_ + k;
    }
    std::fill(std::begin(padded_), std::end(padded_), int8_t{0});
    for (int r = 0; r < rows; ++r) std::memcpy(padded_ + r * depth, q_ + (first + r) * k_ + k, static_cast<size_t>(depth));
    stride = depth;
    return padded_;
  }

 private:
  const int8_t* q_;
  int64_t k_, m0_, tokens_;
  alignas(64) int8_t padded_[kTileRows * 32];
};

// The integer dots of one B tile (already loaded in tile `b`) with every token tile of the pass:
// dots[m][n] for token m0 + m and row n.
template <class Tiles>
inline void tile_dots(Tiles& tiles, PassActs& acts, int a, int b, int64_t k, int depth, int32_t (*dots)[kTileRows]) {
  for (int t = 0; t < acts.tiles(); ++t) {
    const int c = kC0 + t;
    int64_t stride = 0;
    const int8_t* rows = acts.at(t, k, depth, stride);
    tiles.zero(c);
    tiles.load(a, rows, stride);
    tiles.dpbssd(c, a, b);
    tiles.store(c, dots[t * kTileRows], kTileRows * 4);
  }
}

// --- Block formats ------------------------------------------------------------------------

// The VNNI kernels' formula for a block format's sum (kernel_packed.cpp's BlockTile), chosen at
// compile time so that each token's 16 rows take a few vector operations and no branch.
enum class BlockFormula {
  kMin,     // acc += dw * (dot * dx) + m * s              (Q4_1, Q5_1, asymmetric INT4)
  kOffset,  // acc += dw * ((dot - offset * sum) * dx)     (Q4_0, Q5_0, symmetric INT4)
  kPlain,   // acc += dw * (dot * dx)                      (signed values: Q8_0, IQ4_NL, MXFP4)
};

// One activation block's dots of a pass into its float sums; dx, s and sum: the pass's tokens'.
template <BlockFormula kFormula>
inline void add_block_dots(const int32_t (*dots)[kTileRows], int tokens, const float* dw, const float* mv,
                           const float* dx, const float* s, const int32_t* sum, int32_t offset,
                           float (*acc)[kTileRows]) {
  for (int m = 0; m < tokens; ++m) {
    const int32_t* dot_row = dots[m];
    float* out = acc[m];
    const float d = dx[m];
    const int32_t less = kFormula == BlockFormula::kOffset ? offset * sum[m] : 0;
#pragma omp simd  // the 16 rows of a token: one vector, whatever the compiler would pick
    for (int c = 0; c < kTileRows; ++c) {
      const float dot = static_cast<float>(dot_row[c] - less);
      out[c] = std::fma(dw[c], dot * d, out[c]);
      if constexpr (kFormula == BlockFormula::kMin) out[c] = std::fma(mv[c], s[m], out[c]);
    }
  }
}

// A block format's pass (Q4_0 .. Q8_0, IQ4_NL, MXFP4, the INT4 types): per activation block of 32, in
// K order, acc += dw * (dx * dot) and the offset's or mins' term, as kernel_packed.cpp's BlockTile on VNNI.
template <BlockFormula kFormula, class Tiles>
void block_pass(Tiles& tiles, const PackedFormat& f, const WidenedGroup& g, const TileTokenTerms& x, int64_t nb,
                PassActs& acts, int64_t m0, float (*acc)[kTileRows]) {
  if (!x.has(f)) throw std::logic_error("a tile product's token terms were made without its format");
  const int subs_per_block = f.group / static_cast<int>(kSubWeights);
  alignas(64) int32_t dots[kPassTokens][kTileRows];
  for (int64_t ab = 0; ab < nb; ++ab) {  // activation block = sub-block
    tiles.load(kB32, g.sub_tile(ab), kTileBytes);
    tile_dots(tiles, acts, kA32, kB32, ab * kActBlock, 32, dots);
    const size_t wb = static_cast<size_t>(ab / subs_per_block) * kTileRows;  // the weight block
    const float* s = kFormula == BlockFormula::kMin ? x.s_at(ab, m0) : nullptr;
    const int32_t* sum = kFormula == BlockFormula::kOffset ? x.sum_at(ab, m0) : nullptr;
    add_block_dots<kFormula>(dots, acts.tokens(), g.dw.data() + wb, g.mv.data() + wb, x.dx_at(ab, m0), s, sum,
                             f.offset, acc);
  }
}

// --- Super formats (K-quants, IQ4_XS) -----------------------------------------------------

// One sub-block's dots into the integer sums of a super-block: isum += sc * dot.
inline void add_sub_dots(const int32_t (*dots)[kTileRows], int tokens, const int32_t* sc, int32_t (*isum)[kTileRows]) {
  for (int m = 0; m < tokens; ++m) {
    #pragma omp simd  // the 16 rows of a token: one vector, whatever the compiler would pick
    for (int c = 0; c < kTileRows; ++c) {
      isum[m][c] = static_cast<int32_t>(static_cast<uint32_t>(isum[m][c]) + static_cast<uint32_t>(sc[c] * dots[m][c]));
    }
  }
}

// A super-block's integer sums into the float sums, per token: imin = sum_j mn_j * (the token's
// activation sum of sub-block j) where the format has mins or an offset, then acc += d * dx *
// isum - dmin * dx * imin (mins), or acc += d * dx * (isum - offset * imin).
template <bool kMin, bool kSums>
inline void add_super_sums(const int32_t (*isum)[kTileRows], int tokens, int subs, const int32_t* mn,
                           const int32_t* x_sums, int64_t x_sums_stride, int offset, const float* d, const float* dmin,
                           const float* dx, float (*acc)[kTileRows]) {
  for (int m = 0; m < tokens; ++m) {
    int32_t imin[kTileRows] = {};
    if constexpr (kSums) {
      const int32_t* x_sum = x_sums + m * x_sums_stride;
      for (int j = 0; j < subs; ++j) {
        #pragma omp simd  // the 16 rows of a token: one vector, whatever the compiler would pick
        for (int c = 0; c < kTileRows; ++c) imin[c] += mn[j * kTileRows + c] * x_sum[j];
      }
    }
    float* out = acc[m];
    #pragma omp simd  // the 16 rows of a token: one vector, whatever the compiler would pick
    for (int c = 0; c < kTileRows; ++c) {
      if constexpr (kMin) {
        out[c] = std::fma(d[c] * dx[m], static_cast<float>(isum[m][c]), out[c]);
        out[c] = std::fma(dmin[c] * -dx[m], static_cast<float>(imin[c]), out[c]);
      } else {
        out[c] = std::fma(d[c] * dx[m], static_cast<float>(isum[m][c] - imin[c] * offset), out[c]);
      }
    }
  }
}

// A super format's pass: per 256 weights, isum = sum_j sc_j * dot_j and imin = sum_j m_j *
// (activation sum of sub-block j) in integers, then acc += d * dx * isum - dmin * dx * imin, as
// kernel_packed.cpp's SuperTile on VNNI (the same integers whatever the order of their sums).
template <bool kMin, bool kSums, class Tiles>
void super_pass(Tiles& tiles, const PackedFormat& f, const WidenedGroup& g, const SuperActs& x, PassActs& acts,
                int64_t m0, float (*acc)[kTileRows]) {
  const int halves = static_cast<int>(kSubWeights) / f.sub;  // sub-block scales per 32 weights
  const int offset = signed_values(f) ? 0 : f.offset;        // VNNI's +128 cancels in the integers
  const int a = f.sub == 16 ? kA16 : kA32, b = f.sub == 16 ? kB16 : kB32;
  const int64_t nb = x.blocks(), subs = kSuperBlock / f.sub, sums_per_token = x.k / f.sub;
  const int32_t* sums = f.sub == 16 ? x.sum16 : x.sum32;
  alignas(64) int32_t dots[kPassTokens][kTileRows];
  alignas(64) int32_t isum[kPassTokens][kTileRows];
  float dx[kPassTokens];
  for (int64_t kb = 0; kb < nb; ++kb) {
    std::fill(&isum[0][0], &isum[0][0] + kPassTokens * kTileRows, 0);
    for (int s = 0; s < 8; ++s) {
      for (int h = 0; h < halves; ++h) {
        const int64_t j = kb * subs + s * halves + h;  // sub-block within the row
        tiles.load(b, g.sub_tile(kb * 8 + s) + h * (kSubTileBytes / 2), kTileBytes);
        tile_dots(tiles, acts, a, b, kb * kSuperBlock + s * kSubWeights + h * f.sub, f.sub, dots);
        add_sub_dots(dots, acts.tokens(), g.sc.data() + j * kTileRows, isum);
      }
    }
    for (int m = 0; m < acts.tokens(); ++m) dx[m] = x.d[(m0 + m) * nb + kb];
    add_super_sums<kMin, kSums>(isum, acts.tokens(), static_cast<int>(subs), g.mn.data() + kb * subs * kTileRows,
                                sums + m0 * sums_per_token + kb * subs, sums_per_token, offset,
                                g.d.data() + kb * kTileRows, g.dmin.data() + kb * kTileRows, dx, acc);
  }
}

// --- The product --------------------------------------------------------------------------

// One pass of up to 64 tokens over a widened group, by the format's formula.
template <class Tiles>
void pass(Tiles& tiles, const PackedFormat& f, const WidenedGroup& g, const PackedInput& x, const TileTokenTerms& terms,
          int64_t m0, int64_t tokens, float (*acc)[kTileRows]) {
  if (f.super()) {
    PassActs acts(x.super.q, x.super.k, m0, tokens);
    const bool sums_needed = f.min || (!signed_values(f) && f.offset != 0);
    if (f.min) return super_pass<true, true>(tiles, f, g, x.super, acts, m0, acc);
    if (sums_needed) return super_pass<false, true>(tiles, f, g, x.super, acts, m0, acc);
    return super_pass<false, false>(tiles, f, g, x.super, acts, m0, acc);
  }
  PassActs acts(x.block.q, x.block.k, m0, tokens);
  const int64_t nb = x.block.blocks();
  if (f.min) return block_pass<BlockFormula::kMin>(tiles, f, g, terms, nb, acts, m0, acc);
  if (!signed_values(f) && f.offset != 0) return block_pass<BlockFormula::kOffset>(tiles, f, g, terms, nb, acts, m0, acc);
  return block_pass<BlockFormula::kPlain>(tiles, f, g, terms, nb, acts, m0, acc);
}

// A pass's sums into y: each token's `stored` rows (16 but in a last, partial group).
inline void store_rows(const float (*acc)[kTileRows], int64_t tokens, int64_t stored, float* y, int64_t ldy) {
  for (int64_t m = 0; m < tokens; ++m) {
    if (stored == kTileRows) {
      std::memcpy(y + m * ldy, acc[m], sizeof acc[m]);  // one vector move, not a loop of runtime length
    } else {
      std::copy_n(acc[m], stored, y + m * ldy);
    }
  }
}

// Rows [n_begin, n_end) of the product, group by group; `terms` are the whole product's tokens'
// (TileTokenTerms, made once for it), which every group and thread reads.
template <class Tiles>
void tile_gemm(Tiles& tiles, const PackedWeight& w, int64_t n_begin, int64_t n_end, const PackedInput& x,
               const TileTokenTerms& terms, int64_t n_tokens, float* y, int64_t ldy) {
  const PackedFormat f = *packed_format(w.type);
  if (!f.super() && terms.tokens() != n_tokens) throw std::logic_error("tile product: token terms of another product");
  thread_local WidenedGroup group;
  alignas(64) float acc[kPassTokens][kTileRows];
  for (int64_t g = n_begin / kPackRows; g * kPackRows < n_end; ++g) {
    group.widen(f, w.group(g), w.cols);
    const int64_t stored = std::min<int64_t>(kPackRows, n_end - g * kPackRows);
    for (int64_t m0 = 0; m0 < n_tokens; m0 += kPassTokens) {
      const int64_t tokens = std::min(kPassTokens, n_tokens - m0);
      std::fill(&acc[0][0], &acc[0][0] + kPassTokens * kTileRows, 0.0f);
      pass(tiles, f, group, x, terms, m0, tokens, acc);
      store_rows(acc, tokens, stored, y + m0 * ldy + g * kPackRows, ldy);
    }
  }
}

}  // namespace ringlm::cpu::RINGLM_TILE_NAMESPACE
