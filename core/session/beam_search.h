// Beam search: the N most likely continuations of a prompt, kept side by side.
//
// BeamSearch is the search alone, over logits it is handed: at each step every live beam's
// tokens are scored (its log-probability so far plus the token's), and the N best candidates
// that do not end become the next beams; a candidate that ends (an end token) and ranks among
// the N best becomes a finished hypothesis. A hypothesis scores log_prob / length^length_penalty (Hugging Face's
// length penalty: 1 favours neither short nor long, above 1 long, below 1 short). The search
// stops when N hypotheses have finished and the best live beam, scored at its present length,
// cannot beat the worst of them (Hugging Face's rule; exact with a length penalty of 0, since a
// beam's log-probability only falls), at the token limit, or when the context is full. A beam of
// one is greedy decoding.
//
// BeamSequences runs it on the model: the prompt is evaluated once into a read-only segment
// that every beam reads as the prefix of its own cache, which holds only that beam's tokens.
// Each step is one batched pass of every live beam's newest token. When the beams are re-formed,
// a beam that goes on keeps its cache (the caches are re-indexed, not copied); only a beam that
// forks gets a copy of its parent's own tokens' rows, never of the prompt's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/kv/kv_cache.h"
#include "core/model/sequence_tokens.h"

namespace ringlm {

class LlamaModel;

struct BeamOptions {
  int n_beams = 4;
  float length_penalty = 1.0f;      // score = log_prob / length^length_penalty
  int max_tokens = -1;              // tokens generated at most (-1: until the context is full)
  std::vector<int32_t> end_tokens;  // a candidate with one of these ends its hypothesis
};

struct BeamHypothesis {
  std::vector<int32_t> tokens;  // generated; the end token last when it ended on one
  double log_prob = 0;          // the sum of its tokens' log-probabilities
  double score = 0;             // log_prob / tokens.size()^length_penalty
  bool ended = false;           // on an end token (otherwise the token limit or a full context)
};

class BeamSearch {
 public:
  BeamSearch(const BeamOptions& options, size_t n_vocab);

  // What the live beams do next: new beam i is old beam parents[i] with tokens[i] appended.
  struct Step {
    std::vector<int> parents;
    std::vector<int32_t> tokens;
  };
  // One step from the logits after each live beam's last token (before the first step: one
  // row, the prompt's). `room`: the beams can take one more token (evaluate what this step
  // appends). Returns the next beams; none once the search is done.
  Step advance(std::span<const std::span<const float>> logits, bool room);
  bool done() const { return done_; }
  int generated() const { return generated_; }  // tokens each live beam holds
  // The best hypotheses, best first (at most n_beams); once done, the search's results.
  const std::vector<BeamHypothesis>& hypotheses() const { return finished_; }

 private:
  struct Beam {
    std::vector<int32_t> tokens;
    double log_prob = 0;
  };
  struct Candidate {
    int parent;
    int32_t token;
    double log_prob;  // the parent's plus the token's
  };
  std::vector<Candidate> candidates(std::span<const std::span<const float>> logits) const;
  bool is_end(int32_t token) const;
  double score(double log_prob, size_t length) const;
  void add_finished(BeamHypothesis h);
  // Whether a live beam with this log-probability, now `length` tokens long, could still end
  // better than the worst of n_beams finished hypotheses.
  bool can_improve(double log_prob, size_t length) const;

  BeamOptions options_;
  size_t n_vocab_;
  std::vector<Beam> beams_;
  std::vector<BeamHypothesis> finished_;  // best first
  int generated_ = 0;
  bool done_ = false;
};

// Beam search on the model: the beams' caches, their passes and their re-forming.
class BeamSequences {
 public:
  // `prompt`: the prompt's cache, read-only from now on; `prompt_logits`: the logits after it.
  // `max_context`: the most tokens (the prompt's and a beam's) a beam's context holds.
  BeamSequences(LlamaModel& model, std::shared_ptr<const KvCache> prompt, std::span<const float> prompt_logits,
                int max_context, KvCacheOptions cache_options, const BeamOptions& options);

  bool done() const { return search_.done(); }
  // The next pass: every live beam's newest token into its cache, its logits wanted.
  std::span<const SequenceTokens> plan();
  // The planned pass has run: the search takes a step and the beams are re-formed.
  void passed();
  const std::vector<BeamHypothesis>& hypotheses() const { return search_.hypotheses(); }
  int live_beams() const { return static_cast<int>(tokens_.size()); }
  // Tokens the beams' caches hold now, and how many rows forks have copied so far.
  size_t kv_bytes_in_use() const;
  int64_t copied_rows() const { return copied_rows_; }

 private:
  // Re-forms the beams for `step`: a parent's first child takes its cache, any other child a
  // copy of it; the caches of parents without children are kept for later forks.
  void reform(const BeamSearch::Step& step);
  KvCache fresh_cache();
  bool room() const;

  LlamaModel& model_;
  std::shared_ptr<const KvCache> prompt_;
  int max_context_;
  KvCacheOptions cache_options_;
  BeamSearch search_;
  std::vector<KvCache> caches_;  // [live beam]
  std::vector<KvCache> spare_;   // emptied caches, for forks
  std::vector<int32_t> tokens_;  // [live beam]: its token in the next pass
  std::vector<float> logits_;    // [live beam][n_vocab]
  std::vector<SequenceTokens> pass_;
  int64_t copied_rows_ = 0;
};

}  // namespace ringlm
