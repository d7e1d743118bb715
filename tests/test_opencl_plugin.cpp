// The OpenCL plugin (plugins/opencl, libringlm-opencl.so) on device 0 against the CPU code it
// stands in for: matmul against the CPU backend (fp32 compute) on Q4_0 / Q4_1 / Q8_0 / F16 / F32
// weights for every M from 1 to 16 the flat GEMM takes; attention against
// cpu::attention_causal with fp16 and fp32 caches, MHA, GQA and MQA, decode and prefill chunks,
// over ring caches with empty slots (holding NaN on the device, which must not leak in) and
// positions out of order; shift-RoPE against the formula computed here, both pair layouts, with
// every byte it must not touch checked to be unchanged. Also: supports(), the argument checks
// (an error status and a reason, never a crash), device_info, and the disk cache of the
// compiled program.
//
// The plugin is loaded with dlopen + dlsym, as ringlm's loader does. Compiling the kernels is the
// slow part (PoCL runs LLVM), so one context is opened for the whole executable (the test
// environment below), and that opening is also what the disk-cache test inspects.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "backends/cpu/attention.h"
#include "backends/cpu/cpu_backend.h"
#include "backends/plugin_api.h"
#include "quant/formats.h"
#include "quant/quantize.h"

namespace ringlm {

// Test names and failure messages show the weight format by name.
void PrintTo(TensorType type, std::ostream* os) { *os << type_traits(static_cast<uint32_t>(type))->name; }

namespace {

namespace fs = std::filesystem;

// --- The plugin, loaded and opened once -------------------------------------------------------

struct Plugin {
  void* library = nullptr;
  const ringlm_plugin* api = nullptr;
  ringlm_context* ctx = nullptr;
  std::string unavailable;  // why there is no device to test on (no plugin built, no OpenCL device)
  std::string failure;      // why they fail (the plugin is there but does not load or open)
  // What the environment saw of the disk cache while opening ctx.
  fs::path cache_dir;
  std::vector<std::string> files_after_first_open;
  std::string first_open_log;             // the verbose log of the first open (from source)
  std::string damaged_open_log;           // the verbose log of an open over a damaged binary
  uintmax_t damaged_file_size_after = 0;  // the size of that file afterwards
  std::string reopen_log;                 // the verbose log of the last open (from the cache)
};

Plugin& plugin() {
  static Plugin p;
  return p;
}

std::vector<std::string> files_in(const fs::path& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// Runs f with stderr going to a file; returns what was written there.
template <typename F>
std::string capture_stderr(F f) {
  std::fflush(stderr);
  FILE* tmp = std::tmpfile();
  const int saved = dup(fileno(stderr));
  dup2(fileno(tmp), fileno(stderr));
  f();
  std::fflush(stderr);
  dup2(saved, fileno(stderr));
  close(saved);
  std::string text;
  std::rewind(tmp);
  for (int c; (c = std::fgetc(tmp)) != EOF;) text += static_cast<char>(c);
  std::fclose(tmp);
  return text;
}

class PluginEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    Plugin& p = plugin();
#ifdef RINGLM_OPENCL_PLUGIN
    p.library = dlopen(RINGLM_OPENCL_PLUGIN, RTLD_NOW | RTLD_LOCAL);
    if (p.library == nullptr) {
      p.failure = std::string("dlopen: ") + dlerror();
      return;
    }
    const auto entry = reinterpret_cast<ringlm_plugin_entry_fn>(dlsym(p.library, RINGLM_PLUGIN_ENTRY));
    if (entry == nullptr) {
      p.failure = "no " RINGLM_PLUGIN_ENTRY " in " RINGLM_OPENCL_PLUGIN;
      return;
    }
    p.api = entry();
    const int32_t n = p.api->device_count();
    if (n <= 0) {
      p.unavailable = "no OpenCL device: " + std::string(p.api->last_error(nullptr));
      return;
    }
    // Open with a fresh cache directory (builds from source, stores the binary) and close. Then a
    // damaged copy of that binary in a second directory (the driver must reject it, the source
    // build must replace it), and finally the first directory again: the context every test
    // uses comes from the cached binary.
    p.cache_dir = fs::temp_directory_path() / ("ringlm_opencl_test_" + std::to_string(getpid()));
    fs::remove_all(p.cache_dir);
    const std::string good_dir = (p.cache_dir / "good").string(), bad_dir = (p.cache_dir / "damaged").string();
    ringlm_open_options options{
        .struct_size = sizeof(ringlm_open_options), .cache_dir = good_dir.c_str(), .verbose = 1};
    ringlm_context* first = nullptr;
    p.first_open_log = capture_stderr([&] { first = p.api->open(0, &options); });
    if (first == nullptr) {
      p.failure = "open failed: " + std::string(p.api->last_error(nullptr));
      return;
    }
    p.api->close(first);
    p.files_after_first_open = files_in(p.cache_dir / "good" / "opencl");

    if (p.files_after_first_open.size() == 1) {
      const std::string& name = p.files_after_first_open[0];
      fs::create_directories(p.cache_dir / "damaged" / "opencl");
      std::FILE* f = std::fopen((p.cache_dir / "damaged" / "opencl" / name).c_str(), "wb");
      std::fputs("not a program binary", f);
      std::fclose(f);
      ringlm_open_options damaged{
          .struct_size = sizeof(ringlm_open_options), .cache_dir = bad_dir.c_str(), .verbose = 1};
      ringlm_context* rebuilt = nullptr;
      p.damaged_open_log = capture_stderr([&] { rebuilt = p.api->open(0, &damaged); });
      if (rebuilt == nullptr) {
        p.failure = "open with a damaged cache failed: " + std::string(p.api->last_error(nullptr));
        return;
      }
      p.api->close(rebuilt);
      p.damaged_file_size_after = fs::file_size(p.cache_dir / "damaged" / "opencl" / name);
    }

    p.reopen_log = capture_stderr([&] { p.ctx = p.api->open(0, &options); });
    if (p.ctx == nullptr) p.failure = "open from the cache failed: " + std::string(p.api->last_error(nullptr));
#else
    p.unavailable = "the OpenCL plugin is not built (OpenCL not found)";
#endif
  }

