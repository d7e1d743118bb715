// `ringlm` run as a subprocess with bad arguments and bad model files.
//
// Each case must end on its own (no hang: a timeout kills it and fails the test), exit with a
// non-zero status rather than a signal, and say on stderr which flag or file was wrong. None of
// them needs a real model: the child gets an empty cache directory and no $RINGLM_MODEL, so a
// check that fails to fire shows up as a wrong message, not as a long generation run.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "tests/gguf_test_builder.h"

extern char** environ;

namespace ringlm {
namespace {

using ::testing::AllOf;
using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::Not;
using namespace std::chrono_literals;

struct RunResult {
  bool timed_out = false;
  int exit_code = -1;  // when the child exited normally
  int signal = 0;      // when a signal ended it
  std::string out, err;
};

std::string describe(const RunResult& r) {
  return "exit " + std::to_string(r.exit_code) + ", signal " + std::to_string(r.signal) +
         (r.timed_out ? ", timed out" : "") + "\n--- stdout:\n" + r.out + "\n--- stderr:\n" + r.err;
}

std::string work_dir() {
  const std::string dir = std::string(RINGLM_TEST_WORK_DIR) + "/test_cli";
  std::filesystem::create_directories(dir + "/empty-cache");
  return dir;
}

// The environment of the child: ours, minus anything that points ringlm at a real model.
std::vector<std::string> child_environment() {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string var = *e;
    if (var.rfind("RINGLM_MODEL=", 0) == 0 || var.rfind("RINGLM_CACHE_DIR=", 0) == 0) continue;
    env.push_back(var);
  }
  env.push_back("RINGLM_CACHE_DIR=" + work_dir() + "/empty-cache");
  return env;
}

std::vector<char*> c_strings(std::vector<std::string>& v) {
  std::vector<char*> out;
  for (std::string& s : v) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// Runs the ringlm binary with `args`, stdin from /dev/null, capturing stdout and stderr
// separately. Kills it if it runs past `timeout`.
RunResult run_ringlm(std::vector<std::string> args, std::chrono::milliseconds timeout = 20s) {
  args.insert(args.begin(), RINGLM_BINARY);
  std::vector<std::string> env = child_environment();
  // Everything the child needs is prepared before fork: after it, only async-signal-safe calls.
  std::vector<char*> argv = c_strings(args);
  std::vector<char*> envp = c_strings(env);

  int out_pipe[2], err_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0) {
    ADD_FAILURE() << "pipe: " << std::strerror(errno);
    return {};
  }
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int null_fd = ::open("/dev/null", O_RDONLY);
    ::dup2(null_fd, STDIN_FILENO);
    ::dup2(out_pipe[1], STDOUT_FILENO);
    ::dup2(err_pipe[1], STDERR_FILENO);
    ::execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  RunResult r;
  if (pid < 0) {
    ADD_FAILURE() << "fork: " << std::strerror(errno);
    ::close(out_pipe[0]);
    ::close(err_pipe[0]);
    return r;
  }

  // Read both pipes until the child closes them or the deadline passes.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  std::string* sinks[2] = {&r.out, &r.err};
  int open_fds = 2;
  while (open_fds > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left <= 0ms) {
      r.timed_out = true;
      break;
    }
    if (::poll(fds, 2, static_cast<int>(left.count())) < 0 && errno != EINTR) break;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      char buf[4096];
      const ssize_t n = ::read(fds[i].fd, buf, sizeof(buf));
      if (n > 0) {
        sinks[i]->append(buf, static_cast<size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      }
    }
  }
  for (const pollfd& p : fds) {
    if (p.fd >= 0) ::close(p.fd);
  }

  // The pipes closing does not mean the child has exited: wait for it, within the deadline too.
  int status = 0;
  while (true) {
    const pid_t done = ::waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    if (r.timed_out || std::chrono::steady_clock::now() >= deadline) {
      r.timed_out = true;
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(10ms);
  }
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) r.signal = WTERMSIG(status);
  return r;
}

