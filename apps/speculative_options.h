// The speculative decoding flags run, chat, batch and serve share (llama.cpp's names): a guesser
// of the tokens to come, either prompt lookup (--lookup N) or a draft model (-md FILE with
// --draft-max, --draft-min, --draft-p-min), and what makes it.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include "core/kv/kv_cache.h"
#include "core/model/loader.h"
#include "core/sampling/sampler.h"
#include "core/speculative/draft_length.h"
#include "core/speculative/draft_model.h"
#include "core/speculative/prompt_lookup.h"

namespace ringlm {

struct SpeculativeOptions {
  int lookup = 0;           // --lookup N: prompt lookup drafts of up to N tokens (0: off)
  std::string draft_model;  // -md: a draft model's GGUF file ("": none)
  DraftModelOptions draft;
  bool enabled() const { return lookup > 0 || !draft_model.empty(); }
};

// `what`: where the lookup drafts come from ("earlier text", "the conversation").
void add_speculative_options(CLI::App& cmd, SpeculativeOptions& opts, const std::string& what);

// The draft model -md names, loaded on the CPU with `n_threads` threads and checked against the
// target's vocabulary (check_same_vocabulary); nothing without -md.
std::optional<LoadedModel> load_draft_model(const SpeculativeOptions& opts, const LoadedModel& target, int n_threads);

// What the target's checking passes cost on this machine: the tuning table's measurement for
// this model file at `n_threads` threads (`ringlm tune`), else PassCost's estimate (also on a
// device, whose passes tune does not measure).
PassCost checking_pass_cost(const LoadedModel& target, int n_threads);

// Refuses drafts (of either guesser) over a KIVI cache, before anything loads (kKiviRefusesDrafts).
void refuse_drafts_with_kivi(const SpeculativeOptions& opts, KvTypes cache);

// One sequence's guesser: prompt lookup, or the draft model following this sequence; null when
// the options ask for none.
std::unique_ptr<Drafter> make_drafter(const SpeculativeOptions& opts, LoadedModel* draft, int n_ctx,
                                      const KvCacheOptions& cache, const SamplingParams& sampling);

}  // namespace ringlm
