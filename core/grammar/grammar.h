// Grammars that constrain generation: llama.cpp's GBNF format, compiled once, and a matcher that
// follows a text through it one code point at a time.
//
// A grammar is a set of rules `name ::= alternatives`; an alternative is a sequence of string
// literals ("..."), character classes ([a-z], [^"\\], .), rule names and parenthesised groups,
// each optionally repeated (*, +, ?, {m}, {m,}, {m,n}); `#` starts a comment. The root rule
// (`root` unless named otherwise) is what a whole text must match.
//
// Compiling flattens it the way llama.cpp's parser does: groups and repetitions become rules of
// their own, so that every rule is a list of alternatives, each a sequence of character classes
// and rule references. The matcher keeps the set of positions the text so far can be at: each a
// stack of places in alternatives, its top a character class (llama.cpp's "stacks"). A code
// point moves every stack whose top accepts it and drops the others.
#pragma once

#include <compare>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ringlm {

// A grammar that cannot be used: the message names what is wrong and where (line and column of
// the GBNF text), e.g. "grammar: line 3, column 7: undefined rule 'value'".
struct GrammarError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// The compiled form: rules of alternatives of elements. Read-only once built; share it between
// the matchers of many sequences.
class Grammar {
 public:
  // Parses and compiles GBNF text. Throws GrammarError on a syntax error, an undefined rule, a
  // missing root, left recursion (a rule that can reach itself without reading a character), a
  // grammar past the size limits (kMaxRules, kMaxElements, nesting deeper than kMaxDepth) or one
  // with more ways to start than a matcher follows at once.
  static std::shared_ptr<const Grammar> parse(std::string_view text, std::string_view root = "root");

  static constexpr int kMaxRules = 20000;
  static constexpr int kMaxElements = 1 << 20;
  static constexpr int kMaxDepth = 200;

  // An element of an alternative: a character class (ranges of code points, maybe negated), a
  // reference to a rule, or the end of the alternative.
  struct Element {
    enum class Kind : uint8_t { kChars, kRule, kEnd } kind = Kind::kEnd;
    bool negated = false;             // kChars: any code point outside the ranges
    int rule = -1;                    // kRule
    std::vector<char32_t> ranges;     // kChars: pairs [low, high], inclusive
    bool accepts(char32_t c) const;
  };
  // Rule r's alternatives: sequences of elements, each ending with a kEnd element.
  const std::vector<std::vector<Element>>& alternatives(int rule) const { return rules_[static_cast<size_t>(rule)]; }
  int root() const { return root_; }

 private:
  friend class GrammarCompiler;
  std::vector<std::vector<std::vector<Element>>> rules_;
  std::vector<std::string> names_;
  int root_ = 0;
};

// Follows a text through a grammar. Cheap to copy (a sampled token is tried on a copy).
class GrammarMatcher {
 public:
  explicit GrammarMatcher(std::shared_ptr<const Grammar> grammar);

  // Moves over `utf8` (a token's bytes: a code point may be split across calls). Returns false,
  // leaving the matcher as it was, when the grammar cannot read it.
  bool accept(std::string_view utf8);
  // Whether the text so far is a whole sentence of the grammar (an end token may come now).
  bool accepting() const;
  // Whether nothing can follow: accepting, and no stack waits for a character.
  bool finished() const;

  // A token's text as the matcher reads it: whole code points, then perhaps the first bytes of
  // one more, which can be any code point in [tail_low, tail_high] (none when tail_low >
  // tail_high). `valid` is false for bytes that are not UTF-8 or that finish a code point begun
  // in an earlier token.
  struct TokenText {
    std::vector<char32_t> code_points;
    char32_t tail_low = 1, tail_high = 0;
    bool valid = true;
  };
  static TokenText decode_token(std::string_view bytes);
  // A vocabulary's token texts, indexed by their first code point.
  struct TokenIndex {
    explicit TokenIndex(std::vector<TokenText> token_texts);
    std::vector<TokenText> texts;
    std::vector<std::pair<char32_t, int32_t>> by_first;  // (first code point, token), sorted
    std::vector<int32_t> tail_only;                      // tokens that are only the first bytes of one
  };
  // For every token, whether the grammar can read its text from here: allowed[i] for texts[i]
  // (an empty text: no). All of them at once, as llama.cpp's grammar sampler does: each stack
  // meets the tokens one code point at a time, and every token whose code point its top accepts
  // goes on with the same successor stacks, so a stack is advanced once per code point position,
  // not once per token; the first code point is looked up in the index by the top's ranges, so
  // that a narrow class (a digit, a quote) costs what its tokens cost, not the vocabulary. For a
  // matcher holding no split code point (holds_split_code_point()).
  void allowed_tokens(const TokenIndex& index, std::vector<uint8_t>& allowed) const;
  bool holds_split_code_point() const { return partial_left_ > 0; }
  // Where the matcher is, as one list of numbers: two matchers of the same grammar with equal
  // keys allow the same tokens (a key for caching allowed_tokens).
  std::vector<int32_t> position_key() const;

 private:
  // A place in the grammar: rule, alternative, element index.
  struct Place {
    int32_t rule, alt, element;
    auto operator<=>(const Place&) const = default;
  };
  using Stack = std::vector<Place>;  // bottom first; the top is a kChars element
  // Tokens being tried against a stack: index into the texts, code points read so far.
  struct Trial {
    int32_t token;
    int32_t read;
  };
  void reject_for_stacks(const std::vector<Stack>& stacks, std::vector<Trial> trials, const std::vector<TokenText>& texts,
                         std::vector<Trial>& rejected) const;
  void reject_for_stack(const Stack& stack, const std::vector<Trial>& trials, const std::vector<TokenText>& texts,
                        std::vector<Trial>& rejected) const;
  // The stacks a stack goes on to once its top has read a code point (whichever one).
  std::vector<Stack> after_top(const Stack& stack) const;
  const Grammar::Element& element(const Place& p) const;
  void expand(Stack stack, std::vector<Stack>& out) const;
  static void normalize(std::vector<Stack>& stacks);
  static std::string too_ambiguous();
  bool advance(char32_t c);
  bool could_read(char32_t low, char32_t high) const;
  bool could_read_on(const Stack& stack, char32_t low, char32_t high) const;
  bool restore(const GrammarMatcher& before);

  std::shared_ptr<const Grammar> grammar_;
  std::vector<Stack> stacks_;  // sorted, no two alike; an empty one: the text may end here
  // A code point split across calls: its bits so far and how many bytes it still needs.
  char32_t partial_ = 0;
  int partial_left_ = 0;
  int partial_extra_ = 0;  // the continuation bytes it has in all
};

// Whether `text` is a whole sentence of the grammar.
bool grammar_matches(std::shared_ptr<const Grammar> grammar, std::string_view text);

}  // namespace ringlm
