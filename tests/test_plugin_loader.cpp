// The plugin loader (backends/plugin_loader.h) against fake plugins built from
// tests/plugins/fake_plugin.c (tests/CMakeLists.txt puts them under RINGLM_TEST_PLUGIN_DIR):
//   good/libringlm-fake.so          "fake": device 0 a CPU, device 1 a GPU
//   cpu_only/libringlm-fake.so      "fake" too, one CPU device (shadowing, auto without a GPU)
//   open_fails/libringlm-openfail.so  two devices; open fails with a two-line build log
//   broken/                          one library per way of failing to load, plus
//                                    libringlm-exploding.so, which loads but cannot list devices
// and `ringlm devices` run as a subprocess on the same directories.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "backends/plugin_loader.h"

namespace ringlm {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using ::testing::StartsWith;

fs::path plugin_dir(const std::string& name) { return fs::path(RINGLM_TEST_PLUGIN_DIR) / name; }

// Writes `content` to `path` by renaming a temporary file into place, so that another test
// process scanning the same directory never sees a half-written file.
void write_file_atomically(const fs::path& path, const std::string& content) {
  const std::string tmp_name = std::string("tmp.") + std::to_string(::getpid()) + "." + path.filename().string();
  const fs::path tmp = path.parent_path() / tmp_name;
  std::ofstream(tmp) << content;
  fs::rename(tmp, path);
}

// broken/ with the entries the test itself adds: a text file with a plugin's name (not a shared
// object at all), and things the scan must skip — a directory with a plugin's name, and files
// whose names are not libringlm-*.so.
fs::path broken_dir() {
  const fs::path dir = plugin_dir("broken");
  write_file_atomically(dir / "libringlm-garbage.so",
                        "This is a text file that happens to be named like a ringlm plugin.\n"
                        "dlopen must refuse it, and the loader must say so.\n");
  fs::create_directories(dir / "libringlm-dir.so");
  write_file_atomically(dir / "libringlm-notes.txt", "not a plugin: wrong suffix\n");
  write_file_atomically(dir / "notaplugin.so", "not a plugin: wrong prefix\n");
  return dir;
}

// The message of the PluginError that `f` throws; fails the test if it throws nothing.
template <typename F>
std::string plugin_error_of(F&& f) {
  try {
    f();
  } catch (const PluginError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no PluginError thrown";
  return "";
}

std::string load_error(const fs::path& library) {
  return plugin_error_of([&] { load_plugin(library); });
}

// Sets (or unsets, with nullopt) $RINGLM_PLUGIN_PATH for one test, then puts it back.
class PluginPathGuard {
 public:
  explicit PluginPathGuard(const std::optional<std::string>& value) {
    if (const char* old = std::getenv("RINGLM_PLUGIN_PATH")) saved_ = old;
    if (value) {
      ::setenv("RINGLM_PLUGIN_PATH", value->c_str(), 1);
    } else {
      ::unsetenv("RINGLM_PLUGIN_PATH");
    }
  }
  ~PluginPathGuard() {
    if (saved_) {
      ::setenv("RINGLM_PLUGIN_PATH", saved_->c_str(), 1);
    } else {
      ::unsetenv("RINGLM_PLUGIN_PATH");
    }
  }
  PluginPathGuard(const PluginPathGuard&) = delete;
  PluginPathGuard& operator=(const PluginPathGuard&) = delete;

 private:
  std::optional<std::string> saved_;
};

std::vector<std::string> names_of(const PluginScan& scan) {
  std::vector<std::string> names;
  for (const auto& p : scan.loaded) names.push_back(p->name());
  return names;
}

std::map<std::string, std::string> failures_by_file(const PluginScan& scan) {
  std::map<std::string, std::string> out;
  for (const auto& f : scan.failed) out[f.path.filename().string()] = f.reason;
  return out;
}

// --- load_plugin -------------------------------------------------------------------------------

TEST(LoadPlugin, LoadsTheWorkingFakeAndListsItsDevices) {
  const fs::path library = plugin_dir("good") / "libringlm-fake.so";
  const auto plugin = load_plugin(library);
  ASSERT_NE(plugin, nullptr);
  EXPECT_EQ(plugin->name(), "fake");
  EXPECT_EQ(plugin->path(), library);
  EXPECT_EQ(plugin->abi_version(), 1u);  // a version-1 plugin loads as it did
  EXPECT_EQ(plugin->last_error(), "");
  const std::vector<ringlm_device_info> devices = plugin->devices();
  ASSERT_EQ(devices.size(), 2u);
  EXPECT_STREQ(devices[0].name, "Fake CPU");
  EXPECT_EQ(devices[0].type, RINGLM_DEVICE_CPU);
  EXPECT_STREQ(devices[1].name, "Fake GPU");
  EXPECT_EQ(devices[1].type, RINGLM_DEVICE_GPU);
  EXPECT_EQ(devices[1].compute_units, 32u);
  EXPECT_EQ(devices[1].memory_bytes, uint64_t{8} << 30);
  EXPECT_STREQ(devices[1].version, "FakeCL 1.0");
}

TEST(LoadPlugin, LoadsABareFileNameFromTheCurrentDirectory) {
  // dlopen searches the system's library path for a name without a slash; the loader must not.
  const fs::path before = fs::current_path();
  fs::current_path(plugin_dir("good"));
  std::shared_ptr<LoadedPlugin> plugin;
  EXPECT_NO_THROW(plugin = load_plugin("libringlm-fake.so"));
  fs::current_path(before);
  ASSERT_NE(plugin, nullptr);
  EXPECT_EQ(plugin->name(), "fake");
}

TEST(LoadPlugin, MissingFileIsNamedAsNotFound) {
  const fs::path library = plugin_dir("good") / "libringlm-nothere.so";
  EXPECT_EQ(load_error(library), library.string() + ": plugin library not found");
}

TEST(LoadPlugin, WrongAbiVersionSaysBothVersions) {
  const fs::path library = broken_dir() / "libringlm-badabi.so";
  EXPECT_EQ(load_error(library), library.string() + ": built for plugin ABI 7, this ringlm speaks 1 to 4");
}

TEST(LoadPlugin, MissingEntrySymbolIsNamed) {
  const fs::path library = broken_dir() / "libringlm-noentry.so";
  EXPECT_THAT(load_error(library),
              AllOf(StartsWith(library.string() + ": "), HasSubstr("entry symbol 'ringlm_plugin_entry' missing")));
}

TEST(LoadPlugin, NullTableIsNamed) {
  const fs::path library = broken_dir() / "libringlm-nullentry.so";
  EXPECT_EQ(load_error(library), library.string() + ": ringlm_plugin_entry returned NULL");
}

TEST(LoadPlugin, MissingFunctionInTheTableIsNamed) {
  const fs::path library = fs::path(RINGLM_TEST_PLUGIN_DIR) / "no_matmul" / "libringlm-nomatmul.so";
  EXPECT_EQ(load_error(library), library.string() + ": plugin table has no 'matmul' function");
}

TEST(LoadPlugin, TooSmallTableSaysBothSizes) {
  const fs::path library = broken_dir() / "libringlm-small.so";
  EXPECT_THAT(load_error(library),
              AllOf(StartsWith(library.string() + ": "),
                    HasSubstr(std::string("plugin table is 16 bytes, plugin ABI 1 needs ") +
                              std::to_string(RINGLM_PLUGIN_V1_SIZE))));
}

TEST(LoadPlugin, Version2TableWithoutItsFunctionsIsRefused) {
  const fs::path library = fs::path(RINGLM_TEST_PLUGIN_DIR) / "half_v2" / "libringlm-halfv2.so";
  EXPECT_EQ(load_error(library), library.string() + ": plugin table (ABI 2) has no 'upload_async' function");
}

TEST(LoadPlugin, UndefinedSymbolPassesDlerrorThrough) {
  const fs::path library = broken_dir() / "libringlm-undefined.so";
  EXPECT_THAT(load_error(library), AllOf(StartsWith(library.string() + ": cannot load: "),
                                         HasSubstr("undefined symbol: ringlm_fake_function_nobody_defines")));
}

TEST(LoadPlugin, TextFileIsNotASharedObject) {
  const fs::path library = broken_dir() / "libringlm-garbage.so";
  const std::string message = load_error(library);
  EXPECT_THAT(message, StartsWith(library.string() + ": cannot load: "));
  EXPECT_THAT(message, HasSubstr("invalid ELF header"));
  // dlerror repeats the path; the message names it once.
  EXPECT_EQ(message.find(library.string(), 1), std::string::npos) << message;
}

TEST(LoadPlugin, DeviceCountFailureCarriesThePluginsReason) {
  const fs::path library = broken_dir() / "libringlm-exploding.so";
  const auto plugin = load_plugin(library);  // loading itself succeeds
  EXPECT_EQ(plugin_error_of([&] { plugin->devices(); }),
            library.string() + ": exploding cannot list its devices: driver exploded");
  EXPECT_EQ(plugin->last_error(), "driver exploded");
}

// --- scan_plugins ------------------------------------------------------------------------------

TEST(ScanPlugins, CollectsLoadedAndFailedWithTheirCauses) {
  const PluginScan scan = scan_plugins({broken_dir()});
  EXPECT_THAT(names_of(scan), ElementsAre("exploding"));
  const auto failed = failures_by_file(scan);
  ASSERT_EQ(failed.size(), 6u) << ::testing::PrintToString(failed);
  EXPECT_EQ(failed.at("libringlm-badabi.so"), "built for plugin ABI 7, this ringlm speaks 1 to 4");
  EXPECT_THAT(failed.at("libringlm-garbage.so"), AllOf(StartsWith("cannot load: "), HasSubstr("invalid ELF header")));
  EXPECT_THAT(failed.at("libringlm-noentry.so"), HasSubstr("entry symbol 'ringlm_plugin_entry' missing"));
  EXPECT_EQ(failed.at("libringlm-nullentry.so"), "ringlm_plugin_entry returned NULL");
  EXPECT_THAT(failed.at("libringlm-small.so"), StartsWith("plugin table is 16 bytes"));
  EXPECT_THAT(failed.at("libringlm-undefined.so"), HasSubstr("undefined symbol"));
  // Failures keep their full paths, in file name order.
  for (const auto& f : scan.failed) EXPECT_EQ(f.path.parent_path(), broken_dir());
  EXPECT_EQ(scan.failed.front().path.filename(), "libringlm-badabi.so");
  EXPECT_EQ(scan.failed.back().path.filename(), "libringlm-undefined.so");
}

TEST(ScanPlugins, FirstPluginOfANameWinsAndTheOtherIsReported) {
  const fs::path good = plugin_dir("good") / "libringlm-fake.so";
  const fs::path cpu_only = plugin_dir("cpu_only") / "libringlm-fake.so";

  const PluginScan good_first = scan_plugins({plugin_dir("good"), plugin_dir("cpu_only")});
  ASSERT_EQ(good_first.loaded.size(), 1u);
  EXPECT_EQ(good_first.loaded[0]->path(), good);
  EXPECT_EQ(good_first.loaded[0]->devices().size(), 2u);
  ASSERT_EQ(good_first.failed.size(), 1u);
  EXPECT_EQ(good_first.failed[0].path, cpu_only);
  EXPECT_EQ(good_first.failed[0].reason, std::string("ignored: plugin 'fake' already loaded from ") + good.string());

  const PluginScan cpu_first = scan_plugins({plugin_dir("cpu_only"), plugin_dir("good")});
  ASSERT_EQ(cpu_first.loaded.size(), 1u);
  EXPECT_EQ(cpu_first.loaded[0]->path(), cpu_only);
  EXPECT_EQ(cpu_first.loaded[0]->devices().size(), 1u);
}

TEST(ScanPlugins, SkipsMissingDirectoriesAndReportsFilesGivenAsDirectories) {
  const fs::path not_a_dir = plugin_dir("good") / "libringlm-fake.so";
  const PluginScan scan = scan_plugins({"/nonexistent/ringlm-plugins", plugin_dir("good"), not_a_dir});
  EXPECT_THAT(names_of(scan), ElementsAre("fake"));
  ASSERT_EQ(scan.failed.size(), 1u);
  EXPECT_EQ(scan.failed[0].path, not_a_dir);
  EXPECT_EQ(scan.failed[0].reason, "not a directory");
}

TEST(ScanPlugins, NothingToFindIsEmpty) {
  const PluginScan scan = scan_plugins({});
  EXPECT_THAT(scan.loaded, IsEmpty());
  EXPECT_THAT(scan.failed, IsEmpty());
}

// --- plugin_search_dirs ------------------------------------------------------------------------

// The test executable and ringlm are built into the same bin/ directory.
fs::path executable_dir() { return fs::weakly_canonical(fs::path(RINGLM_BINARY).parent_path()); }

std::vector<fs::path> canonical(const std::vector<fs::path>& dirs) {
  std::vector<fs::path> out;
  for (const fs::path& d : dirs) out.push_back(fs::weakly_canonical(d));
  return out;
}

TEST(PluginSearchDirs, PluginDirThenEnvironmentThenExecutableDir) {
  const fs::path a = plugin_dir("good"), b = plugin_dir("cpu_only"), c = plugin_dir("broken");
  // Empty entries are ignored; a directory named twice (even spelt differently) is searched once.
  PluginPathGuard env(std::string(":") + a.string() + "::" + b.string() + ":" + a.string() + "/:");
  const std::vector<fs::path> dirs = plugin_search_dirs(c.string());
  EXPECT_THAT(dirs, ElementsAre(c, a, b, ::testing::_));
  EXPECT_EQ(canonical(dirs).back(), executable_dir());
}

TEST(PluginSearchDirs, WithoutFlagOrEnvironmentOnlyTheExecutableDir) {
  PluginPathGuard env(std::nullopt);
  EXPECT_THAT(canonical(plugin_search_dirs("")), ElementsAre(executable_dir()));
}

TEST(PluginSearchDirs, ExecutableDirGivenAsPluginDirIsSearchedOnce) {
  PluginPathGuard env("");
  const std::vector<fs::path> dirs = plugin_search_dirs(executable_dir().string() + "/.");
  ASSERT_EQ(dirs.size(), 1u);
  EXPECT_EQ(dirs[0], executable_dir().string() + "/.");  // kept as the user spelt it
}

// --- parse_device_spec -------------------------------------------------------------------------

TEST(ParseDeviceSpec, AcceptsCpuAutoNameAndNameWithIndex) {
  EXPECT_EQ(parse_device_spec("cpu").kind, DeviceSpec::Kind::kCpu);
  EXPECT_EQ(parse_device_spec("auto").kind, DeviceSpec::Kind::kAuto);

  const DeviceSpec bare = parse_device_spec("opencl");
  EXPECT_EQ(bare.kind, DeviceSpec::Kind::kPlugin);
  EXPECT_EQ(bare.plugin, "opencl");
  EXPECT_EQ(bare.index, 0);

  const DeviceSpec indexed = parse_device_spec("opencl:3");
  EXPECT_EQ(indexed.kind, DeviceSpec::Kind::kPlugin);
  EXPECT_EQ(indexed.plugin, "opencl");
  EXPECT_EQ(indexed.index, 3);

  const DeviceSpec other = parse_device_spec("my-gpu_2:10");
  EXPECT_EQ(other.plugin, "my-gpu_2");
  EXPECT_EQ(other.index, 10);
}

TEST(ParseDeviceSpec, RejectsMalformedValuesNamingThemAndTheAcceptedForms) {
  for (const std::string bad : {"", "opencl:", "opencl:x", ":1", "opencl:-1", "opencl:1:2", "opencl:+1", "opencl: 1",
                                "open cl", "cpu:0", "auto:1", "opencl:99999999999999"}) {
    try {
      parse_device_spec(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_THAT(e.what(), AllOf(HasSubstr("'" + bad + "'"), HasSubstr("cpu, auto, NAME or NAME:N"))) << bad;
    }
  }
}

// --- open_plugin_device ------------------------------------------------------------------------

TEST(OpenPluginDevice, OpensTheNamedDeviceAndItsBuffersWork) {
  const auto device = open_plugin_device(parse_device_spec("fake:1"), {plugin_dir("good")}, "");
  ASSERT_NE(device, nullptr);
  ASSERT_NE(device->context, nullptr);
  EXPECT_EQ(device->index, 1);
  EXPECT_EQ(device->plugin->name(), "fake");
  EXPECT_STREQ(device->info.name, "Fake GPU");
  EXPECT_EQ(device->info.type, RINGLM_DEVICE_GPU);

  // The context is the plugin's: a buffer round trip goes through it.
  const ringlm_plugin& api = device->plugin->api();
  ringlm_buffer* buffer = api.alloc(device->context, 16);
  ASSERT_NE(buffer, nullptr);
  const char in[] = "hello, plugin";
  char out[sizeof(in)] = {};
  EXPECT_EQ(api.upload(device->context, buffer, 2, in, sizeof(in)), RINGLM_OK);
  EXPECT_EQ(api.download(device->context, buffer, 2, out, sizeof(out)), RINGLM_OK);
  EXPECT_STREQ(out, in);
  api.free(device->context, buffer);
}

TEST(OpenPluginDevice, BareNameOpensDeviceZero) {
  const auto device = open_plugin_device(parse_device_spec("fake"), {plugin_dir("good")}, "/tmp/ringlm-cache");
  ASSERT_NE(device, nullptr);
  EXPECT_EQ(device->index, 0);
  EXPECT_STREQ(device->info.name, "Fake CPU");
}

TEST(OpenPluginDevice, UnknownNameListsWhatWasFoundAndWhatFailed) {
  const std::string message = plugin_error_of(
      [&] { open_plugin_device(parse_device_spec("opencl"), {plugin_dir("good"), broken_dir()}, ""); });
  EXPECT_THAT(message, StartsWith(std::string("no plugin named 'opencl' in ") + plugin_dir("good").string() + ", " +
                                  broken_dir().string()));
  const fs::path fake = plugin_dir("good") / "libringlm-fake.so";
  EXPECT_THAT(message, HasSubstr(std::string("found: fake (") + fake.string() + ")"));
  EXPECT_THAT(message, HasSubstr("found: exploding ("));
  EXPECT_THAT(message, HasSubstr(std::string("could not load: ") + (broken_dir() / "libringlm-badabi.so").string() +
                                 ": built for plugin ABI 7, this ringlm speaks 1 to 4"));
  EXPECT_THAT(message, HasSubstr(std::string("could not load: ") + (broken_dir() / "libringlm-garbage.so").string()));
}

TEST(OpenPluginDevice, UnknownNameWithNoPluginsAtAllSaysSo) {
  const std::string message =
      plugin_error_of([&] { open_plugin_device(parse_device_spec("opencl"), {"/nonexistent/plugins"}, ""); });
  EXPECT_THAT(message, AllOf(StartsWith("no plugin named 'opencl' in /nonexistent/plugins"),
                             HasSubstr("libringlm-<name>.so")));
}

TEST(OpenPluginDevice, IndexOutOfRangeSaysWhichIndicesExist) {
  const fs::path good = plugin_dir("good") / "libringlm-fake.so";
  EXPECT_EQ(plugin_error_of([&] { open_plugin_device(parse_device_spec("fake:3"), {plugin_dir("good")}, ""); }),
            good.string() + ": fake has 2 devices (0-1); asked for 3");
  const fs::path cpu_only = plugin_dir("cpu_only") / "libringlm-fake.so";
  EXPECT_EQ(plugin_error_of([&] { open_plugin_device(parse_device_spec("fake:1"), {plugin_dir("cpu_only")}, ""); }),
            cpu_only.string() + ": fake has 1 device (0); asked for 1");
}

TEST(OpenPluginDevice, DeviceListingFailureCarriesThePluginsReason) {
  EXPECT_EQ(plugin_error_of([&] { open_plugin_device(parse_device_spec("exploding"), {broken_dir()}, ""); }),
            (broken_dir() / "libringlm-exploding.so").string() +
                ": exploding cannot list its devices: driver exploded");
}

TEST(OpenPluginDevice, OpenFailureCarriesTheWholeBuildLog) {
  const std::string message =
      plugin_error_of([&] { open_plugin_device(parse_device_spec("openfail:1"), {plugin_dir("open_fails")}, ""); });
  EXPECT_THAT(message, StartsWith((plugin_dir("open_fails") / "libringlm-openfail.so").string() +
                                  ": cannot open openfail:1 (Fake GPU): kernel build failed: matmul.cl:3"));
  EXPECT_THAT(message, HasSubstr("\nmore of the log"));
}

TEST(OpenPluginDevice, RejectsASpecThatNamesNoPlugin) {
  EXPECT_THROW(open_plugin_device(parse_device_spec("cpu"), {plugin_dir("good")}, ""), std::invalid_argument);
}

// --- open_auto_device --------------------------------------------------------------------------

TEST(OpenAutoDevice, PicksTheGpuTypeDevice) {
  std::string why = "stale";
  const auto device = open_auto_device({plugin_dir("good")}, "", why);
  ASSERT_NE(device, nullptr) << why;
  EXPECT_EQ(device->plugin->name(), "fake");
  EXPECT_EQ(device->index, 1);
  EXPECT_EQ(device->info.type, RINGLM_DEVICE_GPU);
  EXPECT_EQ(why, "");
}

TEST(OpenAutoDevice, SkipsAPluginWhoseGpuWillNotOpen) {
  std::string why;
  const auto device = open_auto_device({plugin_dir("open_fails"), plugin_dir("good")}, "", why);
  ASSERT_NE(device, nullptr) << why;
  EXPECT_EQ(device->plugin->name(), "fake");
  EXPECT_EQ(device->index, 1);
}

TEST(OpenAutoDevice, OnlyCpuDevicesGivesNullAndAOneLineReason) {
  std::string why;
  const auto device = open_auto_device({plugin_dir("cpu_only")}, "", why);
  EXPECT_EQ(device, nullptr);
  EXPECT_EQ(why, "no GPU found (fake: CPU device Fake CPU); running on the CPU");
}

TEST(OpenAutoDevice, OpenFailureIsAReasonNotAnException) {
  std::string why;
  std::unique_ptr<OpenedDevice> device;
  EXPECT_NO_THROW(device = open_auto_device({plugin_dir("open_fails")}, "", why));
  EXPECT_EQ(device, nullptr);
  EXPECT_THAT(why, StartsWith("no GPU could be opened (openfail:1 (Fake GPU) failed to open: kernel build failed: "));
  EXPECT_THAT(why, HasSubstr("[...]); running on the CPU"));
  EXPECT_THAT(why, Not(HasSubstr("\n")));
}

TEST(OpenAutoDevice, BrokenPluginsAreReasonsToo) {
  std::string why;
  EXPECT_EQ(open_auto_device({broken_dir()}, "", why), nullptr);
  EXPECT_THAT(why, StartsWith("no GPU found ("));
  EXPECT_THAT(why, HasSubstr("exploding: cannot list devices: driver exploded"));
  EXPECT_THAT(why, HasSubstr("libringlm-badabi.so did not load: built for plugin ABI 7, this ringlm speaks 1 to 4"));
  EXPECT_THAT(why, Not(HasSubstr("\n")));
}

TEST(OpenAutoDevice, NoPluginsAtAll) {
  std::string why;
  EXPECT_EQ(open_auto_device({"/nonexistent/plugins"}, "", why), nullptr);
  EXPECT_EQ(why, "no GPU found (no plugins in /nonexistent/plugins); running on the CPU");
}

// --- ringlm devices ----------------------------------------------------------------------------

struct CommandResult {
  int exit_code = -1;
  std::string out;
};

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (const char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// A hard link where the file system allows one (cheap, and /proc/self/exe of a process started
// through it names the link), else a copy.
void link_or_copy(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  fs::create_hard_link(from, to, ec);
  if (ec) fs::copy_file(from, to, fs::copy_options::overwrite_existing);
}

// The built ringlm, linked into a directory of its own for one test: what `ringlm devices`
// finds next to itself is then only what the test puts there, never the real plugins (or
// whatever else) built into bin/.
class IsolatedRinglm {
 public:
  IsolatedRinglm()
      : dir_(fs::path(RINGLM_TEST_WORK_DIR) / "test_plugin_loader" / (std::string("bin.") + std::to_string(::getpid()))) {
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    link_or_copy(RINGLM_BINARY, binary());
  }
  ~IsolatedRinglm() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  IsolatedRinglm(const IsolatedRinglm&) = delete;
  IsolatedRinglm& operator=(const IsolatedRinglm&) = delete;

  const fs::path& dir() const { return dir_; }
  fs::path binary() const { return dir_ / "ringlm"; }
  // Puts a plugin library next to the executable.
  void add_plugin(const fs::path& library) const { link_or_copy(library, dir_ / library.filename()); }

  // Runs it with `args` and $RINGLM_PLUGIN_PATH set to `plugin_path` (empty: unset), stdout
  // captured; `timeout` ends a hang. stderr goes to the test's own stderr.
  CommandResult run(const std::vector<std::string>& args, const std::string& plugin_path = "") const {
    std::string command = "timeout 60 env -u RINGLM_PLUGIN_PATH ";
    if (!plugin_path.empty()) command += std::string("RINGLM_PLUGIN_PATH=") + shell_quote(plugin_path) + " ";
    command += shell_quote(binary().string());
    for (const std::string& a : args) command += std::string(" ") + shell_quote(a);
    CommandResult result;
    FILE* pipe = ::popen(command.c_str(), "r");
    if (pipe == nullptr) {
      ADD_FAILURE() << "popen failed: " << command;
      return result;
    }
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof(buf), pipe)) > 0;) result.out.append(buf, n);
    const int status = ::pclose(pipe);
    result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    return result;
  }

 private:
  fs::path dir_;
};

// What `ringlm devices` printed for --device label `label` (the row's text after the label and
// the padding that aligns the rows), or "(no row)".
std::string row_of(const std::string& out, const std::string& label) {
  for (size_t start = 0; start < out.size();) {
    const size_t end = std::min(out.find('\n', start), out.size());
    const std::string line = out.substr(start, end - start);
    if (line.rfind(label + " ", 0) == 0) return line.substr(line.find_first_not_of(' ', label.size()));
    start = end + 1;
  }
  return "(no row)";
}

std::string searched_line(const std::vector<std::string>& dirs) {
  std::string line = "\nplugin directories searched: ";
  for (size_t i = 0; i < dirs.size(); ++i) line += (i == 0 ? "" : ", ") + dirs[i];
  return line + "\n";
}

TEST(DevicesCommand, ReportsTheCpuAndEveryBrokenPluginAndExitsZero) {
  const IsolatedRinglm ringlm;
  const fs::path dir = broken_dir();
  const CommandResult r = ringlm.run({"devices", "--plugin-dir", dir.string()});
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_THAT(r.out, StartsWith("cpu "));
  EXPECT_THAT(r.out, AllOf(HasSubstr(" threads), SIMD target "), HasSubstr(" (Highway)\n")));
  // Loads, but cannot list its devices: a row with the reason.
  EXPECT_EQ(row_of(r.out, "exploding"), "exploding cannot list its devices: driver exploded   [" +
                                            (dir / "libringlm-exploding.so").string() + "]");
  EXPECT_THAT(r.out, HasSubstr("\nplugins that could not load:\n"));
  const auto failure_line = [&](const std::string& file, const std::string& cause) {
    return HasSubstr(std::string("\n  ") + (dir / file).string() + ": " + cause);
  };
  EXPECT_THAT(r.out, failure_line("libringlm-badabi.so", "built for plugin ABI 7, this ringlm speaks 1 to 4\n"));
  EXPECT_THAT(r.out, failure_line("libringlm-garbage.so", "cannot load: invalid ELF header\n"));
  EXPECT_THAT(r.out, failure_line("libringlm-noentry.so", "entry symbol 'ringlm_plugin_entry' missing"));
  EXPECT_THAT(r.out, failure_line("libringlm-nullentry.so", "ringlm_plugin_entry returned NULL\n"));
  EXPECT_THAT(r.out, failure_line("libringlm-small.so", "plugin table is 16 bytes"));
  EXPECT_THAT(r.out, failure_line("libringlm-undefined.so", "cannot load: "));
  EXPECT_THAT(r.out, Not(HasSubstr("libringlm-notes.txt")));
  EXPECT_THAT(r.out, Not(HasSubstr("libringlm-dir.so")));
  EXPECT_THAT(r.out, HasSubstr(searched_line({dir.string(), ringlm.dir().string()})));
}

TEST(DevicesCommand, MissingPluginDirStillReports) {
  const IsolatedRinglm ringlm;
  const CommandResult r = ringlm.run({"devices", "--plugin-dir", "/nonexistent/ringlm-plugins"});
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_THAT(r.out, StartsWith("cpu "));
  EXPECT_THAT(r.out, HasSubstr(searched_line({"/nonexistent/ringlm-plugins (absent)", ringlm.dir().string()})));
  EXPECT_THAT(r.out, Not(HasSubstr("plugins that could not load")));
}

TEST(DevicesCommand, ListsEachDeviceOfAPluginOnThePluginPath) {
  const IsolatedRinglm ringlm;
  const fs::path good = plugin_dir("good");
  const CommandResult r = ringlm.run({"devices"}, good.string());
  EXPECT_EQ(r.exit_code, 0) << r.out;
  const std::string where = std::string("   [") + (good / "libringlm-fake.so").string() + "]";
  EXPECT_EQ(row_of(r.out, "fake:0"), std::string("Fake CPU — CPU, 4 compute units, 512 MiB, FakeCL 1.0, plugin ABI 1") + where);
  EXPECT_EQ(row_of(r.out, "fake:1"), std::string("Fake GPU — GPU, 32 compute units, 8.0 GiB, FakeCL 1.0, plugin ABI 1") + where);
  EXPECT_THAT(r.out, HasSubstr(searched_line({good.string(), ringlm.dir().string()})));
  EXPECT_THAT(r.out, Not(HasSubstr("plugins that could not load")));
}

TEST(DevicesCommand, FindsAPluginNextToTheExecutable) {
  const IsolatedRinglm ringlm;
  ringlm.add_plugin(plugin_dir("cpu_only") / "libringlm-fake.so");
  const CommandResult r = ringlm.run({"devices"});
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(row_of(r.out, "fake:0"), std::string("Fake CPU — CPU, 4 compute units, 512 MiB, FakeCL 1.0, plugin ABI 1   [") +
                                         (ringlm.dir() / "libringlm-fake.so").string() + "]");
  EXPECT_EQ(row_of(r.out, "fake:1"), "(no row)");
  EXPECT_THAT(r.out, HasSubstr(searched_line({ringlm.dir().string()})));
}

}  // namespace
}  // namespace ringlm
