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
// Version 2's entries: rms_norm, add, scale, glu, rope, store_kv, get_rows and attention2 with a
// sliding window against references computed here (plain C++, not the plugin), copy,
// upload_async, finish, and the counters, which must grow by exactly what a known sequence of
// calls does.
//
// The plugin is loaded with dlopen + dlsym, as ringlm's loader does. Compiling the kernels is the
// slow part (PoCL runs LLVM), so one context is opened for the whole executable (the test
// environment below), and that opening is also what the disk-cache test inspects.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "backends/cpu/attention.h"
#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/quantize_acts.h"
#include "backends/plugin_api.h"
#include "quant/formats.h"
#include "quant/quantize.h"

// LeakSanitizer in the sanitizer build: no scan of thread-local storage in this binary. At exit
// its tracer crashes reading the dynamic TLS table ("DTLS 9 at 0x276-0x400001378", a bogus range),
// which grows here as PoCL loads a library per compiled kernel. Heap memory held only through
// TLS then reads as leaked: libgomp's per-thread state is the one case (tests/lsan_suppressions.txt).
extern "C" const char* __lsan_default_options() { return "use_tls=0"; }

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

ringlm_counters counters_now();

// Whether the kernels run in their GPU shapes: a GPU, or RINGLM_OPENCL_KERNELS=gpu (the plugin's rule).
bool gpu_kernel_shapes() {
  if (const char* forced = std::getenv("RINGLM_OPENCL_KERNELS")) {
    if (std::string(forced) == "gpu") return true;
    if (std::string(forced) == "cpu") return false;
  }
  ringlm_device_info info{};
  return api().device_info(0, &info) == RINGLM_OK && info.type != RINGLM_DEVICE_CPU;
}
uint32_t device_compute_units() {
  ringlm_device_info info{};
  EXPECT_EQ(api().device_info(0, &info), RINGLM_OK) << last_error();
  return info.compute_units;
}

// --- Table and devices ------------------------------------------------------------------------

