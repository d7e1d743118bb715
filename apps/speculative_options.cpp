#include "apps/speculative_options.h"

#include <stdexcept>

#include "apps/common_options.h"
#include "backends/cpu/tuning.h"

namespace ringlm {

void add_speculative_options(CLI::App& cmd, SpeculativeOptions& opts, const std::string& what) {
  auto* lookup = cmd.add_option("--lookup", opts.lookup,
                                "speculative decoding by prompt lookup: drafts of up to N tokens from " + what +
                                    ", checked in one pass (0: off)")
                     ->check(CLI::Range(0, 64));
  auto* draft = cmd.add_option("--model-draft", opts.draft_model,
                               "speculative decoding with a draft model of the same vocabulary (a GGUF file; -md too)");
  lookup->excludes(draft);
  cmd.add_option("--draft-max,--draft", opts.draft.max_draft, "draft model: tokens per draft at most")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  cmd.add_option("--draft-min", opts.draft.min_draft, "draft model: a shorter draft is not checked")
      ->check(CLI::Range(0, 64))
      ->capture_default_str();
  cmd.add_option("--draft-p-min", opts.draft.p_min,
                 "draft model: drafting stops before a token it gives less probability than this")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
}

std::optional<LoadedModel> load_draft_model(const SpeculativeOptions& opts, const LoadedModel& target, int n_threads) {
  if (opts.draft_model.empty()) return std::nullopt;
  if (opts.draft.min_draft > opts.draft.max_draft) throw std::invalid_argument("--draft-min is larger than --draft-max");
  LoadedModel draft = load_model(resolve_model_path(opts.draft_model), n_threads);
  try {
    check_same_vocabulary(*target.tokenizer, *draft.tokenizer);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument("-md " + opts.draft_model + ": " + e.what());
  }
  return draft;
}

PassCost checking_pass_cost(const LoadedModel& target, int n_threads) {
  if (target.backend->offloads()) return {};
  // Quietly: the CPU backend has already warned about a table it could not read.
  const KernelTable table = load_configured_kernel_table(/*warn=*/false);
  const PassCostEntry* entry = table.pass_cost(target.gguf->path(), n_threads);
  return entry != nullptr ? PassCost::measured(entry->cost) : PassCost();
}

void refuse_drafts_with_kivi(const SpeculativeOptions& opts, KvTypes cache) {
  if (opts.enabled() && cache.keys == KvType::kKivi2) throw std::invalid_argument(kKiviRefusesDrafts);
}

std::unique_ptr<Drafter> make_drafter(const SpeculativeOptions& opts, LoadedModel* draft, int n_ctx,
                                      const KvCacheOptions& cache, const SamplingParams& sampling) {
  if (opts.lookup > 0) return std::make_unique<PromptLookup>(opts.lookup);
  if (draft == nullptr) return nullptr;
  return std::make_unique<DraftModel>(*draft->model, n_ctx, cache, sampling, opts.draft);
}

}  // namespace ringlm
