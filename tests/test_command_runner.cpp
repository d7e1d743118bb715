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

// Endings that must never pass for an error exit: success, a signal (128 + N through the shell
// and `timeout`), the timeout, a program that is not there.
TEST(CommandRunner, OtherEndingsAreNotErrorExits) {
  struct Ending {
    std::string command;
    int timeout_s, exit_code;
  };
  const Ending endings[] = {
      {"true", 60, 0},
      {"sh -c 'kill -SEGV $$'", 60, 128 + SIGSEGV},
      {"sh -c 'kill -ABRT $$'", 60, 128 + SIGABRT},
      {"sh -c 'kill -KILL $$'", 60, 128 + SIGKILL},
      {"sleep 30", 1, 124},
      {"./no-such-program-here", 60, 127},
  };
  for (const Ending& e : endings) {
    const test::CommandResult r = test::run_command(e.command, work_dir(), e.timeout_s);
    EXPECT_EQ(r.exit_code, e.exit_code) << e.command;
    EXPECT_FALSE(test::exited_with_error(r)) << e.command;
  }
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