TEST(OpenclPlugin, TableAndDeviceInfo) {
  REQUIRE_PLUGIN();
  EXPECT_EQ(api().abi_version, RINGLM_PLUGIN_ABI_VERSION);
  EXPECT_EQ(api().abi_version, 4u);
  EXPECT_EQ(api().struct_size, sizeof(ringlm_plugin));
  EXPECT_STREQ(api().name, "opencl");
  // Every entry of the table is filled, versions 2 to 4 included.
  const auto* entries = reinterpret_cast<const unsigned char*>(&api());
  for (size_t at = offsetof(ringlm_plugin, last_error); at < sizeof(ringlm_plugin); at += sizeof(void*)) {
    void* entry = nullptr;
    std::memcpy(&entry, entries + at, sizeof(entry));
    EXPECT_NE(entry, nullptr) << "table entry at byte " << at;
  }

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

// The code book formats, which ringlm reads but does not quantize to.
bool is_codebook(TensorType type) {
  return type == TensorType::IQ4_NL || type == TensorType::IQ4_XS || type == TensorType::MXFP4;
}

// Weights: random floats quantized (the formats ringlm quantizes to), or random codes under a
// random scale (every block starts with it: IQ4_NL's and IQ4_XS's fp16, MXFP4's E8M0 exponent,
// here 2^-11 .. 2^-6 once halved), with their dequantization.
Weights make_weights(TensorType type, int64_t n, int64_t k, std::mt19937& rng) {
  const std::vector<float> w = random_floats(static_cast<size_t>(n * k), rng);
  const size_t row = row_bytes(type, k);
  Weights out{std::vector<uint8_t>(row * static_cast<size_t>(n)), std::vector<float>(w.size())};
  if (is_codebook(type)) {
    for (uint8_t& b : out.bytes) b = static_cast<uint8_t>(rng());
    const size_t block = type_traits(static_cast<uint32_t>(type))->block_bytes;
    for (size_t at = 0; at < out.bytes.size(); at += block) {
      if (type == TensorType::MXFP4) {
        out.bytes[at] = static_cast<uint8_t>(117 + rng() % 6);
        continue;
      }
      const uint16_t d = fp32_to_fp16(random_floats(1, rng, 0.01f)[0]);
      std::memcpy(&out.bytes[at], &d, sizeof(d));
    }
  }
  for (int64_t r = 0; r < n; ++r) {
    if (!is_codebook(type)) quantize_row(type, &w[static_cast<size_t>(r * k)], &out.bytes[row * static_cast<size_t>(r)], k);
    dequantize_row(type, &out.bytes[row * static_cast<size_t>(r)], &out.dequant[static_cast<size_t>(r * k)], k);
  }
  return out;
}

// Weights per block of a format as the plugin reads it: 256 in the super-blocks of the K-quants
// and IQ4_XS, else 32 (F16 and F32 rows too).
int64_t block_weights(TensorType type) { return std::max<int64_t>(32, type_traits(static_cast<uint32_t>(type))->block_elems); }
// The formats since ABI 3 (the files people download): fewer shapes each, to keep the suite short.
bool later_format(TensorType type) {
  return type != TensorType::Q4_0 && type != TensorType::Q4_1 && type != TensorType::Q8_0 && type != TensorType::F16 &&
         type != TensorType::F32;
}

class Matmul : public ::testing::TestWithParam<TensorType> {};

TEST_P(Matmul, MatchesCpuBackendForEveryM) {
  REQUIRE_PLUGIN();
  const TensorType type = GetParam();
  std::mt19937 rng(static_cast<unsigned>(type) + 7);
  auto cpu = make_cpu_backend(1, ComputeType::kFp32);
  // n not a multiple of any group of rows; k from one block to several chunks; 576 = SmolLM2's width.
  const int64_t block = block_weights(type);
  std::vector<std::pair<int64_t, int64_t>> shapes = {{1, block}, {101, block == 256 ? 768 : 576}, {130, 256}, {300, 2048}};
  std::vector<int64_t> ms = {1, 2, 3, 7, 8, 9, 15, 16};
  if (later_format(type)) {  // (their GEMV, which decode runs, has the next test)
    shapes = {{1, block}, {101, 768}};
    ms = {1, 16};
  }
  double worst = 0.0;  // max |gpu - cpu| / (1 + sum |x| |w|)
  for (const auto& [n, k] : shapes) {
    const Weights w = make_weights(type, n, k, rng);
    auto prepared = cpu->prepare({"w", type, n, k, w.bytes.data()});
    DeviceBuffer wd(w.bytes);
    for (const int64_t m : ms) {
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

// matmul2 (ABI v2: the GEMV with the input's RMSNorm and the residual add fused) against the CPU
// backend on the normalised rows, for every format and m, with and without each fusion; and a
// row's result is bit for bit the same whatever m is.
TEST_P(Matmul, FusedNormAndResidualMatchTheCpu) {
  REQUIRE_PLUGIN();
  const TensorType type = GetParam();
  std::mt19937 rng(static_cast<unsigned>(type) + 11);
  auto cpu = make_cpu_backend(1, ComputeType::kFp32);
  // (Longer rows: Matmul2RowIsBitIdenticalWhateverM.)
  std::vector<std::pair<int64_t, int64_t>> shapes = {{101, block_weights(type) == 256 ? 768 : 576}};
  // A mixture of experts' router: fewer rows than a group of the GEMV has work-items, and than
  // the input has rows (F32, the routers' type, and one quantized format: the norm is the same).
  if (type == TensorType::F32 || type == TensorType::Q8_0) shapes.insert(shapes.end(), {{4, 256}, {8, 256}});
  for (const auto& [n, k] : shapes) {
    const Weights w = make_weights(type, n, k, rng);
    auto prepared = cpu->prepare({"w", type, n, k, w.bytes.data()});
    DeviceBuffer wd(w.bytes);
    const std::vector<float> norm = random_floats(static_cast<size_t>(k), rng, 1.5f);
    DeviceBuffer nd(norm, 8);
    for (const int64_t m : {1, 3, 16}) {
      for (const bool with_norm : {false, true}) {
        for (const bool accumulate : {false, true}) {
          SCOPED_TRACE("n=" + std::to_string(n) + " k=" + std::to_string(k) + " m=" + std::to_string(m) +
                       (with_norm ? " norm" : "") + (accumulate ? " accumulate" : ""));
          const std::vector<float> x = random_floats(static_cast<size_t>(m * k), rng, 2.0f);
          const std::vector<float> y0 = random_floats(static_cast<size_t>(m * n), rng, 3.0f);
          std::vector<float> expected(y0.size());
          const MatmulInput input{x.data(), m, with_norm ? norm.data() : nullptr, 1e-5f};
          const PreparedWeight* weights[] = {prepared.get()};
          float* const outs[] = {expected.data()};
          cpu->matmul_many(weights, input, outs);
          if (accumulate) {
            for (size_t i = 0; i < expected.size(); ++i) expected[i] += y0[i];
          }
          DeviceBuffer xd(x, 16);
          DeviceBuffer yd(y0, 32);
          ringlm_matmul2_args args{};
          args.base = ringlm_matmul_args{wd.get(), static_cast<uint32_t>(type), n, k, xd.get(), 16, yd.get(), 32, m};
          if (with_norm) {
            args.rms_weight = nd.get();
            args.rms_weight_offset = 8;
            args.rms_eps = 1e-5f;
          }
          args.accumulate = accumulate ? 1 : 0;
          ASSERT_EQ(api().matmul2(ctx(), &args), RINGLM_OK) << last_error();
          const std::vector<float> y = yd.download<float>(expected.size(), 32);
          double worst = 0.0, scale = 0.0;
          for (size_t i = 0; i < y.size(); ++i) {
            worst = std::max(worst, std::fabs(static_cast<double>(y[i]) - expected[i]));
            scale = std::max(scale, std::fabs(static_cast<double>(expected[i])));
          }
          EXPECT_LE(worst, 1e-4 * (1.0 + scale));
        }
      }
    }
  }
}

// matmul2 past MAX_M rows (a prompt chunk) runs the tiled GEMM on a GPU-shaped device, with the
// GEMV's fusions: against the CPU backend for the input's norm with the residual, q/k/v parts and
// gate|up with the activation, over odd row counts and formats of both block sizes. A CPU device
// says no (RINGLM_OP_GEMM) and refuses the call: it multiplies prompts by the GEMV's chunks.
// Whether the plugin's GEMM quantizes x to int8, as RINGLM_OPENCL_INT8 tells it (the
// test_opencl_plugin.gpu_int8 entry runs this file's GEMM tests so on PoCL, whose dot4_add is
// the four multiply-adds that PTX dp4a replaces on NVIDIA).
bool int8_gemm() {
  const char* forced = std::getenv("RINGLM_OPENCL_INT8");
  return forced != nullptr && std::string(forced) == "1";
}

// x ([m][k]) as the int8 GEMM multiplies it: normalised as the CPU normalises (with a norm), then
// quantized per 32 as the CPU's int8 kernels quantize (quantize_acts) and turned back into floats.
std::vector<float> int8_rounded(const std::vector<float>& x, int64_t m, int64_t k, const float* norm) {
  std::vector<float> normed(x.size());
  for (int64_t r = 0; r < m; ++r) {
    const MatmulInput in{x.data(), m, norm, 1e-5f};
    const float* row = normalized_input_row(in, r, k, &normed[static_cast<size_t>(r * k)]);
    if (row != &normed[static_cast<size_t>(r * k)]) std::copy(row, row + k, &normed[static_cast<size_t>(r * k)]);
  }
  std::vector<int8_t> q(x.size());
  std::vector<float> d(x.size() / 32), s(x.size() / 32);
  std::vector<int32_t> sum(x.size() / 32);
  cpu::quantize_acts(normed.data(), 0, m, cpu::QuantizedActs{q.data(), d.data(), s.data(), sum.data(), k});
  std::vector<float> out(x.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = d[i / 32] * static_cast<float>(q[i]);
  return out;
}

// matmul2 past 16 rows (a prompt chunk) takes the tiled GEMM in its GPU shape, and a CPU device
// refuses it: each fusion, several M and odd N (tile edges inside a part) against the CPU's fp32
// products. On the int8 path the reference multiplies x as quantized per 32 (int8_rounded), so
// the integer dots are checked exactly up to float summation: 1e-4 without a norm; with one, a
// code may round the other way when the device's 1 / RMS differs from the CPU's in the last
// bit, so 2e-3 (a wrong scale, min or code is off by the result's own size).
TEST(OpenclPlugin, Matmul2GemmTakesPromptChunksOnAGpu) {
  REQUIRE_PLUGIN();
  std::mt19937 rng(41);
  auto cpu = make_cpu_backend(1, ComputeType::kFp32);
  ringlm_op_desc gemm{};
  gemm.op = RINGLM_OP_GEMM;
  gemm.weight_format = RINGLM_FORMAT_Q4_0;
  gemm.m = 512;
  gemm.n = 64;
  gemm.k = 256;
  const bool takes = api().supports(ctx(), &gemm) != 0;
  EXPECT_EQ(takes, gpu_kernel_shapes());
  const bool int8 = int8_gemm();
  // (MXFP4: 17-byte blocks, so rows of 13 blocks start at odd addresses)
  for (const TensorType type : {TensorType::Q4_0, TensorType::Q4_1, TensorType::Q4_K, TensorType::Q6_K, TensorType::MXFP4}) {
    const int64_t k = block_weights(type) == 256 ? 512 : 416;  // 416: 13 blocks of 32
    const std::vector<int64_t> rows = {130, 33, 64};  // q, k, v; gate and up: the first two of 130
    std::vector<Weights> w;
    std::vector<std::unique_ptr<DeviceBuffer>> wd;
    std::vector<std::unique_ptr<PreparedWeight>> prepared;
    for (int64_t n : rows) {
      w.push_back(make_weights(type, n, k, rng));
      wd.push_back(std::make_unique<DeviceBuffer>(w.back().bytes));
      prepared.push_back(cpu->prepare({"w", type, n, k, w.back().bytes.data()}));
    }
    std::vector<Weights> up = {make_weights(type, rows[0], k, rng)};
    DeviceBuffer upd(up[0].bytes);
    auto up_prepared = cpu->prepare({"up", type, rows[0], k, up[0].bytes.data()});
    const std::vector<float> norm = random_floats(static_cast<size_t>(k), rng, 1.5f);
    DeviceBuffer nd(norm);
    std::vector<int64_t> ms = {17, 100};
    if (type == TensorType::Q4_0) ms.push_back(512);
    for (const int64_t m : ms) {
      SCOPED_TRACE(std::string(type_traits(static_cast<uint32_t>(type))->name) + " m=" + std::to_string(m) +
                   (int8 ? " int8" : " fp32"));
      const std::vector<float> x = random_floats(static_cast<size_t>(m * k), rng, 2.0f);
      DeviceBuffer xd(x, 8);
      // The CPU's fp32 product of weight `wp` and x, with or without the norm, as the GEMM sees x.
      const auto reference = [&](const PreparedWeight* wp, int64_t n, bool with_norm) {
        std::vector<float> out(static_cast<size_t>(m * n));
        const std::vector<float> rounded = int8 ? int8_rounded(x, m, k, with_norm ? norm.data() : nullptr) : x;
        const MatmulInput in{rounded.data(), m, with_norm && !int8 ? norm.data() : nullptr, 1e-5f};
        const PreparedWeight* one[] = {wp};
        float* const outs[] = {out.data()};
        cpu->matmul_many(one, in, outs);
        return out;
      };
      std::vector<std::vector<float>> y0(3);
      std::vector<std::unique_ptr<DeviceBuffer>> yd;
      for (size_t i = 0; i < 3; ++i) {
        y0[i] = random_floats(static_cast<size_t>(m * rows[i]), rng, 3.0f);
        yd.push_back(std::make_unique<DeviceBuffer>(y0[i], 16));
      }
      const auto expect_close = [&](const std::vector<float>& got, const std::vector<float>& expected, bool with_norm,
                                    const char* what) {
        double worst = 0.0, scale = 0.0;
        for (size_t i = 0; i < got.size(); ++i) {
          worst = std::max(worst, std::fabs(static_cast<double>(got[i]) - expected[i]));
          scale = std::max(scale, std::fabs(static_cast<double>(expected[i])));
        }
        EXPECT_LE(worst, (int8 && with_norm ? 2e-3 : 1e-4) * (1.0 + scale)) << what;
      };
      ringlm_counters before{}, after{};
      ASSERT_EQ(api().counters(ctx(), &before), RINGLM_OK);
      ringlm_matmul2_args args{};
      args.base = ringlm_matmul_args{wd[0]->get(), static_cast<uint32_t>(type), rows[0], k, xd.get(), 8,
                                     yd[0]->get(), 16, m};
      args.rms_weight = nd.get();
      args.rms_eps = 1e-5f;
      args.accumulate = 1;
      const int32_t status = api().matmul2(ctx(), &args);
      if (!takes) {
        EXPECT_EQ(status, RINGLM_ERROR_UNSUPPORTED);
        EXPECT_NE(last_error().find("CPU device"), std::string::npos) << last_error();
        continue;
      }
      ASSERT_EQ(status, RINGLM_OK) << last_error();
      ASSERT_EQ(api().counters(ctx(), &after), RINGLM_OK);
      EXPECT_EQ(after.launches - before.launches, int8 ? 2u : 1u) << "the int8 path quantizes x, then multiplies";
      std::vector<float> residual = reference(prepared[0].get(), rows[0], true);
      for (size_t i = 0; i < residual.size(); ++i) residual[i] += y0[0][i];
      expect_close(yd[0]->download<float>(residual.size(), 16), residual, true, "norm + residual");

      // q, k and v of one input in one launch, without a norm.
      args.accumulate = 0;
      args.rms_weight = nullptr;
      args.n_more = 2;
      for (size_t i = 1; i < 3; ++i) args.more[i - 1] = ringlm_matmul_part{wd[i]->get(), rows[i], yd[i]->get(), 16};
      ASSERT_EQ(api().matmul2(ctx(), &args), RINGLM_OK) << last_error();
      for (size_t i = 0; i < 3; ++i) {
        expect_close(yd[i]->download<float>(y0[i].size(), 16), reference(prepared[i].get(), rows[i], false), false,
                     "parts");
      }

      // gate|up with SiLU, after the norm.
      const std::vector<float> gate = reference(prepared[0].get(), rows[0], true);
      const std::vector<float> up_want = reference(up_prepared.get(), rows[0], true);
      std::vector<float> glu_want(gate.size());
      for (size_t i = 0; i < glu_want.size(); ++i) glu_want[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up_want[i];
      args.rms_weight = nd.get();
      args.n_more = 1;
      args.more[0] = ringlm_matmul_part{upd.get(), rows[0], nullptr, 0};
      args.glu = 1;
      args.activation = RINGLM_ACT_SILU;
      ASSERT_EQ(api().matmul2(ctx(), &args), RINGLM_OK) << last_error();
      expect_close(yd[0]->download<float>(glu_want.size(), 16), glu_want, true, "gate|up");
      args.glu = 0;
    }
  }
}

// matmul2's fusions of several products of one input: q, k and v in one launch give, bit for bit,
// what three launches give; gate and up with the activation give act(gate) * up of the separate
// products (the activation to float rounding, against the formulas computed here).
TEST(OpenclPlugin, Matmul2FusesPartsAndTheGatedActivation) {
  REQUIRE_PLUGIN();
  std::mt19937 rng(97);
  const int64_t k = 576, m = 3;
  const std::vector<int64_t> rows = {96, 32, 32};
  std::vector<Weights> w;
  std::vector<std::unique_ptr<DeviceBuffer>> wd;
  for (const int64_t n : rows) {
    w.push_back(make_weights(TensorType::Q4_1, n, k, rng));
    wd.push_back(std::make_unique<DeviceBuffer>(w.back().bytes));
  }
  const std::vector<float> x = random_floats(static_cast<size_t>(m * k), rng, 2.0f);
  const std::vector<float> norm = random_floats(static_cast<size_t>(k), rng, 1.0f);
  DeviceBuffer xd(x), nd(norm);
  const auto args_for = [&](size_t i, ringlm_buffer* y) {
    ringlm_matmul2_args a{};
    a.base = ringlm_matmul_args{wd[i]->get(), static_cast<uint32_t>(TensorType::Q4_1), rows[i], k, xd.get(), 0, y, 0, m};
    a.rms_weight = nd.get();
    a.rms_eps = 1e-5f;
    return a;
  };
  std::vector<std::vector<float>> separate;
  for (size_t i = 0; i < 3; ++i) {
    DeviceBuffer yd(static_cast<size_t>(m * rows[i]) * sizeof(float));
    const ringlm_matmul2_args a = args_for(i, yd.get());
    ASSERT_EQ(api().matmul2(ctx(), &a), RINGLM_OK) << last_error();
    separate.push_back(yd.download<float>(static_cast<size_t>(m * rows[i])));
  }
  // q, k, v in one launch, each into its own buffer (k's at an offset).
  DeviceBuffer q(static_cast<size_t>(m * rows[0]) * sizeof(float)), kk(64 + static_cast<size_t>(m * rows[1]) * sizeof(float)),
      v(static_cast<size_t>(m * rows[2]) * sizeof(float));
  ringlm_matmul2_args fused = args_for(0, q.get());
  fused.n_more = 2;
  fused.more[0] = ringlm_matmul_part{wd[1]->get(), rows[1], kk.get(), 64};
  fused.more[1] = ringlm_matmul_part{wd[2]->get(), rows[2], v.get(), 0};
  ASSERT_EQ(api().matmul2(ctx(), &fused), RINGLM_OK) << last_error();
  EXPECT_EQ(q.download<float>(separate[0].size()), separate[0]);
  EXPECT_EQ(kk.download<float>(separate[1].size(), 64), separate[1]);
  EXPECT_EQ(v.download<float>(separate[2].size()), separate[2]);

  // gate (weights 1) and up (weights 2), both 32 rows, with each activation.
  for (const uint32_t act : {uint32_t{RINGLM_ACT_SILU}, uint32_t{RINGLM_ACT_GELU_TANH}}) {
    DeviceBuffer out(static_cast<size_t>(m * rows[1]) * sizeof(float));
    ringlm_matmul2_args glu = args_for(1, out.get());
    glu.n_more = 1;
    glu.more[0] = ringlm_matmul_part{wd[2]->get(), rows[2], nullptr, 0};
    glu.glu = 1;
    glu.activation = act;
    ASSERT_EQ(api().matmul2(ctx(), &glu), RINGLM_OK) << last_error();
    const std::vector<float> got = out.download<float>(separate[1].size());
    for (size_t i = 0; i < got.size(); ++i) {
      const double g = separate[1][i], u = separate[2][i];
      const double a = act == RINGLM_ACT_SILU ? g / (1.0 + std::exp(-g))
                                              : 0.5 * g * (1.0 + std::tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)));
      EXPECT_NEAR(got[i], a * u, 1e-5 * (1.0 + std::fabs(a * u))) << "element " << i << " activation " << act;
    }
  }
  // A glu whose second weight has other rows, or accumulate with parts, is refused.
  ringlm_matmul2_args bad = args_for(0, q.get());
  bad.n_more = 1;
  bad.more[0] = ringlm_matmul_part{wd[1]->get(), rows[1], nullptr, 0};
  bad.glu = 1;
  EXPECT_EQ(api().matmul2(ctx(), &bad), RINGLM_ERROR_INVALID_ARGUMENT);
  EXPECT_STRNE(api().last_error(ctx()), "");
  bad.glu = 0;
  bad.more[0].y = kk.get();
  bad.accumulate = 1;
  EXPECT_EQ(api().matmul2(ctx(), &bad), RINGLM_ERROR_INVALID_ARGUMENT);
}

TEST(OpenclPlugin, Matmul2RowIsBitIdenticalWhateverM) {
  REQUIRE_PLUGIN();
  std::mt19937 rng(98);
  const int64_t n = 130, k = 2048;
  const Weights w = make_weights(TensorType::Q4_0, n, k, rng);
  DeviceBuffer wd(w.bytes);
  const std::vector<float> x = random_floats(static_cast<size_t>(16 * k), rng, 2.0f);
  const std::vector<float> norm = random_floats(static_cast<size_t>(k), rng, 1.0f);
  DeviceBuffer xd(x), nd(norm);
  DeviceBuffer yd(static_cast<size_t>(16 * n) * sizeof(float));
  const auto multiply = [&](int64_t first_row, int64_t m) {
    ringlm_matmul2_args args{};
    args.base = ringlm_matmul_args{wd.get(), static_cast<uint32_t>(TensorType::Q4_0), n, k, xd.get(),
                                   static_cast<size_t>(first_row * k) * sizeof(float), yd.get(), 0, m};
    args.rms_weight = nd.get();
    args.rms_eps = 1e-6f;
    EXPECT_EQ(api().matmul2(ctx(), &args), RINGLM_OK) << last_error();
    return yd.download<float>(static_cast<size_t>(m * n));
  };
  const std::vector<float> all = multiply(0, 16);
  for (const int64_t row : {0, 5, 15}) {
    const std::vector<float> alone = multiply(row, 1);
    EXPECT_TRUE(std::equal(alone.begin(), alone.end(), all.begin() + row * n)) << "row " << row;
  }
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
                                           TensorType::F32, TensorType::Q5_0, TensorType::Q5_1, TensorType::IQ4_NL,
                                           TensorType::Q4_K, TensorType::Q5_K, TensorType::Q6_K, TensorType::IQ4_XS,
                                           TensorType::MXFP4),
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
  kv.key_type = kv.value_type = c.f16 ? KvType::kF16 : KvType::kF32;
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
  const ringlm_counters before = counters_now();
  ASSERT_EQ(api().attention(ctx(), &args), RINGLM_OK) << last_error();
  const ringlm_counters after = counters_now();
  // Flash-decoding (a launch for the splits, one for their merge) where the GPU shape leaves
  // compute units idle over a long cache; one launch otherwise.
  const bool split = gpu_kernel_shapes() && c.n_slots >= 1024 &&
                     static_cast<uint32_t>(c.n_head * c.n_tokens) < 2 * device_compute_units();
  EXPECT_EQ(after.launches - before.launches, split ? 2u : 1u);
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
        AttentionCase{4, 4, 64, 500, 17, 520, false, true},
        // Gemma 3's head_dim 256 (a tile of fewer queries where local memory is 48 KiB).
        AttentionCase{4, 1, 256, 60, 20, 80, true, true},
        // Decode with few heads over a long cache: split over the keys on a GPU (flash-decoding),
        // a split of empty slots only in the last.
        AttentionCase{2, 1, 64, 1500, 1, 2000, true, true}, AttentionCase{3, 1, 128, 1200, 1, 1300, false, false},
        AttentionCase{2, 2, 64, 300, 1, 1100, false, false}),
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
  EXPECT_FALSE(matmul(30, 1, 576, 576));  // BF16: not a format it reads
  EXPECT_TRUE(matmul(RINGLM_FORMAT_MXFP4, 3, 100, 96));
  EXPECT_FALSE(matmul(RINGLM_FORMAT_MXFP4, 3, 100, 80));  // k not a multiple of 32
  EXPECT_TRUE(matmul(RINGLM_FORMAT_Q4_K, 1, 576, 768));
  EXPECT_FALSE(matmul(RINGLM_FORMAT_Q4_K, 1, 576, 576));  // k not a multiple of a super-block (256)
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
  a.weight_format = 30;  // BF16
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

// --- Version 2: row ops -----------------------------------------------------------------------

// |got - want| <= tol, with the index in the message.
void expect_close(const std::vector<float>& got, const std::vector<double>& want, double rel, double abs,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_LE(std::fabs(static_cast<double>(got[i]) - want[i]), rel * std::fabs(want[i]) + abs)
        << what << " [" << i << "] = " << got[i] << ", reference " << want[i];
  }
}

TEST(OpenclPlugin, RmsNormMatchesReferenceInPlaceAndNot) {
  REQUIRE_PLUGIN();
  std::mt19937 rng(11);
  const int64_t n_rows = 3;
  const float eps = 1e-5f;
  for (const int64_t width : {37, 64, 576}) {
    const std::vector<float> x = random_floats(static_cast<size_t>(n_rows * width), rng, 3.0f);
    const std::vector<float> w = random_floats(static_cast<size_t>(width), rng, 2.0f);
    std::vector<double> want(x.size());
    for (int64_t r = 0; r < n_rows; ++r) {
      double sum = 0.0;
      for (int64_t c = 0; c < width; ++c) sum += static_cast<double>(x[r * width + c]) * x[r * width + c];
      const double inv = 1.0 / std::sqrt(sum / static_cast<double>(width) + eps);
      for (int64_t c = 0; c < width; ++c) want[r * width + c] = x[r * width + c] * inv * w[c];
    }
    const size_t bytes = x.size() * sizeof(float), x_offset = 32, w_offset = 16;
    DeviceBuffer wd(w, w_offset);
    for (const bool in_place : {false, true}) {
      SCOPED_TRACE("width " + std::to_string(width) + (in_place ? " in place" : " out of place"));
      DeviceBuffer xd(x, x_offset);
      DeviceBuffer od(8 + bytes);
      const ringlm_rms_norm_args args{.x = xd.get(),
                                      .x_offset = x_offset,
                                      .out = in_place ? xd.get() : od.get(),
                                      .out_offset = in_place ? x_offset : 8,
                                      .weight = wd.get(),
                                      .weight_offset = w_offset,
                                      .n_rows = n_rows,
                                      .width = width,
                                      .eps = eps};
      ASSERT_EQ(api().rms_norm(ctx(), &args), RINGLM_OK) << last_error();
      const std::vector<float> got =
          in_place ? xd.download<float>(x.size(), x_offset) : od.download<float>(x.size(), 8);
      expect_close(got, want, 1e-5, 1e-6, "rms_norm");
      if (!in_place) {
        EXPECT_EQ(xd.download<float>(x.size(), x_offset), x);  // x itself untouched
      }
    }
  }
}

TEST(OpenclPlugin, AddResidualAndRowBias) {
  REQUIRE_PLUGIN();
  std::mt19937 rng(12);
  const int64_t rows = 5, width = 48, n = rows * width;
  const std::vector<float> x = random_floats(static_cast<size_t>(n), rng, 4.0f);
  const std::vector<float> residual = random_floats(static_cast<size_t>(n), rng, 4.0f);
  const std::vector<float> bias = random_floats(static_cast<size_t>(width), rng, 4.0f);
  const size_t x_offset = 64, d_offset = 4;
  for (const bool row_bias : {false, true}) {
    SCOPED_TRACE(row_bias ? "row bias" : "residual");
    const std::vector<float>& delta = row_bias ? bias : residual;
    DeviceBuffer xd(x, x_offset);
    DeviceBuffer dd(delta, d_offset);
    const ringlm_add_args args{.x = xd.get(),
                               .x_offset = x_offset,
                               .delta = dd.get(),
                               .delta_offset = d_offset,
                               .n = n,
                               .delta_n = static_cast<int64_t>(delta.size())};
    ASSERT_EQ(api().add(ctx(), &args), RINGLM_OK) << last_error();
    std::vector<float> want(x.size());
    for (size_t i = 0; i < x.size(); ++i) want[i] = x[i] + delta[i % delta.size()];
    EXPECT_EQ(xd.download<float>(x.size(), x_offset), want);  // one float addition each: exact
  }
}

TEST(OpenclPlugin, ScaleMultipliesEveryElement) {
  REQUIRE_PLUGIN();
  std::mt19937 rng(13);
  const std::vector<float> x = random_floats(300, rng, 5.0f);
  DeviceBuffer xd(x, 12);
  ASSERT_EQ(api().scale(ctx(), xd.get(), 12, 299, 0.125f), RINGLM_OK) << last_error();  // all but the last
  std::vector<float> want = x;
  for (size_t i = 0; i + 1 < want.size(); ++i) want[i] *= 0.125f;
  EXPECT_EQ(xd.download<float>(x.size(), 12), want);
  ASSERT_EQ(api().scale(ctx(), xd.get(), 12, 300, -3.0f), RINGLM_OK) << last_error();
  for (float& v : want) v *= -3.0f;
  EXPECT_EQ(xd.download<float>(x.size(), 12), want);
}

TEST(OpenclPlugin, GluEveryActivation) {
  REQUIRE_PLUGIN();
  std::mt19937 rng(14);
  const size_t n = 1000;
  std::vector<float> gate = random_floats(n, rng, 8.0f);
  gate[0] = -8.0f, gate[1] = 8.0f, gate[2] = 0.0f, gate[3] = -1e-3f;
  std::vector<float> up = random_floats(n, rng, 2.0f);
  up[4] = 9.0f, up[5] = -9.0f;  // past swiglu_oai's clamp
  for (const uint32_t act : {static_cast<uint32_t>(RINGLM_ACT_SILU), static_cast<uint32_t>(RINGLM_ACT_GELU_TANH),
                             static_cast<uint32_t>(RINGLM_ACT_SWIGLU_OAI)}) {
    SCOPED_TRACE(act == RINGLM_ACT_SILU ? "silu" : act == RINGLM_ACT_GELU_TANH ? "gelu_tanh" : "swiglu_oai");
    DeviceBuffer gd(gate, 16);
    DeviceBuffer ud(up, 4);
    const ringlm_glu_args args{.gate = gd.get(),
                               .gate_offset = 16,
                               .up = ud.get(),
                               .up_offset = 4,
                               .n = static_cast<int64_t>(n),
                               .activation = act};
    ASSERT_EQ(api().glu(ctx(), &args), RINGLM_OK) << last_error();
    std::vector<double> want(n);
    const double sqrt_2_over_pi = std::sqrt(2.0 / 3.14159265358979323846);
    for (size_t i = 0; i < n; ++i) {
      const double g = gate[i];
      if (act == RINGLM_ACT_SWIGLU_OAI) {  // ggml's swiglu_oai: gate clamped above at 7, up to [-7, 7]
        const double a = std::min(g, 7.0), b = std::clamp(static_cast<double>(up[i]), -7.0, 7.0);
        want[i] = a / (1.0 + std::exp(-1.702 * a)) * (b + 1.0);
        continue;
      }
      const double a = act == RINGLM_ACT_SILU
                           ? g / (1.0 + std::exp(-g))
                           : g / 2.0 * (1.0 + std::tanh(sqrt_2_over_pi * (g + 0.044715 * g * g * g)));
      want[i] = a * up[i];
    }
    // 1e-5 relative; GELU's 1 + tanh(z) for z near -3 loses digits to cancellation in float,
    // hence an absolute term of a few float roundings of g * up.
    const std::vector<float> got = gd.download<float>(n, 16);
    for (size_t i = 0; i < n; ++i) {
      const double tol = 1e-5 * std::fabs(want[i]) + 2e-6 * std::fabs(up[i]) * std::max(1.0, std::fabs(gate[i] * 1.0));
      ASSERT_LE(std::fabs(got[i] - want[i]), tol) << "gate " << gate[i] << " up " << up[i] << ": " << got[i]
                                                  << ", reference " << want[i];
    }
  }
}

struct RowRopeCase {
  bool adjacent;
  int head_dim, n_rot;
};

class RowRope : public ::testing::TestWithParam<RowRopeCase> {};

TEST_P(RowRope, RotatesTheFirstNRotOfEveryHead) {
  REQUIRE_PLUGIN();
  const RowRopeCase c = GetParam();
  std::mt19937 rng(static_cast<unsigned>(c.head_dim * 3 + c.n_rot + c.adjacent));
  const int n_rows = 2, n_heads = 3, half = c.n_rot / 2;
  const size_t width = static_cast<size_t>(n_heads * c.head_dim);
  const std::vector<float> x = random_floats(n_rows * width, rng, 2.0f);
  // Row r's angles: (r + 1) * theta_i, so the two rows turn differently.
  std::vector<float> cos_t(static_cast<size_t>(n_rows * half)), sin_t(cos_t.size());
  for (int r = 0; r < n_rows; ++r) {
    for (int i = 0; i < half; ++i) {
      const double angle = (r + 1) * std::pow(10000.0, -2.0 * i / c.n_rot) * 7.0;
      cos_t[static_cast<size_t>(r * half + i)] = static_cast<float>(std::cos(angle));
      sin_t[static_cast<size_t>(r * half + i)] = static_cast<float>(std::sin(angle));
    }
  }
  // The formula in float, as rope_shift's test.
  std::vector<float> want = x;
  for (int r = 0; r < n_rows; ++r) {
    for (int h = 0; h < n_heads; ++h) {
      float* row = &want[r * width + static_cast<size_t>(h * c.head_dim)];
      for (int i = 0; i < half; ++i) {
        const int a = c.adjacent ? 2 * i : i, b = c.adjacent ? 2 * i + 1 : i + half;
        const float xa = row[a], xb = row[b], cs = cos_t[static_cast<size_t>(r * half + i)],
                    sn = sin_t[static_cast<size_t>(r * half + i)];
        row[a] = xa * cs - xb * sn;
        row[b] = xa * sn + xb * cs;
      }
    }
  }
  // cos and sin in one buffer, as a host's table could keep them.
  std::vector<float> table = cos_t;
  table.insert(table.end(), sin_t.begin(), sin_t.end());
  DeviceBuffer xd(x, 40);
  DeviceBuffer td(table, 8);
  const ringlm_rope_args args{.x = xd.get(),
                              .x_offset = 40,
                              .n_rows = n_rows,
                              .n_heads = n_heads,
                              .head_dim = c.head_dim,
                              .n_rot = c.n_rot,
                              .adjacent_pairs = c.adjacent,
                              .cos = td.get(),
                              .cos_offset = 8,
                              .sin = td.get(),
                              .sin_offset = 8 + cos_t.size() * sizeof(float)};
  ASSERT_EQ(api().rope(ctx(), &args), RINGLM_OK) << last_error();
  const std::vector<float> got = xd.download<float>(x.size(), 40);
  for (size_t i = 0; i < got.size(); ++i) {
    const int e = static_cast<int>(i % static_cast<size_t>(c.head_dim));
    if (e >= c.n_rot) {
      ASSERT_EQ(got[i], x[i]) << "element " << i << " is past n_rot and must not change";
    } else {
      ASSERT_LE(std::fabs(got[i] - want[i]), 1e-6f * (1.0f + std::fabs(want[i]))) << "element " << i;
    }
  }
  EXPECT_NE(got, x);
}

INSTANTIATE_TEST_SUITE_P(Layouts, RowRope,
                         ::testing::Values(RowRopeCase{true, 64, 64}, RowRopeCase{false, 64, 64},
                                           RowRopeCase{true, 64, 32}, RowRopeCase{false, 16, 8}),
                         [](const auto& info) {
                           return std::string(info.param.adjacent ? "adjacent" : "halves") + "_d" +
                                  std::to_string(info.param.head_dim) + "_rot" + std::to_string(info.param.n_rot);
                         });

// rope_store (q's and k's RoPE and the store of k and v in one launch) writes, bit for bit, what
// rope, rope, store_kv, store_kv write: rotated q and k in place, the cache rows of k and v, for
// both pair layouts, n_rot < head_dim, fp16 and fp32 caches, several rows.
TEST(OpenclPlugin, RopeStoreEqualsRopeThenStore) {
  REQUIRE_PLUGIN();
  std::mt19937 rng(31);
  const int n_rows = 3, n_head = 4, n_head_kv = 2, head_dim = 16;
  const size_t q_n = static_cast<size_t>(n_rows * n_head * head_dim), kv_n = static_cast<size_t>(n_rows * n_head_kv * head_dim);
  for (const int n_rot : {16, 8}) {
    for (const int adjacent : {0, 1}) {
      for (const uint32_t format : {uint32_t{RINGLM_FORMAT_F16}, uint32_t{RINGLM_FORMAT_F32}}) {
        SCOPED_TRACE("n_rot " + std::to_string(n_rot) + " adjacent " + std::to_string(adjacent) + " format " +
                     std::to_string(format));
        const std::vector<float> q = random_floats(q_n, rng, 3.0f), k = random_floats(kv_n, rng, 3.0f),
                                 v = random_floats(kv_n, rng, 3.0f);
        const std::vector<float> cos = random_floats(static_cast<size_t>(n_rows * n_rot / 2), rng, 1.0f),
                                 sin = random_floats(static_cast<size_t>(n_rows * n_rot / 2), rng, 1.0f);
        const size_t elem = format == RINGLM_FORMAT_F16 ? 2 : 4, cache_bytes = 64 + kv_n * elem;
        DeviceBuffer cd(cos), sd(sin);
        // The reference: four launches.
        DeviceBuffer q1(q), k1(k), v1(v), keys1(cache_bytes), values1(cache_bytes);
        ringlm_rope_args rq{q1.get(), 0, n_rows, n_head, head_dim, n_rot, adjacent, cd.get(), 0, sd.get(), 0};
        ringlm_rope_args rk = rq;
        rk.x = k1.get();
        rk.n_heads = n_head_kv;
        ASSERT_EQ(api().rope(ctx(), &rq), RINGLM_OK) << last_error();
        ASSERT_EQ(api().rope(ctx(), &rk), RINGLM_OK) << last_error();
        const ringlm_store_kv_args sk{k1.get(), 0, keys1.get(), 64, format, n_rows, n_head_kv * head_dim};
        ringlm_store_kv_args sv = sk;
        sv.src = v1.get();
        sv.dst = values1.get();
        ASSERT_EQ(api().store_kv(ctx(), &sk), RINGLM_OK) << last_error();
        ASSERT_EQ(api().store_kv(ctx(), &sv), RINGLM_OK) << last_error();
        // One launch.
        DeviceBuffer q2(q), k2(k), v2(v), keys2(cache_bytes), values2(cache_bytes);
        ringlm_rope_store_args fused{};
        fused.rope = rq;
        fused.rope.x = q2.get();
        fused.k = k2.get();
        fused.v = v2.get();
        fused.n_head_kv = n_head_kv;
        fused.keys = keys2.get();
        fused.keys_offset = 64;
        fused.values = values2.get();
        fused.values_offset = 64;
        fused.kv_format = format;
        ASSERT_EQ(api().rope_store(ctx(), &fused), RINGLM_OK) << last_error();
        EXPECT_EQ(q2.download<float>(q_n), q1.download<float>(q_n));
        EXPECT_EQ(k2.download<float>(kv_n), k1.download<float>(kv_n));
        EXPECT_EQ(keys2.download<uint8_t>(kv_n * elem, 64), keys1.download<uint8_t>(kv_n * elem, 64));
        EXPECT_EQ(values2.download<uint8_t>(kv_n * elem, 64), values1.download<uint8_t>(kv_n * elem, 64));
        // k stored into its own buffer is refused.
        ringlm_rope_store_args bad = fused;
        bad.keys = k2.get();
        bad.keys_offset = 0;
        EXPECT_EQ(api().rope_store(ctx(), &bad), RINGLM_ERROR_INVALID_ARGUMENT);
      }
    }
  }
}

TEST(OpenclPlugin, StoreKvF32ExactAndF16RoundedToNearestEven) {
  REQUIRE_PLUGIN();
  std::mt19937 rng(15);
  const int64_t n_rows = 3, row_width = 40;
  const size_t n = static_cast<size_t>(n_rows * row_width);
  std::vector<float> src = random_floats(n, rng, 10.0f);
  // Edge cases of the fp16 rounding: ties (to even), the largest half, overflow, subnormals, zeros.
  const std::vector<float> edges = {1.0f + 0x1p-11f,    1.0f + 3 * 0x1p-11f, 65504.0f,   65519.0f, 65520.0f,
                                    1e9f,               -1e9f,               0x1p-24f,   0x1p-25f, 0x1.8p-24f,
                                    3e-6f,              -7.5e-5f,            -0.0f,      0.0f,     1e-30f,
                                    std::numeric_limits<float>::infinity(), 2049.0f,    -2051.0f};
  std::copy(edges.begin(), edges.end(), src.begin() + 7);
  const size_t src_offset = 20;
  DeviceBuffer sd(src, src_offset);

  for (const bool f16 : {false, true}) {
    SCOPED_TRACE(f16 ? "f16" : "f32");
    const size_t elem = f16 ? 2 : 4, dst_offset = 6 * elem, total = dst_offset + n * elem + 32;
    DeviceBuffer dd(std::vector<uint8_t>(total, 0xAB));
    const ringlm_store_kv_args args{.src = sd.get(),
                                    .src_offset = src_offset,
                                    .dst = dd.get(),
                                    .dst_offset = dst_offset,
                                    .kv_format = f16 ? RINGLM_FORMAT_F16 : RINGLM_FORMAT_F32,
                                    .n_rows = n_rows,
                                    .row_width = row_width};
    ASSERT_EQ(api().store_kv(ctx(), &args), RINGLM_OK) << last_error();
    std::vector<uint8_t> want(total, 0xAB);
    for (size_t i = 0; i < n; ++i) {
      if (f16) {
        const uint16_t h = fp32_to_fp16(src[i]);  // ringlm's own round-to-nearest-even conversion
        std::memcpy(&want[dst_offset + i * 2], &h, 2);
      } else {
        std::memcpy(&want[dst_offset + i * 4], &src[i], 4);
      }
    }
    const std::vector<uint8_t> got = dd.download<uint8_t>(total);
    for (size_t at = 0; at < total; at += elem) {
      ASSERT_EQ(std::memcmp(&got[at], &want[at], elem), 0)
          << "byte " << at << (at >= dst_offset && at < dst_offset + n * elem
                                   ? ": element of " + std::to_string(src[(at - dst_offset) / elem])
                                   : std::string(": outside the rows"));
    }
  }
}

class GetRows : public ::testing::TestWithParam<TensorType> {};

TEST_P(GetRows, MatchesDequantizeRowAndZerosOutOfRange) {
  REQUIRE_PLUGIN();
  const TensorType type = GetParam();
  std::mt19937 rng(static_cast<unsigned>(type) + 16);
  const bool float_type = type == TensorType::F32 || type == TensorType::F16;
  // Float rows need not be whole blocks of 32.
  const int64_t n_rows = 5, cols = float_type ? 40 : 3 * block_weights(type);
  const Weights w = make_weights(type, n_rows, cols, rng);
  const std::vector<int32_t> ids = {3, 0, 4, -1, 5, 3, std::numeric_limits<int32_t>::min()};
  const size_t ids_offset = 8, out_offset = 12;
  DeviceBuffer wd(w.bytes);
  DeviceBuffer id(ids, ids_offset);
  DeviceBuffer od(std::vector<float>(out_offset / sizeof(float) + ids.size() * cols, 42.0f));
  const ringlm_get_rows_args args{.weight = wd.get(),
                                  .weight_format = static_cast<uint32_t>(type),
                                  .n_weight_rows = n_rows,
                                  .cols = cols,
                                  .ids = id.get(),
                                  .ids_offset = ids_offset,
                                  .n_ids = static_cast<int64_t>(ids.size()),
                                  .out = od.get(),
                                  .out_offset = out_offset};
  ASSERT_EQ(api().get_rows(ctx(), &args), RINGLM_OK) << last_error();
  const std::vector<float> got = od.download<float>(ids.size() * cols, out_offset);
  const size_t row_size = row_bytes(type, cols);
  std::vector<float> want(static_cast<size_t>(cols));
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] >= 0 && ids[i] < n_rows) {
      dequantize_row(type, &w.bytes[row_size * static_cast<size_t>(ids[i])], want.data(), cols);
    } else {
      std::fill(want.begin(), want.end(), 0.0f);
    }
    for (int64_t c = 0; c < cols; ++c) {
      ASSERT_EQ(got[i * cols + c], want[static_cast<size_t>(c)]) << "id " << ids[i] << " column " << c;
    }
  }
  EXPECT_EQ(od.download<float>(out_offset / sizeof(float))[0], 42.0f);  // before out_offset: untouched
}

