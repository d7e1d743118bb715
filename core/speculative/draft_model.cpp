#include "core/speculative/draft_model.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>


namespace ringlm {

namespace {

constexpr int32_t kMaxVocabularyPadding = 128;
constexpr size_t kFewTokens = 4;  // what the draft follows one token at a time

// The probability softmax gives the most likely token.
float top_probability(std::span<const float> logits) {
  const float best = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float x : logits) sum += std::exp(static_cast<double>(x) - best);
  return static_cast<float>(1.0 / sum);
}

// The draft model's sampler draws with its own generator: seeded like the target's, its draws
// would repeat the target's, and the checks that compare the two would not be independent.
SamplingParams own_seed(SamplingParams sampling) {
  if (sampling.seed != 0xFFFFFFFF) sampling.seed = sampling.seed * 6364136223846793005ULL + 1442695040888963407ULL;
  if (sampling.seed == 0xFFFFFFFF) ++sampling.seed;
  return sampling;
}

}  // namespace

void check_same_vocabulary(const Tokenizer& target, const Tokenizer& draft) {
  const int32_t n_target = target.n_vocab(), n_draft = draft.n_vocab();
  if (std::abs(n_target - n_draft) > kMaxVocabularyPadding) {
    throw std::invalid_argument("the draft model's vocabulary has " + std::to_string(n_draft) + " tokens and the target's " +
                                std::to_string(n_target) + ": not the same vocabulary");
  }
  for (int32_t id = 0; id < std::min(n_target, n_draft); ++id) {
    if (target.token_text(id) != draft.token_text(id)) {
      throw std::invalid_argument("the draft model's vocabulary differs from the target's at token " + std::to_string(id) +
                                  ": '" + std::string(draft.token_text(id)) + "' in the draft, '" +
                                  std::string(target.token_text(id)) + "' in the target");
    }
  }
  if (draft.bos_id() != target.bos_id() || draft.add_bos_by_default() != target.add_bos_by_default()) {
    throw std::invalid_argument("the draft model starts its text with another BOS token than the target");
  }
}

DraftModel::DraftModel(LlamaModel& model, int n_ctx, const KvCacheOptions& cache, const SamplingParams& sampling,
                       const DraftModelOptions& options)
    : model_(model),
      cache_(model.make_cache(n_ctx, cache)),
      sampler_(own_seed(sampling), model.hparams().n_vocab),
      options_(options),
      greedy_(sampling.temperature <= 0),
      logits_(static_cast<size_t>(model.hparams().n_vocab)) {
  if (options.max_draft < 1) throw std::invalid_argument("--draft-max: at least 1 token");
  if (options.min_draft < 0 || options.min_draft > options.max_draft) {
    throw std::invalid_argument("--draft-min: between 0 and --draft-max");
  }
  if (!(options.p_min >= 0.0f && options.p_min <= 1.0f)) throw std::invalid_argument("--draft-p-min: between 0 and 1");
}

void DraftModel::evaluate(std::span<const int32_t> tokens) {
  model_.forward(tokens, cache_, logits_.data());
  fed_.insert(fed_.end(), tokens.begin(), tokens.end());
  evaluated_ += static_cast<int64_t>(tokens.size());
}

void DraftModel::follow(std::span<const int32_t> history) {
  size_t common = std::mismatch(fed_.begin(), fed_.end(), history.begin(), history.end()).first - fed_.begin();
  if (common == history.size() && common > 0) --common;  // evaluated already, but its logits are gone
  const auto back = static_cast<int>(fed_.size() - common);
  bool rolled_back = back == 0;
  if (!rolled_back && back <= cache_.size()) {
    try {
      cache_.rollback(back);
      fed_.resize(common);
      rolled_back = true;
    } catch (const std::invalid_argument&) {  // past a shift or the window ring's slack
    }
  }
  if (!rolled_back) {  // start over from the newest text the cache holds
    cache_.clear();
    fed_.clear();
    common = history.size() - std::min(history.size(), static_cast<size_t>(std::max(1, cache_.capacity() / 2)));
    fed_.assign(history.begin(), history.begin() + static_cast<std::ptrdiff_t>(common));  // as if seen, and dropped
  }
  // The target ran the prompt in one pass and each later token as a decode step (or a checking
  // pass's row, the same bits): the draft model does the same, and a model drafting for itself
  // then sees exactly the target's numbers.
  std::span<const int32_t> fresh = history.subspan(common);
  if (fresh.size() > kFewTokens) {
    evaluate(fresh.first(fresh.size() - 1));
    fresh = fresh.last(1);
  }
  for (size_t i = 0; i < fresh.size(); ++i) evaluate(fresh.subspan(i, 1));
}

void DraftModel::start(std::span<const int32_t> prompt) {
  cache_.clear();
  fed_.clear();
  if (!prompt.empty()) evaluate(prompt);  // in one pass, as the target did
}

Draft DraftModel::guess(std::span<const int32_t> history, int limit) {
  if (history.empty()) return {};
  follow(history);
  // The draft's tokens must be rolled back when the target rejects them: no shift between.
  limit = std::min({limit, options_.max_draft, cache_.draft_room() + 1});
  Draft draft;
  if (!greedy_) context_.assign(history.begin(), history.end());
  while (static_cast<int>(draft.tokens.size()) < limit) {
    if (top_probability(logits_) < options_.p_min) break;
    int32_t token;
    if (greedy_) {
      token = static_cast<int32_t>(std::max_element(logits_.begin(), logits_.end()) - logits_.begin());
    } else {
      const std::span<const Sampler::Candidate> q = sampler_.distribution(logits_, context_);
      token = sampler_.draw_from(q);
      draft.q.emplace_back(q.begin(), q.end());
      context_.push_back(token);
    }
    draft.tokens.push_back(token);
    if (static_cast<int>(draft.tokens.size()) < limit) evaluate(std::span<const int32_t>(&draft.tokens.back(), 1));
  }
  if (static_cast<int>(draft.tokens.size()) < std::max(1, options_.min_draft)) return {};
  return draft;
}

}  // namespace ringlm
