// The per-machine kernel table (backends/cpu/tuning.h): lookup rules, the JSON file and its
// failure modes, where it is found, that the CPU backend follows it (the int8 and sgemm paths
// round differently, so which one ran shows in the last bits), and `ringlm tune` end to end.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "backends/cpu/amx.h"
#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/kernel_packed.h"
#include "backends/cpu/tuning.h"
#include "core/gguf/gguf.h"
#include "core/model/loader.h"
#include "tests/command_runner.h"

namespace ringlm {
namespace {

constexpr int64_t kNever = KernelTable::kNever;
constexpr int64_t kDefault = KernelTable::kDefaultCrossover;

std::string work_dir() { return test::work_dir_for("test_tuning"); }
using test::slurp;

void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

KernelEntry entry(TensorType type, int64_t n, int64_t k, int64_t crossover, int64_t tiles_from = KernelEntry::kTilesNotMeasured) {
  KernelEntry e;
  e.type = type;
  e.n = n;
  e.k = k;
  e.crossover = crossover;
  e.tiles_from = tiles_from;
  return e;
}

// Sets an environment variable for one scope and puts the old value back.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value != nullptr) setenv(name, value, 1);
    else unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_) setenv(name_, old_->c_str(), 1);
    else unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// SmolLM2-like shapes: attention 576x576, FFN up 1536x576 and down 576x1536, a tied Q8_0 output.
KernelTable smol_table() {
  KernelTable t;
  t.set(entry(TensorType::Q4_1, 576, 576, 64));
  t.set(entry(TensorType::Q4_1, 1536, 576, 32));
  t.set(entry(TensorType::Q4_1, 576, 1536, 96));
  t.set(entry(TensorType::Q8_0, 49152, 576, kNever));
  return t;
}

// --- Lookup ---------------------------------------------------------------------------------

TEST(KernelTableLookup, ExactEntries) {
  const KernelTable t = smol_table();
  EXPECT_EQ(t.crossover(TensorType::Q4_1, 576, 576), 64);
  EXPECT_EQ(t.crossover(TensorType::Q4_1, 1536, 576), 32);
  EXPECT_EQ(t.crossover(TensorType::Q4_1, 576, 1536), 96);
  EXPECT_EQ(t.crossover(TensorType::Q8_0, 49152, 576), kNever);
}

TEST(KernelTableLookup, NearestByKThenN) {
  const KernelTable t = smol_table();
  // K = 576 matches two entries: N decides (2048 is nearer 1536 than 576).
  EXPECT_EQ(t.crossover(TensorType::Q4_1, 2048, 576), 32);
  EXPECT_EQ(t.crossover(TensorType::Q4_1, 192, 576), 64);
  // K comes first: N = 576 matches the 576x576 entry exactly, but K = 1400 is nearer 1536.
  EXPECT_EQ(t.crossover(TensorType::Q4_1, 576, 1400), 96);
  EXPECT_EQ(t.crossover(TensorType::Q4_1, 100000, 600), 32);
  // Only entries of the same type count.
  EXPECT_EQ(t.crossover(TensorType::Q8_0, 576, 576), kNever);
}

TEST(KernelTableLookup, DefaultWithoutAnEntryOfTheType) {
  const KernelTable t = smol_table();
  EXPECT_EQ(t.crossover(TensorType::Q4_0, 576, 576), kDefault);
  const KernelTable empty;
  EXPECT_TRUE(empty.empty());
  EXPECT_EQ(empty.crossover(TensorType::Q4_1, 576, 576), kDefault);
  // Without a measurement, the int8 kernels take every token count (tuning.h says why).
  EXPECT_EQ(kDefault, KernelTable::kNever);
}

TEST(KernelTableLookup, SetReplacesTheSameShape) {
  KernelTable t = smol_table();
  t.set(entry(TensorType::Q4_1, 576, 576, 16));
  EXPECT_EQ(t.entries().size(), 4u);
  EXPECT_EQ(t.crossover(TensorType::Q4_1, 576, 576), 16);
}

TEST(KernelTableLookup, CrossoverFromTimings) {
  const std::vector<TuningPoint> int8_wins = {{8, 1, 2}, {16, 2, 3}, {32, 4, 5}};
  EXPECT_EQ(crossover_from_timings(int8_wins), kNever);
  const std::vector<TuningPoint> sgemm_from_32 = {{8, 1, 2}, {16, 2, 3}, {32, 5, 4}, {64, 9, 7}};
  EXPECT_EQ(crossover_from_timings(sgemm_from_32), 32);
  // A noisy win at 16 followed by int8 wins does not count: the run from 64 on does.
  const std::vector<TuningPoint> blip = {{8, 1, 2}, {16, 3, 2}, {32, 4, 5}, {64, 9, 7}, {128, 18, 12}};
  EXPECT_EQ(crossover_from_timings(blip), 64);
  // sgemm wins at the largest M only if it is faster there: a loss at the end means never.
  const std::vector<TuningPoint> lost_at_end = {{8, 2, 1}, {16, 3, 2}, {32, 4, 5}};
  EXPECT_EQ(crossover_from_timings(lost_at_end), kNever);
  const std::vector<TuningPoint> sgemm_wins = {{8, 2, 1}, {16, 3, 2}};
  EXPECT_EQ(crossover_from_timings(sgemm_wins), 8);
  EXPECT_EQ(crossover_from_timings({}), kNever);
}

// The tiles' start: the nearest entry of the type that measured it (entries of a machine without
// AMX did not), else the table's default.
TEST(KernelTableLookup, TilesFromTheNearestMeasuredEntry) {
  KernelTable t = smol_table();  // measured no tiles
  EXPECT_EQ(t.tiles_from(TensorType::Q4_1, 576, 576), KernelTable::kDefaultTilesFrom);
  t.set(entry(TensorType::Q4_1, 1536, 576, 32, 96));
  t.set(entry(TensorType::Q4_1, 576, 2048, kNever, kNever));
  EXPECT_EQ(t.tiles_from(TensorType::Q4_1, 1536, 576), 96);
  EXPECT_EQ(t.tiles_from(TensorType::Q4_1, 576, 576), 96) << "the nearest measured one, not the unmeasured exact shape";
  EXPECT_EQ(t.tiles_from(TensorType::Q4_1, 576, 1900), kNever);
  EXPECT_EQ(t.tiles_from(TensorType::Q8_0, 49152, 576), KernelTable::kDefaultTilesFrom);
  t.default_tiles_from = 1;
  EXPECT_EQ(t.tiles_from(TensorType::Q8_0, 49152, 576), 1);
}

TEST(KernelTableLookup, TilesFromTimings) {
  // {m, int8, sgemm, tiles}
  const std::vector<TuningPoint> tiles_from_64 = {{16, 1, 9, 2}, {32, 2, 9, 2.5}, {64, 4, 9, 3}, {128, 8, 9, 5}};
  EXPECT_EQ(tiles_from_timings(tiles_from_64), 64);
  const std::vector<TuningPoint> blip = {{16, 1, 9, 0.5}, {32, 2, 9, 3}, {64, 4, 9, 3}};
  EXPECT_EQ(tiles_from_timings(blip), 64) << "a win at 16 followed by a loss does not count";
  const std::vector<TuningPoint> lost_at_end = {{16, 1, 9, 0.5}, {32, 2, 9, 3}};
  EXPECT_EQ(tiles_from_timings(lost_at_end), kNever);
  const std::vector<TuningPoint> not_measured = {{16, 2, 9}, {32, 4, 9}};
  EXPECT_EQ(tiles_from_timings(not_measured), kNever);
}

// --- The file ---------------------------------------------------------------------------------

KernelTable full_table() {
  KernelTable t = smol_table();
  t.machine = {"Test CPU @ 1 GHz", "AVX2", 3, "2025-01-02T03:04:05Z", "9.9.9"};
  KernelEntry measured = entry(TensorType::Q4_0, 192, 576, 24);
  measured.m = {8, 16, 24};
  measured.int8_ms = {0.5, 1.0, 2.0};
  measured.sgemm_ms = {1.0, 1.5, 1.75};
  measured.tiles_from = 16;
  measured.tiles_ms = {0.75, 0.5, 0.875};
  t.set(measured);
  t.set(entry(TensorType::Q6_K, 576, 1536, kNever, kNever));
  t.passes.push_back({"model.gguf", 98362432, 2, {1.125, 1.25, 1.5}});
  return t;
}

void expect_same(const KernelTable& a, const KernelTable& b) {
  EXPECT_EQ(a.machine.cpu, b.machine.cpu);
  EXPECT_EQ(a.machine.target, b.machine.target);
  EXPECT_EQ(a.machine.threads, b.machine.threads);
  EXPECT_EQ(a.machine.date, b.machine.date);
  EXPECT_EQ(a.machine.version, b.machine.version);
  ASSERT_EQ(a.entries().size(), b.entries().size());
  for (size_t i = 0; i < a.entries().size(); ++i) {
    const KernelEntry &x = a.entries()[i], &y = b.entries()[i];
    EXPECT_EQ(std::make_tuple(x.type, x.n, x.k, x.crossover, x.tiles_from),
              std::make_tuple(y.type, y.n, y.k, y.crossover, y.tiles_from)) << i;
  }
  ASSERT_EQ(a.passes.size(), b.passes.size());
  for (size_t i = 0; i < a.passes.size(); ++i) {
    const PassCostEntry &x = a.passes[i], &y = b.passes[i];
    EXPECT_EQ(std::make_tuple(x.model, x.bytes, x.threads, x.cost), std::make_tuple(y.model, y.bytes, y.threads, y.cost)) << i;
  }
}

TEST(KernelTableFile, JsonRoundTrip) {
  const KernelTable t = full_table();
  const KernelTable back = KernelTable::from_json(t.to_json());
  expect_same(t, back);
  // The file is plain JSON with the documented fields.
  const nlohmann::json j = nlohmann::json::parse(t.to_json());
  EXPECT_EQ(j["ringlm_tuning"], 1);
  EXPECT_EQ(j["machine"]["threads"], 3);
  EXPECT_EQ(j["entries"].size(), 6u);
  EXPECT_TRUE(j["entries"][3]["crossover"].is_null());  // the Q8_0 "never"
  EXPECT_FALSE(j["entries"][3].contains("tiles_from")) << "not measured: absent";
  EXPECT_EQ(j["entries"][4]["m"], nlohmann::json({8, 16, 24}));
  EXPECT_EQ(j["entries"][4]["tiles_from"], 16);
  EXPECT_EQ(j["entries"][4]["tiles_ms"], nlohmann::json({0.75, 0.5, 0.875}));
  EXPECT_TRUE(j["entries"][5]["tiles_from"].is_null());  // the Q6_K tiles' "never"
  EXPECT_EQ(j["entries"][0]["type"], "Q4_1");
  EXPECT_EQ(j["checking_passes"][0]["cost"], nlohmann::json({1.125, 1.25, 1.5}));
  EXPECT_FALSE(nlohmann::json::parse(smol_table().to_json()).contains("checking_passes")) << "optional";
}

// A model's checking passes are its file's (name and size) at one thread count.
TEST(KernelTableFile, PassCostsBelongToAModelFileAndThreadCount) {
  const std::string model = work_dir() + "/passes/model.gguf";
  std::filesystem::create_directories(work_dir() + "/passes");
  write_file(model, std::string(1000, 'x'));
  KernelTable t;
  t.passes.push_back({"model.gguf", 1000, 2, {1.1, 1.2}});
  t.passes.push_back({"model.gguf", 1000, 4, {1.3}});
  ASSERT_NE(t.pass_cost(model, 2), nullptr);
  EXPECT_EQ(t.pass_cost(model, 2)->cost, std::vector<double>({1.1, 1.2}));
  EXPECT_EQ(t.pass_cost(model, 4)->cost, std::vector<double>({1.3}));
  EXPECT_EQ(t.pass_cost(model, 8), nullptr) << "another thread count";
  EXPECT_EQ(t.pass_cost(work_dir() + "/passes/missing.gguf", 2), nullptr);
  write_file(model, std::string(1001, 'x'));
  EXPECT_EQ(t.pass_cost(model, 2), nullptr) << "the same name, another file";
}

TEST(KernelTableFile, SaveAndLoad) {
  const std::string path = work_dir() + "/nested/dir/tuning.json";
  std::filesystem::remove_all(work_dir() + "/nested");
  save_kernel_table(full_table(), path);
  testing::internal::CaptureStderr();
  const KernelTable back = load_kernel_table(path);
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
  expect_same(full_table(), back);
}

// Each text is wrong in its own way; every one must be a warning naming the file, and defaults.
TEST(KernelTableFile, MalformedFilesWarnAndFallBackToDefaults) {
  const std::string good = full_table().to_json();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"empty", ""},
      {"truncated", good.substr(0, good.size() / 2)},
      {"not json", "crossover = 48\n"},
      {"array", "[1, 2, 3]"},
      {"no version", R"({"entries": []})"},
      {"future version", R"({"ringlm_tuning": 2, "entries": []})"},
      {"entries not an array", R"({"ringlm_tuning": 1, "entries": {}})"},
      {"entry not an object", R"({"ringlm_tuning": 1, "entries": [7]})"},
      {"n a string", R"({"ringlm_tuning": 1, "entries": [{"type_id": 3, "n": "576", "k": 576, "crossover": 8}]})"},
      {"k negative", R"({"ringlm_tuning": 1, "entries": [{"type_id": 3, "n": 576, "k": -576, "crossover": 8}]})"},
      {"crossover 0", R"({"ringlm_tuning": 1, "entries": [{"type_id": 3, "n": 576, "k": 576, "crossover": 0}]})"},
      {"crossover float", R"({"ringlm_tuning": 1, "entries": [{"type_id": 3, "n": 576, "k": 576, "crossover": 4.5}]})"},
      {"missing crossover", R"({"ringlm_tuning": 1, "entries": [{"type_id": 3, "n": 576, "k": 576}]})"},
      {"tiles_from 0", R"({"ringlm_tuning": 1, "entries": [{"type_id": 3, "n": 576, "k": 576, "crossover": 8, "tiles_from": 0}]})"},
      {"tiles_from a string", R"({"ringlm_tuning": 1, "entries": [{"type_id": 3, "n": 576, "k": 576, "crossover": 8, "tiles_from": "64"}]})"},
      {"unknown type", R"({"ringlm_tuning": 1, "entries": [{"type_id": 77, "n": 576, "k": 576, "crossover": 8}]})"},
      {"threads a string", R"({"ringlm_tuning": 1, "machine": {"threads": "two"}, "entries": []})"},
      {"machine an array", R"({"ringlm_tuning": 1, "machine": [], "entries": []})"},
      {"passes not an array", R"({"ringlm_tuning": 1, "entries": [], "checking_passes": {}})"},
      {"pass without a model", R"({"ringlm_tuning": 1, "entries": [], "checking_passes": [{"bytes": 5, "threads": 2, "cost": [1.1]}]})"},
      {"pass of no bytes", R"({"ringlm_tuning": 1, "entries": [], "checking_passes": [{"model": "m", "bytes": 0, "threads": 2, "cost": [1.1]}]})"},
      {"pass cost empty", R"({"ringlm_tuning": 1, "entries": [], "checking_passes": [{"model": "m", "bytes": 5, "threads": 2, "cost": []}]})"},
      {"pass cost a string", R"({"ringlm_tuning": 1, "entries": [], "checking_passes": [{"model": "m", "bytes": 5, "threads": 2, "cost": ["1.1"]}]})"},
      {"pass cost too low", R"({"ringlm_tuning": 1, "entries": [], "checking_passes": [{"model": "m", "bytes": 5, "threads": 2, "cost": [0.1]}]})"},
      {"pass cost too high", R"({"ringlm_tuning": 1, "entries": [], "checking_passes": [{"model": "m", "bytes": 5, "threads": 2, "cost": [1.1, 13]}]})"},
  };
  for (const auto& [name, text] : cases) {
    SCOPED_TRACE(name);
    EXPECT_THROW(KernelTable::from_json(text), std::runtime_error);
    const std::string path = work_dir() + "/bad.json";
    write_file(path, text);
    testing::internal::CaptureStderr();
    const KernelTable t = load_kernel_table(path);
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_TRUE(t.empty());
    EXPECT_EQ(t.crossover(TensorType::Q4_1, 576, 576), kDefault);
    EXPECT_NE(err.find("warning"), std::string::npos) << err;
    EXPECT_NE(err.find(path), std::string::npos) << err;
    EXPECT_EQ(err.find('\n'), err.size() - 1) << "one line: " << err;
  }
}