INSTANTIATE_TEST_SUITE_P(Formats, GetRows,
                         ::testing::Values(TensorType::Q4_0, TensorType::Q4_1, TensorType::Q8_0, TensorType::F16,
                                           TensorType::F32, TensorType::Q5_0, TensorType::Q5_1, TensorType::IQ4_NL,
                                           TensorType::Q4_K, TensorType::Q5_K, TensorType::Q6_K, TensorType::IQ4_XS,
                                           TensorType::MXFP4),
                         [](const auto& info) {
                           return std::string(type_traits(static_cast<uint32_t>(info.param))->name);
                         });

// The attention the plugin computes, in double: the n_tokens queries of q (from position q_pos0)
// over the slots whose positions they see (0 <= pos <= p, and pos > p - window when window > 0),
// reading element `at` of the cache's keys and values as key(at) and value(at) (the cache as the
// device holds it; slot j's KV head g at j * row_stride + g * hd), with each head's sink, when
// `sinks` has them, in its denominator.
template <class Key, class Value>
std::vector<double> reference_attention(const std::vector<float>& q, const std::vector<int32_t>& positions,
                                        int n_tokens, int64_t q_pos0, int n_head, int n_head_kv, int hd,
                                        int row_stride, float scale, int window, Key key, Value value,
                                        const std::vector<float>& sinks = {}) {
  const int q_width = n_head * hd;
  std::vector<double> want(static_cast<size_t>(n_tokens * q_width), 0.0);
  for (int i = 0; i < n_tokens; ++i) {
    const int64_t p = q_pos0 + i;
    for (int h = 0; h < n_head; ++h) {
      const size_t q_row = static_cast<size_t>(i * q_width + h * hd);
      const size_t kv_col = static_cast<size_t>((h / (n_head / n_head_kv)) * hd);
      std::vector<std::pair<size_t, double>> scores;  // (slot, score)
      for (size_t j = 0; j < positions.size(); ++j) {
        const int64_t pos = positions[j];
        if (pos < 0 || pos > p || (window > 0 && pos <= p - window)) continue;
        double dot = 0.0;
        for (int d = 0; d < hd; ++d) dot += static_cast<double>(q[q_row + d]) * key(j * row_stride + kv_col + d);
        scores.emplace_back(j, dot * scale);
      }
      if (scores.empty()) continue;
      double max_score = -INFINITY, denominator = 0.0;
      for (const auto& [j, sc] : scores) max_score = std::max(max_score, sc);
      for (const auto& [j, sc] : scores) denominator += std::exp(sc - max_score);
      if (!sinks.empty()) denominator += std::exp(static_cast<double>(sinks[static_cast<size_t>(h)]) - max_score);
      for (const auto& [j, sc] : scores) {
        const double weight = std::exp(sc - max_score) / denominator;
        for (int d = 0; d < hd; ++d) want[q_row + d] += weight * value(j * row_stride + kv_col + d);
      }
    }
  }
  return want;
}

