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
constexpr int64_t kBlock = 32;             // the block of every format packed here
constexpr int kBlockTileRows = kBlock / 4;  // a block's B tile: 8 rows of 4-byte groups

float fp16_at(const uint8_t* p) {
  uint16_t bits = 0;
  std::memcpy(&bits, p, 2);
  return fp16_to_fp32(bits);
}

// One block of a GGML format: its 32 codes as int8, its scale and its min.
struct DecodedBlock {
  int8_t codes[kBlock];
  float scale = 0, min = 0;
};

// Bytes of a block, and its decoding (GGML's layouts: the low nibbles are weights 0..15, the
// high ones 16..31; Q5's fifth bits in a 32-bit field, bit j for weight j).
size_t block_bytes(TensorType type) {
  switch (type) {
    case TensorType::Q8_0: return 34;
    case TensorType::Q4_0: return 18;
    case TensorType::IQ4_NL: return 18;
    case TensorType::Q4_1: return 20;
    case TensorType::Q5_0: return 22;
    case TensorType::Q5_1: return 24;
    default: return 0;
  }
}

DecodedBlock decode_block(TensorType type, const uint8_t* p) {
  DecodedBlock b;
  b.scale = fp16_at(p);
  const bool has_min = type == TensorType::Q4_1 || type == TensorType::Q5_1;
  if (has_min) b.min = fp16_at(p + 2);
  const uint8_t* after_scales = p + (has_min ? 4 : 2);
  if (type == TensorType::Q8_0) {
    std::memcpy(b.codes, after_scales, kBlock);
    return b;
  }
  const bool five_bits = type == TensorType::Q5_0 || type == TensorType::Q5_1;
  uint32_t high_bits = 0;
  if (five_bits) std::memcpy(&high_bits, after_scales, 4);
  const uint8_t* nibbles = after_scales + (five_bits ? 4 : 0);
  for (int j = 0; j < kBlock; ++j) {
    int code = j < 16 ? nibbles[j] & 0x0F : nibbles[j - 16] >> 4;
    if (five_bits) code |= static_cast<int>((high_bits >> j) & 1u) << 4;
    switch (type) {
      case TensorType::Q4_0: code -= 8; break;
      case TensorType::Q5_0: code -= 16; break;
      case TensorType::IQ4_NL: code = kIq4nlValues[code]; break;
      default: break;  // Q4_1, Q5_1: unsigned codes with a min
    }
    b.codes[j] = static_cast<int8_t>(code);
  }
  return b;
}

}  // namespace

TilePackedBlocks pack_blocks_for_tiles(TensorType type, const uint8_t* data, int64_t rows, int64_t cols) {
  const size_t bytes = block_bytes(type);
  if (bytes == 0) throw std::invalid_argument("no tile packing for tensor type " + std::to_string(static_cast<uint32_t>(type)));
  if (cols % kBlock != 0) throw std::invalid_argument("rows of " + std::to_string(cols) + " values (a multiple of 32)");
  TilePackedBlocks w;
  w.rows = rows;
  w.cols = cols;
  w.has_min = type == TensorType::Q4_1 || type == TensorType::Q5_1;
  const int64_t groups = w.groups(), blocks = w.blocks();
  w.codes.assign(static_cast<size_t>(groups * blocks * kBlockTileRows * kTileBytes), 0);
  w.scales.assign(static_cast<size_t>(groups * blocks * kTileRows), 0.0f);
  if (w.has_min) w.mins.assign(w.scales.size(), 0.0f);
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t g = row / kTileRows, n = row % kTileRows;
    for (int64_t b = 0; b < blocks; ++b) {
      const DecodedBlock block = decode_block(type, data + static_cast<size_t>(row * blocks + b) * bytes);
      const size_t at = static_cast<size_t>((g * blocks + b) * kTileRows + n);
      w.scales[at] = block.scale;
      if (w.has_min) w.mins[at] = block.min;
      int8_t* tile = w.codes.data() + (g * blocks + b) * kBlockTileRows * kTileBytes;
      for (int k = 0; k < kBlockTileRows; ++k) std::memcpy(tile + k * kTileBytes + 4 * n, block.codes + 4 * k, 4);
    }
  }
  return w;
}

template <class Tiles>
void tile_gemm_blocks(Tiles& tiles, const TilePackedBlocks& w, const int8_t* xq, const float* xd, const float* xs,
                      int64_t m_count, float* y, int64_t ldy) {
  if (w.has_min && xs == nullptr) throw std::invalid_argument("tile_gemm_blocks: weights with mins need the activations' sums");
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
        const size_t at = static_cast<size_t>((g * blocks + b) * kTileRows);
        const float* wd = w.scales.data() + at;
        for (int r = 0; r < tokens; ++r) {
          const float x_scale = xd[(m0 + r) * blocks + b];
          for (int n = 0; n < kTileRows; ++n) acc[r][n] += wd[n] * (x_scale * static_cast<float>(dots[r * kTileRows + n]));
          if (!w.has_min) continue;
          const float x_sum = xs[(m0 + r) * blocks + b];
          for (int n = 0; n < kTileRows; ++n) acc[r][n] += w.mins[at + static_cast<size_t>(n)] * x_sum;
        }
      }
      const int outputs = static_cast<int>(std::min<int64_t>(kTileRows, w.rows - g * kTileRows));
      for (int r = 0; r < tokens; ++r) std::copy_n(acc[r], outputs, y + (m0 + r) * ldy + g * kTileRows);
    }
  }
  tiles.release();
}

template void tile_gemm_blocks<EmulatedTiles>(EmulatedTiles&, const TilePackedBlocks&, const int8_t*, const float*,
                                              const float*, int64_t, float*, int64_t);

}  // namespace ringlm::cpu
