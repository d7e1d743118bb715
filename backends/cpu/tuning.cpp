#include "backends/cpu/tuning.h"

// The int8 kernels build the AVX-512 VNNI target too (kernel_packed.cpp): ask for it here as
// well so that HWY_TARGETS, and so the target named in the header, matches their dispatch.
#ifndef HWY_WANT_AVX3_DL
#define HWY_WANT_AVX3_DL
#endif

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <tuple>

#include "hwy/targets.h"
#include "quant/int4.h"

namespace ringlm {
namespace {

constexpr int kFormatVersion = 1;
constexpr const char* kRinglmVersion = "0.1.0";  // as project(VERSION) in the top CMakeLists.txt

using nlohmann::json;

[[noreturn]] void malformed(const std::string& where, const std::string& what) {
  throw std::runtime_error(where + ": " + what);
}

// A required member of an object, present and of the wanted kind.
const json& member(const json& obj, const std::string& where, const char* key) {
  const auto it = obj.find(key);
  if (it == obj.end()) malformed(where, std::string("missing \"") + key + "\"");
  return *it;
}

int64_t integer_in(const json& v, const std::string& where, int64_t min, int64_t max) {
  if (!v.is_number_integer() || v.get<int64_t>() < min || v.get<int64_t>() > max) {
    malformed(where, "expected an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "], got " + v.dump());
  }
  return v.get<int64_t>();
}
int64_t positive_int(const json& v, const std::string& where) { return integer_in(v, where, 1, INT64_MAX); }

// An optional string member of the header: absent reads as empty.
std::string optional_string(const json& obj, const std::string& where, const char* key) {
  const auto it = obj.find(key);
  if (it == obj.end()) return "";
  if (!it->is_string()) malformed(where + "." + key, "expected a string, got " + it->dump());
  return it->get<std::string>();
}

TuningMachine parse_machine(const json& j) {
  TuningMachine m;
  const auto it = j.find("machine");
  if (it == j.end()) return m;
  if (!it->is_object()) malformed("machine", "expected an object");
  m.cpu = optional_string(*it, "machine", "cpu");
  m.target = optional_string(*it, "machine", "target");
  m.date = optional_string(*it, "machine", "date");
  m.version = optional_string(*it, "machine", "ringlm");
  // 0: not known (a table written by hand or by a test).
  if (it->contains("threads")) m.threads = static_cast<int>(integer_in((*it)["threads"], "machine.threads", 0, 1 << 20));
  return m;
}

KernelEntry parse_entry(const json& e, const std::string& where) {
  if (!e.is_object()) malformed(where, "expected an object");
  KernelEntry entry;
  const int64_t id = integer_in(member(e, where, "type_id"), where + ".type_id", 0, UINT32_MAX);
  if (!type_traits(static_cast<uint32_t>(id)) && !int4_format(static_cast<uint32_t>(id))) {
    malformed(where + ".type_id", "unknown tensor type " + std::to_string(id));
  }
  entry.type = static_cast<TensorType>(id);
  entry.n = positive_int(member(e, where, "n"), where + ".n");
  entry.k = positive_int(member(e, where, "k"), where + ".k");
  const json& c = member(e, where, "crossover");
  entry.crossover = c.is_null() ? KernelTable::kNever : positive_int(c, where + ".crossover");
  if (const auto t = e.find("tiles_from"); t != e.end()) {
    entry.tiles_from = t->is_null() ? KernelTable::kNever : positive_int(*t, where + ".tiles_from");
  }
  return entry;
}

PassCostEntry parse_pass_cost(const json& e, const std::string& where) {
  if (!e.is_object()) malformed(where, "expected an object");
  PassCostEntry entry;
  const json& model = member(e, where, "model");
  if (!model.is_string() || model.get<std::string>().empty()) malformed(where + ".model", "expected a file name");
  entry.model = model.get<std::string>();
  entry.bytes = positive_int(member(e, where, "bytes"), where + ".bytes");
  entry.threads = static_cast<int>(integer_in(member(e, where, "threads"), where + ".threads", 1, 1 << 20));
  const json& cost = member(e, where, "cost");
  if (!cost.is_array() || cost.empty() || cost.size() > 256) malformed(where + ".cost", "expected an array of 1 to 256 numbers");
  for (size_t i = 0; i < cost.size(); ++i) {
    // A pass of i + 2 rows costs at least about a decode step, and may cost more than i + 2 of
    // them (a tiny model's passes are all overhead, more so under the sanitizers); four times
    // that would be a broken measurement.
    const double most = 4.0 * static_cast<double>(i + 2);
    if (!cost[i].is_number() || !(cost[i].get<double>() >= 0.5) || !(cost[i].get<double>() <= most)) {
      malformed(where + ".cost[" + std::to_string(i) + "]", "expected a pass's cost in decode steps, between 0.5 and " +
                                                                std::to_string(static_cast<int>(most)) + ", got " + cost[i].dump());
    }
    entry.cost.push_back(cost[i].get<double>());
  }
  return entry;
}

std::string type_name(TensorType type) {
  const auto traits = type_traits(static_cast<uint32_t>(type));
  return traits ? std::string(traits->name) : "type " + std::to_string(static_cast<uint32_t>(type));
}

double round_to_us(double ms) { return std::round(ms * 1000.0) / 1000.0; }

nlohmann::ordered_json entry_json(const KernelEntry& e) {
  nlohmann::ordered_json o;
  o["type_id"] = static_cast<uint32_t>(e.type);
  o["type"] = type_name(e.type);
  o["n"] = e.n;
  o["k"] = e.k;
  o["crossover"] = e.crossover >= KernelTable::kNever ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(e.crossover);
  if (e.tiles_from != KernelEntry::kTilesNotMeasured) {
    o["tiles_from"] = e.tiles_from >= KernelTable::kNever ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(e.tiles_from);
  }
  if (!e.m.empty()) {
    o["m"] = e.m;
    const auto times = [&](const char* key, const std::vector<double>& ms) {
      o[key] = nlohmann::ordered_json::array();
      for (const double v : ms) o[key].push_back(round_to_us(v));
    };
    times("int8_ms", e.int8_ms);
    times("sgemm_ms", e.sgemm_ms);
    if (!e.tiles_ms.empty()) times("tiles_ms", e.tiles_ms);
  }
  return o;
}

// The target HWY_DYNAMIC_DISPATCH picks: the best (lowest-bit) one both compiled and supported.
std::string highway_target() {
  const int64_t targets = hwy::SupportedTargets() & HWY_TARGETS;
  return targets == 0 ? "none" : hwy::TargetName(targets & -targets);
}

std::filesystem::path cache_dir() {
  if (const char* dir = std::getenv("RINGLM_CACHE_DIR"); dir != nullptr && *dir != '\0') return dir;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != '\0') {
    return std::filesystem::path(xdg) / "ringlm";
  }
  const char* home = std::getenv("HOME");
  return std::filesystem::path(home != nullptr ? home : ".") / ".cache" / "ringlm";
}

}  // namespace