// Sliding-window attention against a reference written here (cpu::attention_causal has no window):
// a ring of slots in random order with empty ones (NaN on the device), a prefill chunk of queries,
// windows from 1 (each query sees only its own key) to wider than the cache (no window).
TEST(OpenclPlugin, Attention2WindowMatchesReference) {
  REQUIRE_PLUGIN();
  std::mt19937 rng(17);
  const int n_head = 4, n_head_kv = 2, hd = 32, n_keys = 40, n_tokens = 12, n_slots = 48;
  const int kv_width = n_head_kv * hd, q_width = n_head * hd, row_stride = kv_width + 4;
  const int64_t q_pos0 = n_keys - n_tokens;
  std::vector<int> slot_of(n_slots);
  std::iota(slot_of.begin(), slot_of.end(), 0);
  std::shuffle(slot_of.begin(), slot_of.end(), rng);
  std::vector<int32_t> positions(n_slots, -1);
  for (int t = 0; t < n_keys; ++t) positions[static_cast<size_t>(slot_of[static_cast<size_t>(t)])] = t;
  const size_t cache = static_cast<size_t>(n_slots * row_stride);
  std::vector<float> k = random_floats(cache, rng, 1.5f), v = random_floats(cache, rng);
  for (size_t j = 0; j < static_cast<size_t>(n_slots); ++j) {
    if (positions[j] >= 0) continue;
    for (int e = 0; e < row_stride; ++e) k[j * row_stride + e] = v[j * row_stride + e] = std::nanf("");
  }
  const std::vector<float> q = random_floats(static_cast<size_t>(n_tokens * q_width), rng, 1.5f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));

  DeviceBuffer qd(q);
  DeviceBuffer pd(positions);
  DeviceBuffer od(q.size() * sizeof(float));
  DeviceBuffer od_v1(q.size() * sizeof(float));
  for (const bool f16 : {false, true}) {
    std::vector<uint16_t> k16(cache), v16(cache);
    for (size_t i = 0; i < cache; ++i) k16[i] = fp32_to_fp16(k[i]), v16[i] = fp32_to_fp16(v[i]);
    // What the reference reads: the cache as the device holds it.
    const auto key = [&](size_t at) { return f16 ? fp16_to_fp32(k16[at]) : k[at]; };
    const auto value = [&](size_t at) { return f16 ? fp16_to_fp32(v16[at]) : v[at]; };
    DeviceBuffer kd = f16 ? DeviceBuffer(k16) : DeviceBuffer(k);
    DeviceBuffer vd = f16 ? DeviceBuffer(v16) : DeviceBuffer(v);
    const ringlm_attention_args base{.q = qd.get(),
                                     .q_offset = 0,
                                     .out = od.get(),
                                     .out_offset = 0,
                                     .keys = kd.get(),
                                     .keys_offset = 0,
                                     .values = vd.get(),
                                     .values_offset = 0,
                                     .kv_format = f16 ? RINGLM_FORMAT_F16 : RINGLM_FORMAT_F32,
                                     .row_stride = row_stride,
                                     .positions = pd.get(),
                                     .n_slots = n_slots,
                                     .n_tokens = n_tokens,
                                     .q_pos0 = q_pos0,
                                     .n_head = n_head,
                                     .n_head_kv = n_head_kv,
                                     .head_dim = hd,
                                     .scale = scale};
    for (const int window : {0, 1, 3, 8, 1000}) {
      SCOPED_TRACE(std::string(f16 ? "f16" : "f32") + " window " + std::to_string(window));
      const ringlm_attention2_args args{.base = base, .window = window};
      ASSERT_EQ(api().attention2(ctx(), &args), RINGLM_OK) << last_error();
      const std::vector<float> got = od.download<float>(q.size());
      const std::vector<double> want = reference_attention(q, positions, n_tokens, q_pos0, n_head, n_head_kv, hd,
                                                           row_stride, scale, window, key, value);
      expect_close(got, want, 0.0, 1e-4, "attention2");
      if (window == 1) {  // each query sees its own key only: its value row, exactly
        for (int i = 0; i < n_tokens; ++i) {
          const size_t j = static_cast<size_t>(slot_of[static_cast<size_t>(q_pos0 + i)]);
          EXPECT_EQ(got[static_cast<size_t>(i * q_width)], value(j * row_stride));
        }
      }
      if (window == 0) {  // attention (v1) is the same kernel with window 0: bit for bit
        ringlm_attention_args v1 = base;
        v1.out = od_v1.get();
        ASSERT_EQ(api().attention(ctx(), &v1), RINGLM_OK) << last_error();
        EXPECT_EQ(od_v1.download<float>(q.size()), got);
      }
    }
  }
}