  void TearDown() override {
    Plugin& p = plugin();
    if (p.ctx != nullptr) p.api->close(p.ctx);
    p.ctx = nullptr;
    if (!p.cache_dir.empty()) fs::remove_all(p.cache_dir);
    // The library stays loaded: a driver (PoCL) may still run exit-time code of its own.
  }
};

[[maybe_unused]] const auto* const kEnvironment = ::testing::AddGlobalTestEnvironment(new PluginEnvironment);

// Fails a test where the plugin is missing, broken or finds no device: scripts/setup.sh installs
// PoCL, so a machine that ran it always has an OpenCL device to test on.
#define REQUIRE_PLUGIN()                                               \
  do {                                                                 \
    if (!plugin().failure.empty()) FAIL() << plugin().failure;         \
    if (plugin().ctx == nullptr) FAIL() << plugin().unavailable;       \
  } while (0)

const ringlm_plugin& api() { return *plugin().api; }
ringlm_context* ctx() { return plugin().ctx; }
std::string last_error() { return api().last_error(ctx()); }

// A device buffer freed at scope exit.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : buffer_(api().alloc(ctx(), bytes)) {
    EXPECT_NE(buffer_, nullptr) << last_error();
  }
  template <typename T>
  explicit DeviceBuffer(const std::vector<T>& data, size_t offset = 0)
      : DeviceBuffer(offset + data.size() * sizeof(T)) {
    upload(data, offset);
  }
  ~DeviceBuffer() { api().free(ctx(), buffer_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  ringlm_buffer* get() const { return buffer_; }
  template <typename T>
  void upload(const std::vector<T>& data, size_t offset = 0) {
    ASSERT_EQ(api().upload(ctx(), buffer_, offset, data.data(), data.size() * sizeof(T)), RINGLM_OK) << last_error();
  }
  template <typename T>
  std::vector<T> download(size_t count, size_t offset = 0) const {
    std::vector<T> out(count);
    EXPECT_EQ(api().download(ctx(), buffer_, offset, out.data(), count * sizeof(T)), RINGLM_OK) << last_error();
    return out;
  }

 private:
  ringlm_buffer* buffer_;
};

std::vector<float> random_floats(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// --- Table and devices ------------------------------------------------------------------------

TEST(OpenclPlugin, TableAndDeviceInfo) {
  REQUIRE_PLUGIN();
  EXPECT_EQ(api().abi_version, RINGLM_PLUGIN_ABI_VERSION);
  EXPECT_EQ(api().struct_size, sizeof(ringlm_plugin));
  EXPECT_STREQ(api().name, "opencl");

  const int32_t n = api().device_count();
  ASSERT_GE(n, 1);
  ringlm_device_info info;
  std::memset(&info, 0x55, sizeof(info));
  ASSERT_EQ(api().device_info(0, &info), RINGLM_OK) << last_error();
  EXPECT_GT(std::strlen(info.name), 0u);
  EXPECT_LT(std::strlen(info.name), sizeof(info.name));
  EXPECT_NE(std::string(info.version).find("OpenCL"), std::string::npos) << info.version;
  EXPECT_GT(info.compute_units, 0u);
  EXPECT_GT(info.memory_bytes, 0u);
  EXPECT_LE(info.type, static_cast<uint32_t>(RINGLM_DEVICE_OTHER));
  std::printf("device 0: %s | %s | type %u | %u compute units | %llu MiB\n", info.name, info.version, info.type,
              info.compute_units, static_cast<unsigned long long>(info.memory_bytes >> 20));

  EXPECT_NE(api().device_info(n, &info), RINGLM_OK);
  EXPECT_NE(std::string(api().last_error(nullptr)), "");
  EXPECT_NE(api().device_info(0, nullptr), RINGLM_OK);
  EXPECT_EQ(api().open(n, nullptr), nullptr);
  EXPECT_NE(std::string(api().last_error(nullptr)).find("no OpenCL device"), std::string::npos)
      << api().last_error(nullptr);
}

// --- The disk cache ---------------------------------------------------------------------------

TEST(OpenclPlugin, DiskCacheStoresTheProgramAndLoadsItBack) {
  REQUIRE_PLUGIN();
  const Plugin& p = plugin();
  // One binary after the first open, and no temporary file left behind.
  ASSERT_EQ(p.files_after_first_open.size(), 1u) << ::testing::PrintToString(p.files_after_first_open);
  const std::string& file = p.files_after_first_open[0];
  EXPECT_EQ(file.size(), 16u + 4u) << file;
  EXPECT_TRUE(file.ends_with(".bin")) << file;
  const uintmax_t size = fs::file_size(p.cache_dir / "good" / "opencl" / file);
  EXPECT_GT(size, 0u);
  EXPECT_NE(p.first_open_log.find("built from source"), std::string::npos) << p.first_open_log;
  EXPECT_NE(p.first_open_log.find("program cached in"), std::string::npos) << p.first_open_log;
  // The last open took the binary (and the context works: every other test uses it).
  EXPECT_NE(p.reopen_log.find("program loaded from cache"), std::string::npos) << p.reopen_log;
  EXPECT_EQ(p.reopen_log.find("built from source"), std::string::npos) << p.reopen_log;
}

TEST(OpenclPlugin, DiskCacheFallsBackToSourceOnADamagedBinary) {
  REQUIRE_PLUGIN();
  const Plugin& p = plugin();
  ASSERT_EQ(p.files_after_first_open.size(), 1u);
  EXPECT_NE(p.damaged_open_log.find("rejected"), std::string::npos) << p.damaged_open_log;
  EXPECT_NE(p.damaged_open_log.find("built from source"), std::string::npos) << p.damaged_open_log;
  // The damaged file (20 bytes) was replaced by the binary of the source build.
  EXPECT_GT(p.damaged_file_size_after, 100u);
  EXPECT_EQ(files_in(p.cache_dir / "damaged" / "opencl").size(), 1u);
}

TEST(OpenclPlugin, UnwritableCacheDirIsNoError) {
  REQUIRE_PLUGIN();
  // A second context on the same device shares the program (no rebuild), whatever its cache_dir.
  const std::string dir = "/proc/ringlm-no-such-dir";
  ringlm_open_options options{.struct_size = sizeof(ringlm_open_options), .cache_dir = dir.c_str(), .verbose = 0};
  ringlm_context* other = api().open(0, &options);
  ASSERT_NE(other, nullptr) << api().last_error(nullptr);
  api().close(other);
}

// --- Matmul -----------------------------------------------------------------------------------

struct Weights {
  std::vector<uint8_t> bytes;  // n rows as stored
  std::vector<float> dequant;  // the same weights as fp32, [n][k]
};

Weights make_weights(TensorType type, int64_t n, int64_t k, std::mt19937& rng) {
  const std::vector<float> w = random_floats(static_cast<size_t>(n * k), rng);
  const size_t row = row_bytes(type, k);
  Weights out{std::vector<uint8_t>(row * static_cast<size_t>(n)), std::vector<float>(w.size())};
  for (int64_t r = 0; r < n; ++r) {
    quantize_row(type, &w[static_cast<size_t>(r * k)], &out.bytes[row * static_cast<size_t>(r)], k);
    dequantize_row(type, &out.bytes[row * static_cast<size_t>(r)], &out.dequant[static_cast<size_t>(r * k)], k);
  }
  return out;
}

class Matmul : public ::testing::TestWithParam<TensorType> {};

TEST_P(Matmul, MatchesCpuBackendForEveryM) {
  REQUIRE_PLUGIN();
  const TensorType type = GetParam();
  std::mt19937 rng(static_cast<unsigned>(type) + 7);
  auto cpu = make_cpu_backend(1, ComputeType::kFp32);
  // n not a multiple of any group of rows; k from one block to several chunks; 576 = SmolLM2's width.
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 32}, {101, 576}, {130, 256}, {300, 2048}};
  double worst = 0.0;  // max |gpu - cpu| / (1 + sum |x| |w|)
  for (const auto& [n, k] : shapes) {
    const Weights w = make_weights(type, n, k, rng);
    auto prepared = cpu->prepare({"w", type, n, k, w.bytes.data()});
    DeviceBuffer wd(w.bytes);
    for (const int64_t m : {1, 2, 3, 7, 8, 9, 15, 16}) {
      SCOPED_TRACE("n=" + std::to_string(n) + " k=" + std::to_string(k) + " m=" + std::to_string(m));
      const std::vector<float> x = random_floats(static_cast<size_t>(m * k), rng, 2.0f);
      std::vector<float> expected(static_cast<size_t>(m * n));
      cpu->matmul(*prepared, x.data(), m, expected.data());

      // x and y away from the start of their buffers, as the host's activation arenas have them.
      const size_t x_offset = 4 * sizeof(float) * static_cast<size_t>(k), y_offset = 64;
      DeviceBuffer xd(x, x_offset);
      DeviceBuffer yd(y_offset + expected.size() * sizeof(float) + 16);
      const ringlm_matmul_args args{.weight = wd.get(),
                                    .weight_format = static_cast<uint32_t>(type),
                                    .n = n,
                                    .k = k,
                                    .x = xd.get(),
                                    .x_offset = x_offset,
                                    .y = yd.get(),
                                    .y_offset = y_offset,
                                    .m = m};
      ASSERT_EQ(api().matmul(ctx(), &args), RINGLM_OK) << last_error();
      const std::vector<float> y = yd.download<float>(expected.size(), y_offset);
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) {
          double magnitude = 0.0;
          for (int64_t c = 0; c < k; ++c) {
            magnitude += std::fabs(x[static_cast<size_t>(i * k + c)] * w.dequant[static_cast<size_t>(j * k + c)]);
          }
          const size_t at = static_cast<size_t>(i * n + j);
          const double err = std::fabs(static_cast<double>(y[at]) - expected[at]) / (1.0 + magnitude);
          worst = std::max(worst, err);
          ASSERT_LE(err, 1e-4) << "y[" << i << "][" << j << "] = " << y[at] << ", cpu " << expected[at];
        }
      }
    }
  }
  std::printf("matmul %s: max |opencl - cpu| / (1 + sum|x||w|) = %.3g\n",
              std::string(type_traits(static_cast<uint32_t>(type))->name).c_str(), worst);
}

