#include "core/grammar/token_constraint.h"

#include <stdexcept>
#include <string>
#include <utility>

namespace ringlm {

GrammarVocabulary::GrammarVocabulary(const Tokenizer& tokenizer) : tokenizer_(&tokenizer) {
  texts_.reserve(static_cast<size_t>(tokenizer.n_vocab()));
  for (int32_t t = 0; t < tokenizer.n_vocab(); ++t) texts_.push_back(GrammarMatcher::decode_token(tokenizer.token_to_piece(t)));
}

TokenConstraint::TokenConstraint(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const GrammarVocabulary> vocabulary)
    : matcher_(std::move(grammar)), vocabulary_(std::move(vocabulary)) {}

bool TokenConstraint::allows(int32_t token, bool is_end) const {
  if (is_end) return matcher_.accepting();
  const std::string piece = vocabulary_->tokenizer().token_to_piece(token);
  if (piece.empty()) return false;
  GrammarMatcher trial = matcher_;
  return trial.accept(piece);
}

void TokenConstraint::take(int32_t token) {
  const std::string piece = vocabulary_->tokenizer().token_to_piece(token);
  if (piece.empty() || !matcher_.accept(piece)) {
    throw std::logic_error("TokenConstraint: token " + std::to_string(token) + " is not one the grammar allows here");
  }
}

}  // namespace ringlm
