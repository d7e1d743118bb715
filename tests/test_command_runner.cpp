// The end-to-end tests' command runner (command_runner.h) on commands whose ending is known:
// the error checks of those tests are only as good as its verdicts. A crash must never pass for
// a clean error exit, which the shell and `timeout` make easy to miss: they turn a signal into an
// ordinary exit code of 128 + N.
#include <csignal>
#include <fstream>
#include <string>

#include "command_runner.h"

namespace ringlm {
namespace {

const std::string& work_dir() {
  static const std::string dir = test::work_dir_for("command_runner");
  return dir;
}

TEST(CommandRunner, CapturesOutputAndTheProgramsOwnExitCode) {
  const test::CommandResult r = test::run_command("sh -c 'echo out; echo err >&2; exit 3'", work_dir());
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_EQ(r.out, "out\n");
  EXPECT_EQ(r.err, "err\n");
  EXPECT_TRUE(test::exited_with_error(r));
}

TEST(CommandRunner, SuccessIsNotAnErrorExit) {
  const test::CommandResult r = test::run_command("true", work_dir());
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_FALSE(test::exited_with_error(r));
}

TEST(CommandRunner, ACrashIsNotAnErrorExit) {
  for (const int signal : {SIGSEGV, SIGABRT, SIGKILL}) {
    const test::CommandResult r = test::run_command("sh -c 'kill -" + std::to_string(signal) + " $$'", work_dir());
    EXPECT_EQ(r.exit_code, 128 + signal) << "signal " << signal;
    EXPECT_FALSE(test::exited_with_error(r)) << "signal " << signal;
  }
}

TEST(CommandRunner, ATimeoutIsNotAnErrorExit) {
  const test::CommandResult r = test::run_command("sleep 30", work_dir(), 1);
  EXPECT_EQ(r.exit_code, 124);
  EXPECT_FALSE(test::exited_with_error(r));
}

TEST(CommandRunner, AMissingProgramIsNotAnErrorExit) {
  const test::CommandResult r = test::run_command("./no-such-program-here", work_dir());
  EXPECT_EQ(r.exit_code, 127);
  EXPECT_FALSE(test::exited_with_error(r));
}

TEST(CommandRunner, StdinComesFromTheGivenFile) {
  const std::string input = work_dir() + "/stdin.txt";
  {
    std::ofstream(input) << "hello\n";
  }
  const test::CommandResult r = test::run_command("cat", work_dir(), 60, input);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.out, "hello\n");
}

}  // namespace
}  // namespace ringlm