TEST(KernelTableFile, MissingFileAndDirectory) {
  const std::string missing = work_dir() + "/does_not_exist.json";
  testing::internal::CaptureStderr();
  EXPECT_TRUE(load_kernel_table(missing, /*missing_ok=*/true).empty());
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
  testing::internal::CaptureStderr();
  EXPECT_TRUE(load_kernel_table(missing).empty());
  EXPECT_NE(testing::internal::GetCapturedStderr().find(missing), std::string::npos);
  testing::internal::CaptureStderr();
  EXPECT_TRUE(load_kernel_table(work_dir()).empty());
  EXPECT_NE(testing::internal::GetCapturedStderr().find("directory"), std::string::npos);
}

// --- Where the backend finds it -----------------------------------------------------------------

TEST(KernelTableLocation, DefaultPathFollowsTheCacheDirectoryRule) {
  {
    ScopedEnv cache("RINGLM_CACHE_DIR", "/tmp/rc"), xdg("XDG_CACHE_HOME", "/tmp/xdg"), home("HOME", "/tmp/home");
    EXPECT_EQ(default_kernel_table_path(), "/tmp/rc/tuning.json");
  }
  {
    ScopedEnv cache("RINGLM_CACHE_DIR", nullptr), xdg("XDG_CACHE_HOME", "/tmp/xdg"), home("HOME", "/tmp/home");
    EXPECT_EQ(default_kernel_table_path(), "/tmp/xdg/ringlm/tuning.json");
  }
  {
    ScopedEnv cache("RINGLM_CACHE_DIR", ""), xdg("XDG_CACHE_HOME", nullptr), home("HOME", "/tmp/home");
    EXPECT_EQ(default_kernel_table_path(), "/tmp/home/.cache/ringlm/tuning.json");
  }
}

