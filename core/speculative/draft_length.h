// How long a speculative draft may be, learned from how the last ones fared. A checking pass
// costs more the more rows it has, and a rejected row is lost: the limit doubles after a draft
// accepted whole and halves after one rejected at once; a rejected draft of one token pauses
// drafting for some tokens, twice as many each time in a row (open chat, where the text does not
// repeat, then runs nearly as plain decoding does).
#pragma once

#include <algorithm>

namespace ringlm {

class DraftLength {
 public:
  // The most tokens the next draft may have; 0 while drafting pauses (each call counts one token).
  int next_limit() {
    if (pause_ > 0) {
      --pause_;
      return 0;
    }
    return limit_;
  }

  void record(int drafted, int accepted) {
    if (accepted > 0) next_pause_ = kFirstPause;
    if (accepted == drafted) {
      limit_ = std::min(2 * limit_, kMaxLimit);
    } else if (accepted == 0) {
      if (limit_ == 1) {
        pause_ = next_pause_;
        next_pause_ = std::min(2 * next_pause_, kLongestPause);
      }
      limit_ = std::max(1, limit_ / 2);
    }
  }

 private:
  static constexpr int kMaxLimit = 64;  // the guesser's own maximum applies too
  static constexpr int kFirstPause = 8, kLongestPause = 128;
  int limit_ = kMaxLimit;
  int pause_ = 0;  // tokens to go without a draft
  int next_pause_ = kFirstPause;
};

}  // namespace ringlm
