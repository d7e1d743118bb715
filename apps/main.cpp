// ringlm: one executable, one subcommand per job.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>

#include "apps/batch_command.h"
#include "apps/bench_command.h"
#include "apps/chat_command.h"
#include "apps/devices_command.h"
#include "apps/perplexity_command.h"
#include "apps/quantize_command.h"
#include "apps/run_command.h"
#include "apps/serve_command.h"
#include "apps/tokenize_command.h"
#include "apps/tune_command.h"
#include "backends/cpu/tuning.h"

int main(int argc, char** argv) {
  CLI::App app{"ringlm: LLM inference on GGUF models, CPU first"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "ringlm 0.1.0");
  ringlm::add_run_command(app);
  ringlm::add_chat_command(app);
  ringlm::add_batch_command(app);
  ringlm::add_serve_command(app);
  ringlm::add_bench_command(app);
  ringlm::add_perplexity_command(app);
  ringlm::add_quantize_command(app);
  ringlm::add_tune_command(app);
  ringlm::add_devices_command(app);
  ringlm::add_tokenize_command(app);
  try {
    ringlm::apply_simd_target_override();
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "ringlm: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