TEST(KernelTableLocation, EnvironmentChoosesTheFileOrTurnsItOff) {
  const std::string cache_dir = work_dir() + "/cache";
  std::filesystem::create_directories(cache_dir);
  save_kernel_table(smol_table(), cache_dir + "/tuning.json");
  KernelTable other;
  other.set(entry(TensorType::Q4_0, 64, 64, 8));
  const std::string other_path = work_dir() + "/other.json";
  save_kernel_table(other, other_path);

  ScopedEnv cache("RINGLM_CACHE_DIR", cache_dir.c_str());
  {
    ScopedEnv tuning("RINGLM_TUNING", nullptr);
    EXPECT_EQ(load_configured_kernel_table().entries().size(), 4u);
  }
  {
    ScopedEnv tuning("RINGLM_TUNING", other_path.c_str());
    EXPECT_EQ(load_configured_kernel_table().crossover(TensorType::Q4_0, 64, 64), 8);
  }
  {
    ScopedEnv tuning("RINGLM_TUNING", "off");
    EXPECT_TRUE(load_configured_kernel_table().empty());
  }
  {  // No table in the cache is the normal case of an untuned machine: no warning.
    ScopedEnv tuning("RINGLM_TUNING", nullptr), empty_cache("RINGLM_CACHE_DIR", (work_dir() + "/empty").c_str());
    testing::internal::CaptureStderr();
    EXPECT_TRUE(load_configured_kernel_table().empty());
    EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
  }
}