// The common verdict: the command failed cleanly and in time, and stderr says why.
template <typename Matcher>
void expect_clean_failure(const RunResult& r, Matcher stderr_matcher) {
  EXPECT_FALSE(r.timed_out) << describe(r);
  EXPECT_EQ(r.signal, 0) << "ended by a signal: " << describe(r);
  EXPECT_NE(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.exit_code, 127) << "the binary did not start: " << describe(r);
  EXPECT_THAT(r.err, AllOf(Not(::testing::IsEmpty()), stderr_matcher)) << describe(r);
  // In the sanitizer build a memory error ends the child with exit code 1, not a signal.
  EXPECT_THAT(r.err, AllOf(Not(HasSubstr("Sanitizer")), Not(HasSubstr("runtime error:")))) << describe(r);
}

std::string write_work_file(const std::string& name, const std::vector<uint8_t>& bytes) {
  const std::string path = work_dir() + "/" + name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  EXPECT_TRUE(out.good()) << path;
  return path;
}

// A valid GGUF image with some metadata and a tensor, to cut short.
std::vector<uint8_t> small_gguf() {
  std::vector<float> values(256, 0.5f);
  return test::GgufBuilder()
      .kv_string("general.architecture", "llama")
      .kv_strings("tokenizer.ggml.tokens", {"a", "b", "c"})
      .tensor_f32("token_embd.weight", {64, 4}, values)
      .build();
}

// ---------------------------------------------------------------------------------------------

TEST(Cli, HelpSucceeds) {
  // The positive control: the binary starts, parses and exits 0, so the failures below are
  // the checks firing, not a binary that fails on everything.
  const RunResult r = run_ringlm({"run", "--help"});
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_THAT(r.out, AllOf(HasSubstr("--prompt"), HasSubstr("--model")));
}

TEST(Cli, NoSubcommand) { expect_clean_failure(run_ringlm({}), HasSubstr("subcommand")); }

TEST(Cli, UnknownSubcommand) {
  // CLI11 reports the missing subcommand before the unexpected word, so the message names the
  // problem but not "frobnicate" itself.
  expect_clean_failure(run_ringlm({"frobnicate"}), HasSubstr("subcommand"));
}

TEST(Cli, UnknownFlag) {
  expect_clean_failure(run_ringlm({"run", "--no-such-flag", "-p", "hi"}), HasSubstr("--no-such-flag"));
}

TEST(Cli, NegativeTemperature) {
  expect_clean_failure(run_ringlm({"run", "--temp", "-1", "-p", "hi"}), HasSubstr("--temp"));
}

TEST(Cli, TopPAboveOne) { expect_clean_failure(run_ringlm({"run", "--top-p", "2", "-p", "hi"}), HasSubstr("--top-p")); }

TEST(Cli, NonNumericThreads) {
  expect_clean_failure(run_ringlm({"run", "-t", "abc", "-p", "hi"}), AllOf(HasSubstr("--threads"), HasSubstr("abc")));
}

TEST(Cli, NegativeTokenCount) {
  expect_clean_failure(run_ringlm({"run", "-n", "-5", "-p", "hi"}), HasSubstr("--n-predict"));
}

TEST(Cli, NegativeContextSize) {
  expect_clean_failure(run_ringlm({"run", "-c", "-1", "-p", "hi"}), HasSubstr("--ctx-size"));
}

TEST(Cli, UnknownStatsFormat) {
  expect_clean_failure(run_ringlm({"run", "--stats", "xml", "-p", "hi"}), HasSubstr("--stats"));
}

TEST(Cli, NeitherPromptNorFile) {
  expect_clean_failure(run_ringlm({"run"}), AllOf(HasSubstr("--prompt"), HasSubstr("--file")));
}

TEST(Cli, BothPromptAndFile) {
  expect_clean_failure(run_ringlm({"run", "-p", "hi", "-f", "prompt.txt"}),
                       AllOf(HasSubstr("--prompt"), HasSubstr("--file")));
}

