#include "core/session/beam_search.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "core/model/llama.h"

namespace ringlm {

namespace {

// log(sum(exp(logits))): each token's log-probability is its logit minus this. The exponentials
// in float (a vocabulary of 128k per beam at every step), their sum in double.
double log_sum_exp(std::span<const float> logits) {
  const float* x = logits.data();
  const size_t n = logits.size();
  float top = -INFINITY;
#pragma omp simd reduction(max : top)
  for (size_t i = 0; i < n; ++i) top = x[i] > top ? x[i] : top;
  double sum = 0;
  for (size_t i = 0; i < n; ++i) sum += std::exp(x[i] - top);
  return top + std::log(sum);
}

}  // namespace

BeamSearch::BeamSearch(const BeamOptions& options, size_t n_vocab) : options_(options), n_vocab_(n_vocab) {
  if (options.n_beams < 1) throw std::invalid_argument("beams must be at least 1");
  beams_.push_back({});  // the prompt: no tokens yet
  done_ = options.max_tokens == 0;
}

bool BeamSearch::is_end(int32_t token) const {
  return std::find(options_.end_tokens.begin(), options_.end_tokens.end(), token) != options_.end_tokens.end();
}

double BeamSearch::score(double log_prob, size_t length) const {
  return log_prob / std::pow(static_cast<double>(length), static_cast<double>(options_.length_penalty));
}

// Every beam's end tokens, and its n_beams best other tokens (the next beams are among those).
// Best first; ties go to the earlier beam, then the lower token.
std::vector<BeamSearch::Candidate> BeamSearch::candidates(std::span<const std::span<const float>> logits) const {
  const auto n = static_cast<size_t>(options_.n_beams);
  for (const std::span<const float> row : logits) {
    if (row.size() != n_vocab_) throw std::invalid_argument("beam search: a beam's logits are not the vocabulary's");
  }
  // Each beam's candidates on its own (the threads share the beams), then all of them ranked.
  std::vector<std::vector<Candidate>> of_beam(beams_.size());
  const auto n_beams = static_cast<int64_t>(beams_.size());
#pragma omp parallel for schedule(dynamic, 1) if (n_beams > 1)
  for (int64_t b = 0; b < n_beams; ++b) {
    const std::span<const float> row = logits[static_cast<size_t>(b)];
    const double base = beams_[static_cast<size_t>(b)].log_prob - log_sum_exp(row);
    std::vector<Candidate>& mine = of_beam[static_cast<size_t>(b)];
    std::vector<Candidate> best;  // the beam's best tokens that do not end, best first
    for (size_t t = 0; t < row.size(); ++t) {
      const Candidate c{static_cast<int>(b), static_cast<int32_t>(t), base + row[t]};
      if (is_end(c.token)) {
        mine.push_back(c);
        continue;
      }
      if (best.size() == n && c.log_prob <= best.back().log_prob) continue;
      if (best.size() == n) best.pop_back();
      const auto at = std::upper_bound(best.begin(), best.end(), c,
                                       [](const Candidate& x, const Candidate& y) { return x.log_prob > y.log_prob; });
      best.insert(at, c);
    }
    mine.insert(mine.end(), best.begin(), best.end());
  }
  std::vector<Candidate> all;
  for (const std::vector<Candidate>& mine : of_beam) all.insert(all.end(), mine.begin(), mine.end());
  std::stable_sort(all.begin(), all.end(), [](const Candidate& x, const Candidate& y) {
    if (x.log_prob != y.log_prob) return x.log_prob > y.log_prob;
    return x.parent != y.parent ? x.parent < y.parent : x.token < y.token;
  });
  return all;
}

void BeamSearch::add_finished(BeamHypothesis h) {
  const auto n = static_cast<size_t>(options_.n_beams);
  if (finished_.size() == n && h.score <= finished_.back().score) return;
  const auto at = std::upper_bound(finished_.begin(), finished_.end(), h,
                                   [](const BeamHypothesis& x, const BeamHypothesis& y) { return x.score > y.score; });
  finished_.insert(at, std::move(h));
  if (finished_.size() > n) finished_.pop_back();
}

// Hugging Face's rule (early_stopping=False): the best live beam, scored at its present length,
// against the worst of n_beams finished hypotheses. With a length penalty of 0 it is exact (a
// beam's log-probability only falls); a beam of 1 is then greedy decoding for every penalty.
bool BeamSearch::can_improve(double log_prob, size_t length) const {
  if (finished_.size() < static_cast<size_t>(options_.n_beams)) return true;
  return score(log_prob, length) > finished_.back().score;
}

BeamSearch::Step BeamSearch::advance(std::span<const std::span<const float>> logits, bool room) {
  if (done_) return {};
  if (logits.size() != beams_.size()) throw std::invalid_argument("beam search: one row of logits per live beam");
  const size_t length = static_cast<size_t>(generated_) + 1;  // each candidate's tokens
  const bool last = !room || (options_.max_tokens >= 0 && static_cast<int>(length) >= options_.max_tokens);
  std::vector<Beam> next;
  Step step;
  const std::vector<Candidate> ranked = candidates(logits);
  for (size_t rank = 0; rank < ranked.size(); ++rank) {
    const Candidate& c = ranked[rank];
    std::vector<int32_t> tokens = beams_[static_cast<size_t>(c.parent)].tokens;
    tokens.push_back(c.token);
    if (is_end(c.token)) {
      // Only among the step's n_beams best (Hugging Face's rule): so one beam is greedy decoding.
      if (rank < static_cast<size_t>(options_.n_beams)) {
        add_finished({std::move(tokens), c.log_prob, score(c.log_prob, length), /*ended=*/true});
      }
      continue;
    }
    if (next.size() == static_cast<size_t>(options_.n_beams)) continue;
    if (last) {
      add_finished({tokens, c.log_prob, score(c.log_prob, length), /*ended=*/false});
    }
    next.push_back({std::move(tokens), c.log_prob});
    step.parents.push_back(c.parent);
    step.tokens.push_back(c.token);
  }
  generated_ = static_cast<int>(length);
  if (last || next.empty() || !can_improve(next.front().log_prob, length)) {
    done_ = true;
    beams_.clear();
    return {};
  }
  beams_ = std::move(next);
  return step;
}

// --- on the model ------------------------------------------------------------------------------

BeamSequences::BeamSequences(LlamaModel& model, std::shared_ptr<const KvCache> prompt,
                             std::span<const float> prompt_logits, int max_context, KvCacheOptions cache_options,
                             const BeamOptions& options)
    : model_(model),
      prompt_(std::move(prompt)),
      max_context_(max_context),
      cache_options_(cache_options),
      search_(options, prompt_logits.size()) {
  cache_options_.context_shift = false;  // a cache that reads a prefix never shifts
  const std::span<const float> rows[] = {prompt_logits};
  reform(search_.advance(rows, room()));
}

bool BeamSequences::room() const { return prompt_->context_size() + search_.generated() < max_context_; }

KvCache BeamSequences::fresh_cache() {
  if (!spare_.empty()) {
    KvCache cache = std::move(spare_.back());
    spare_.pop_back();
    return cache;
  }
  KvCache cache = model_.make_cache(max_context_, cache_options_);
  cache.attach_prefix(prompt_);
  return cache;
}

void BeamSequences::reform(const BeamSearch::Step& step) {
  const size_t n = step.parents.size();
  std::vector<KvCache> old = std::move(caches_);
  caches_.clear();
  std::vector<int> children(std::max<size_t>(old.size(), 1), 0);
  for (const int parent : step.parents) ++children[static_cast<size_t>(parent)];
  // Caches no beam goes on in are emptied for later forks; that frees their pages.
  for (size_t p = 0; p < old.size(); ++p) {
    if (children[p] > 0) continue;
    old[p].clear();
    old[p].attach_prefix(prompt_);
    spare_.push_back(std::move(old[p]));
  }
  // Forks first (they read their parent's cache), then each parent's cache to its last child.
  std::vector<std::optional<KvCache>> formed(n);
  std::vector<int> left = children;
  for (size_t i = 0; i < n; ++i) {
    const auto parent = static_cast<size_t>(step.parents[i]);
    if (--left[parent] == 0) continue;
    formed[i].emplace(fresh_cache());
    if (parent < old.size()) {
      formed[i]->copy_from(old[parent]);
      copied_rows_ += old[parent].size();
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (formed[i]) continue;
    const auto parent = static_cast<size_t>(step.parents[i]);
    formed[i].emplace(parent < old.size() ? std::move(old[parent]) : fresh_cache());
  }
  for (auto& cache : formed) caches_.push_back(std::move(*cache));
  tokens_ = step.tokens;
  logits_.resize(n * static_cast<size_t>(model_.hparams().n_vocab));
}

std::span<const SequenceTokens> BeamSequences::plan() {
  pass_.clear();
  const auto vocab = static_cast<size_t>(model_.hparams().n_vocab);
  for (size_t i = 0; i < caches_.size(); ++i) {
    pass_.emplace_back(std::span<const int32_t>(&tokens_[i], 1), &caches_[i], logits_.data() + i * vocab);
  }
  return pass_;
}

void BeamSequences::passed() {
  const auto vocab = static_cast<size_t>(model_.hparams().n_vocab);
  std::vector<std::span<const float>> rows;
  for (size_t i = 0; i < caches_.size(); ++i) rows.emplace_back(logits_.data() + i * vocab, vocab);
  const BeamSearch::Step step = search_.advance(rows, room());
  if (search_.done()) {
    caches_.clear();
    spare_.clear();
    tokens_.clear();
    return;
  }
  reform(step);
}

size_t BeamSequences::kv_bytes_in_use() const {
  size_t bytes = 0;
  for (const KvCache& c : caches_) bytes += c.bytes_in_use();
  return bytes;
}

}  // namespace ringlm