// --- The backend follows the table ----------------------------------------------------------

// A random Q4_0 weight: random nibbles, small scales of either sign.
std::vector<uint8_t> random_q4_0(int64_t rows, int64_t cols, std::mt19937& rng) {
  std::vector<uint8_t> bytes(row_bytes(TensorType::Q4_0, cols) * static_cast<size_t>(rows));
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> scale(-0.05f, 0.05f);
  for (size_t off = 0; off < bytes.size(); off += sizeof(BlockQ4_0)) {
    const f16_bits d = fp32_to_fp16(scale(rng));
    std::memcpy(&bytes[off], &d, sizeof(d));
  }
  return bytes;
}

class BackendFollowsTable : public ::testing::Test {
 protected:
  static constexpr int64_t kN = 64, kK = 576;
  void SetUp() override {
    std::mt19937 rng(7);
    w_ = random_q4_0(kN, kK, rng);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    x_.resize(static_cast<size_t>(64 * kK));
    for (float& v : x_) v = normal(rng);
  }

  std::vector<float> run(Backend& backend, int64_t m) const {
    const auto w = backend.prepare(WeightView{"w", TensorType::Q4_0, kN, kK, w_.data()});
    std::vector<float> y(static_cast<size_t>(m * kN));
    backend.matmul(*w, x_.data(), m, y.data());
    return y;
  }
  std::vector<float> forced_int8(int64_t m) const { return run(*make_cpu_backend(1, ComputeType::kInt8, kNever), m); }
  std::vector<float> forced_sgemm(int64_t m) const { return run(*make_cpu_backend(1, ComputeType::kInt8, 1), m); }
  std::vector<float> with_table(int64_t crossover, int64_t m) const {
    KernelTable t;
    t.set(entry(TensorType::Q4_0, kN, kK, crossover));
    return run(*make_cpu_backend(1, ComputeType::kInt8, t), m);
  }

