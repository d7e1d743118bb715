// A grammar over a vocabulary: which tokens may come next, so that sampling only draws text the
// grammar allows (llama.cpp's --grammar). A token is allowed when the grammar can read its bytes
// from where the text is; an end token when the text so far is a whole sentence; a token with no
// text of its own (a control token) never.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/grammar/grammar.h"
#include "core/tokenizer/tokenizer.h"

namespace ringlm {

// Every token's text, decoded once for a vocabulary (a few milliseconds for 50k tokens), shared
// by the constraints of every sequence that uses it.
class GrammarVocabulary {
 public:
  explicit GrammarVocabulary(const Tokenizer& tokenizer);
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  const std::vector<GrammarMatcher::TokenText>& texts() const { return texts_; }

 private:
  const Tokenizer* tokenizer_;
  std::vector<GrammarMatcher::TokenText> texts_;
};

class TokenConstraint {
 public:
  TokenConstraint(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const GrammarVocabulary> vocabulary);

  // Whether `token` may come next (`is_end`: it would end the text).
  bool allows(int32_t token, bool is_end) const;
  // Sets every logit of a token that may not come next to -inf (the end tokens: those for which
  // is_end(token)); returns how many tokens may.
  template <typename IsEnd>
  size_t mask(std::span<float> logits, IsEnd is_end) const;
  // Moves the grammar over the token's text. Throws std::logic_error if it was not allowed.
  void take(int32_t token);

  bool accepting() const { return matcher_.accepting(); }
  bool finished() const { return matcher_.finished(); }

 private:
  const std::vector<GrammarMatcher::TokenText>& texts() const { return vocabulary_->texts(); }

  GrammarMatcher matcher_;
  std::shared_ptr<const GrammarVocabulary> vocabulary_;
  mutable std::vector<uint8_t> allowed_;  // mask()'s, reused
};

template <typename IsEnd>
size_t TokenConstraint::mask(std::span<float> logits, IsEnd is_end) const {
  if (matcher_.holds_split_code_point()) {  // (rare: a token cut a character in two) one token at a time
    allowed_.assign(texts().size(), 0);
    for (size_t t = 0; t < texts().size(); ++t) allowed_[t] = allows(static_cast<int32_t>(t), is_end(static_cast<int32_t>(t)));
  } else {
    matcher_.allowed_tokens(texts(), allowed_);
  }
  size_t n_allowed = 0;
  for (size_t t = 0; t < logits.size(); ++t) {
    const bool ok = t < allowed_.size() && (is_end(static_cast<int32_t>(t)) ? matcher_.accepting() : allowed_[t] != 0);
    if (ok) {
      ++n_allowed;
    } else {
      logits[t] = -INFINITY;
    }
  }
  return n_allowed;
}

}  // namespace ringlm
