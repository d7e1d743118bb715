// ringlm: one executable, one subcommand per job.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <span>
#include <string>
#include <string_view>

#include "apps/batch_command.h"
#include "apps/bench_command.h"
#include "apps/chat_command.h"
#include "apps/devices_command.h"
#include "apps/perplexity_command.h"
#include "apps/pipeline_process.h"
#include "apps/quantize_command.h"
#include "apps/run_command.h"
#include "apps/serve_command.h"
#include "apps/tokenize_command.h"
#include "apps/tune_command.h"
#include "backends/cpu/tuning.h"

namespace {

// llama.cpp's flags of several letters after one dash, which CLI11 cannot name: each is read as
// its long name, so that a llama.cpp command line works as it is.
void translate_llama_cpp_short_flags(int argc, char** argv) {
  static char model_draft[] = "--model-draft";
  static char cache_type_k[] = "--cache-type-k";
  static char cache_type_v[] = "--cache-type-v";
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg(argv[i]);
    if (arg == "-md") argv[i] = model_draft;
    if (arg == "-ctk") argv[i] = cache_type_k;
    if (arg == "-ctv") argv[i] = cache_type_v;
  }
}

}  // namespace

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
    // Under mpirun with several processes: this one's rank in the pipeline (pipeline_process.h).
    ringlm::set_this_process(ringlm::PipelineProcess::join(std::span<char* const>(argv, static_cast<size_t>(argc))));
    ringlm::apply_simd_target_override();
    translate_llama_cpp_short_flags(argc, argv);
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    // In a pipeline, every rank goes down with the error (and the rank that failed is named).
    if (!ringlm::this_process().alone()) ringlm::this_process().abort(std::string("error: ") + e.what());
    std::fprintf(stderr, "ringlm: error: %s\n", e.what());
    return 1;
  }
  ringlm::set_this_process(nullptr);  // MPI_Finalize before exit, once every rank is done
  return 0;
}