// A row's result does not depend on the rows it is multiplied with: batched decode then gives
// every sequence what it gets alone, so greedy outputs do not depend on --parallel.
TEST(OpenclPlugin, MatmulRowIsBitIdenticalWhateverM) {
  REQUIRE_PLUGIN();
  std::mt19937 rng(99);
  const int64_t n = 130, k = 2048;  // several x chunks: the chunking differs with m
  const Weights w = make_weights(TensorType::Q4_1, n, k, rng);
  DeviceBuffer wd(w.bytes);
  const std::vector<float> x = random_floats(static_cast<size_t>(16 * k), rng, 2.0f);
  DeviceBuffer xd(x);
  DeviceBuffer yd(static_cast<size_t>(16 * n) * sizeof(float));
  const auto multiply = [&](int64_t first_row, int64_t m) {
    const ringlm_matmul_args args{.weight = wd.get(),
                                  .weight_format = static_cast<uint32_t>(TensorType::Q4_1),
                                  .n = n,
                                  .k = k,
                                  .x = xd.get(),
                                  .x_offset = static_cast<size_t>(first_row * k) * sizeof(float),
                                  .y = yd.get(),
                                  .y_offset = 0,
                                  .m = m};
    EXPECT_EQ(api().matmul(ctx(), &args), RINGLM_OK) << last_error();
    return yd.download<float>(static_cast<size_t>(m * n));
  };
  const std::vector<float> all = multiply(0, 16);
  for (const int64_t row : {0, 5, 15}) {
    const std::vector<float> alone = multiply(row, 1);
    EXPECT_EQ(std::memcmp(alone.data(), &all[static_cast<size_t>(row * n)], static_cast<size_t>(n) * sizeof(float)), 0)
        << "row " << row;
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, Matmul,
                         ::testing::Values(TensorType::Q4_0, TensorType::Q4_1, TensorType::Q8_0, TensorType::F16,
                                           TensorType::F32),
                         [](const auto& info) {
                           return std::string(type_traits(static_cast<uint32_t>(info.param))->name);
                         });

// --- Attention --------------------------------------------------------------------------------

struct AttentionCase {
  int n_head, n_head_kv, head_dim;
  int n_keys;    // tokens in the cache, the chunk's own included
  int n_tokens;  // queries: the last n_tokens of the n_keys
  int n_slots;   // >= n_keys; the others are empty
  bool f16;
  bool shuffled;  // tokens over the slots in random order (a ring that wrapped), else in order
};

std::string case_name(const ::testing::TestParamInfo<AttentionCase>& info) {
  const AttentionCase& c = info.param;
  return std::to_string(c.n_head) + "x" + std::to_string(c.n_head_kv) + "_d" + std::to_string(c.head_dim) + "_keys" +
         std::to_string(c.n_keys) + "_tok" + std::to_string(c.n_tokens) + "_slots" + std::to_string(c.n_slots) +
         (c.f16 ? "_f16" : "_f32") + (c.shuffled ? "_ring" : "_inorder");
}

class Attention : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(Attention, MatchesCpuAttention) {
  REQUIRE_PLUGIN();
  const AttentionCase c = GetParam();
  std::mt19937 rng(static_cast<unsigned>(c.n_keys * 131 + c.n_tokens * 7 + c.head_dim + c.f16));
  const int hd = c.head_dim, kv_width = c.n_head_kv * hd, q_width = c.n_head * hd;
  const int row_stride = kv_width + 8;  // rows padded, as a cache with a few spare elements per slot could be
  const int64_t q_pos0 = c.n_keys - c.n_tokens;

  // Token t in slot slot_of[t]; the other slots are empty (-1).
  std::vector<int> slot_of(static_cast<size_t>(c.n_slots));
  std::iota(slot_of.begin(), slot_of.end(), 0);
  if (c.shuffled) std::shuffle(slot_of.begin(), slot_of.end(), rng);
  std::vector<int32_t> positions(static_cast<size_t>(c.n_slots), -1);
  for (int t = 0; t < c.n_keys; ++t) positions[static_cast<size_t>(slot_of[static_cast<size_t>(t)])] = t;

  // Keys and values; empty slots and the padding hold NaN on the device (masked slots must be
  // skipped, not multiplied by 0) and large finite garbage for the CPU.
  const size_t cache_elems = static_cast<size_t>(c.n_slots) * row_stride;
  std::vector<float> k = random_floats(cache_elems, rng), v = random_floats(cache_elems, rng);
  std::vector<float> k_dev = k, v_dev = v;
  for (size_t j = 0; j < static_cast<size_t>(c.n_slots); ++j) {
    for (int e = 0; e < row_stride; ++e) {
      if (positions[j] >= 0 && e < kv_width) continue;
      const size_t at = j * row_stride + static_cast<size_t>(e);
      k[at] = v[at] = 1e4f;
      k_dev[at] = v_dev[at] = std::numeric_limits<float>::quiet_NaN();
    }
  }
  std::vector<uint16_t> k16(cache_elems), v16(cache_elems), k16_dev(cache_elems), v16_dev(cache_elems);
  for (size_t i = 0; i < cache_elems; ++i) {
    k16[i] = fp32_to_fp16(k[i]);
    v16[i] = fp32_to_fp16(v[i]);
    k16_dev[i] = fp32_to_fp16(k_dev[i]);
    v16_dev[i] = fp32_to_fp16(v_dev[i]);
  }
  const std::vector<float> q = random_floats(static_cast<size_t>(c.n_tokens) * q_width, rng, 1.5f);

  // The CPU's answer.
  std::vector<int64_t> positions64(positions.begin(), positions.end());
  cpu::KvLayer kv;
  kv.keys = c.f16 ? static_cast<const void*>(k16.data()) : k.data();
  kv.values = c.f16 ? static_cast<const void*>(v16.data()) : v.data();
  kv.row_stride = row_stride;
  kv.f16 = c.f16;
  kv.positions = positions64.data();
  kv.n_slots = c.n_slots;
  cpu::AttentionScratch scratch;
  std::vector<float> expected(q.size());
  cpu::attention_causal({c.n_head, c.n_head_kv, hd}, q.data(), kv, q_pos0, c.n_tokens, expected.data(), scratch, 1);

  // The device's, with every buffer at an offset.
  const size_t q_offset = 256, kv_offset = 512;
  DeviceBuffer qd(q, q_offset);
  DeviceBuffer kd = c.f16 ? DeviceBuffer(k16_dev, kv_offset) : DeviceBuffer(k_dev, kv_offset);
  DeviceBuffer vd = c.f16 ? DeviceBuffer(v16_dev, kv_offset) : DeviceBuffer(v_dev, kv_offset);
  DeviceBuffer pd(positions);
  DeviceBuffer od(q_offset + q.size() * sizeof(float));
  const ringlm_attention_args args{.q = qd.get(),
                                   .q_offset = q_offset,
                                   .out = od.get(),
                                   .out_offset = q_offset,
                                   .keys = kd.get(),
                                   .keys_offset = kv_offset,
                                   .values = vd.get(),
                                   .values_offset = kv_offset,
                                   .kv_format = c.f16 ? RINGLM_FORMAT_F16 : RINGLM_FORMAT_F32,
                                   .row_stride = row_stride,
                                   .positions = pd.get(),
                                   .n_slots = c.n_slots,
                                   .n_tokens = c.n_tokens,
                                   .q_pos0 = q_pos0,
                                   .n_head = c.n_head,
                                   .n_head_kv = c.n_head_kv,
                                   .head_dim = hd,
                                   .scale = 1.0f / std::sqrt(static_cast<float>(hd))};
  ASSERT_EQ(api().attention(ctx(), &args), RINGLM_OK) << last_error();
  const std::vector<float> out = od.download<float>(q.size(), q_offset);

  double worst = 0.0;
  for (size_t i = 0; i < out.size(); ++i) {
    const double err = std::fabs(static_cast<double>(out[i]) - expected[i]);
    worst = std::max(worst, err);
    ASSERT_LE(err, 1e-4) << "out[" << i << "] = " << out[i] << ", cpu " << expected[i];
  }
  std::printf("attention %s: max |opencl - cpu| = %.3g\n", case_name({c, 0}).c_str(), worst);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, Attention,
    ::testing::Values(
        // Decode over a long ring (GQA 4:1, fp16 and fp32), MHA, MQA.
        AttentionCase{8, 2, 128, 1500, 1, 2000, true, true}, AttentionCase{8, 2, 128, 1500, 1, 2000, false, true},
        AttentionCase{4, 4, 64, 700, 1, 1000, true, true}, AttentionCase{6, 1, 64, 300, 1, 300, false, false},
        // Prefill chunks: from an empty cache, and on top of a ring.
        AttentionCase{4, 2, 64, 40, 40, 64, false, false}, AttentionCase{8, 2, 128, 900, 33, 1200, true, true},
        AttentionCase{4, 4, 64, 500, 17, 520, false, true}),
    case_name);

// --- Shift-RoPE -------------------------------------------------------------------------------

struct RopeCase {
  bool f16;
  bool adjacent;
  int n_rot;  // of head_dim 64: all of it, or a partial rotary part
};

class RopeShift : public ::testing::TestWithParam<RopeCase> {};

TEST_P(RopeShift, RotatesExactlyTheListedSlots) {
  REQUIRE_PLUGIN();
  const RopeCase c = GetParam();
  std::mt19937 rng(static_cast<unsigned>(c.n_rot + 2 * c.f16 + c.adjacent));
  const int n_layer = 3, n_slots = 50, n_head_kv = 2, head_dim = 64, half = c.n_rot / 2;
  const int64_t row_stride = n_head_kv * head_dim + 8;
  const size_t elem = c.f16 ? 2 : 4;
  const size_t keys_offset = 128;
  const size_t layer_stride = static_cast<size_t>(n_slots * row_stride) * elem + 64;  // layers padded apart
  const size_t total_bytes = keys_offset + n_layer * layer_stride;

  // The whole buffer as random values of the element type (padding included).
  std::vector<uint8_t> bytes(total_bytes);
  const std::vector<float> init = random_floats(total_bytes / elem, rng, 3.0f);
  for (size_t i = 0; i < init.size(); ++i) {
    if (c.f16) {
      const uint16_t h = fp32_to_fp16(init[i]);
      std::memcpy(&bytes[i * 2], &h, 2);
    } else {
      std::memcpy(&bytes[i * 4], &init[i], 4);
    }
  }
  std::vector<int32_t> slots(static_cast<size_t>(n_slots));
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(20);
  std::vector<float> cos_sin(static_cast<size_t>(c.n_rot));
  std::uniform_real_distribution<double> angle(-3.2, 3.2);
  for (int i = 0; i < half; ++i) {
    const double a = angle(rng);
    cos_sin[static_cast<size_t>(i)] = static_cast<float>(std::cos(a));
    cos_sin[static_cast<size_t>(half + i)] = static_cast<float>(std::sin(a));
  }

  // Expected: the formula, in float, element by element.
  std::vector<uint8_t> expected = bytes;
  const auto load = [&](size_t at) {
    if (!c.f16) {
      float f;
      std::memcpy(&f, &expected[at], 4);
      return f;
    }
    uint16_t h;
    std::memcpy(&h, &expected[at], 2);
    return fp16_to_fp32(h);
  };
  const auto store = [&](size_t at, float v) {
    if (c.f16) {
      const uint16_t h = fp32_to_fp16(v);
      std::memcpy(&expected[at], &h, 2);
    } else {
      std::memcpy(&expected[at], &v, 4);
    }
  };
  for (int l = 0; l < n_layer; ++l) {
    for (const int32_t s : slots) {
      for (int h = 0; h < n_head_kv; ++h) {
        const size_t row = keys_offset + l * layer_stride + (s * row_stride + h * head_dim) * elem;
        for (int i = 0; i < half; ++i) {
          const size_t a = row + (c.adjacent ? 2 * i : i) * elem, b = row + (c.adjacent ? 2 * i + 1 : i + half) * elem;
          const float xa = load(a), xb = load(b), cs = cos_sin[static_cast<size_t>(i)],
                      sn = cos_sin[static_cast<size_t>(half + i)];
          store(a, xa * cs - xb * sn);
          store(b, xa * sn + xb * cs);
        }
      }
    }
  }

  DeviceBuffer kd(bytes);
  DeviceBuffer sd(slots);
  DeviceBuffer cd(cos_sin);
  const ringlm_rope_shift_args args{.keys = kd.get(),
                                    .keys_offset = keys_offset,
                                    .layer_stride_bytes = layer_stride,
                                    .n_layer = n_layer,
                                    .kv_format = c.f16 ? RINGLM_FORMAT_F16 : RINGLM_FORMAT_F32,
                                    .row_stride = row_stride,
                                    .slots = sd.get(),
                                    .n_moved = static_cast<int32_t>(slots.size()),
                                    .n_head_kv = n_head_kv,
                                    .head_dim = head_dim,
                                    .n_rot = c.n_rot,
                                    .adjacent_pairs = c.adjacent,
                                    .cos_sin = cd.get()};
  ASSERT_EQ(api().rope_shift(ctx(), &args), RINGLM_OK) << last_error();
  const std::vector<uint8_t> got = kd.download<uint8_t>(total_bytes);

  // Untouched bytes are identical; rotated elements match the formula (the same float
  // operations, no FMA: bit for bit, but a rounding of difference is tolerated and reported).
  double worst = 0.0;
  size_t differing = 0;
  for (size_t at = 0; at < total_bytes; at += elem) {
    if (std::memcmp(&got[at], &expected[at], elem) == 0) continue;
    ++differing;
    float g, e;
    if (c.f16) {
      uint16_t hg, he;
      std::memcpy(&hg, &got[at], 2);
      std::memcpy(&he, &expected[at], 2);
      ASSERT_LE(std::abs(static_cast<int>(hg) - static_cast<int>(he)), 1) << "element at byte " << at;  // 1 ulp
      g = fp16_to_fp32(hg);
      e = fp16_to_fp32(he);
    } else {
      std::memcpy(&g, &got[at], 4);
      std::memcpy(&e, &expected[at], 4);
      ASSERT_LE(std::fabs(g - e), 1e-6f * (1.0f + std::fabs(e))) << "element at byte " << at;
    }
    worst = std::max(worst, static_cast<double>(std::fabs(g - e)));
  }
  // And something did rotate.
  EXPECT_NE(got, bytes);
  std::printf("rope_shift %s %s n_rot %d: %zu elements differ from the float formula, max diff %.3g\n",
              c.f16 ? "f16" : "f32", c.adjacent ? "adjacent" : "halves", c.n_rot, differing, worst);
}

INSTANTIATE_TEST_SUITE_P(Layouts, RopeShift,
                         ::testing::Values(RopeCase{false, true, 64}, RopeCase{false, false, 64},
                                           RopeCase{true, true, 64}, RopeCase{true, false, 64},
                                           RopeCase{true, false, 32}, RopeCase{false, true, 48}),
                         [](const auto& info) {
                           return std::string(info.param.f16 ? "f16" : "f32") +
                                  (info.param.adjacent ? "_adjacent" : "_halves") + "_rot" +
                                  std::to_string(info.param.n_rot);
                         });

// --- What it refuses --------------------------------------------------------------------------

TEST(OpenclPlugin, SupportsSaysNoToWhatItCannotRun) {
  REQUIRE_PLUGIN();
  const auto matmul = [](uint32_t format, int64_t m, int64_t n, int64_t k) {
    ringlm_op_desc d{};
    d.op = RINGLM_OP_MATMUL;
    d.weight_format = format;
    d.m = m;
    d.n = n;
    d.k = k;
    return api().supports(ctx(), &d);
  };
  EXPECT_TRUE(matmul(RINGLM_FORMAT_Q4_1, 1, 576, 576));
  EXPECT_TRUE(matmul(RINGLM_FORMAT_Q4_0, 16, 49152, 4096));
  EXPECT_TRUE(matmul(RINGLM_FORMAT_Q8_0, 5, 10, 32));
  EXPECT_TRUE(matmul(RINGLM_FORMAT_F16, 5, 10, 64));
  EXPECT_FALSE(matmul(RINGLM_FORMAT_Q4_1, 17, 576, 576));  // the host splits M into chunks of 16
  EXPECT_FALSE(matmul(RINGLM_FORMAT_Q4_1, 0, 576, 576));
  EXPECT_FALSE(matmul(RINGLM_FORMAT_Q4_1, 1, 576, 48));  // k not a multiple of 32
  EXPECT_FALSE(matmul(RINGLM_FORMAT_Q4_1, 1, 0, 576));
  EXPECT_FALSE(matmul(12, 1, 576, 576));  // Q4_K: not a format it reads
  EXPECT_FALSE(matmul(99, 1, 576, 576));

  const auto attention = [](uint32_t kv_format, int n_head, int n_head_kv, int head_dim) {
    ringlm_op_desc d{};
    d.op = RINGLM_OP_ATTENTION;
    d.kv_format = kv_format;
    d.n_head = n_head;
    d.n_head_kv = n_head_kv;
    d.head_dim = head_dim;
    return api().supports(ctx(), &d);
  };
  EXPECT_TRUE(attention(RINGLM_FORMAT_F16, 9, 3, 64));
  EXPECT_TRUE(attention(RINGLM_FORMAT_F32, 32, 8, 128));
  EXPECT_TRUE(attention(RINGLM_FORMAT_F16, 8, 1, 256));
  EXPECT_FALSE(attention(RINGLM_FORMAT_F16, 9, 2, 64));  // n_head % n_head_kv != 0
  EXPECT_FALSE(attention(RINGLM_FORMAT_F16, 8, 0, 64));
  EXPECT_FALSE(attention(RINGLM_FORMAT_Q4_0, 8, 8, 64));
  EXPECT_FALSE(attention(RINGLM_FORMAT_F16, 8, 8, 66));  // not a multiple of 4
  EXPECT_FALSE(attention(RINGLM_FORMAT_F16, 8, 8, 8192));

  const auto rope = [](uint32_t kv_format, int head_dim, int n_rot) {
    ringlm_op_desc d{};
    d.op = RINGLM_OP_ROPE_SHIFT;
    d.kv_format = kv_format;
    d.n_head_kv = 4;
    d.head_dim = head_dim;
    d.n_rot = n_rot;
    return api().supports(ctx(), &d);
  };
  EXPECT_TRUE(rope(RINGLM_FORMAT_F16, 64, 64));
  EXPECT_TRUE(rope(RINGLM_FORMAT_F32, 128, 32));
  EXPECT_FALSE(rope(RINGLM_FORMAT_F16, 64, 63));
  EXPECT_FALSE(rope(RINGLM_FORMAT_F16, 64, 128));
  EXPECT_FALSE(rope(RINGLM_FORMAT_Q8_0, 64, 64));

  ringlm_op_desc unknown{};
  unknown.op = 42;
  EXPECT_FALSE(api().supports(ctx(), &unknown));
  EXPECT_FALSE(api().supports(ctx(), nullptr));
}

// Expects `status` to be an error of kind `expected` with a reason naming `word`.
void expect_error(int32_t status, int32_t expected, const std::string& word) {
  EXPECT_EQ(status, expected);
  const std::string reason = last_error();
  EXPECT_NE(reason, "");
  EXPECT_NE(reason.find(word), std::string::npos) << reason;
}

TEST(OpenclPlugin, BadArgumentsAreErrorsNotCrashes) {
  REQUIRE_PLUGIN();
  std::mt19937 rng(5);
  const int64_t n = 8, k = 64, m = 2;
  const Weights w = make_weights(TensorType::Q4_0, n, k, rng);
  DeviceBuffer wd(w.bytes);
  DeviceBuffer xd(random_floats(m * k, rng));
  DeviceBuffer yd(m * n * sizeof(float));

  // Matmul.
  ringlm_matmul_args good{.weight = wd.get(),
                          .weight_format = RINGLM_FORMAT_Q4_0,
                          .n = n,
                          .k = k,
                          .x = xd.get(),
                          .x_offset = 0,
                          .y = yd.get(),
                          .y_offset = 0,
                          .m = m};
  ASSERT_EQ(api().matmul(ctx(), &good), RINGLM_OK) << last_error();
  ringlm_matmul_args a = good;
  a.weight = nullptr;
  expect_error(api().matmul(ctx(), &a), RINGLM_ERROR_INVALID_ARGUMENT, "null buffer");
  a = good;
  a.x_offset = 4;  // x runs past its buffer's end
  expect_error(api().matmul(ctx(), &a), RINGLM_ERROR_INVALID_ARGUMENT, "matmul x");
  a = good;
  a.y_offset = 1ull << 62;
  expect_error(api().matmul(ctx(), &a), RINGLM_ERROR_INVALID_ARGUMENT, "matmul y");
  a = good;
  a.x_offset = 2;  // not a whole float
  expect_error(api().matmul(ctx(), &a), RINGLM_ERROR_INVALID_ARGUMENT, "multiple");
  a = good;
  a.n = n * 2;  // more rows than the weight buffer holds
  expect_error(api().matmul(ctx(), &a), RINGLM_ERROR_INVALID_ARGUMENT, "matmul weight");
  a = good;
  a.m = 17;
  expect_error(api().matmul(ctx(), &a), RINGLM_ERROR_UNSUPPORTED, "m = 17");
  a = good;
  a.k = 48;
  expect_error(api().matmul(ctx(), &a), RINGLM_ERROR_UNSUPPORTED, "k = 48");
  a = good;
  a.weight_format = 12;
  expect_error(api().matmul(ctx(), &a), RINGLM_ERROR_UNSUPPORTED, "format");
  expect_error(api().matmul(ctx(), nullptr), RINGLM_ERROR_INVALID_ARGUMENT, "null");
  expect_error(api().matmul(nullptr, &good), RINGLM_ERROR_INVALID_ARGUMENT, "null context");

  // Buffers.
  EXPECT_EQ(api().alloc(ctx(), 0), nullptr);
  EXPECT_NE(last_error(), "");
  std::vector<uint8_t> host(64);
  expect_error(api().upload(ctx(), xd.get(), m * k * sizeof(float) - 8, host.data(), 16), RINGLM_ERROR_INVALID_ARGUMENT,
               "past the buffer");
  expect_error(api().download(ctx(), xd.get(), SIZE_MAX - 4, host.data(), 16), RINGLM_ERROR_INVALID_ARGUMENT,
               "overflows");
  expect_error(api().download(ctx(), nullptr, 0, host.data(), 16), RINGLM_ERROR_INVALID_ARGUMENT, "null buffer");
  expect_error(api().upload(ctx(), xd.get(), 0, nullptr, 16), RINGLM_ERROR_INVALID_ARGUMENT, "null source");
  api().free(ctx(), nullptr);  // a no-op

  // Attention.
  const std::vector<int32_t> positions = {0, 1, -1, 2};
  DeviceBuffer pd(positions);
  DeviceBuffer kv(random_floats(4 * 2 * 16, rng));
  DeviceBuffer q(random_floats(2 * 16, rng));
  DeviceBuffer out(2 * 16 * sizeof(float));
  // Three tokens' KV rows (two heads of 16) in four slots, one of them empty; one query at position 2.
  const ringlm_attention_args attention{.q = q.get(),
                                        .q_offset = 0,
                                        .out = out.get(),
                                        .out_offset = 0,
                                        .keys = kv.get(),
                                        .keys_offset = 0,
                                        .values = kv.get(),
                                        .values_offset = 0,
                                        .kv_format = RINGLM_FORMAT_F32,
                                        .row_stride = 32,
                                        .positions = pd.get(),
                                        .n_slots = 4,
                                        .n_tokens = 1,
                                        .q_pos0 = 2,
                                        .n_head = 2,
                                        .n_head_kv = 2,
                                        .head_dim = 16,
                                        .scale = 0.25f};
  ASSERT_EQ(api().attention(ctx(), &attention), RINGLM_OK) << last_error();
  ringlm_attention_args b = attention;
  b.n_slots = 5;  // more slots than the cache and the positions hold
  expect_error(api().attention(ctx(), &b), RINGLM_ERROR_INVALID_ARGUMENT, "attention keys");
  b = attention;
  b.n_tokens = 0;
  expect_error(api().attention(ctx(), &b), RINGLM_ERROR_INVALID_ARGUMENT, "n_tokens");
  b = attention;
  b.positions = nullptr;
  expect_error(api().attention(ctx(), &b), RINGLM_ERROR_INVALID_ARGUMENT, "null buffer");
  b = attention;
  b.n_head_kv = 3;
  expect_error(api().attention(ctx(), &b), RINGLM_ERROR_UNSUPPORTED, "n_head");
  b = attention;
  b.kv_format = RINGLM_FORMAT_Q4_0;
  expect_error(api().attention(ctx(), &b), RINGLM_ERROR_UNSUPPORTED, "KV format");

  // Shift-RoPE: slot lists that would write outside the cache are refused.
  DeviceBuffer cos_sin(std::vector<float>(16, 0.5f));
  DeviceBuffer slots(std::vector<int32_t>{0, 3});
  // The same four slots as one layer of keys: slots 0..3 are valid.
  const ringlm_rope_shift_args rope{.keys = kv.get(),
                                    .keys_offset = 0,
                                    .layer_stride_bytes = 4 * 32 * sizeof(float),
                                    .n_layer = 1,
                                    .kv_format = RINGLM_FORMAT_F32,
                                    .row_stride = 32,
                                    .slots = slots.get(),
                                    .n_moved = 2,
                                    .n_head_kv = 2,
                                    .head_dim = 16,
                                    .n_rot = 16,
                                    .adjacent_pairs = 1,
                                    .cos_sin = cos_sin.get()};
  ASSERT_EQ(api().rope_shift(ctx(), &rope), RINGLM_OK) << last_error();
  ringlm_rope_shift_args r = rope;
  DeviceBuffer far_slot(std::vector<int32_t>{1, 4});
  r.slots = far_slot.get();
  expect_error(api().rope_shift(ctx(), &r), RINGLM_ERROR_INVALID_ARGUMENT, "slot 4");
  DeviceBuffer negative_slot(std::vector<int32_t>{-1, 2});
  r.slots = negative_slot.get();
  expect_error(api().rope_shift(ctx(), &r), RINGLM_ERROR_INVALID_ARGUMENT, "slot -1");
  DeviceBuffer twice(std::vector<int32_t>{2, 2});
  r.slots = twice.get();
  expect_error(api().rope_shift(ctx(), &r), RINGLM_ERROR_INVALID_ARGUMENT, "twice");
  r = rope;
  r.n_layer = 2;  // the second layer is past the buffer
  expect_error(api().rope_shift(ctx(), &r), RINGLM_ERROR_INVALID_ARGUMENT, "rope_shift keys");
  r = rope;
  r.n_rot = 15;
  expect_error(api().rope_shift(ctx(), &r), RINGLM_ERROR_UNSUPPORTED, "n_rot");

  // After all that, the context still works.
  ASSERT_EQ(api().matmul(ctx(), &good), RINGLM_OK) << last_error();
  EXPECT_EQ(yd.download<float>(m * n).size(), static_cast<size_t>(m * n));
}

}  // namespace
}  // namespace ringlm
