#include "backends/cpu/amx.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "quant/formats.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace ringlm::cpu {

// --- Whether AMX can run here -------------------------------------------------------------

namespace {

#if defined(__x86_64__)
constexpr unsigned kAmxTileBit = 1u << 24, kAmxInt8Bit = 1u << 25;  // CPUID.(7, 0):EDX
constexpr int kArchReqXcompPerm = 0x1023;                           // arch_prctl: ask for a state
constexpr int kXfeatureXtiledata = 18;                              // the tiles' data

bool cpu_has_amx_int8() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
  return (d & kAmxTileBit) != 0 && (d & kAmxInt8Bit) != 0;
}

// The kernel enables the tile state for a process only on request (Linux 5.16 on); an older
// kernel, or one without the state in XCR0, refuses.
bool kernel_grants_tiles() { return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0; }
#else
bool cpu_has_amx_int8() { return false; }
bool kernel_grants_tiles() { return false; }
#endif

AmxState decide_amx_state() {
  const char* env = std::getenv("RINGLM_AMX");
  if (env != nullptr && std::string(env) == "off") return AmxState::kOffByUser;
  if (!cpu_has_amx_int8()) return AmxState::kNotInCpu;
  return kernel_grants_tiles() ? AmxState::kOffered : AmxState::kNotOfferedByKernel;
}

}  // namespace

AmxState amx_state() {
  static const AmxState state = decide_amx_state();
  return state;
}

std::string amx_state_words(AmxState state) {
  switch (state) {
    case AmxState::kOffered:
      return "offered";
    case AmxState::kOffByUser:
      return "off (RINGLM_AMX=off)";
    case AmxState::kNotInCpu:
      return "not in this CPU";
    case AmxState::kNotOfferedByKernel:
      return "not offered by the kernel";
  }
  return "unknown";
}

// --- The tiles ----------------------------------------------------------------------------

void EmulatedTiles::load_config(const TileConfig& config) {
  for (const TileShape& s : config) {
    if (s.rows < 0 || s.rows > kTileRows || s.colsb < 0 || s.colsb > kTileBytes || (s.rows == 0) != (s.colsb == 0)) {
      throw std::logic_error("tile configuration: a tile of " + std::to_string(s.rows) + " rows of " +
                             std::to_string(s.colsb) + " bytes");
    }
  }
  config_ = config;
  configured_ = true;
  for (auto& tile : data_) tile.fill(0);
}

void EmulatedTiles::release() {
  config_ = TileConfig{};
  configured_ = false;
}

const TileShape& EmulatedTiles::shape(int t) const {
  if (!configured_) throw std::logic_error("a tile instruction before the tile configuration was loaded");
  if (t < 0 || t >= kTiles || config_[static_cast<size_t>(t)].rows == 0) {
    throw std::logic_error("tile " + std::to_string(t) + " is not configured");
  }
  return config_[static_cast<size_t>(t)];
}

void EmulatedTiles::load(int t, const void* base, int64_t stride) {
  const TileShape& s = shape(t);
  auto& tile = data_[static_cast<size_t>(t)];
  tile.fill(0);  // bytes past the configured shape read as zero
  for (int r = 0; r < s.rows; ++r) {
    std::memcpy(tile.data() + r * kTileBytes, static_cast<const uint8_t*>(base) + r * stride, static_cast<size_t>(s.colsb));
  }
}

void EmulatedTiles::store(int t, void* base, int64_t stride) const {
  const TileShape& s = shape(t);
  const auto& tile = data_[static_cast<size_t>(t)];
  for (int r = 0; r < s.rows; ++r) {
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, tile.data() + r * kTileBytes, static_cast<size_t>(s.colsb));
  }
}

void EmulatedTiles::zero(int t) {
  shape(t);
  data_[static_cast<size_t>(t)].fill(0);
}

template <bool kSignedA>
void EmulatedTiles::dot_product(int c, int a, int b) {
  const TileShape &sc = shape(c), &sa = shape(a), &sb = shape(b);
  if (sa.rows != sc.rows || sb.rows != sa.colsb / 4 || sb.colsb != sc.colsb || sa.colsb % 4 != 0 || sc.colsb % 4 != 0) {
    throw std::logic_error("tile dot product: shapes C " + std::to_string(sc.rows) + "x" + std::to_string(sc.colsb) + ", A " +
                           std::to_string(sa.rows) + "x" + std::to_string(sa.colsb) + ", B " + std::to_string(sb.rows) +
                           "x" + std::to_string(sb.colsb) + " do not fit");
  }
  const uint8_t* ta = data_[static_cast<size_t>(a)].data();
  const auto* tb = reinterpret_cast<const int8_t*>(data_[static_cast<size_t>(b)].data());
  uint8_t* tc = data_[static_cast<size_t>(c)].data();
  for (int m = 0; m < sc.rows; ++m) {
    for (int n = 0; n < sc.colsb / 4; ++n) {
      int32_t acc = 0;
      std::memcpy(&acc, tc + m * kTileBytes + 4 * n, 4);
      uint32_t sum = static_cast<uint32_t>(acc);  // the hardware's sums wrap around
      for (int k = 0; k < sa.colsb / 4; ++k) {
        for (int i = 0; i < 4; ++i) {
          const uint8_t byte = ta[m * kTileBytes + 4 * k + i];
          const int32_t x = kSignedA ? static_cast<int32_t>(static_cast<int8_t>(byte)) : static_cast<int32_t>(byte);
          sum += static_cast<uint32_t>(x * tb[k * kTileBytes + 4 * n + i]);
        }
      }
      acc = static_cast<int32_t>(sum);
      std::memcpy(tc + m * kTileBytes + 4 * n, &acc, 4);
    }
  }
}