void KernelTable::set(KernelEntry entry) {
  for (KernelEntry& e : entries_) {
    if (e.type == entry.type && e.n == entry.n && e.k == entry.k) {
      e = std::move(entry);
      return;
    }
  }
  entries_.push_back(std::move(entry));
}

const KernelEntry* KernelTable::nearest(TensorType type, int64_t n, int64_t k, bool with_tiles) const {
  const KernelEntry* best = nullptr;
  const auto distance = [&](const KernelEntry& e) { return std::make_tuple(std::abs(e.k - k), std::abs(e.n - n)); };
  for (const KernelEntry& e : entries_) {
    if (e.type != type || (with_tiles && e.tiles_from == KernelEntry::kTilesNotMeasured)) continue;
    if (best == nullptr || distance(e) < distance(*best)) best = &e;
  }
  return best;
}

int64_t KernelTable::crossover(TensorType type, int64_t n, int64_t k) const {
  const KernelEntry* e = nearest(type, n, k, /*with_tiles=*/false);
  return e != nullptr ? e->crossover : kDefaultCrossover;
}

int64_t KernelTable::tiles_from(TensorType type, int64_t n, int64_t k) const {
  const KernelEntry* e = nearest(type, n, k, /*with_tiles=*/true);
  return e != nullptr ? e->tiles_from : default_tiles_from;
}

const PassCostEntry* KernelTable::pass_cost(const std::string& model_path, int threads) const {
  std::error_code ec;
  const auto bytes = static_cast<int64_t>(std::filesystem::file_size(model_path, ec));
  if (ec) return nullptr;
  const std::string name = std::filesystem::path(model_path).filename().string();
  for (const PassCostEntry& e : passes) {
    if (e.model == name && e.bytes == bytes && e.threads == threads) return &e;
  }
  return nullptr;
}

std::string KernelTable::to_json() const {
  const nlohmann::ordered_json header = {{"cpu", machine.cpu},
                                         {"target", machine.target},
                                         {"threads", machine.threads},
                                         {"date", machine.date},
                                         {"ringlm", machine.version}};
  // One line per entry: a table of a few dozen shapes stays readable in a terminal.
  std::string out = "{\n  \"ringlm_tuning\": " + std::to_string(kFormatVersion) + ",\n  \"machine\": " +
                    header.dump() + ",\n  \"entries\": [";
  for (size_t i = 0; i < entries_.size(); ++i) out += (i == 0 ? "\n    " : ",\n    ") + entry_json(entries_[i]).dump();
  out += "\n  ]";
  if (!passes.empty()) {
    out += ",\n  \"checking_passes\": [";
    for (size_t i = 0; i < passes.size(); ++i) {
      nlohmann::ordered_json o = {{"model", passes[i].model}, {"bytes", passes[i].bytes}, {"threads", passes[i].threads}};
      o["cost"] = nlohmann::ordered_json::array();
      for (const double c : passes[i].cost) o["cost"].push_back(std::round(c * 1000.0) / 1000.0);
      out += (i == 0 ? "\n    " : ",\n    ") + o.dump();
    }
    out += "\n  ]";
  }
  return out + "\n}\n";
}

