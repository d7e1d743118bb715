#include "backends/cpu/amx.h"

#include <algorithm>
#include <atomic>
#include <optional>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "quant/formats.h"

#define RINGLM_TILE_NAMESPACE emulated
#include "backends/cpu/tile_gemm-inl.h"  // IWYU pragma: keep
#undef RINGLM_TILE_NAMESPACE

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
  const std::string wanted = env != nullptr ? env : "";
  if (wanted == "off") return AmxState::kOffByUser;
  if (wanted == "emulate") return AmxState::kEmulated;
  if (!wanted.empty() && wanted != "on") {
    throw std::runtime_error("RINGLM_AMX=" + wanted + ": expected on (the default: the tiles where the CPU has them), off or emulate");
  }
  if (!cpu_has_amx_int8()) return AmxState::kNotInCpu;
  if (!kernel_grants_tiles()) return AmxState::kNotOfferedByKernel;
  return amx_agrees_with_emulation() ? AmxState::kOn : AmxState::kSelfCheckFailed;
}

constexpr int kNoOverride = -1;
std::atomic<int> state_for_test{kNoOverride};
std::atomic<int64_t> emulated_product_calls{0};

}  // namespace

AmxState amx_state() {
  const int forced = state_for_test.load(std::memory_order_relaxed);
  if (forced != kNoOverride) return static_cast<AmxState>(forced);
  static const AmxState state = decide_amx_state();
  return state;
}

void set_amx_state_for_test(std::optional<AmxState> state) {
  state_for_test.store(state ? static_cast<int>(*state) : kNoOverride, std::memory_order_relaxed);
}

TilePath tile_path_for(TensorType type) {
  if (!tiles_multiply(type)) return TilePath::kNone;
  switch (amx_state()) {
    case AmxState::kOn: return TilePath::kCpu;
    case AmxState::kEmulated: return TilePath::kEmulated;
    default: return TilePath::kNone;
  }
}

std::string amx_state_words(AmxState state) {
  switch (state) {
    case AmxState::kOn:
      return "on";
    case AmxState::kSelfCheckFailed:
      return "off (the tiles' results differed from the emulation's)";
    case AmxState::kEmulated:
      return "emulated (RINGLM_AMX=emulate)";
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

// --- The packed products on the tiles -----------------------------------------------------

bool tiles_multiply(TensorType type) {
  const std::optional<PackedFormat> f = packed_format(type);
  return f.has_value() && !f->floats();
}

TileConfig tile_product_config() {
  TileConfig config{};
  for (int c = emulated::kC0; c < emulated::kC0 + emulated::kPassTiles; ++c) config[static_cast<size_t>(c)] = {kTileRows, kTileBytes};
  config[emulated::kA32] = {kTileRows, 32};
  config[emulated::kB32] = {8, kTileBytes};
  config[emulated::kA16] = {kTileRows, 16};
  config[emulated::kB16] = {4, kTileBytes};
  return config;
}

namespace {

// What the tiles' sums of a block format add to its integer dots: the block's integer sum, offset
// times (unsigned codes with an offset), or s = dx * sum, times the mins.
bool reads_sums(const PackedFormat& f) { return !f.min && !emulated::signed_values(f) && f.offset != 0; }
bool reads_s(const PackedFormat& f) { return f.min; }

}  // namespace

void TileTokenTerms::reset(int64_t tokens, int64_t blocks) {
  tokens_ = tokens;
  blocks_ = blocks;
  dx_.clear();
  sum_.clear();
  s_.clear();
}

void TileTokenTerms::add_format(const PackedFormat& f) {
  if (f.super()) return;
  const auto size = static_cast<size_t>(tokens_ * blocks_);
  dx_.resize(size);
  if (reads_sums(f)) sum_.resize(size);
  if (reads_s(f)) s_.resize(size);
}

bool TileTokenTerms::has(const PackedFormat& f) const {
  return f.super() || (!empty() && (!reads_sums(f) || !sum_.empty()) && (!reads_s(f) || !s_.empty()));
}

void TileTokenTerms::fill(const QuantizedActs& x, int64_t m) {
  if (empty()) return;
  for (int64_t ab = 0; ab < blocks_; ++ab) {
    const int64_t from = m * blocks_ + ab;
    const auto to = static_cast<size_t>(ab * tokens_ + m);
    dx_[to] = x.d[from];
    if (!sum_.empty()) sum_[to] = x.sum[from];
    if (!s_.empty()) s_[to] = x.s[from];
  }
}

void TileTokenTerms::make(const PackedFormat& f, const QuantizedActs& x, int64_t tokens) {
  reset(tokens, x.blocks());
  add_format(f);
  for (int64_t m = 0; m < tokens; ++m) fill(x, m);
}

void tile_gemm_packed(EmulatedTiles& tiles, const PackedWeight& w, int64_t n_begin, int64_t n_end,
                      const PackedInput& x, const TileTokenTerms& terms, int64_t n_tokens, float* y, int64_t ldy) {
  if (!tiles_multiply(w.type)) {
    throw std::invalid_argument("tile_gemm_packed: tensor type " + std::to_string(static_cast<uint32_t>(w.type)) +
                                " has no int8 path");
  }
  emulated::tile_gemm(tiles, w, n_begin, n_end, x, terms, n_tokens, y, ldy);
}

void tile_gemm_packed(EmulatedTiles& tiles, const PackedWeight& w, int64_t n_begin, int64_t n_end,
                      const PackedInput& x, int64_t n_tokens, float* y, int64_t ldy) {
  TileTokenTerms terms;
  if (tiles_multiply(w.type)) terms.make(*packed_format(w.type), x.block, n_tokens);
  tile_gemm_packed(tiles, w, n_begin, n_end, x, terms, n_tokens, y, ldy);
}

void gemm_on_tiles(TilePath path, const PackedWeight& w, int64_t n_begin, int64_t n_end, const PackedInput& x,
                   const TileTokenTerms& terms, int64_t n_tokens, float* y, int64_t ldy) {
  if (path == TilePath::kCpu) return amx_gemm_packed(w, n_begin, n_end, x, terms, n_tokens, y, ldy);
  if (path != TilePath::kEmulated) throw std::logic_error("gemm_on_tiles: a weight without a tile path");
  // Counted here only: no shared counter for the threads of the real path to contend for.
  emulated_product_calls.fetch_add(1, std::memory_order_relaxed);
  thread_local EmulatedTiles tiles;
  if (!tiles.configured()) tiles.load_config(tile_product_config());
  tile_gemm_packed(tiles, w, n_begin, n_end, x, terms, n_tokens, y, ldy);
}

int64_t emulated_tile_products() { return emulated_product_calls.load(std::memory_order_relaxed); }

}  // namespace ringlm::cpu