  std::vector<uint8_t> w_;
  std::vector<float> x_;
};

TEST_F(BackendFollowsTable, TheTwoPathsDifferInTheLastBits) {
  // What the tests below rely on: quantizing the activations to int8 changes the result.
  for (const int64_t m : {8, 20, 48}) EXPECT_NE(forced_int8(m), forced_sgemm(m)) << "M " << m;
}

TEST_F(BackendFollowsTable, CrossoverOneTakesSgemmAndNeverTakesInt8) {
  for (const int64_t m : {1, 8, 20, 48}) {
    SCOPED_TRACE("M " + std::to_string(m));
    EXPECT_EQ(with_table(1, m), forced_sgemm(m));
    EXPECT_EQ(with_table(kNever, m), forced_int8(m));
  }
}

TEST_F(BackendFollowsTable, CrossoverIsTheFirstSgemmTokenCount) {
  EXPECT_EQ(with_table(21, 20), forced_int8(20));
  EXPECT_EQ(with_table(21, 21), forced_sgemm(21));
}

TEST_F(BackendFollowsTable, NearestShapeAndOtherTypes) {
  KernelTable t;
  t.set(entry(TensorType::Q4_0, 128, 512, 1));  // the nearest Q4_0 shape: sgemm
  t.set(entry(TensorType::Q4_1, kN, kK, kNever));  // the exact shape, but another type
  EXPECT_EQ(run(*make_cpu_backend(1, ComputeType::kInt8, t), 20), forced_sgemm(20));
  KernelTable no_q4_0;
  no_q4_0.set(entry(TensorType::Q4_1, kN, kK, 1));
  // The default crossover (never) then holds for Q4_0: int8 at 20 tokens and at 48.
  EXPECT_EQ(run(*make_cpu_backend(1, ComputeType::kInt8, no_q4_0), 20), forced_int8(20));
  EXPECT_EQ(run(*make_cpu_backend(1, ComputeType::kInt8, no_q4_0), 48), forced_int8(48));
}

