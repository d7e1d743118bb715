// What the end-to-end tests share: a work directory per test file, a file's contents, and a
// shell command run under a time limit with its exit code, stdout and stderr captured.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

namespace ringlm::test {

// RINGLM_TEST_WORK_DIR/<name>, created on first use.
inline std::string work_dir_for(const std::string& name) {
  const std::string dir = std::string(RINGLM_TEST_WORK_DIR) + "/" + name;
  std::filesystem::create_directories(dir);
  return dir;
}

// A file's bytes ("" when it cannot be read).
inline std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

struct CommandResult {
  int exit_code = -1;  // -1: the shell itself was killed by a signal
  std::string out, err;
};

// Whether the command failed the way a program reports an error: an exit code of its own,
// 1..123. Not success, not the timeout (124, or 125 when `timeout` itself failed), not a command
// that could not run (126, 127), and not a crash: the shell and `timeout` report a command ended
// by signal N as exit code 128 + N (a segfault reads 139), which a bare "non-zero" check would
// take for an error exit. A failed check says which of these it was.
inline ::testing::AssertionResult exited_with_error(const CommandResult& r) {
  const int code = r.exit_code;
  if (code >= 1 && code <= 123) return ::testing::AssertionSuccess() << "exit code " << code;
  const std::string why = code == 0                  ? "success"
                          : code == 124 || code == 125 ? "the time limit"
                          : code == 126 || code == 127 ? "the command could not run"
                          : code >= 128                ? "signal " + std::to_string(code - 128)
                                                       : "the shell was killed by a signal";
  return ::testing::AssertionFailure() << "exit code " << code << ": " << why;
}

// Runs `command` through the shell with stdin from `stdin_path`, ended by `timeout` after
// timeout_s (exit code 124), and returns its exit code, stdout and stderr. The captures are files
// in `dir` named after the running test and this process: CTest runs the tests of a file as
// parallel processes, and one test may run several commands one after another.
inline CommandResult run_command(const std::string& command, const std::string& dir, int timeout_s = 600,
                                 const std::string& stdin_path = "/dev/null") {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = info != nullptr ? info->name() : "command";
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';  // parameterized names hold '/'
  }
  const std::string stem = dir + "/" + name + "." + std::to_string(::getpid());
  const std::string out = stem + ".stdout", err = stem + ".stderr";
  const std::string line = "timeout " + std::to_string(timeout_s) + " " + command + " >'" + out + "' 2>'" + err +
                           "' <'" + stdin_path + "'";
  const int status = std::system(line.c_str());
  CommandResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = slurp(out);
  r.err = slurp(err);
  std::filesystem::remove(out);
  std::filesystem::remove(err);
  return r;
}

}  // namespace ringlm::test