// Attention with sinks (version 4, gpt-oss) against a reference written here: each head's
// denominator gains exp(sink - max score), for a prompt chunk (the tiled kernel in GPU shapes)
// and a decode row over many slots (split into flash-decoding parts where the device has the
// cores), with and without a window; a sink far below every score changes nothing, one far above
// drives the output to zero.
TEST(OpenclPlugin, Attention3SinksMatchReference) {
  REQUIRE_PLUGIN();
  std::mt19937 rng(29);
  // Two heads: a decode row is then too few groups for the device's cores.
  const int n_head = 2, n_head_kv = 1, hd = 32, n_slots = 1100;  // past 2 x 512: the decode row splits
  const int kv_width = n_head_kv * hd, q_width = n_head * hd;
  std::vector<int32_t> positions(n_slots);
  std::iota(positions.begin(), positions.end(), 0);
  const size_t cache = static_cast<size_t>(n_slots * kv_width);
  const std::vector<float> k = random_floats(cache, rng, 1.5f), v = random_floats(cache, rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  DeviceBuffer kd(k), vd(v), pd(positions);
  for (const int n_tokens : {12, 1}) {
    const std::vector<float> q = random_floats(static_cast<size_t>(n_tokens * q_width), rng, 1.5f);
    const int64_t q_pos0 = n_slots - n_tokens;
    DeviceBuffer qd(q), od(q.size() * sizeof(float));
    const std::vector<std::vector<float>> sink_sets = {{0.5f, 2.5f}, {-1e4f, -1e4f}, {1e4f, 1e4f}};
    for (const int window : {0, 8}) {
      for (const std::vector<float>& sinks : sink_sets) {
        SCOPED_TRACE("tokens " + std::to_string(n_tokens) + " window " + std::to_string(window) + " sink " +
                     std::to_string(sinks[0]));
        DeviceBuffer sd(sinks, 8);
        ringlm_attention3_args args{};
        args.base.base = {.q = qd.get(), .q_offset = 0, .out = od.get(), .out_offset = 0, .keys = kd.get(),
                          .keys_offset = 0, .values = vd.get(), .values_offset = 0, .kv_format = RINGLM_FORMAT_F32,
                          .row_stride = kv_width, .positions = pd.get(), .n_slots = n_slots, .n_tokens = n_tokens,
                          .q_pos0 = q_pos0, .n_head = n_head, .n_head_kv = n_head_kv, .head_dim = hd, .scale = scale};
        args.base.window = window;
        args.sinks = sd.get();
        args.sinks_offset = 8;  // bytes: DeviceBuffer(sinks, 8) puts them there
        ASSERT_EQ(api().attention3(ctx(), &args), RINGLM_OK) << last_error();
        const std::vector<float> got = od.download<float>(q.size());
        const std::vector<double> want =
            reference_attention(q, positions, n_tokens, q_pos0, n_head, n_head_kv, hd, kv_width, scale, window,
                                [&](size_t at) { return k[at]; }, [&](size_t at) { return v[at]; }, sinks);
        expect_close(got, want, 0.0, 1e-4, "attention3");
        if (sinks[0] > 1e3f) {
          for (const float x : got) ASSERT_EQ(x, 0.0f);  // the sink takes every weight, and gives nothing
        }
        ringlm_attention3_args past_end = args;
        past_end.sinks_offset = 16;  // the two sinks would end 8 bytes past the buffer
        expect_error(api().attention3(ctx(), &past_end), RINGLM_ERROR_INVALID_ARGUMENT, "attention sinks");
      }
    }
  }
}

// --- Version 2: transfers and counters --------------------------------------------------------

TEST(OpenclPlugin, CopyMovesBytesOnTheDevice) {
  REQUIRE_PLUGIN();
  std::vector<uint8_t> a(256), b(128, 0);
  std::iota(a.begin(), a.end(), uint8_t{0});
  DeviceBuffer ad(a);
  DeviceBuffer bd(b);
  ASSERT_EQ(api().copy(ctx(), bd.get(), 10, ad.get(), 100, 50), RINGLM_OK) << last_error();
  std::vector<uint8_t> want_b = b;
  std::copy(a.begin() + 100, a.begin() + 150, want_b.begin() + 10);
  EXPECT_EQ(bd.download<uint8_t>(b.size()), want_b);
  // Within one buffer, the ranges apart.
  ASSERT_EQ(api().copy(ctx(), ad.get(), 0, ad.get(), 128, 128), RINGLM_OK) << last_error();
  std::vector<uint8_t> want_a = a;
  std::copy(a.begin() + 128, a.end(), want_a.begin());
  EXPECT_EQ(ad.download<uint8_t>(a.size()), want_a);
  EXPECT_EQ(api().copy(ctx(), ad.get(), 0, ad.get(), 0, 0), RINGLM_OK) << last_error();  // nothing to copy
}

TEST(OpenclPlugin, UploadAsyncKeepsItsOwnCopy) {
  REQUIRE_PLUGIN();
  std::mt19937 rng(18);
  const size_t n = 4096;
  DeviceBuffer d(n * sizeof(float) + 64);
  std::vector<float> want;
  {
    // The caller's memory is reused and then freed as soon as upload_async returns.
    auto host = std::make_unique<std::vector<float>>(random_floats(n, rng));
    want = *host;
    ASSERT_EQ(api().upload_async(ctx(), d.get(), 64, host->data(), n * sizeof(float)), RINGLM_OK) << last_error();
    std::fill(host->begin(), host->end(), -1.0f);
  }
  EXPECT_EQ(d.download<float>(n, 64), want);

  // Many in a row, each over part of the last: the device ends with the last one's bytes.
  for (int round = 0; round < 20; ++round) {
    std::vector<float> chunk = random_floats(n / 2, rng);
    const size_t at = 64 + static_cast<size_t>(round % 3) * 1024;
    ASSERT_EQ(api().upload_async(ctx(), d.get(), at, chunk.data(), chunk.size() * sizeof(float)), RINGLM_OK)
        << last_error();
    std::copy(chunk.begin(), chunk.end(), want.begin() + static_cast<std::ptrdiff_t>((at - 64) / sizeof(float)));
  }
  ASSERT_EQ(api().finish(ctx()), RINGLM_OK) << last_error();
  EXPECT_EQ(d.download<float>(n, 64), want);
  // Zero bytes: nothing to do, and no source needed.
  EXPECT_EQ(api().upload_async(ctx(), d.get(), 0, nullptr, 0), RINGLM_OK) << last_error();
}

ringlm_counters counters_now() {
  ringlm_counters c{};
  EXPECT_EQ(api().counters(ctx(), &c), RINGLM_OK) << last_error();
  return c;
}

// Expects `after` - `before` to be exactly (launches, upload bytes, download bytes, waits).
void expect_delta(const ringlm_counters& before, const ringlm_counters& after, uint64_t launches, uint64_t up,
                  uint64_t down, uint64_t waits, const char* what) {
  EXPECT_EQ(after.launches - before.launches, launches) << what;
  EXPECT_EQ(after.upload_bytes - before.upload_bytes, up) << what;
  EXPECT_EQ(after.download_bytes - before.download_bytes, down) << what;
  EXPECT_EQ(after.waits - before.waits, waits) << what;
}

TEST(OpenclPlugin, CountersCountExactlyWhatWasDone) {
  REQUIRE_PLUGIN();
  DeviceBuffer a(256);
  DeviceBuffer b(256);
  const std::vector<float> host(16, 1.5f);
  std::vector<float> back(16);
  const std::vector<float> ones(16, 1.0f);
  DeviceBuffer w(ones);

  ringlm_counters c0 = counters_now();
  ASSERT_EQ(api().upload_async(ctx(), a.get(), 0, host.data(), 64), RINGLM_OK) << last_error();
  ringlm_counters c1 = counters_now();
  expect_delta(c0, c1, 0, 64, 0, 0, "upload_async of 64 bytes");

  ASSERT_EQ(api().download(ctx(), a.get(), 0, back.data(), 64), RINGLM_OK) << last_error();
  ringlm_counters c2 = counters_now();
  expect_delta(c1, c2, 0, 0, 64, 1, "download of 64 bytes");
  EXPECT_EQ(back, host);

  const ringlm_rms_norm_args norm{.x = a.get(),
                                  .x_offset = 0,
                                  .out = b.get(),
                                  .out_offset = 0,
                                  .weight = w.get(),
                                  .weight_offset = 0,
                                  .n_rows = 1,
                                  .width = 16,
                                  .eps = 1e-6f};
  ASSERT_EQ(api().rms_norm(ctx(), &norm), RINGLM_OK) << last_error();
  ringlm_counters c3 = counters_now();
  expect_delta(c2, c3, 1, 0, 0, 0, "rms_norm");

  ASSERT_EQ(api().scale(ctx(), b.get(), 0, 16, 2.0f), RINGLM_OK) << last_error();
  ASSERT_EQ(api().copy(ctx(), a.get(), 128, b.get(), 0, 64), RINGLM_OK) << last_error();  // a launch too
  ringlm_counters c4 = counters_now();
  expect_delta(c3, c4, 2, 0, 0, 0, "scale and copy");

  ASSERT_EQ(api().finish(ctx()), RINGLM_OK) << last_error();
  ringlm_counters c5 = counters_now();
  expect_delta(c4, c5, 0, 0, 0, 1, "finish");

  ASSERT_EQ(api().upload(ctx(), a.get(), 0, host.data(), 32), RINGLM_OK) << last_error();
  ringlm_counters c6 = counters_now();
  expect_delta(c5, c6, 0, 32, 0, 1, "blocking upload of 32 bytes");

  // Refused calls do nothing, and zero-byte transfers move nothing.
  EXPECT_NE(api().scale(ctx(), b.get(), 0, 0, 2.0f), RINGLM_OK);
  EXPECT_NE(api().download(ctx(), a.get(), 250, back.data(), 64), RINGLM_OK);
  EXPECT_NE(api().upload_async(ctx(), a.get(), 250, host.data(), 64), RINGLM_OK);
  EXPECT_EQ(api().download(ctx(), a.get(), 0, back.data(), 0), RINGLM_OK);
  ringlm_counters c7 = counters_now();
  expect_delta(c6, c7, 0, 0, 0, 0, "refused and empty calls");

  // And the result of that sequence: b = rms_norm(1.5 ...) * 2 = 2, copied to a[128..].
  ASSERT_EQ(api().download(ctx(), a.get(), 128, back.data(), 64), RINGLM_OK) << last_error();
  for (const float v : back) EXPECT_NEAR(v, 2.0f, 1e-5f);

  ringlm_counters unused{};
  expect_error(api().counters(nullptr, &unused), RINGLM_ERROR_INVALID_ARGUMENT, "null context");
  expect_error(api().counters(ctx(), nullptr), RINGLM_ERROR_INVALID_ARGUMENT, "null output");
}

// --- Version 2: what it refuses --------------------------------------------------------------

TEST(OpenclPlugin, SupportsRowOpsAndWindowAttention) {
  REQUIRE_PLUGIN();
  const auto row_ops = [](uint32_t kv_format, uint32_t weight_format) {
    ringlm_op_desc d{};
    d.op = RINGLM_OP_ROW_OPS;
    d.kv_format = kv_format;
    d.weight_format = weight_format;
    return api().supports(ctx(), &d);
  };
  EXPECT_TRUE(row_ops(0, 0));  // nothing asked: F32 both
  EXPECT_TRUE(row_ops(RINGLM_FORMAT_F16, RINGLM_FORMAT_Q4_0));
  EXPECT_TRUE(row_ops(RINGLM_FORMAT_F32, RINGLM_FORMAT_Q4_1));
  EXPECT_TRUE(row_ops(RINGLM_FORMAT_F16, RINGLM_FORMAT_Q8_0));
  EXPECT_TRUE(row_ops(RINGLM_FORMAT_F16, RINGLM_FORMAT_F16));
  EXPECT_FALSE(row_ops(RINGLM_FORMAT_Q8_0, RINGLM_FORMAT_F32));  // not a KV format
  EXPECT_FALSE(row_ops(RINGLM_FORMAT_F16, 30));                  // BF16
  EXPECT_FALSE(row_ops(RINGLM_FORMAT_F16, 99));

  const auto window = [](uint32_t kv_format, int n_head, int n_head_kv, int head_dim) {
    ringlm_op_desc d{};
    d.op = RINGLM_OP_WINDOW_ATTENTION;
    d.kv_format = kv_format;
    d.n_head = n_head;
    d.n_head_kv = n_head_kv;
    d.head_dim = head_dim;
    return api().supports(ctx(), &d);
  };
  EXPECT_TRUE(window(RINGLM_FORMAT_F16, 9, 3, 64));
  EXPECT_TRUE(window(RINGLM_FORMAT_F32, 8, 8, 256));
  EXPECT_FALSE(window(RINGLM_FORMAT_F16, 9, 2, 64));
  EXPECT_FALSE(window(RINGLM_FORMAT_Q4_0, 8, 8, 64));
  EXPECT_FALSE(window(RINGLM_FORMAT_F16, 8, 8, 66));
}

TEST(OpenclPlugin, BadArgumentsOfVersion2AreErrorsNotCrashes) {
  REQUIRE_PLUGIN();
  const int64_t rows = 2, width = 32, n = rows * width;
  DeviceBuffer x(std::vector<float>(n, 1.0f));
  DeviceBuffer y(std::vector<float>(n, 2.0f));
  DeviceBuffer w(std::vector<float>(width, 1.0f));
  std::mt19937 rng(19);
  const Weights q = make_weights(TensorType::Q8_0, 4, 64, rng);
  DeviceBuffer qd(q.bytes);
  DeviceBuffer ids(std::vector<int32_t>{0, 1});
  DeviceBuffer pos(std::vector<int32_t>{0, 1});
  const ringlm_counters before = counters_now();  // every upload of the test's data done

  // upload_async, finish, copy.
  std::vector<uint8_t> host(64);
  expect_error(api().upload_async(nullptr, x.get(), 0, host.data(), 16), RINGLM_ERROR_INVALID_ARGUMENT,
               "null context");
  expect_error(api().upload_async(ctx(), nullptr, 0, host.data(), 16), RINGLM_ERROR_INVALID_ARGUMENT, "null buffer");
  expect_error(api().upload_async(ctx(), x.get(), n * sizeof(float) - 8, host.data(), 16),
               RINGLM_ERROR_INVALID_ARGUMENT, "past the buffer");
  expect_error(api().upload_async(ctx(), x.get(), SIZE_MAX - 4, host.data(), 16), RINGLM_ERROR_INVALID_ARGUMENT,
               "overflows");
  expect_error(api().upload_async(ctx(), x.get(), 0, nullptr, 16), RINGLM_ERROR_INVALID_ARGUMENT, "null source");
  expect_error(api().finish(nullptr), RINGLM_ERROR_INVALID_ARGUMENT, "null context");
  expect_error(api().copy(ctx(), nullptr, 0, y.get(), 0, 16), RINGLM_ERROR_INVALID_ARGUMENT, "copy dst: null buffer");
  expect_error(api().copy(ctx(), x.get(), 0, nullptr, 0, 16), RINGLM_ERROR_INVALID_ARGUMENT, "copy src: null buffer");
  expect_error(api().copy(ctx(), x.get(), 0, y.get(), n * sizeof(float) - 8, 16), RINGLM_ERROR_INVALID_ARGUMENT,
               "copy src");
  expect_error(api().copy(ctx(), x.get(), n * sizeof(float) - 8, y.get(), 0, 16), RINGLM_ERROR_INVALID_ARGUMENT,
               "copy dst");
  expect_error(api().copy(ctx(), x.get(), 0, x.get(), 8, 16), RINGLM_ERROR_INVALID_ARGUMENT, "overlap");
  expect_error(api().copy(ctx(), x.get(), 8, x.get(), 0, 16), RINGLM_ERROR_INVALID_ARGUMENT, "overlap");
  expect_error(api().copy(nullptr, x.get(), 0, y.get(), 0, 16), RINGLM_ERROR_INVALID_ARGUMENT, "null context");

  // rms_norm.
  const ringlm_rms_norm_args norm{.x = x.get(),
                                  .x_offset = 0,
                                  .out = y.get(),
                                  .out_offset = 0,
                                  .weight = w.get(),
                                  .weight_offset = 0,
                                  .n_rows = rows,
                                  .width = width,
                                  .eps = 1e-6f};
  ringlm_rms_norm_args nm = norm;
  nm.x = nullptr;
  expect_error(api().rms_norm(ctx(), &nm), RINGLM_ERROR_INVALID_ARGUMENT, "rms_norm x: null buffer");
  nm = norm;
  nm.n_rows = 3;  // past both x and out
  expect_error(api().rms_norm(ctx(), &nm), RINGLM_ERROR_INVALID_ARGUMENT, "past the buffer");
  nm = norm;
  nm.width = 0;
  expect_error(api().rms_norm(ctx(), &nm), RINGLM_ERROR_INVALID_ARGUMENT, "width");
  nm = norm;
  nm.n_rows = -1;
  expect_error(api().rms_norm(ctx(), &nm), RINGLM_ERROR_INVALID_ARGUMENT, "n_rows");
  nm = norm;
  nm.n_rows = INT64_MAX / 2;  // the size overflows
  expect_error(api().rms_norm(ctx(), &nm), RINGLM_ERROR_INVALID_ARGUMENT, "overflows");
  nm = norm;
  nm.weight_offset = 8;  // the weight runs past its buffer
  expect_error(api().rms_norm(ctx(), &nm), RINGLM_ERROR_INVALID_ARGUMENT, "rms_norm weight");
  nm = norm;
  nm.out_offset = 2;
  expect_error(api().rms_norm(ctx(), &nm), RINGLM_ERROR_INVALID_ARGUMENT, "multiple");
  nm = norm;
  nm.n_rows = 1;
  nm.out = x.get();
  nm.out_offset = 64;  // out = x's second half of the row: partly over x
  expect_error(api().rms_norm(ctx(), &nm), RINGLM_ERROR_INVALID_ARGUMENT, "overlaps");
  expect_error(api().rms_norm(ctx(), nullptr), RINGLM_ERROR_INVALID_ARGUMENT, "null arguments");
  expect_error(api().rms_norm(nullptr, &norm), RINGLM_ERROR_INVALID_ARGUMENT, "null context");

  // add, scale, glu.
  const ringlm_add_args add{.x = x.get(), .x_offset = 0, .delta = y.get(), .delta_offset = 0, .n = n, .delta_n = n};
  ringlm_add_args ad = add;
  ad.delta = nullptr;
  expect_error(api().add(ctx(), &ad), RINGLM_ERROR_INVALID_ARGUMENT, "add delta: null buffer");
  ad = add;
  ad.n = 0;
  expect_error(api().add(ctx(), &ad), RINGLM_ERROR_INVALID_ARGUMENT, "n = 0");
  ad = add;
  ad.delta_n = 24;  // does not divide 64
  expect_error(api().add(ctx(), &ad), RINGLM_ERROR_INVALID_ARGUMENT, "delta_n");
  ad = add;
  ad.delta_offset = 4;
  expect_error(api().add(ctx(), &ad), RINGLM_ERROR_INVALID_ARGUMENT, "add delta");
  ad = add;
  ad.n = ad.delta_n = n / 2;
  ad.delta = x.get();
  ad.delta_offset = 16;
  expect_error(api().add(ctx(), &ad), RINGLM_ERROR_INVALID_ARGUMENT, "overlaps");
  expect_error(api().scale(ctx(), nullptr, 0, 4, 2.0f), RINGLM_ERROR_INVALID_ARGUMENT, "null buffer");
  expect_error(api().scale(ctx(), x.get(), 0, -5, 2.0f), RINGLM_ERROR_INVALID_ARGUMENT, "n = -5");
  expect_error(api().scale(ctx(), x.get(), 4, n, 2.0f), RINGLM_ERROR_INVALID_ARGUMENT, "past the buffer");
  expect_error(api().scale(ctx(), x.get(), 0, INT64_MAX, 2.0f), RINGLM_ERROR_INVALID_ARGUMENT, "overflows");
  expect_error(api().scale(nullptr, x.get(), 0, 4, 2.0f), RINGLM_ERROR_INVALID_ARGUMENT, "null context");
  const ringlm_glu_args glu{
      .gate = x.get(), .gate_offset = 0, .up = y.get(), .up_offset = 0, .n = n, .activation = RINGLM_ACT_SILU};
  ringlm_glu_args gl = glu;
  gl.up = nullptr;
  expect_error(api().glu(ctx(), &gl), RINGLM_ERROR_INVALID_ARGUMENT, "glu up: null buffer");
  gl = glu;
  gl.n = n + 1;
  expect_error(api().glu(ctx(), &gl), RINGLM_ERROR_INVALID_ARGUMENT, "past the buffer");
  gl = glu;
  gl.n = 0;
  expect_error(api().glu(ctx(), &gl), RINGLM_ERROR_INVALID_ARGUMENT, "n = 0");
  gl = glu;
  gl.activation = 7;
  expect_error(api().glu(ctx(), &gl), RINGLM_ERROR_UNSUPPORTED, "activation 7");

  // rope.
  const ringlm_rope_args rope{.x = x.get(),
                              .x_offset = 0,
                              .n_rows = rows,
                              .n_heads = 2,
                              .head_dim = 16,
                              .n_rot = 16,
                              .adjacent_pairs = 1,
                              .cos = w.get(),
                              .cos_offset = 0,
                              .sin = w.get(),
                              .sin_offset = 64};
  ringlm_rope_args rp = rope;
  rp.cos = nullptr;
  expect_error(api().rope(ctx(), &rp), RINGLM_ERROR_INVALID_ARGUMENT, "rope cos: null buffer");
  rp = rope;
  rp.sin_offset = 68;  // the sines run past w
  expect_error(api().rope(ctx(), &rp), RINGLM_ERROR_INVALID_ARGUMENT, "rope sin");
  rp = rope;
  rp.n_rows = 0;
  expect_error(api().rope(ctx(), &rp), RINGLM_ERROR_INVALID_ARGUMENT, "n_rows = 0");
  rp = rope;
  rp.n_rot = 15;
  expect_error(api().rope(ctx(), &rp), RINGLM_ERROR_INVALID_ARGUMENT, "n_rot = 15");
  rp = rope;
  rp.n_rot = 18;
  expect_error(api().rope(ctx(), &rp), RINGLM_ERROR_INVALID_ARGUMENT, "n_rot = 18");
  rp = rope;
  rp.sin = x.get();
  rp.sin_offset = 0;
  expect_error(api().rope(ctx(), &rp), RINGLM_ERROR_INVALID_ARGUMENT, "overlaps");

  // store_kv.
  const ringlm_store_kv_args store{.src = x.get(),
                                   .src_offset = 0,
                                   .dst = y.get(),
                                   .dst_offset = 0,
                                   .kv_format = RINGLM_FORMAT_F16,
                                   .n_rows = rows,
                                   .row_width = width};
  ringlm_store_kv_args st = store;
  st.dst = nullptr;
  expect_error(api().store_kv(ctx(), &st), RINGLM_ERROR_INVALID_ARGUMENT, "store_kv dst: null buffer");
  st = store;
  st.kv_format = RINGLM_FORMAT_F32;
  st.dst_offset = 4;  // fp32 rows one element past y
  expect_error(api().store_kv(ctx(), &st), RINGLM_ERROR_INVALID_ARGUMENT, "store_kv dst");
  st = store;
  st.dst_offset = 1;  // not a whole fp16
  expect_error(api().store_kv(ctx(), &st), RINGLM_ERROR_INVALID_ARGUMENT, "multiple");
  st = store;
  st.row_width = -3;
  expect_error(api().store_kv(ctx(), &st), RINGLM_ERROR_INVALID_ARGUMENT, "row_width");
  st = store;
  st.kv_format = RINGLM_FORMAT_Q8_0;
  expect_error(api().store_kv(ctx(), &st), RINGLM_ERROR_UNSUPPORTED, "KV format");

  // get_rows.
  const ringlm_get_rows_args get{.weight = qd.get(),
                                 .weight_format = RINGLM_FORMAT_Q8_0,
                                 .n_weight_rows = 4,
                                 .cols = 64,
                                 .ids = ids.get(),
                                 .ids_offset = 0,
                                 .n_ids = 1,
                                 .out = y.get(),
                                 .out_offset = 0};
  ringlm_get_rows_args gr = get;
  gr.ids = nullptr;
  expect_error(api().get_rows(ctx(), &gr), RINGLM_ERROR_INVALID_ARGUMENT, "get_rows ids: null buffer");
  gr = get;
  gr.n_weight_rows = 5;  // more rows than the buffer holds
  expect_error(api().get_rows(ctx(), &gr), RINGLM_ERROR_INVALID_ARGUMENT, "get_rows weight");
  gr = get;
  gr.n_ids = 3;
  expect_error(api().get_rows(ctx(), &gr), RINGLM_ERROR_INVALID_ARGUMENT, "get_rows ids");
  gr = get;
  gr.n_ids = 0;
  expect_error(api().get_rows(ctx(), &gr), RINGLM_ERROR_INVALID_ARGUMENT, "n_ids = 0");
  gr = get;
  gr.cols = 48;
  expect_error(api().get_rows(ctx(), &gr), RINGLM_ERROR_INVALID_ARGUMENT, "multiple of 32");
  gr = get;
  gr.out_offset = 4;
  gr.n_ids = 2;  // 2 rows of 64 floats from byte 4: past y's 256 bytes
  expect_error(api().get_rows(ctx(), &gr), RINGLM_ERROR_INVALID_ARGUMENT, "get_rows out");
  gr = get;
  gr.weight_format = 30;  // BF16
  expect_error(api().get_rows(ctx(), &gr), RINGLM_ERROR_UNSUPPORTED, "format");

  // attention2: everything attention checks, and the window.
  const ringlm_attention2_args att{.base = {.q = x.get(),
                                            .q_offset = 0,
                                            .out = y.get(),
                                            .out_offset = 0,
                                            .keys = x.get(),
                                            .keys_offset = 0,
                                            .values = x.get(),
                                            .values_offset = 0,
                                            .kv_format = RINGLM_FORMAT_F32,
                                            .row_stride = 32,
                                            .positions = pos.get(),
                                            .n_slots = 2,
                                            .n_tokens = 1,
                                            .q_pos0 = 1,
                                            .n_head = 2,
                                            .n_head_kv = 2,
                                            .head_dim = 16,
                                            .scale = 0.25f},
                                   .window = 1};
  ringlm_attention2_args at = att;
  at.window = -1;
  expect_error(api().attention2(ctx(), &at), RINGLM_ERROR_INVALID_ARGUMENT, "window = -1");
  at = att;
  at.base.n_slots = 3;
  expect_error(api().attention2(ctx(), &at), RINGLM_ERROR_INVALID_ARGUMENT, "attention keys");
  at = att;
  at.base.positions = nullptr;
  expect_error(api().attention2(ctx(), &at), RINGLM_ERROR_INVALID_ARGUMENT, "null buffer");
  at = att;
  at.base.head_dim = 18;
  expect_error(api().attention2(ctx(), &at), RINGLM_ERROR_UNSUPPORTED, "head_dim");
  expect_error(api().attention2(ctx(), nullptr), RINGLM_ERROR_INVALID_ARGUMENT, "null arguments");

  // Nothing of that reached the device; the good calls still work.
  expect_delta(before, counters_now(), 0, 0, 0, 0, "refused calls");
  ASSERT_EQ(api().rms_norm(ctx(), &norm), RINGLM_OK) << last_error();
  ASSERT_EQ(api().add(ctx(), &add), RINGLM_OK) << last_error();
  ASSERT_EQ(api().glu(ctx(), &glu), RINGLM_OK) << last_error();
  ASSERT_EQ(api().rope(ctx(), &rope), RINGLM_OK) << last_error();
  ASSERT_EQ(api().store_kv(ctx(), &store), RINGLM_OK) << last_error();
  ASSERT_EQ(api().get_rows(ctx(), &get), RINGLM_OK) << last_error();
  ASSERT_EQ(api().attention2(ctx(), &att), RINGLM_OK) << last_error();
  ASSERT_EQ(api().finish(ctx()), RINGLM_OK) << last_error();
}


// --- Top-k (version 3) ------------------------------------------------------------------------

// The k best of a row by sorting all of it: the larger value first, the lower index among equals,
// NaNs left out, {-1, -inf} past the values there are.
std::vector<ringlm_top_entry> reference_top_k(const float* row, int64_t n, int k) {
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isnan(row[i])) ids.push_back(static_cast<int32_t>(i));
  }
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return row[a] > row[b]; });
  std::vector<ringlm_top_entry> top;
  for (int e = 0; e < k; ++e) {
    top.push_back(static_cast<size_t>(e) < ids.size() ? ringlm_top_entry{ids[static_cast<size_t>(e)], row[ids[static_cast<size_t>(e)]]}
                                                      : ringlm_top_entry{-1, -INFINITY});
  }
  return top;
}