// A grammar that cannot be used is refused before the model loads, naming what is wrong.
TEST(Cli, BadGrammars) {
  expect_clean_failure(run_ringlm({"run", "-p", "hi", "--grammar", "root ::= expr\nexpr ::= expr \"+\" | \"1\""}),
                       HasSubstr("'expr' is left-recursive"));
  expect_clean_failure(run_ringlm({"run", "-p", "hi", "--grammar-file", "no-such.gbnf"}), HasSubstr("no-such.gbnf"));
  expect_clean_failure(run_ringlm({"run", "-p", "hi", "--json-schema", "{\"type\": \"object\", \"not\": {}}"}),
                       HasSubstr("unsupported keyword 'not'"));
  expect_clean_failure(run_ringlm({"run", "-p", "hi", "--json-schema", "{not json"}), HasSubstr("not valid JSON"));
  expect_clean_failure(run_ringlm({"run", "-p", "hi", "--grammar", "root ::= \"a\"", "--json-schema", "{}"}),
                       HasSubstr("--grammar"));
  expect_clean_failure(run_ringlm({"run", "-p", "hi", "--grammar", "root ::= \"a\"", "--beams", "2"}), HasSubstr("--beams"));
}

// RINGLM_SIMD_TARGET (a benchmarking knob) picks one SIMD target's kernels, and names the
// targets there are when it names none of them. SSE4 is on every x86-64 machine this runs on.
class SimdTargetEnv {
 public:
  explicit SimdTargetEnv(const char* value) { setenv("RINGLM_SIMD_TARGET", value, 1); }
  ~SimdTargetEnv() { unsetenv("RINGLM_SIMD_TARGET"); }
};

TEST(Cli, SimdTargetOverride) {
  const SimdTargetEnv env("SSE4");
  const RunResult r = run_ringlm({"devices"});
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_THAT(r.out, HasSubstr("SIMD target SSE4")) << describe(r);
}

// `ringlm devices` says whether AMX could run here, as /proc/cpuinfo's flags tell it on their own;
// RINGLM_AMX=off turns it off, RINGLM_AMX=emulate puts the emulation in its place.
TEST(Cli, DevicesSayWhetherAmxCanRun) {
  std::ifstream cpuinfo("/proc/cpuinfo");
  const std::string flags((std::istreambuf_iterator<char>(cpuinfo)), std::istreambuf_iterator<char>());
  const bool in_cpu = flags.find(" amx_tile") != std::string::npos && flags.find(" amx_int8") != std::string::npos;
  const RunResult r = run_ringlm({"devices"});
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  if (in_cpu) {
    // Not "off (the tiles' results differed ...)": that would be a wrong tile product.
    EXPECT_THAT(r.out, ContainsRegex("\namx +(on \\(prompts|not offered by the kernel)")) << describe(r);
  } else {
    EXPECT_THAT(r.out, ContainsRegex("\namx +not in this CPU\n")) << describe(r);
  }
  setenv("RINGLM_AMX", "off", 1);
  const RunResult off = run_ringlm({"devices"});
  unsetenv("RINGLM_AMX");
  EXPECT_THAT(off.out, ContainsRegex("\namx +off \\(RINGLM_AMX=off\\)\n")) << describe(off);
  setenv("RINGLM_AMX", "emulate", 1);
  const RunResult emulated = run_ringlm({"devices"});
  unsetenv("RINGLM_AMX");
  EXPECT_THAT(emulated.out, ContainsRegex("\namx +emulated \\(RINGLM_AMX=emulate\\)")) << describe(emulated);
  setenv("RINGLM_AMX", "maybe", 1);
  const RunResult unknown = run_ringlm({"devices"});
  unsetenv("RINGLM_AMX");
  EXPECT_NE(unknown.exit_code, 0) << describe(unknown);
  EXPECT_THAT(unknown.err, HasSubstr("RINGLM_AMX=maybe: expected on")) << describe(unknown);
}

TEST(Cli, UnknownSimdTarget) {
  const SimdTargetEnv env("NEON");
  expect_clean_failure(run_ringlm({"devices"}), AllOf(HasSubstr("RINGLM_SIMD_TARGET=NEON"), HasSubstr("SSE4")));
}

TEST(Cli, MissingModelFile) {
  const std::string path = "/nonexistent/dir/model.gguf";
  expect_clean_failure(run_ringlm({"run", "-m", path, "-p", "hi"}), AllOf(HasSubstr(path), HasSubstr("cannot open")));
}

