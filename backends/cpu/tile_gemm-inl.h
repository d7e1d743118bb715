// The packed products (kernel_packed.h) with every integer dot product of 16 tokens x 16 rows x
// 32 (or 16) weights taken by one AMX tile multiply (TDPBSSD), written once for any `Tiles`:
// amx.cpp instantiates it on EmulatedTiles (any CPU: the tests), amx_native.cpp on the real
// instructions. No include guard: each of those files includes it once, after defining
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
#ifndef RINGLM_TILE_NAMESPACE
#error "define RINGLM_TILE_NAMESPACE before including tile_gemm-inl.h"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

// Whether a format's weights are signed values (Q8_0's bytes, IQ4's code book) rather than
// unsigned codes; VNNI adds 128 to those and subtracts 128 times the activations' sum.
constexpr bool signed_values(const PackedFormat& f) { return f.codes == Codes::kBytes || f.codebook; }

// Sub-block `sub` (16 rows x 32 weights of the packed layout) as a B tile: row k holds, for each
// row r, its weights 4k .. 4k + 3 as bytes (unsigned codes, or the signed values).
inline void widen_sub_block(const PackedFormat& f, const uint8_t* sub, int8_t* tile) {
  auto* out = reinterpret_cast<uint8_t*>(tile);
  const auto chunk = [sub](int c) { return sub + static_cast<size_t>(c) * kChunkBytes; };
  for (int k = 0; k < 8; ++k) {
    uint8_t* row = out + k * kTileBytes;
    switch (f.codes) {
      case Codes::kBytes:
        std::memcpy(row, chunk(k), kChunkBytes);
        break;
      case Codes::kNib4:
      case Codes::kNib4Hb1:
      case Codes::kNib4Hb2: {
        const uint8_t* nib = chunk(k / 2);  // low nibbles: quad 2c, high: quad 2c + 1
        const int shift = 4 * (k % 2);
        for (int i = 0; i < kTileBytes; ++i) row[i] = static_cast<uint8_t>((nib[i] >> shift) & 0x0F);
        if (f.codes == Codes::kNib4Hb1) {  // bit k of the fifth-bit plane: quad k's bit 4
          const uint8_t* hb = chunk(4);
          for (int i = 0; i < kTileBytes; ++i) row[i] = static_cast<uint8_t>(row[i] | (((hb[i] >> k) & 1) << 4));
        }
        if (f.codes == Codes::kNib4Hb2) {  // bits 2(k % 4) .. +1 of plane 4 + k / 4: bits 4-5
          const uint8_t* hb = chunk(4 + k / 4);
          const int at = 2 * (k % 4);
          for (int i = 0; i < kTileBytes; ++i) row[i] = static_cast<uint8_t>(row[i] | (((hb[i] >> at) & 3) << 4));
        }
        if (f.codebook) {
          for (int i = 0; i < kTileBytes; ++i) row[i] = static_cast<uint8_t>(kIq4nlValues[row[i]]);
        }
        break;
      }
      case Codes::kCrumb2:
      case Codes::kCrumb2Hb1: {
        const uint8_t* crumbs = chunk(k / 4);  // bits 2(k % 4) .. +1: quad k
        const int at = 2 * (k % 4);
        for (int i = 0; i < kTileBytes; ++i) row[i] = static_cast<uint8_t>((crumbs[i] >> at) & 3);
        if (f.codes == Codes::kCrumb2Hb1) {
          const uint8_t* hb = chunk(2);
          for (int i = 0; i < kTileBytes; ++i) row[i] = static_cast<uint8_t>(row[i] | (((hb[i] >> k) & 1) << 2));
        }
        break;
      }
      default:
        break;  // float formats never come here
    }
  }
}

// One 16-row group: its codes widened to B tiles, and where each K-block's header lies.
struct WidenedGroup {
  std::vector<int8_t> tiles;              // [cols / 32][8][64]
  std::vector<const uint8_t*> headers;    // per K-block
  void widen(const PackedFormat& f, const uint8_t* group, int64_t cols) {
    tiles.resize(static_cast<size_t>(cols / kSubWeights) * kSubTileBytes);
    headers.clear();
    const uint8_t* p = group;
    int64_t sub = 0;
    for (int64_t k0 = 0; k0 < cols; k0 += f.kblock) {
      const int64_t n = std::min<int64_t>(f.kblock, cols - k0);
      headers.push_back(p);
      p += f.header_bytes_for(n);
      for (int64_t s = 0; s < n / kSubWeights; ++s, ++sub, p += f.sub_code_bytes()) {
        widen_sub_block(f, p, tiles.data() + static_cast<size_t>(sub) * kSubTileBytes);
      }
    }
  }
  const int8_t* sub_tile(int64_t sub) const { return tiles.data() + static_cast<size_t>(sub) * kSubTileBytes; }
};