TEST(OpenclPlugin, TopKPicksTheLargestLowestIndexFirst) {
  REQUIRE_PLUGIN();
  std::mt19937 rng(29);
  struct Case {
    int64_t n_rows, n;
    int k;
  };
  // A vocabulary's width; odd widths; k at its bounds; rows with ties, NaNs and infinities.
  for (const Case c : {Case{1, 49152, 1}, Case{1, 49152, 40}, Case{3, 1000, 64}, Case{2, 7, 7}, Case{1, 1, 1},
                       Case{2, 300, 5}}) {
    std::vector<float> x = random_floats(static_cast<size_t>(c.n_rows * c.n), rng, 8.0f);
    std::uniform_int_distribution<int64_t> at(0, c.n - 1);
    for (int64_t r = 0; r < c.n_rows; ++r) {
      float* row = x.data() + r * c.n;
      // Ties: a few values repeated across the row (some of them the largest).
      for (int i = 0; i < 6; ++i) row[at(rng)] = 9.0f;
      for (int i = 0; i < 20; ++i) row[at(rng)] = std::round(row[at(rng)]);
      row[at(rng)] = std::nanf("");
      row[at(rng)] = -INFINITY;
    }
    const size_t x_offset = 64, out_offset = 32;
    DeviceBuffer xd(x, x_offset);
    const size_t out_entries = static_cast<size_t>(c.n_rows) * static_cast<size_t>(c.k);
    DeviceBuffer od(out_offset + out_entries * sizeof(ringlm_top_entry));
    const ringlm_top_k_args args{.x = xd.get(), .x_offset = x_offset, .n_rows = c.n_rows, .n = c.n, .k = c.k,
                                 .out = od.get(), .out_offset = out_offset};
    const ringlm_counters before = counters_now();
    ASSERT_EQ(api().top_k(ctx(), &args), RINGLM_OK) << last_error();
    EXPECT_EQ(counters_now().launches - before.launches, 1u);
    const std::vector<ringlm_top_entry> got = od.download<ringlm_top_entry>(out_entries, out_offset);
    for (int64_t r = 0; r < c.n_rows; ++r) {
      const std::vector<ringlm_top_entry> want = reference_top_k(x.data() + r * c.n, c.n, c.k);
      for (int e = 0; e < c.k; ++e) {
        const ringlm_top_entry& g = got[static_cast<size_t>(r * c.k + e)];
        ASSERT_EQ(g.id, want[static_cast<size_t>(e)].id) << "n " << c.n << " k " << c.k << " row " << r << " pick " << e;
        ASSERT_EQ(g.value, want[static_cast<size_t>(e)].value) << "n " << c.n << " k " << c.k << " row " << r;
      }
    }
  }
  // A row of NaNs but one: one pick, then the {-1, -inf} of the picks there are not.
  std::vector<float> nans(10, std::nanf(""));
  nans[6] = -3.0f;
  DeviceBuffer xd(nans);
  DeviceBuffer od(4 * sizeof(ringlm_top_entry));
  const ringlm_top_k_args args{.x = xd.get(), .x_offset = 0, .n_rows = 1, .n = 10, .k = 4, .out = od.get(), .out_offset = 0};
  ASSERT_EQ(api().top_k(ctx(), &args), RINGLM_OK) << last_error();
  const std::vector<ringlm_top_entry> got = od.download<ringlm_top_entry>(4);
  EXPECT_EQ(got[0].id, 6);
  EXPECT_EQ(got[0].value, -3.0f);
  for (int e = 1; e < 4; ++e) EXPECT_EQ(got[static_cast<size_t>(e)].id, -1);
}