TEST(Cli, NoModelGivenAndNoneInstalled) {
  // With no -m, no $RINGLM_MODEL and an empty cache, the message must say where it looked.
  expect_clean_failure(run_ringlm({"run", "-p", "hi"}), AllOf(HasSubstr("no model"), HasSubstr("empty-cache")));
}

TEST(Cli, TruncatedModelFile) {
  const std::vector<uint8_t> image = small_gguf();
  for (size_t len : {image.size() / 2, image.size() - 1, size_t{20}}) {
    const std::string path = write_work_file("truncated-" + std::to_string(len) + ".gguf",
                                             std::vector<uint8_t>(image.begin(), image.begin() + static_cast<ptrdiff_t>(len)));
    expect_clean_failure(run_ringlm({"run", "-m", path, "-p", "hi"}), HasSubstr(path + ": "));
  }
}

TEST(Cli, TextFileAsModel) {
  const std::string text = "this is a text file, not a model\n";
  const std::string path = write_work_file("not-a-model.txt", std::vector<uint8_t>(text.begin(), text.end()));
  expect_clean_failure(run_ringlm({"run", "-m", path, "-p", "hi"}), AllOf(HasSubstr(path), HasSubstr("not a GGUF file")));
}

TEST(Cli, EmptyFileAsModel) {
  const std::string path = write_work_file("empty.gguf", {});
  expect_clean_failure(run_ringlm({"run", "-m", path, "-p", "hi"}), AllOf(HasSubstr(path), HasSubstr("empty file")));
}

TEST(Cli, DirectoryAsModel) {
  const std::string path = work_dir();
  expect_clean_failure(run_ringlm({"run", "-m", path, "-p", "hi"}),
                       AllOf(HasSubstr(path), HasSubstr("not a regular file")));
}

TEST(Cli, ValidGgufThatIsNotALlamaModel) {
  // Parses, but has no model hyperparameters: the loader must name what is missing.
  const std::string path = write_work_file("no-hparams.gguf", small_gguf());
  expect_clean_failure(run_ringlm({"run", "-m", path, "-p", "hi"}),
                       AllOf(HasSubstr(path), HasSubstr("llama.context_length")));
}

// The JSON object of the last stderr line (--stats json).
nlohmann::json last_stats(const RunResult& r) {
  std::string err = r.err;
  while (!err.empty() && err.back() == '\n') err.pop_back();
  return nlohmann::json::parse(err.substr(err.rfind('\n') + 1));
}

TEST(CliContextShift, GenerationGoesOnPastTheContext) {
  // 150 tokens through a 64-token cache: StreamingLLM shifts (4 sinks, 30 dropped each time).
  const RunResult r = run_ringlm({"run", "-m", RINGLM_TEST_MODEL, "-p", "Once upon a time", "-c", "64", "--keep", "4",
                                  "-n", "150", "--ignore-eos", "--temp", "0", "--stats", "json", "-t", "2"},
                                 120s);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const nlohmann::json stats = last_stats(r);
  EXPECT_EQ(stats["gen_tokens"], 150);
  EXPECT_EQ(stats["stop_reason"], "limit");
  // 4 prompt tokens (+BOS at most) and 149 decoded: the cache overflows after 64, then every 30.
  EXPECT_GE(stats["n_shifts"].get<int>(), 3);
  EXPECT_EQ(stats["n_discarded"].get<int>(), 30 * stats["n_shifts"].get<int>());
  // One time per decode step (the first generated token comes from the prompt's logits).
  EXPECT_EQ(stats["token_ms"].size(), 149u);
  // SmolLM2-135M: 30 layers of keys and values, 3 KV heads of 64, fp16, for the 64 slots.
  EXPECT_EQ(stats["kv_type"], "f16");
  EXPECT_EQ(stats["kv_bytes"].get<size_t>(), size_t{30} * 2 * 64 * 3 * 64 * 2);
}