// The tiles (emulated, so that this runs on any CPU) take a weight's products from the table's
// tiles_from on, from its default where no entry measured them, and never under RINGLM_AMX=off.
TEST_F(BackendFollowsTable, TilesStartWhereTheTableSays) {
  const auto tile_products = [&](const KernelTable& t, cpu::AmxState state, int64_t m) {
    cpu::set_amx_state_for_test(state);
    const auto backend = make_cpu_backend(1, ComputeType::kInt8, t);
    const int64_t before = cpu::emulated_tile_products();
    run(*backend, m);
    cpu::set_amx_state_for_test(std::nullopt);
    return cpu::emulated_tile_products() - before;
  };
  KernelTable t;
  t.set(entry(TensorType::Q4_0, kN, kK, kNever, 20));
  EXPECT_EQ(tile_products(t, cpu::AmxState::kEmulated, 19), 0);
  EXPECT_GT(tile_products(t, cpu::AmxState::kEmulated, 20), 0);
  EXPECT_EQ(tile_products(t, cpu::AmxState::kOffByUser, 20), 0);
  KernelTable never;
  never.set(entry(TensorType::Q4_0, kN, kK, kNever, kNever));
  EXPECT_EQ(tile_products(never, cpu::AmxState::kEmulated, 64), 0);
  KernelTable unmeasured;  // the default: prompt chunks of KernelTable::kDefaultTilesFrom tokens
  unmeasured.set(entry(TensorType::Q4_0, kN, kK, kNever));
  EXPECT_EQ(tile_products(unmeasured, cpu::AmxState::kEmulated, 64), 0);
  unmeasured.default_tiles_from = 64;
  EXPECT_GT(tile_products(unmeasured, cpu::AmxState::kEmulated, 64), 0);
}

TEST_F(BackendFollowsTable, DefaultBackendReadsTheConfiguredTable) {
  KernelTable t;
  t.set(entry(TensorType::Q4_0, kN, kK, 1));
  const std::string path = work_dir() + "/sgemm_everywhere.json";
  save_kernel_table(t, path);
  {
    ScopedEnv tuning("RINGLM_TUNING", path.c_str());
    EXPECT_EQ(run(*make_cpu_backend(1, ComputeType::kInt8), 20), forced_sgemm(20));
    // An explicit crossover wins over the table.
    EXPECT_EQ(run(*make_cpu_backend(1, ComputeType::kInt8, 32), 20), forced_int8(20));
  }
  {
    ScopedEnv tuning("RINGLM_TUNING", "off");
    EXPECT_EQ(run(*make_cpu_backend(1, ComputeType::kInt8), 20), forced_int8(20));
  }
  {
    const std::string bad = work_dir() + "/truncated.json";
    write_file(bad, slurp(path).substr(0, 40));
    ScopedEnv tuning("RINGLM_TUNING", bad.c_str());
    testing::internal::CaptureStderr();
    const std::vector<float> y = run(*make_cpu_backend(1, ComputeType::kInt8), 20);
    EXPECT_NE(testing::internal::GetCapturedStderr().find(bad), std::string::npos);
    EXPECT_EQ(y, forced_int8(20));
  }
}

// load_model (run, bench, perplexity) goes through the configured table: a table that sends
// every shape of a tiny model to sgemm gives the logits of a backend forced to sgemm.
TEST(KernelTableModel, LoadModelUsesTheTable) {
  const std::string model = std::string(RINGLM_TEST_WORK_DIR) + "/tiny_q4_0.gguf";
  const std::vector<int32_t> prompt = {1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61, 65, 69, 73, 77};
  const auto logits_of = [&](LlamaModel& m) {
    KvCache cache = m.make_cache(64);
    std::vector<float> logits(static_cast<size_t>(m.hparams().n_vocab));
    m.forward(prompt, cache, logits.data());
    return logits;
  };
  const auto logits_with = [&](int64_t crossover) {
    const auto gguf = GgufFile::open(model);
    const auto backend = make_cpu_backend(1, ComputeType::kInt8, crossover);
    LlamaModel m(*gguf, *backend);
    return logits_of(m);
  };
  KernelTable t;
  for (const TensorType type : {TensorType::Q4_0, TensorType::Q4_1, TensorType::Q8_0}) t.set(entry(type, 1, 1, 1));
  const std::string path = work_dir() + "/tiny_sgemm.json";
  save_kernel_table(t, path);
  ScopedEnv tuning("RINGLM_TUNING", path.c_str());
  LoadedModel loaded = load_model(model, 1);
  const std::vector<float> tuned = logits_of(*loaded.model);
  EXPECT_EQ(tuned, logits_with(1));
  EXPECT_NE(tuned, logits_with(kNever));
}

