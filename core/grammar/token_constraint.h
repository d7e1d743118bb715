// A grammar over a vocabulary: which tokens may come next, so that sampling only draws text the
// grammar allows (llama.cpp's --grammar). A token is allowed when the grammar can read its bytes
// from where the text is; an end token when the text so far is a whole sentence; a token with no
// text of its own (a control token) never.
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
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
  const GrammarMatcher::TokenIndex& index() const { return index_; }
  const std::vector<GrammarMatcher::TokenText>& texts() const { return index_.texts; }

 private:
  const Tokenizer* tokenizer_;
  GrammarMatcher::TokenIndex index_;
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
  // Moves it over text (a lazy grammar's start, already generated); false, and nothing moved,
  // if the grammar cannot read it.
  bool take_text(std::string_view text) { return matcher_.accept(text); }

  bool accepting() const { return matcher_.accepting(); }
  bool finished() const { return matcher_.finished(); }

 private:
  const std::vector<GrammarMatcher::TokenText>& texts() const { return vocabulary_->texts(); }

  // The tokens allowed where the matcher is, from the cache when it was there before.
  const std::vector<uint8_t>& allowed_here() const;

  GrammarMatcher matcher_;
  std::shared_ptr<const GrammarVocabulary> vocabulary_;
  // The allowed tokens of the places masked before: a text comes back to the same places (inside
  // a string, after a member), and a mask costs milliseconds where a lookup costs microseconds.
  static constexpr size_t kCachedPlaces = 8;  // (each a byte per token: 400 KB on a 50k vocabulary)
  mutable std::map<std::vector<int32_t>, std::vector<uint8_t>> allowed_at_;
};

template <typename IsEnd>
size_t TokenConstraint::mask(std::span<float> logits, IsEnd is_end) const {
  const std::vector<uint8_t>& allowed = allowed_here();
  size_t n_allowed = 0;
  for (size_t t = 0; t < logits.size(); ++t) {
    const bool ok = t < allowed.size() && (is_end(static_cast<int32_t>(t)) ? matcher_.accepting() : allowed[t] != 0);
    if (ok) {
      ++n_allowed;
    } else {
      logits[t] = -INFINITY;
    }
  }
  return n_allowed;
}

}  // namespace ringlm