// The activations of a pass: kPassTiles tiles of 16 tokens from m0 on; a last tile short of 16
// tokens reads a copy padded with zero rows (its results are never stored).
class PassActs {
 public:
  PassActs(const int8_t* q, int64_t k, int64_t m0, int64_t tokens) : q_(q), k_(k), m0_(m0), tokens_(tokens) {}
  int tiles() const { return static_cast<int>((tokens_ + kTileRows - 1) / kTileRows); }
  int tokens_in(int t) const { return static_cast<int>(std::min<int64_t>(kTileRows, tokens_ - t * kTileRows)); }
  // Tile t's `depth` activations from column k on, and the stride between its rows.
  const int8_t* at(int t, int64_t k, int depth, int64_t& stride) {
    const int64_t first = m0_ + t * kTileRows;
    const int rows = tokens_in(t);
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
// dots[t][r][n] for token m0 + 16t + r and row n.
template <class Tiles>
inline void tile_dots(Tiles& tiles, PassActs& acts, int a, int b, int64_t k, int depth, int32_t (*dots)[kTileRows][kTileRows]) {
  for (int t = 0; t < acts.tiles(); ++t) {
    const int c = kC0 + t;
    int64_t stride = 0;
    const int8_t* rows = acts.at(t, k, depth, stride);
    tiles.zero(c);
    tiles.load(a, rows, stride);
    tiles.dpbssd(c, a, b);
    tiles.store(c, dots[t], kTileRows * 4);
  }
}

// A block format's pass (Q4_0 .. Q8_0, IQ4_NL, the INT4 types): per activation block of 32, in
// K order, acc += dw * (dx * dot + offset term), as kernel_packed.cpp's BlockTile on VNNI.
template <class Tiles>
void block_pass(Tiles& tiles, const PackedFormat& f, const WidenedGroup& g, int64_t cols, const QuantizedActs& x,
                PassActs& acts, int64_t m0, float (*acc)[kTileRows]) {
  const int offset = signed_values(f) ? 128 : f.offset;
  const int64_t nb = x.blocks();
  alignas(64) int32_t dots[kPassTiles][kTileRows][kTileRows];
  int64_t sub = 0;
  for (size_t kb = 0; kb < g.headers.size(); ++kb) {
    const int64_t k0 = static_cast<int64_t>(kb) * f.kblock, n = std::min<int64_t>(f.kblock, cols - k0);
    const int blocks = static_cast<int>(n / f.group);
    for (int b = 0; b < blocks; ++b) {
      float dw[kTileRows], mv[kTileRows];
      for (int r = 0; r < kTileRows; ++r) {
        dw[r] = scale_at(g.headers[kb] + (static_cast<size_t>(b) * kPackRows + static_cast<size_t>(r)) * f.value_bytes(), f.scale);
        mv[r] = f.min ? scale_at(g.headers[kb] + (static_cast<size_t>(blocks + b) * kPackRows + static_cast<size_t>(r)) * f.value_bytes(), f.scale)
                      : 0.0f;
      }
      for (int s = 0; s < f.group / static_cast<int>(kSubWeights); ++s, ++sub) {
        const int64_t ab = (k0 + b * f.group) / kActBlock + s;  // activation block
        tiles.load(kB32, g.sub_tile(sub), kTileBytes);
        tile_dots(tiles, acts, kA32, kB32, ab * kActBlock, 32, dots);
        for (int t = 0; t < acts.tiles(); ++t) {
          for (int r = 0; r < acts.tokens_in(t); ++r) {
            const int64_t m = m0 + t * kTileRows + r;
            const float dx = x.d[m * nb + ab], sx = x.s[m * nb + ab];
            int32_t shift = 0;  // signed values made unsigned: + 128 * the block's activation sum
            if (signed_values(f)) {
              for (int i = 0; i < 32; ++i) shift += x.q[m * x.k + ab * kActBlock + i];
              shift *= 128;
            }
            float* out = acc[t * kTileRows + r];
            const int32_t* d = dots[t][r];
            for (int c = 0; c < kTileRows; ++c) {
              const float dot = static_cast<float>(d[c] + shift);
              if (f.min) {
                out[c] = std::fma(dw[c], dot * dx, out[c]);
                out[c] = std::fma(mv[c], sx, out[c]);
              } else if (offset != 0) {
                out[c] = std::fma(dw[c], std::fma(dot, dx, -static_cast<float>(offset) * sx), out[c]);
              } else {
                out[c] = std::fma(dw[c], dot * dx, out[c]);
              }
            }
          }
        }
      }
    }
  }
}

// A super format's pass (K-quants, IQ4_XS): per 256 weights, isum = sum_j sc_j * dot_j and
// imin = sum_j m_j * (activation sum of sub-block j) in integers, then acc += d * dx * isum -
// dmin * dx * imin, as kernel_packed.cpp's SuperTile on VNNI (the same integers whatever the
// order of their sums).
template <class Tiles>
void super_pass(Tiles& tiles, const PackedFormat& f, const WidenedGroup& g, const SuperActs& x, PassActs& acts,
                int64_t m0, float (*acc)[kTileRows]) {
  const int halves = static_cast<int>(kSubWeights) / f.sub;  // sub-block scales per 32 weights
  const int offset = signed_values(f) ? 0 : f.offset;        // VNNI's +128 cancels in the integers
  const bool sums = f.min || offset != 0;
  const int a = f.sub == 16 ? kA16 : kA32, b = f.sub == 16 ? kB16 : kB32;
  const int64_t nb = x.blocks();
  alignas(64) int32_t dots[kPassTiles][kTileRows][kTileRows];
  int32_t isum[kPassTokens][kTileRows], imin[kPassTokens][kTileRows];
  for (int64_t kb = 0; kb < nb; ++kb) {
    const uint8_t* header = g.headers[static_cast<size_t>(kb)];
    std::fill(&isum[0][0], &isum[0][0] + kPassTokens * kTileRows, 0);
    std::fill(&imin[0][0], &imin[0][0] + kPassTokens * kTileRows, 0);
    for (int s = 0; s < 8; ++s) {
      for (int h = 0; h < halves; ++h) {
        const int j = s * halves + h;
        tiles.load(b, g.sub_tile(kb * 8 + s) + h * (kSubTileBytes / 2), kTileBytes);
        tile_dots(tiles, acts, a, b, kb * kSuperBlock + s * kSubWeights + h * f.sub, f.sub, dots);
        int sc[kTileRows], mn[kTileRows];
        for (int r = 0; r < kTileRows; ++r) {
          const SubScale v = sub_scale_at(f, header, j, r);
          sc[r] = v.scale;
          mn[r] = f.min ? v.min : v.scale;  // offset formats: the offset meets sum_j sc_j * sum_j
        }
        for (int t = 0; t < acts.tiles(); ++t) {
          for (int r = 0; r < acts.tokens_in(t); ++r) {
            const int64_t m = m0 + t * kTileRows + r;
            const int32_t x_sum = !sums            ? 0
                                  : f.sub == 16 ? x.sum16[m * (x.k / 16) + kb * 16 + j]
                                                : x.sum32[m * (x.k / 32) + kb * 8 + j];
            int32_t* is = isum[t * kTileRows + r];
            int32_t* im = imin[t * kTileRows + r];
            for (int c = 0; c < kTileRows; ++c) {
              is[c] = static_cast<int32_t>(static_cast<uint32_t>(is[c]) + static_cast<uint32_t>(sc[c] * dots[t][r][c]));
              im[c] += mn[c] * x_sum;
            }
          }
        }
      }
    }
    float d[kTileRows], dmin[kTileRows];
    for (int r = 0; r < kTileRows; ++r) {
      d[r] = scale_at(header + 2 * r, ScaleType::kF16);
      dmin[r] = f.min ? scale_at(header + 32 + 2 * r, ScaleType::kF16) : 0.0f;
    }
    for (int t = 0; t < acts.tiles(); ++t) {
      for (int r = 0; r < acts.tokens_in(t); ++r) {
        const int64_t m = m0 + t * kTileRows + r;
        const float dx = x.d[m * nb + kb];
        float* out = acc[t * kTileRows + r];
        for (int c = 0; c < kTileRows; ++c) {
          const int32_t i = isum[t * kTileRows + r][c];
          const int32_t i_min = imin[t * kTileRows + r][c];
          if (f.min) {
            out[c] = std::fma(d[c] * dx, static_cast<float>(i), out[c]);
            out[c] = std::fma(dmin[c] * -dx, static_cast<float>(i_min), out[c]);
          } else {
            out[c] = std::fma(d[c] * dx, static_cast<float>(i - i_min * offset), out[c]);
          }
        }
      }
    }
  }
}

template <class Tiles>
void tile_gemm(Tiles& tiles, const PackedWeight& w, int64_t n_begin, int64_t n_end, const PackedInput& x,
               int64_t n_tokens, float* y, int64_t ldy) {
  const PackedFormat f = *packed_format(w.type);
  thread_local WidenedGroup group;
  alignas(64) float acc[kPassTokens][kTileRows];
  for (int64_t g = n_begin / kPackRows; g * kPackRows < n_end; ++g) {
    group.widen(f, w.group(g), w.cols);
    const int64_t stored = std::min<int64_t>(kPackRows, n_end - g * kPackRows);
    for (int64_t m0 = 0; m0 < n_tokens; m0 += kPassTokens) {
      const int64_t tokens = std::min(kPassTokens, n_tokens - m0);
      std::fill(&acc[0][0], &acc[0][0] + kPassTokens * kTileRows, 0.0f);
      if (f.super()) {
        PassActs acts(x.super.q, x.super.k, m0, tokens);
        super_pass(tiles, f, group, x.super, acts, m0, acc);
      } else {
        PassActs acts(x.block.q, x.block.k, m0, tokens);
        block_pass(tiles, f, group, w.cols, x.block, acts, m0, acc);
      }
      for (int64_t m = 0; m < tokens; ++m) std::copy_n(acc[m], stored, y + (m0 + m) * ldy + g * kPackRows);
    }
  }
}

}  // namespace ringlm::cpu::RINGLM_TILE_NAMESPACE