// --- ringlm tune ---------------------------------------------------------------------------------

using Result = test::CommandResult;

// `env`: a prefix such as "env -u RINGLM_TUNING ..." that sets the command's environment.
Result ringlm_tune(const std::string& args, const std::string& env = "") {
  return test::run_command(env + " " + std::string(RINGLM_BINARY) + " tune " + args, work_dir());
}

// The (type, N, K) the int8 kernels would run in a model file, read from the GGUF directly.
std::set<std::tuple<uint32_t, int64_t, int64_t>> int8_shapes(const std::string& model) {
  const auto gguf = GgufFile::open(model);
  const bool tied = gguf->find_tensor("output.weight") == nullptr;
  std::set<std::tuple<uint32_t, int64_t, int64_t>> shapes;
  for (const GgufTensorInfo& t : gguf->tensors()) {
    if (t.shape.size() == 2 && cpu::packed_supported(t.type, t.shape[0]) && (tied || t.name != "token_embd.weight")) {
      shapes.insert({static_cast<uint32_t>(t.type), t.shape[1], t.shape[0]});
    }
  }
  return shapes;
}

TEST(TuneCommand, WritesAnEntryPerWeightShape) {
  const std::string model = std::string(RINGLM_TEST_WORK_DIR) + "/tiny_q4_0.gguf";
  const std::string path = work_dir() + "/tuned.json";
  std::filesystem::remove(path);
  const Result r = ringlm_tune("-m " + model + " -t 1 -o " + path + " --max-m 32");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find(path), std::string::npos) << r.err;

  const KernelTable t = KernelTable::from_json(slurp(path));
  EXPECT_EQ(t.machine.threads, 1);
  EXPECT_FALSE(t.machine.cpu.empty());
  EXPECT_FALSE(t.machine.target.empty());
  EXPECT_FALSE(t.machine.date.empty());
  const auto expected = int8_shapes(model);
  ASSERT_FALSE(expected.empty());
  std::set<std::tuple<uint32_t, int64_t, int64_t>> got;
  for (const KernelEntry& e : t.entries()) got.insert({static_cast<uint32_t>(e.type), e.n, e.k});
  EXPECT_EQ(got, expected);
  EXPECT_EQ(t.entries().size(), expected.size());  // no shape twice

  // The measurements behind each crossover: M = 8..32, and the crossover one of them (or never).
  const nlohmann::json j = nlohmann::json::parse(slurp(path));
  for (const auto& e : j["entries"]) {
    EXPECT_EQ(e["m"], nlohmann::json({8, 16, 24, 32}));
    for (const char* key : {"int8_ms", "sgemm_ms"}) {
      ASSERT_EQ(e[key].size(), 4u);
      for (const auto& ms : e[key]) EXPECT_GE(ms.get<double>(), 0.0);
    }
    if (!e["crossover"].is_null()) {
      EXPECT_EQ(std::count(e["m"].begin(), e["m"].end(), e["crossover"]), 1);
    }
    // Each shape's rows are in the printed table.
    const std::string label = e["type"].get<std::string>() + " " + std::to_string(e["n"].get<int64_t>()) + "x" +
                              std::to_string(e["k"].get<int64_t>());
    EXPECT_NE(r.out.find(label), std::string::npos) << label;
  }
  // The checking passes of speculative decoding on the same model: 1 to 8 drafted tokens, each a
  // cost in decode steps (from_json checks the range), and printed.
  ASSERT_EQ(t.passes.size(), 1u);
  EXPECT_EQ(t.passes[0].model, "tiny_q4_0.gguf");
  EXPECT_EQ(t.passes[0].bytes, static_cast<int64_t>(std::filesystem::file_size(model)));
  EXPECT_EQ(t.passes[0].threads, 1);
  EXPECT_EQ(t.passes[0].cost.size(), 8u);
  EXPECT_NE(t.pass_cost(model, 1), nullptr);
  EXPECT_NE(r.out.find("checking passes"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("| 8 | "), std::string::npos) << r.out;
}

