#include "core/grammar/token_constraint.h"

#include <stdexcept>
#include <string>
#include <utility>

namespace ringlm {

namespace {

std::vector<GrammarMatcher::TokenText> token_texts(const Tokenizer& tokenizer) {
  std::vector<GrammarMatcher::TokenText> texts;
  texts.reserve(static_cast<size_t>(tokenizer.n_vocab()));
  for (int32_t t = 0; t < tokenizer.n_vocab(); ++t) texts.push_back(GrammarMatcher::decode_token(tokenizer.token_to_piece(t)));
  return texts;
}

}  // namespace

GrammarVocabulary::GrammarVocabulary(const Tokenizer& tokenizer) : tokenizer_(&tokenizer), index_(token_texts(tokenizer)) {}

TokenConstraint::TokenConstraint(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const GrammarVocabulary> vocabulary)
    : matcher_(std::move(grammar)), vocabulary_(std::move(vocabulary)) {}

const std::vector<uint8_t>& TokenConstraint::allowed_here() const {
  std::vector<int32_t> key = matcher_.position_key();
  if (const auto found = allowed_at_.find(key); found != allowed_at_.end()) return found->second;
  if (allowed_at_.size() >= kCachedPlaces) allowed_at_.clear();
  std::vector<uint8_t>& allowed = allowed_at_[std::move(key)];
  if (matcher_.holds_split_code_point()) {  // (rare: a token cut a character in two) one token at a time
    allowed.assign(texts().size(), 0);
    for (size_t t = 0; t < texts().size(); ++t) allowed[t] = allows(static_cast<int32_t>(t), false);
  } else {
    matcher_.allowed_tokens(vocabulary_->index(), allowed);
  }
  return allowed;
}

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
