#include "core/speculative/prompt_lookup.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace ringlm {

PromptLookup::PromptLookup(int max_draft, int max_ngram, int min_ngram)
    : max_draft_(max_draft), max_ngram_(max_ngram), min_ngram_(min_ngram) {
  if (max_draft < 1) throw std::invalid_argument("--lookup: a draft of " + std::to_string(max_draft) + " tokens (at least 1)");
  if (min_ngram < 1 || max_ngram < min_ngram) {
    throw std::invalid_argument("prompt lookup: n-grams of " + std::to_string(min_ngram) + " to " + std::to_string(max_ngram) +
                                " tokens");
  }
}

std::vector<int32_t> PromptLookup::propose(std::span<const int32_t> history, int limit) const {
  const auto n_history = static_cast<int64_t>(history.size());
  const int64_t wanted = std::min(limit, max_draft_);
  if (wanted <= 0) return {};
  for (int n = std::min<int64_t>(max_ngram_, n_history - 1); n >= min_ngram_; --n) {
    const std::span<const int32_t> tail = history.subspan(static_cast<size_t>(n_history - n));
    // The latest earlier occurrence: the nearest text is the likeliest to go on the same way.
    for (int64_t start = n_history - n - 1; start >= 0; --start) {
      if (!std::equal(tail.begin(), tail.end(), history.begin() + start)) continue;
      const int64_t from = start + n;
      const int64_t count = std::min(wanted, n_history - from);
      return {history.begin() + from, history.begin() + from + count};
    }
  }
  return {};
}

}  // namespace ringlm