// A second model tuned into the same table on the same machine keeps the first one's shapes and
// checking passes, and tuning the first again replaces its own.
TEST(TuneCommand, ASecondModelKeepsTheFirstModelsMeasurements) {
  const std::string dir = std::string(RINGLM_TEST_WORK_DIR);
  const std::string path = work_dir() + "/two_models.json";
  std::filesystem::remove(path);
  ASSERT_EQ(ringlm_tune("-m " + dir + "/tiny_q4_0.gguf -t 1 -o " + path + " --max-m 8").exit_code, 0);
  const Result second = ringlm_tune("-m " + dir + "/tiny_q8_0.gguf -t 1 -o " + path + " --max-m 8");
  ASSERT_EQ(second.exit_code, 0) << second.err;
  const KernelTable t = KernelTable::from_json(slurp(path));
  std::set<std::tuple<uint32_t, int64_t, int64_t>> got, want = int8_shapes(dir + "/tiny_q4_0.gguf");
  for (const auto& s : int8_shapes(dir + "/tiny_q8_0.gguf")) want.insert(s);
  for (const KernelEntry& e : t.entries()) got.insert({static_cast<uint32_t>(e.type), e.n, e.k});
  EXPECT_EQ(got, want);
  EXPECT_EQ(t.entries().size(), want.size());
  EXPECT_NE(t.pass_cost(dir + "/tiny_q4_0.gguf", 1), nullptr);
  EXPECT_NE(t.pass_cost(dir + "/tiny_q8_0.gguf", 1), nullptr);
  EXPECT_NE(second.err.find("kept from earlier runs"), std::string::npos) << second.err;
  // Another machine's table (here: another CPU name) is replaced whole.
  KernelTable other = t;
  other.machine.cpu = "Another CPU";
  save_kernel_table(other, path);
  ASSERT_EQ(ringlm_tune("-m " + dir + "/tiny_q8_0.gguf -t 1 -o " + path + " --max-m 8").exit_code, 0);
  const KernelTable replaced = KernelTable::from_json(slurp(path));
  EXPECT_EQ(replaced.passes.size(), 1u);
  EXPECT_EQ(replaced.pass_cost(dir + "/tiny_q4_0.gguf", 1), nullptr);
}

// Where the tiles run (here their emulation: RINGLM_AMX=emulate), tune times them beside the
// int8 kernels and sgemm at every M and writes where they start (or never).
TEST(TuneCommand, MeasuresTheTilesWhereTheyRun) {
  const std::string model = std::string(RINGLM_TEST_WORK_DIR) + "/tiny_q4_0.gguf";
  const std::string path = work_dir() + "/tuned_tiles.json";
  std::filesystem::remove(path);
  const Result r = ringlm_tune("-m " + model + " -t 1 -o " + path + " --max-m 16", "env RINGLM_AMX=emulate");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("amx emulated"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("AMX tiles from"), std::string::npos) << r.out;
  const nlohmann::json j = nlohmann::json::parse(slurp(path));
  ASSERT_FALSE(j["entries"].empty());
  for (const auto& e : j["entries"]) {
    ASSERT_EQ(e["tiles_ms"].size(), 2u) << e.dump();
    for (const auto& ms : e["tiles_ms"]) EXPECT_GT(ms.get<double>(), 0.0);
    ASSERT_TRUE(e.contains("tiles_from")) << e.dump();
    if (!e["tiles_from"].is_null()) {
      EXPECT_EQ(std::count(e["m"].begin(), e["m"].end(), e["tiles_from"]), 1);
    }
  }
  // Without the tiles (RINGLM_AMX=off) nothing about them is measured or written.
  const Result off = ringlm_tune("-m " + model + " -t 1 -o " + path + " --max-m 8", "env RINGLM_AMX=off");
  ASSERT_EQ(off.exit_code, 0) << off.err;
  const nlohmann::json without = nlohmann::json::parse(slurp(path));
  for (const auto& e : without["entries"]) {
    EXPECT_FALSE(e.contains("tiles_from")) << e.dump();
    EXPECT_FALSE(e.contains("tiles_ms")) << e.dump();
  }
}

TEST(TuneCommand, DefaultOutputIsTheCacheDirectory) {
  const std::string cache = work_dir() + "/tune_cache";
  std::filesystem::remove_all(cache);
  const std::string model = std::string(RINGLM_TEST_WORK_DIR) + "/tiny_q4_0.gguf";
  const Result r = ringlm_tune("-m " + model + " -t 1 --max-m 8", "env -u RINGLM_TUNING RINGLM_CACHE_DIR=" + cache);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_FALSE(KernelTable::from_json(slurp(cache + "/tuning.json")).empty());
}

TEST(TuneCommand, ErrorsAreOneLine) {
  Result r = ringlm_tune("-m " + work_dir() + "/no_such_model.gguf -o " + work_dir() + "/unused.json");
  EXPECT_TRUE(test::exited_with_error(r));
  EXPECT_EQ(r.err.rfind("ringlm: error: ", 0), 0u) << r.err;
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << r.err;
  // A file without weight matrices (a vocabulary-only GGUF) has nothing to tune.
  std::filesystem::remove(work_dir() + "/unused.json");
  r = ringlm_tune("-m " + std::string(RINGLM_SHARED_DATA) + "/vocab/ggml-vocab-starcoder.gguf -o " + work_dir() + "/unused.json");
  EXPECT_TRUE(test::exited_with_error(r));
  EXPECT_NE(r.err.find("nothing to tune"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(work_dir() + "/unused.json"));
}

}  // namespace
}  // namespace ringlm