void EmulatedTiles::dpbssd(int c, int a, int b) { dot_product<true>(c, a, b); }
void EmulatedTiles::dpbusd(int c, int a, int b) { dot_product<false>(c, a, b); }

// --- Int8 weights in the tile layout ------------------------------------------------------

namespace {
constexpr int64_t kBlock = 32;             // Q8_0's block
constexpr size_t kQ8Bytes = 2 + kBlock;    // its fp16 scale and 32 codes
constexpr int kBlockTileRows = kBlock / 4;  // a block's B tile: 8 rows of 4-byte groups
}  // namespace

TilePackedQ8 pack_q8_0_for_tiles(const uint8_t* q8_0, int64_t rows, int64_t cols) {
  if (cols % kBlock != 0) throw std::invalid_argument("Q8_0 rows of " + std::to_string(cols) + " values (a multiple of 32)");
  TilePackedQ8 w;
  w.rows = rows;
  w.cols = cols;
  const int64_t groups = w.groups(), blocks = w.blocks();
  w.codes.assign(static_cast<size_t>(groups * blocks * kBlockTileRows * kTileBytes), 0);
  w.scales.assign(static_cast<size_t>(groups * blocks * kTileRows), 0.0f);
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t g = row / kTileRows, n = row % kTileRows;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = q8_0 + (static_cast<size_t>(row * blocks + b)) * kQ8Bytes;
      uint16_t d = 0;
      std::memcpy(&d, block, 2);
      w.scales[static_cast<size_t>((g * blocks + b) * kTileRows + n)] = fp16_to_fp32(d);
      int8_t* tile = w.codes.data() + (g * blocks + b) * kBlockTileRows * kTileBytes;
      for (int k = 0; k < kBlockTileRows; ++k) {
        std::memcpy(tile + k * kTileBytes + 4 * n, block + 2 + 4 * k, 4);
      }
    }
  }
  return w;
}

template <class Tiles>
void tile_gemm_q8(Tiles& tiles, const TilePackedQ8& w, const int8_t* xq, const float* xd, int64_t m_count, float* y,
                  int64_t ldy) {
  enum : int { kC = 0, kA = 1, kB = 2 };
  TileConfig config{};
  config[kC] = {kTileRows, kTileBytes};       // 16 tokens x 16 outputs, int32
  config[kA] = {kTileRows, kBlock};           // 16 tokens x one block of 32 codes
  config[kB] = {kBlockTileRows, kTileBytes};  // the block's codes of 16 outputs
  tiles.load_config(config);
  const int64_t blocks = w.blocks();
  alignas(64) int8_t padded[kTileRows * kBlock];  // a last tile's tokens, and zero rows after them
  alignas(64) int32_t dots[kTileRows * kTileRows];
  for (int64_t m0 = 0; m0 < m_count; m0 += kTileRows) {
    const int tokens = static_cast<int>(std::min<int64_t>(kTileRows, m_count - m0));
    for (int64_t g = 0; g < w.groups(); ++g) {
      float acc[kTileRows][kTileRows] = {};
      for (int64_t b = 0; b < blocks; ++b) {
        const int8_t* a = xq + m0 * w.cols + b * kBlock;
        int64_t a_stride = w.cols;
        if (tokens < kTileRows) {
          std::fill(std::begin(padded), std::end(padded), int8_t{0});
          for (int r = 0; r < tokens; ++r) std::memcpy(padded + r * kBlock, a + r * w.cols, kBlock);
          a = padded;
          a_stride = kBlock;
        }
        tiles.zero(kC);
        tiles.load(kA, a, a_stride);
        tiles.load(kB, w.codes.data() + (g * blocks + b) * kBlockTileRows * kTileBytes, kTileBytes);
        tiles.dpbssd(kC, kA, kB);
        tiles.store(kC, dots, kTileBytes);
        const float* wd = w.scales.data() + (g * blocks + b) * kTileRows;
        for (int r = 0; r < tokens; ++r) {
          const float x_scale = xd[(m0 + r) * blocks + b];
          for (int n = 0; n < kTileRows; ++n) acc[r][n] += wd[n] * (x_scale * static_cast<float>(dots[r * kTileRows + n]));
        }
      }
      const int outputs = static_cast<int>(std::min<int64_t>(kTileRows, w.rows - g * kTileRows));
      for (int r = 0; r < tokens; ++r) std::copy_n(acc[r], outputs, y + (m0 + r) * ldy + g * kTileRows);
    }
  }
  tiles.release();
}

template void tile_gemm_q8<EmulatedTiles>(EmulatedTiles&, const TilePackedQ8&, const int8_t*, const float*, int64_t,
                                          float*, int64_t);

}  // namespace ringlm::cpu
