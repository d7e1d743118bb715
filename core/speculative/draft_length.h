// How long a speculative draft may be: the length that gives the most tokens per unit of a
// checking pass's cost (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
// Decoding", section 3.5). With each drafted token accepted with probability a (after the ones
// before it), a pass over the token and k drafted ones gives 1 + a + a^2 + ... + a^k tokens and
// costs PassCost::of(k) decode steps; a is learned from how the last drafts fared (an
// exponential average of the share of the tokens tried that were accepted). Where a draft of one
// token is rejected, drafting pauses for some tokens, twice as many each time in a row (open
// chat, where the text does not repeat, then runs nearly as plain decoding does).
#pragma once

#include <algorithm>
#include <utility>
#include <vector>

namespace ringlm {

// What a checking pass of the evaluated token and k drafted ones costs, in decode steps: as
// `ringlm tune` measured it for the model on this machine, else 1 + kRowCost * k.
class PassCost {
 public:
  // A checking row's cost in decode steps without a measurement: about a quarter on 2 AVX2
  // cores with SmolLM2-135M (bench/speculative_replay.py measures it from a run's own passes).
  static constexpr double kRowCost = 0.25;

  PassCost() = default;
  static PassCost linear(double row_cost) {
    PassCost c;
    c.row_cost_ = row_cost;
    return c;
  }
  // measured[k - 1]: a pass of 1 + k rows against a decode step. Made non-decreasing (a longer
  // pass never costs less; a noisy measurement must not say so); past the last, each row costs
  // the measured passes' average per row.
  static PassCost measured(std::vector<double> measured) {
    PassCost c;
    for (size_t i = 0; i < measured.size(); ++i) measured[i] = std::max(measured[i], i ? measured[i - 1] : 1.0);
    if (!measured.empty()) c.row_cost_ = (measured.back() - 1.0) / static_cast<double>(measured.size());
    c.measured_ = std::move(measured);
    return c;
  }

  double of(int k) const {
    if (k <= 0) return 1.0;
    const int n = static_cast<int>(measured_.size());
    if (k <= n) return measured_[static_cast<size_t>(k - 1)];
    return (n > 0 ? measured_.back() : 1.0) + row_cost_ * (k - n);
  }
  bool is_measured() const { return !measured_.empty(); }

 private:
  double row_cost_ = kRowCost;  // past the measured passes
  std::vector<double> measured_;
};

class DraftLength {
 public:
  explicit DraftLength(PassCost cost = {}) : cost_(std::move(cost)) {}

  // The most tokens the next draft may have; 0 while drafting pauses (each call counts one token).
  int next_limit() {
    if (pause_ > 0) {
      --pause_;
      return 0;
    }
    int best = 1;  // at least one token: a rejected one is what pauses drafting
    double tokens = 1.0, best_rate = 0.0, power = 1.0;
    for (int k = 1; k <= kMaxLimit; ++k) {
      power *= acceptance_;
      tokens += power;
      const double rate = tokens / cost_.of(k);
      if (rate > best_rate) best_rate = rate, best = k;
    }
    return best;
  }

  // A draft of `drafted` tokens of which the first `accepted` were taken.
  void record(int drafted, int accepted) {
    // Tokens tried: the accepted ones and the first rejected one, if any.
    const double share = static_cast<double>(accepted) / (accepted + (accepted < drafted ? 1 : 0));
    acceptance_ += kLearningRate * (share - acceptance_);
    if (accepted > 0) next_pause_ = kFirstPause;
    if (drafted == 1 && accepted == 0) {
      pause_ = next_pause_;
      next_pause_ = std::min(2 * next_pause_, kLongestPause);
    }
  }

  double acceptance() const { return acceptance_; }

 private:
  static constexpr int kMaxLimit = 64;  // the guesser's own maximum applies too
  static constexpr int kFirstPause = 8, kLongestPause = 128;
  // The weight of the last draft in the learned acceptance, and where it starts (a guesser's
  // first drafts are taken at its word; bench/speculative_replay.py chose both over its prompts).
  static constexpr double kLearningRate = 0.2, kFirstAcceptance = 0.8;
  PassCost cost_;
  double acceptance_ = kFirstAcceptance;
  int pause_ = 0;  // tokens to go without a draft
  int next_pause_ = kFirstPause;
};

}  // namespace ringlm
