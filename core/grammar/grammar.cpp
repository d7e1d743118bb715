#include "core/grammar/grammar.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <tuple>
#include <utility>

namespace ringlm {

namespace {

using Element = Grammar::Element;
using Sequence = std::vector<Element>;

constexpr char32_t kMaxCodePoint = 0x10FFFF;

Element chars(std::vector<char32_t> ranges, bool negated = false) {
  Element e;
  e.kind = Element::Kind::kChars;
  e.ranges = std::move(ranges);
  e.negated = negated;
  return e;
}

Element rule_ref(int rule) {
  Element e;
  e.kind = Element::Kind::kRule;
  e.rule = rule;
  return e;
}

Element end_of_alternative() { return Element{}; }

bool is_name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
}

}  // namespace

bool Grammar::Element::accepts(char32_t c) const {
  bool in = false;
  for (size_t i = 0; i + 1 < ranges.size() && !in; i += 2) in = ranges[i] <= c && c <= ranges[i + 1];
  return in != negated;
}

// Parses GBNF text into rules, desugaring groups and repetitions into rules of their own (as
// llama.cpp's parser does), then checks what the matcher relies on: every rule defined, a root,
// no left recursion.
class GrammarCompiler {
 public:
  explicit GrammarCompiler(std::string_view text) : text_(text) {}

  std::shared_ptr<const Grammar> compile(std::string_view root) {
    skip_space(true);
    while (pos_ < text_.size()) {
      parse_rule();
      skip_space(true);
    }
    for (size_t r = 0; r < g_.rules_.size(); ++r) {
      if (!defined_[r]) fail_at(first_use_[r], "undefined rule '" + g_.names_[r] + "'");
    }
    const auto found = ids_.find(std::string(root));
    if (found == ids_.end()) throw GrammarError("grammar: no rule named '" + std::string(root) + "' (the root)");
    g_.root_ = found->second;
    refuse_left_recursion();
    return std::make_shared<const Grammar>(std::move(g_));
  }