TEST(CliContextShift, NoContextShiftStopsAtAFullContext) {
  const RunResult r = run_ringlm({"run", "-m", RINGLM_TEST_MODEL, "-p", "Once upon a time", "-c", "32",
                                  "--no-context-shift", "-n", "100", "--ignore-eos", "--temp", "0", "--stats", "json",
                                  "--cache-type", "f32"},
                                 120s);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const nlohmann::json stats = last_stats(r);
  EXPECT_EQ(stats["kv_type"], "f32");
  EXPECT_EQ(stats["kv_bytes"].get<size_t>(), size_t{30} * 2 * 32 * 3 * 64 * 4);  // 32 slots of fp32
  EXPECT_EQ(stats["stop_reason"], "context");
  EXPECT_EQ(stats["n_shifts"], 0);
  EXPECT_LT(stats["gen_tokens"].get<int>(), 32);
}

// A q8_0 cache through several shifts (its keys rotated and quantized again each time): the
// generation goes on, and the cache takes q8_0's bytes: 34 per 32 elements.
TEST(CliContextShift, QuantizedCachesShiftAndTakeTheirBytes) {
  const RunResult r = run_ringlm({"run", "-m", RINGLM_TEST_MODEL, "-p", "Once upon a time", "-c", "64", "--keep", "4",
                                  "-n", "120", "--ignore-eos", "--temp", "0", "--stats", "json", "-t", "2", "-ctk", "q8_0",
                                  "-ctv", "q8_0"},
                                 120s);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const nlohmann::json stats = last_stats(r);
  EXPECT_EQ(stats["gen_tokens"], 120);
  EXPECT_GE(stats["n_shifts"].get<int>(), 2);
  EXPECT_EQ(stats["kv_type"], "q8_0");
  EXPECT_EQ(stats["kv_bytes"].get<size_t>(), size_t{30} * 2 * 64 * (3 * 64 / 32 * 34));
  // q4_0: 18 bytes per 32 elements.
  const RunResult q4 = run_ringlm({"run", "-m", RINGLM_TEST_MODEL, "-p", "Once upon a time", "-c", "64", "-n", "4",
                                   "--stats", "json", "--cache-type", "q4_0"},
                                  120s);
  ASSERT_EQ(q4.exit_code, 0) << describe(q4);
  EXPECT_EQ(last_stats(q4)["kv_type"], "q4_0");
  EXPECT_EQ(last_stats(q4)["kv_bytes"].get<size_t>(), size_t{30} * 2 * 64 * (3 * 64 / 32 * 18));
  // Keys and values of their own types (llama.cpp's -ctk, -ctv), through shifts: each side's bytes.
  const RunResult mixed = run_ringlm({"run", "-m", RINGLM_TEST_MODEL, "-p", "Once upon a time", "-c", "64", "-n", "80",
                                      "--ignore-eos", "--stats", "json", "--cache-type", "f16", "-ctk", "q8_0", "-ctv",
                                      "q4_0"},
                                     120s);
  ASSERT_EQ(mixed.exit_code, 0) << describe(mixed);
  EXPECT_EQ(last_stats(mixed)["kv_type"], "q8_0/q4_0");
  EXPECT_GE(last_stats(mixed)["n_shifts"].get<int>(), 1);
  EXPECT_EQ(last_stats(mixed)["kv_bytes"].get<size_t>(), size_t{30} * 64 * (3 * 64 / 32 * 34 + 3 * 64 / 32 * 18));
}

TEST(CliContextShift, BadCacheFlags) {
  expect_clean_failure(run_ringlm({"run", "-m", RINGLM_TEST_MODEL, "-p", "hi", "-c", "64", "--keep", "64"}),
                       HasSubstr("--keep"));
  expect_clean_failure(run_ringlm({"run", "-m", RINGLM_TEST_MODEL, "-p", "hi", "-c", "64", "--discard", "61"}),
                       HasSubstr("--discard"));
  expect_clean_failure(run_ringlm({"run", "-p", "hi", "--cache-type", "q8"}), HasSubstr("--cache-type"));
  expect_clean_failure(run_ringlm({"run", "-p", "hi", "-ctk", "q8"}), HasSubstr("--cache-type-k"));
  expect_clean_failure(run_ringlm({"run", "-p", "hi", "-ctv", "q2_k"}), HasSubstr("--cache-type-v"));
  expect_clean_failure(run_ringlm({"run", "-p", "hi", "--keep", "-2"}), HasSubstr("--keep"));
}

}  // namespace
}  // namespace ringlm