KernelTable KernelTable::from_json(const std::string& text) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    // nlohmann's message after its "[json.exception.parse_error.101] " tag.
    const std::string what = e.what();
    const size_t tag_end = what.find("] ");
    throw std::runtime_error(tag_end == std::string::npos ? what : what.substr(tag_end + 2));
  }
  if (!j.is_object()) malformed("top level", "expected an object");
  const json& version = member(j, "top level", "ringlm_tuning");
  if (version != kFormatVersion) malformed("ringlm_tuning", "unsupported format version " + version.dump());
  KernelTable table;
  table.machine = parse_machine(j);
  const json& entries = member(j, "top level", "entries");
  if (!entries.is_array()) malformed("entries", "expected an array");
  for (size_t i = 0; i < entries.size(); ++i) {
    table.set(parse_entry(entries[i], "entries[" + std::to_string(i) + "]"));
  }
  if (const auto it = j.find("checking_passes"); it != j.end()) {
    if (!it->is_array()) malformed("checking_passes", "expected an array");
    for (size_t i = 0; i < it->size(); ++i) {
      table.passes.push_back(parse_pass_cost((*it)[i], "checking_passes[" + std::to_string(i) + "]"));
    }
  }
  return table;
}

KernelTable load_kernel_table(const std::string& path, bool missing_ok, bool warn) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    if (!missing_ok && warn) std::fprintf(stderr, "ringlm: warning: tuning table %s does not exist; using the default kernel choice\n", path.c_str());
    return {};
  }
  try {
    if (std::filesystem::is_directory(path, ec)) throw std::runtime_error("is a directory");
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error("cannot be opened");
    const std::string text(std::istreambuf_iterator<char>(in), {});
    return KernelTable::from_json(text);
  } catch (const std::exception& e) {
    if (warn) std::fprintf(stderr, "ringlm: warning: tuning table %s: %s; using the default kernel choice\n", path.c_str(), e.what());
    return {};
  }
}

void save_kernel_table(const KernelTable& table, const std::string& path) {
  const std::filesystem::path p(path);
  std::error_code ec;
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path(), ec);
  // Written beside the target and renamed over it: a reader never sees half a table.
  const std::string tmp = path + ".tmp" + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << table.to_json();
    out.close();
    if (!out) throw std::runtime_error("cannot write the tuning table " + tmp);
  }
  std::filesystem::rename(tmp, p, ec);
  if (ec) {
    std::filesystem::remove(tmp, ec);
    throw std::runtime_error("cannot write the tuning table " + path);
  }
}

std::string default_kernel_table_path() { return (cache_dir() / "tuning.json").string(); }

KernelTable load_configured_kernel_table(bool warn) {
  const char* env = std::getenv("RINGLM_TUNING");
  if (env != nullptr && std::string(env) == "off") return {};
  if (env != nullptr && *env != '\0') return load_kernel_table(env, /*missing_ok=*/false, warn);
  return load_kernel_table(default_kernel_table_path(), /*missing_ok=*/true, warn);
}

std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t colon = line.find(':');
    const size_t start = colon == std::string::npos ? std::string::npos : line.find_first_not_of(" \t", colon + 1);
    if (start != std::string::npos) return line.substr(start);
  }
  return "unknown CPU";
}

std::string utc_now() {
  char buf[32];
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  std::strftime(buf, sizeof(buf), "%FT%TZ", &tm);
  return buf;
}

TuningMachine this_machine(int threads) {
  return {cpu_model_name(), highway_target(), threads, utc_now(), kRinglmVersion};
}

void apply_simd_target_override() {
  const char* env = std::getenv("RINGLM_SIMD_TARGET");
  if (env == nullptr || *env == '\0') return;
  std::string available;
  for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
    // The target and every lesser one the CPU runs (a lower bit is a better target): a file
    // compiled without the named target (only the packed kernels have AVX3_DL) then runs its
    // best code below it, not the baseline.
    if (std::string(hwy::TargetName(target)) == env) {
      return hwy::SetSupportedTargetsForTest(hwy::SupportedTargets() & ~(target - 1));
    }
    available += (available.empty() ? "" : ", ") + std::string(hwy::TargetName(target));
  }
  throw std::runtime_error(std::string("RINGLM_SIMD_TARGET=") + env + ": not a SIMD target of this CPU (" + available + ")");
}

int64_t crossover_from_timings(std::span<const TuningPoint> points) {
  int64_t crossover = KernelTable::kNever;
  for (auto it = points.rbegin(); it != points.rend() && it->sgemm_ms < it->int8_ms; ++it) crossover = it->m;
  return crossover;
}

int64_t tiles_from_timings(std::span<const TuningPoint> points) {
  int64_t from = KernelTable::kNever;
  for (auto it = points.rbegin(); it != points.rend() && it->tiles_ms >= 0 && it->tiles_ms < it->int8_ms; ++it) from = it->m;
  return from;
}

}  // namespace ringlm