TEST(OpenclPlugin, TopKRefusesBadArguments) {
  REQUIRE_PLUGIN();
  DeviceBuffer xd(100 * sizeof(float));
  DeviceBuffer od(100 * sizeof(ringlm_top_entry));
  const ringlm_top_k_args good{.x = xd.get(), .x_offset = 0, .n_rows = 1, .n = 100, .k = 8, .out = od.get(), .out_offset = 0};
  const ringlm_counters before = counters_now();
  ringlm_top_k_args a = good;
  a.k = 0;
  expect_error(api().top_k(ctx(), &a), RINGLM_ERROR_INVALID_ARGUMENT, "k = 0");
  a.k = RINGLM_TOP_K_MAX + 1;
  expect_error(api().top_k(ctx(), &a), RINGLM_ERROR_INVALID_ARGUMENT, "k = 65");
  a = good;
  a.n = 4;
  a.k = 5;
  expect_error(api().top_k(ctx(), &a), RINGLM_ERROR_INVALID_ARGUMENT, "k = 5");
  a = good;
  a.n_rows = 2;
  expect_error(api().top_k(ctx(), &a), RINGLM_ERROR_INVALID_ARGUMENT, "top_k x");
  a = good;
  a.out = xd.get();
  a.out_offset = 64;
  expect_error(api().top_k(ctx(), &a), RINGLM_ERROR_INVALID_ARGUMENT, "overlaps");
  a = good;
  a.x = nullptr;
  expect_error(api().top_k(ctx(), &a), RINGLM_ERROR_INVALID_ARGUMENT, "null buffer");
  expect_error(api().top_k(ctx(), nullptr), RINGLM_ERROR_INVALID_ARGUMENT, "null arguments");
  expect_delta(before, counters_now(), 0, 0, 0, 0, "refused calls");
  ASSERT_EQ(api().top_k(ctx(), &good), RINGLM_OK) << last_error();
}
}  // namespace
}  // namespace ringlm