 private:
  [[noreturn]] void fail_at(size_t at, const std::string& what) const {
    int line = 1, column = 1;
    for (size_t i = 0; i < at && i < text_.size(); ++i) {
      if (text_[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    throw GrammarError("grammar: line " + std::to_string(line) + ", column " + std::to_string(column) + ": " + what);
  }
  [[noreturn]] void fail(const std::string& what) const { fail_at(pos_, what); }

  bool at_end() const { return pos_ >= text_.size(); }
  char peek() const { return at_end() ? '\0' : text_[pos_]; }

  // Spaces, tabs and comments; newlines too where `newlines` (between rules, inside groups,
  // after ::= and |).
  void skip_space(bool newlines) {
    while (!at_end()) {
      const char c = text_[pos_];
      if (c == ' ' || c == '\t' || (newlines && (c == '\n' || c == '\r'))) {
        ++pos_;
      } else if (c == '#') {
        while (!at_end() && text_[pos_] != '\n') ++pos_;
      } else {
        break;
      }
    }
  }

  std::string parse_name() {
    const size_t start = pos_;
    while (!at_end() && is_name_char(text_[pos_])) ++pos_;
    if (pos_ == start) fail(at_end() ? "a rule name expected, found the end" : std::string("a rule name expected, found '") + peek() + "'");
    return std::string(text_.substr(start, pos_ - start));
  }

  int rule_id(const std::string& name, size_t used_at) {
    const auto [it, added] = ids_.try_emplace(name, static_cast<int>(g_.rules_.size()));
    if (added) new_rule(name, used_at);
    return it->second;
  }

  int new_rule(const std::string& name, size_t used_at) {
    if (static_cast<int>(g_.rules_.size()) >= Grammar::kMaxRules) {
      fail("more than " + std::to_string(Grammar::kMaxRules) + " rules");
    }
    g_.rules_.emplace_back();
    g_.names_.push_back(name);
    defined_.push_back(false);
    first_use_.push_back(used_at);
    return static_cast<int>(g_.rules_.size()) - 1;
  }

  // A rule of its own for generated pieces (groups, repetitions), named after the rule it serves.
  int generated_rule(std::vector<Sequence> alternatives) {
    const int id = new_rule(current_ + "-" + std::to_string(g_.rules_.size()), pos_);
    for (Sequence& alt : alternatives) add_alternative(id, std::move(alt));
    defined_[static_cast<size_t>(id)] = true;
    return id;
  }

  void add_alternative(int rule, Sequence alt) {
    elements_ += alt.size() + 1;
    if (elements_ > static_cast<size_t>(Grammar::kMaxElements)) {
      fail("more than " + std::to_string(Grammar::kMaxElements) + " elements");
    }
    alt.push_back(end_of_alternative());
    g_.rules_[static_cast<size_t>(rule)].push_back(std::move(alt));
  }

  void parse_rule() {
    const size_t start = pos_;
    const std::string name = parse_name();
    skip_space(false);
    if (text_.substr(pos_, 3) != "::=") fail("'::=' expected after the rule name '" + name + "'");
    pos_ += 3;
    skip_space(true);
    const int id = rule_id(name, start);
    if (defined_[static_cast<size_t>(id)]) fail_at(start, "rule '" + name + "' is defined twice");
    defined_[static_cast<size_t>(id)] = true;
    current_ = name;
    for (Sequence& alt : parse_alternatives(0)) add_alternative(id, std::move(alt));
    if (!at_end() && peek() != '\n' && peek() != '\r') fail(std::string("unexpected '") + peek() + "'");
  }

  std::vector<Sequence> parse_alternatives(int depth) {
    if (depth > Grammar::kMaxDepth) fail("groups nested deeper than " + std::to_string(Grammar::kMaxDepth));
    std::vector<Sequence> alternatives;
    alternatives.push_back(parse_sequence(depth));
    while (peek() == '|') {
      ++pos_;
      skip_space(true);
      alternatives.push_back(parse_sequence(depth));
    }
    return alternatives;
  }

  // Elements up to '|', ')' or the end of the rule's line (a newline ends a rule outside groups).
  Sequence parse_sequence(int depth) {
    Sequence seq;
    const bool nested = depth > 0;
    while (!at_end()) {
      const char c = peek();
      if (c == '|' || c == ')' || c == '\n' || c == '\r') break;
      const size_t piece_start = seq.size();
      parse_element(seq, depth);
      skip_space(nested);
      parse_repetitions(seq, piece_start);
      skip_space(nested);
    }
    return seq;
  }

  void parse_element(Sequence& seq, int depth) {
    const char c = peek();
    if (c == '"') {
      ++pos_;
      while (peek() != '"') {
        if (at_end() || peek() == '\n') fail("a string literal is not closed");
        const char32_t cp = parse_char();
        seq.push_back(chars({cp, cp}));
      }
      ++pos_;
    } else if (c == '[') {
      seq.push_back(parse_class());
    } else if (c == '.') {
      ++pos_;
      seq.push_back(chars({0, kMaxCodePoint}));
    } else if (c == '(') {
      ++pos_;
      skip_space(true);
      std::vector<Sequence> alternatives = parse_alternatives(depth + 1);
      if (peek() != ')') fail(at_end() ? "a group is not closed" : std::string("')' expected, found '") + peek() + "'");
      ++pos_;
      seq.push_back(rule_ref(generated_rule(std::move(alternatives))));
    } else if (is_name_char(c)) {
      const size_t at = pos_;
      seq.push_back(rule_ref(rule_id(parse_name(), at)));
    } else {
      fail(std::string("unexpected '") + c + "'");
    }
  }

  // One character of a literal or class, escapes decoded; UTF-8 read as code points.
  char32_t parse_char() {
    if (peek() == '\\') {
      ++pos_;
      if (at_end()) fail("an escape is cut off");
      const char e = text_[pos_++];
      switch (e) {
        case 'n': return '\n';
        case 'r': return '\r';
        case 't': return '\t';
        case '\\': case '"': case '[': case ']': case '-': case '^': case '\'': return static_cast<char32_t>(e);
        case 'x': return parse_hex(2);
        case 'u': return parse_hex(4);
        case 'U': return parse_hex(8);
        default: fail(std::string("unknown escape '\\") + e + "'");
      }
    }
    const auto lead = static_cast<unsigned char>(text_[pos_]);
    const int extra = lead < 0x80 ? 0 : lead >= 0xF0 ? 3 : lead >= 0xE0 ? 2 : lead >= 0xC0 ? 1 : -1;
    if (extra < 0 || pos_ + static_cast<size_t>(extra) >= text_.size()) fail("invalid UTF-8");
    char32_t cp = extra == 0 ? lead : lead & (0x3F >> extra);
    ++pos_;
    for (int i = 0; i < extra; ++i) {
      const auto next = static_cast<unsigned char>(text_[pos_++]);
      if ((next & 0xC0) != 0x80) fail("invalid UTF-8");
      cp = cp << 6 | (next & 0x3F);
    }
    return cp;
  }

  char32_t parse_hex(int digits) {
    char32_t value = 0;
    for (int i = 0; i < digits; ++i) {
      const char h = peek();
      const int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
      if (d < 0) fail("a hexadecimal escape needs " + std::to_string(digits) + " digits");
      value = value * 16 + static_cast<char32_t>(d);
      ++pos_;
    }
    if (value > kMaxCodePoint) fail("an escape past U+10FFFF");
    return value;
  }

  Element parse_class() {
    ++pos_;  // [
    const bool negated = peek() == '^';
    if (negated) ++pos_;
    std::vector<char32_t> ranges;
    while (peek() != ']') {
      if (at_end() || peek() == '\n') fail("a character class is not closed");
      const char32_t low = parse_char();
      char32_t high = low;
      if (peek() == '-' && pos_ + 1 < text_.size() && text_[pos_ + 1] != ']') {
        ++pos_;
        high = parse_char();
        if (high < low) fail("a character range runs backwards");
      }
      ranges.push_back(low);
      ranges.push_back(high);
    }
    ++pos_;
    return chars(std::move(ranges), negated);
  }

  // Postfix operators on the piece seq[piece_start, end): *, +, ?, {m}, {m,}, {m,n}.
  void parse_repetitions(Sequence& seq, size_t piece_start) {
    while (true) {
      const char c = peek();
      int min = 0, max = -1;  // max -1: unbounded
      if (c == '*') {
        ++pos_;
      } else if (c == '+') {
        ++pos_;
        min = 1;
      } else if (c == '?') {
        ++pos_;
        max = 1;
      } else if (c == '{') {
        ++pos_;
        min = parse_count();
        max = min;
        if (peek() == ',') {
          ++pos_;
          max = peek() == '}' ? -1 : parse_count();
        }
        if (peek() != '}') fail("'}' expected to close a repetition");
        ++pos_;
        if (max >= 0 && max < min) fail("a repetition's maximum is below its minimum");
      } else {
        return;
      }
      Sequence piece(seq.begin() + static_cast<std::ptrdiff_t>(piece_start), seq.end());
      if (piece.empty()) fail("a repetition of nothing");
      seq.resize(piece_start);
      repeat(seq, piece, min, max);
      skip_space(false);
    }
  }

  int parse_count() {
    const size_t start = pos_;
    long value = 0;
    while (peek() >= '0' && peek() <= '9') {
      value = value * 10 + (peek() - '0');
      if (value > Grammar::kMaxElements) fail("a repetition count too large");
      ++pos_;
    }
    if (pos_ == start) fail("a repetition count expected");
    return static_cast<int>(value);
  }

  // seq += piece repeated min to max times (max -1: any number), as rules:
  // P* -> R ::= P R | (empty); P{0,n} -> R_n ::= P R_{n-1} | (empty), R_1 ::= P | (empty).
  void repeat(Sequence& seq, const Sequence& piece, int min, int max) {
    for (int i = 0; i < min; ++i) append(seq, piece);
    if (max < 0) {
      const int star = new_rule(current_ + "-" + std::to_string(g_.rules_.size()), pos_);
      Sequence again = piece;
      again.push_back(rule_ref(star));
      add_alternative(star, std::move(again));
      add_alternative(star, {});
      defined_[static_cast<size_t>(star)] = true;
      seq.push_back(rule_ref(star));
      return;
    }
    int optional = -1;  // the rule for up to k more, built from the innermost out
    for (int k = 1; k <= max - min; ++k) {
      Sequence once = piece;
      if (optional >= 0) once.push_back(rule_ref(optional));
      optional = generated_rule({std::move(once), Sequence{}});
    }
    if (optional >= 0) seq.push_back(rule_ref(optional));
  }

  void append(Sequence& seq, const Sequence& piece) {
    elements_ += piece.size();
    if (elements_ > static_cast<size_t>(Grammar::kMaxElements)) {
      fail("more than " + std::to_string(Grammar::kMaxElements) + " elements");
    }
    seq.insert(seq.end(), piece.begin(), piece.end());
  }

  // Left recursion would make the matcher expand a rule into itself forever: refused, naming the
  // rule. A rule reaches another "on the left" when the other is referenced after only elements
  // that can match nothing (nullable rules).
  void refuse_left_recursion() const {
    const size_t n = g_.rules_.size();
    std::vector<bool> nullable(n, false);
    for (bool changed = true; changed;) {
      changed = false;
      for (size_t r = 0; r < n; ++r) {
        if (nullable[r]) continue;
        for (const Sequence& alt : g_.rules_[r]) {
          bool all = true;
          for (const Element& e : alt) {
            if (e.kind == Element::Kind::kEnd) break;
            all = all && e.kind == Element::Kind::kRule && nullable[static_cast<size_t>(e.rule)];
          }
          if (all) {
            nullable[r] = changed = true;
            break;
          }
        }
      }
    }
    std::vector<std::vector<int>> left(n);
    for (size_t r = 0; r < n; ++r) {
      for (const Sequence& alt : g_.rules_[r]) {
        for (const Element& e : alt) {
          if (e.kind != Element::Kind::kRule) break;
          left[r].push_back(e.rule);
          if (!nullable[static_cast<size_t>(e.rule)]) break;
        }
      }
    }
    // Depth-first search for a cycle, iteratively (a long chain of rules must not overflow the stack).
    std::vector<uint8_t> state(n, 0);  // 0 unseen, 1 on the path, 2 done
    for (size_t start = 0; start < n; ++start) {
      if (state[start] != 0) continue;
      std::vector<std::pair<int, size_t>> path{{static_cast<int>(start), 0}};
      state[start] = 1;
      while (!path.empty()) {
        auto& [r, next] = path.back();
        if (next == left[static_cast<size_t>(r)].size()) {
          state[static_cast<size_t>(r)] = 2;
          path.pop_back();
          continue;
        }
        const int to = left[static_cast<size_t>(r)][next++];
        if (state[static_cast<size_t>(to)] == 1) {
          throw GrammarError("grammar: rule '" + display_name(to) +
                             "' is left-recursive (it can reach itself before reading a character)");
        }
        if (state[static_cast<size_t>(to)] == 0) {
          state[static_cast<size_t>(to)] = 1;
          path.emplace_back(to, 0);
        }
      }
    }
  }

  // A generated rule is shown as the user's rule it came from.
  std::string display_name(int rule) const {
    const std::string& name = g_.names_[static_cast<size_t>(rule)];
    for (const auto& [user, id] : ids_) {
      if (id == rule) return user;
    }
    return name.substr(0, name.rfind('-'));
  }

  std::string_view text_;
  size_t pos_ = 0;
  Grammar g_;
  std::map<std::string, int> ids_;
  std::vector<bool> defined_;
  std::vector<size_t> first_use_;
  std::string current_;
  size_t elements_ = 0;
};

std::shared_ptr<const Grammar> Grammar::parse(std::string_view text, std::string_view root) {
  std::shared_ptr<const Grammar> grammar = GrammarCompiler(text).compile(root);
  GrammarMatcher{grammar};  // (refuses a grammar with more ways to start than the matcher follows)
  return grammar;
}

// --- Matching ---------------------------------------------------------------------------------

namespace {

constexpr size_t kMaxStacks = 4096;

// The code points a UTF-8 sequence can still become when `missing` of its `extra` continuation
// bytes have not come yet and the others gave `bits`: the low bits may be anything, but never an
// overlong form (a lead byte of 3 bytes is U+0800 at least) nor past U+10FFFF.
std::pair<char32_t, char32_t> split_code_point(char32_t bits, int extra, int missing) {
  constexpr char32_t kLeast[] = {0, 0x80, 0x800, 0x10000};
  const int shift = 6 * missing;
  const char32_t low = bits << shift, high = low | ((char32_t{1} << shift) - 1);
  return {std::max(low, kLeast[extra]), std::min(high, kMaxCodePoint)};
}

}  // namespace

const Grammar::Element& GrammarMatcher::element(const Place& p) const {
  return grammar_->alternatives(p.rule)[static_cast<size_t>(p.alt)][static_cast<size_t>(p.element)];
}

// Brings `stack` to positions whose top waits for a character (or to the empty stack: the text
// may end here), expanding a rule at the top into its alternatives. A place is never left on a
// stack at the end of its alternative: the rule it continues is then done (as llama.cpp's stacks).
void GrammarMatcher::expand(Stack stack, std::vector<Stack>& out) const {
  if (stack.empty()) {
    out.push_back(std::move(stack));
    return;
  }
  const Place top = stack.back();
  const Element& e = element(top);
  if (e.kind == Grammar::Element::Kind::kChars) {
    out.push_back(std::move(stack));
    return;
  }
  // A rule reference: the place after it (unless that ends its alternative), then each alternative.
  stack.pop_back();
  const Place after{top.rule, top.alt, top.element + 1};
  if (element(after).kind != Grammar::Element::Kind::kEnd) stack.push_back(after);
  const auto& alternatives = grammar_->alternatives(e.rule);
  for (size_t a = 0; a < alternatives.size(); ++a) {
    Stack next = stack;
    if (alternatives[a][0].kind != Grammar::Element::Kind::kEnd) next.push_back(Place{e.rule, static_cast<int32_t>(a), 0});
    expand(std::move(next), out);
    if (out.size() > kMaxStacks) throw GrammarError(too_ambiguous());
  }
}

std::string GrammarMatcher::too_ambiguous() {
  return "grammar: more than " + std::to_string(kMaxStacks) +
         " ways to parse the text at once (an ambiguous grammar, e.g. alternatives that all start alike)";
}

void GrammarMatcher::normalize(std::vector<Stack>& stacks) {
  std::sort(stacks.begin(), stacks.end());
  stacks.erase(std::unique(stacks.begin(), stacks.end()), stacks.end());
}

GrammarMatcher::GrammarMatcher(std::shared_ptr<const Grammar> grammar) : grammar_(std::move(grammar)) {
  const auto& alternatives = grammar_->alternatives(grammar_->root());
  for (size_t a = 0; a < alternatives.size(); ++a) {
    Stack stack;
    if (alternatives[a][0].kind != Grammar::Element::Kind::kEnd) stack.push_back(Place{grammar_->root(), static_cast<int32_t>(a), 0});
    expand(std::move(stack), stacks_);
    if (stacks_.size() > kMaxStacks) throw GrammarError(too_ambiguous());
  }
  normalize(stacks_);
}

std::vector<GrammarMatcher::Stack> GrammarMatcher::after_top(const Stack& stack) const {
  Stack moved = stack;
  const Place top = moved.back();
  moved.pop_back();
  const Place after{top.rule, top.alt, top.element + 1};
  if (element(after).kind != Grammar::Element::Kind::kEnd) moved.push_back(after);
  std::vector<Stack> out;
  expand(std::move(moved), out);
  return out;
}

bool GrammarMatcher::advance(char32_t c) {
  std::vector<Stack> next;
  for (const Stack& stack : stacks_) {
    if (stack.empty() || !element(stack.back()).accepts(c)) continue;
    for (Stack& s : after_top(stack)) next.push_back(std::move(s));
    if (next.size() > kMaxStacks) throw GrammarError(too_ambiguous());
  }
  if (next.empty()) return false;
  normalize(next);
  stacks_ = std::move(next);
  return true;
}

GrammarMatcher::TokenText GrammarMatcher::decode_token(std::string_view bytes) {
  TokenText t;
  size_t i = 0;
  while (i < bytes.size()) {
    const auto lead = static_cast<unsigned char>(bytes[i]);
    const int extra = lead < 0x80 ? 0 : lead >= 0xF8 ? -1 : lead >= 0xF0 ? 3 : lead >= 0xE0 ? 2 : lead >= 0xC0 ? 1 : -1;
    if (extra < 0) {
      t.valid = false;
      return t;
    }
    char32_t cp = extra == 0 ? lead : lead & (0x3F >> extra);
    int have = 0;
    for (; have < extra && i + 1 + static_cast<size_t>(have) < bytes.size(); ++have) {
      const auto next = static_cast<unsigned char>(bytes[i + 1 + static_cast<size_t>(have)]);
      if ((next & 0xC0) != 0x80) {
        t.valid = false;
        return t;
      }
      cp = cp << 6 | (next & 0x3F);
    }
    if (have < extra) {  // cut off: the rest comes with a later token
      std::tie(t.tail_low, t.tail_high) = split_code_point(cp, extra, extra - have);
      return t;
    }
    t.code_points.push_back(cp);
    i += 1 + static_cast<size_t>(extra);
  }
  return t;
}

GrammarMatcher::TokenIndex::TokenIndex(std::vector<TokenText> token_texts) : texts(std::move(token_texts)) {
  for (size_t i = 0; i < texts.size(); ++i) {
    const TokenText& t = texts[i];
    if (!t.valid) continue;
    if (!t.code_points.empty()) {
      by_first.emplace_back(t.code_points[0], static_cast<int32_t>(i));
    } else if (t.tail_low <= t.tail_high) {
      tail_only.push_back(static_cast<int32_t>(i));
    }
  }
  std::sort(by_first.begin(), by_first.end());
}

namespace {

// The ranges of code points a class accepts, sorted and apart (a negated class's complement).
std::vector<std::pair<char32_t, char32_t>> accepted_ranges(const Grammar::Element& e) {
  std::vector<std::pair<char32_t, char32_t>> ranges;
  for (size_t i = 0; i + 1 < e.ranges.size(); i += 2) ranges.emplace_back(e.ranges[i], e.ranges[i + 1]);
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<char32_t, char32_t>> merged;
  for (const auto& r : ranges) {
    if (!merged.empty() && r.first <= merged.back().second + 1) {
      merged.back().second = std::max(merged.back().second, r.second);
    } else {
      merged.push_back(r);
    }
  }
  if (!e.negated) return merged;
  std::vector<std::pair<char32_t, char32_t>> outside;
  char32_t from = 0;
  for (const auto& [low, high] : merged) {
    if (low > from) outside.emplace_back(from, low - 1);
    from = high + 1;
  }
  if (from <= kMaxCodePoint) outside.emplace_back(from, kMaxCodePoint);
  return outside;
}

}  // namespace

void GrammarMatcher::allowed_tokens(const TokenIndex& index, std::vector<uint8_t>& allowed) const {
  allowed.assign(index.texts.size(), 0);
  std::vector<Trial> going_on, rejected;
  for (const Stack& stack : stacks_) {
    if (stack.empty()) continue;  // (the text may end here: no token's text is empty)
    going_on.clear();
    for (const auto& [low, high] : accepted_ranges(element(stack.back()))) {
      auto it = std::lower_bound(index.by_first.begin(), index.by_first.end(), std::make_pair(low, int32_t{0}));
      for (; it != index.by_first.end() && it->first <= high; ++it) {
        const int32_t t = it->second;
        if (allowed[static_cast<size_t>(t)] != 0) continue;  // (another stack took it)
        const TokenText& text = index.texts[static_cast<size_t>(t)];
        if (text.code_points.size() == 1 && text.tail_low > text.tail_high) {
          allowed[static_cast<size_t>(t)] = 1;
        } else {
          going_on.push_back({t, 1});
        }
      }
    }
    for (const int32_t t : index.tail_only) {
      const TokenText& text = index.texts[static_cast<size_t>(t)];
      if (could_read_on(stack, text.tail_low, text.tail_high)) allowed[static_cast<size_t>(t)] = 1;
    }
    if (going_on.empty()) continue;
    const std::vector<Stack> next = after_top(stack);
    if (next.size() > kMaxStacks) throw GrammarError(too_ambiguous());
    for (const Trial& trial : going_on) allowed[static_cast<size_t>(trial.token)] = 1;
    rejected.clear();
    reject_for_stacks(next, going_on, index.texts, rejected);
    for (const Trial& trial : rejected) allowed[static_cast<size_t>(trial.token)] = 0;
  }
}

// rejected += the trials no stack of `stacks` can read (a trial is kept if any stack reads it).
void GrammarMatcher::reject_for_stacks(const std::vector<Stack>& stacks, std::vector<Trial> trials,
                                       const std::vector<TokenText>& texts, std::vector<Trial>& rejected) const {
  for (const Stack& stack : stacks) {
    if (trials.empty()) return;
    std::vector<Trial> still;
    reject_for_stack(stack, trials, texts, still);
    trials = std::move(still);
  }
  rejected.insert(rejected.end(), trials.begin(), trials.end());
}

void GrammarMatcher::reject_for_stack(const Stack& stack, const std::vector<Trial>& trials,
                                      const std::vector<TokenText>& texts, std::vector<Trial>& rejected) const {
  std::vector<Trial> going_on;
  for (const Trial& trial : trials) {
    const TokenText& t = texts[static_cast<size_t>(trial.token)];
    const auto read = static_cast<size_t>(trial.read);
    if (read == t.code_points.size()) {  // all read: fits, unless its cut-off code point cannot follow
      if (t.tail_low <= t.tail_high && (stack.empty() || !could_read_on(stack, t.tail_low, t.tail_high))) rejected.push_back(trial);
    } else if (!stack.empty() && element(stack.back()).accepts(t.code_points[read])) {
      going_on.push_back({trial.token, trial.read + 1});
    } else {
      rejected.push_back(trial);
    }
  }
  if (going_on.empty()) return;
  const std::vector<Stack> next = after_top(stack);
  if (next.size() > kMaxStacks) throw GrammarError(too_ambiguous());
  // What the stacks after this one reject comes back read one further: as it was at this level,
  // so that the next stack of this level tries it from the same code point.
  std::vector<Trial> rejected_after;
  reject_for_stacks(next, std::move(going_on), texts, rejected_after);
  for (const Trial& t : rejected_after) rejected.push_back({t.token, t.read - 1});
}

// Whether a stack could read a code point in [low, high] (the rest of a split one).
bool GrammarMatcher::could_read_on(const Stack& stack, char32_t low, char32_t high) const {
  if (stack.empty()) return false;
  const Grammar::Element& e = element(stack.back());
  if (e.negated) return true;  // (a class of all but a few code points: close enough)
  for (size_t i = 0; i + 1 < e.ranges.size(); i += 2) {
    if (e.ranges[i] <= high && low <= e.ranges[i + 1]) return true;
  }
  return false;
}

bool GrammarMatcher::could_read(char32_t low, char32_t high) const {
  return std::any_of(stacks_.begin(), stacks_.end(), [&](const Stack& s) { return could_read_on(s, low, high); });
}

bool GrammarMatcher::accept(std::string_view utf8) {
  GrammarMatcher before = *this;
  for (const char ch : utf8) {
    const auto byte = static_cast<unsigned char>(ch);
    if (partial_left_ > 0) {
      if ((byte & 0xC0) != 0x80) return restore(before);
      partial_ = partial_ << 6 | (byte & 0x3F);
      if (--partial_left_ > 0) continue;
      if (!advance(partial_)) return restore(before);
      continue;
    }
    if (byte < 0x80) {
      if (!advance(byte)) return restore(before);
      continue;
    }
    partial_left_ = byte >= 0xF0 ? 3 : byte >= 0xE0 ? 2 : byte >= 0xC0 ? 1 : -1;
    if (partial_left_ < 0 || byte >= 0xF8) return restore(before);
    partial_extra_ = partial_left_;
    partial_ = byte & (0x3F >> partial_left_);
  }
  if (partial_left_ > 0) {
    // The code point so far fixes its high bits: the low ones may be anything.
    const auto [low, high] = split_code_point(partial_, partial_extra_, partial_left_);
    if (!could_read(low, high)) return restore(before);
  }
  return true;
}

bool GrammarMatcher::restore(const GrammarMatcher& before) {
  *this = before;
  return false;
}

std::vector<int32_t> GrammarMatcher::position_key() const {
  std::vector<int32_t> key{static_cast<int32_t>(partial_), partial_left_, partial_extra_};
  for (const Stack& stack : stacks_) {
    key.push_back(static_cast<int32_t>(stack.size()));
    for (const Place& p : stack) key.insert(key.end(), {p.rule, p.alt, p.element});
  }
  return key;
}

bool GrammarMatcher::accepting() const {
  return partial_left_ == 0 && std::any_of(stacks_.begin(), stacks_.end(), [](const Stack& s) { return s.empty(); });
}

bool GrammarMatcher::finished() const {
  return accepting() && std::all_of(stacks_.begin(), stacks_.end(), [](const Stack& s) { return s.empty(); });
}

bool grammar_matches(std::shared_ptr<const Grammar> grammar, std::string_view text) {
  GrammarMatcher matcher(std::move(grammar));
  return matcher.accept(text) && matcher.accepting();
}

}  // namespace ringlm
