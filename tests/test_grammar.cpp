// The GBNF grammar engine (core/grammar/grammar.h): grammars written for these tests parse, and
// the matcher accepts exactly the texts each grammar's language holds (checked against texts
// whose membership is known by construction); hostile grammars are refused by name, in bounded
// time.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "core/grammar/grammar.h"

namespace ringlm {
namespace {

bool matches(const std::string& gbnf, const std::string& text) { return grammar_matches(Grammar::parse(gbnf), text); }

// The JSON grammar of llama.cpp's grammars/json.gbnf, written again here from the JSON spec.
const char* kJson = R"GBNF(
root   ::= value
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: at most 20 characters, so that a model cannot loop on it.
ws ::= | " " | "\n" [ \t]{0,20}
)GBNF";

TEST(Grammar, JsonAcceptsDocumentsAndRefusesOthers) {
  for (const char* good : {R"({"a": 1, "b": [true, false, null], "c": {"d": "e\n\u00e9"}})", "[]", "{}", "-0.5e+3",
                           R"("π ≈ 3.14159")", "[1, [2, [3, []]]]"}) {
    EXPECT_TRUE(matches(kJson, good)) << good;
  }
  for (const char* bad : {R"({"a": 1,})", "[1 2]", "{a: 1}", R"("unterminated)", "01x", "tru", R"({"a" 1})", ""}) {
    EXPECT_FALSE(matches(kJson, bad)) << bad;
  }
}

// Integer arithmetic with precedence: the language of well-formed expressions.
const char* kArithmetic = R"GBNF(
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")" | "-" factor
number ::= [0-9]+
)GBNF";

TEST(Grammar, ArithmeticNestsParentheses) {
  EXPECT_TRUE(matches(kArithmetic, "1+2*3"));
  EXPECT_TRUE(matches(kArithmetic, "((1))-(2*(3+-4))/5"));
  std::string deep;
  for (int i = 0; i < 300; ++i) deep += "(";
  deep += "7";
  for (int i = 0; i < 300; ++i) deep += ")";
  EXPECT_TRUE(matches(kArithmetic, deep));
  EXPECT_FALSE(matches(kArithmetic, deep + ")"));
  EXPECT_FALSE(matches(kArithmetic, "1+"));
  EXPECT_FALSE(matches(kArithmetic, "(1"));
  EXPECT_FALSE(matches(kArithmetic, "1**2"));
}

// Bounded repetitions: a list of 2 to 4 items, each a word of 1 to 3 lowercase letters.
const char* kList = R"GBNF(
root ::= item ("," item){1,3} "\n"?
item ::= [a-z]{1,3}
)GBNF";

TEST(Grammar, BoundedRepetitionsCountExactly) {
  EXPECT_TRUE(matches(kList, "a,bc"));
  EXPECT_TRUE(matches(kList, "a,b,c,def\n"));
  EXPECT_FALSE(matches(kList, "a"));
  EXPECT_FALSE(matches(kList, "a,b,c,d,e"));
  EXPECT_FALSE(matches(kList, "abcd,e"));
  EXPECT_FALSE(matches(kList, "a,,b"));
}

// A small C-like language: declarations, assignments, while and if blocks.
const char* kTinyC = R"GBNF(
root      ::= (ws statement)* ws
statement ::= decl | assign | while | if
decl      ::= "int" wsp ident (ws "=" ws expr)? ws ";"
assign    ::= ident ws "=" ws expr ws ";"
while     ::= "while" ws "(" ws expr ws ")" ws block
if        ::= "if" ws "(" ws expr ws ")" ws block (ws "else" ws block)?
block     ::= "{" (ws statement)* ws "}"
expr      ::= operand (ws [-+*/<>] ws operand)*
operand   ::= ident | [0-9]+ | "(" ws expr ws ")"
ident     ::= [a-zA-Z_] [a-zA-Z0-9_]*
ws        ::= [ \t\n]*
wsp       ::= [ \t\n]+
)GBNF";

TEST(Grammar, TinyCProgramsParse) {
  EXPECT_TRUE(matches(kTinyC, "int x = 1;\nwhile (x < 10) { x = x * 2; if (x > 5) { int y; } else { y = 0; } }\n"));
  EXPECT_TRUE(matches(kTinyC, ""));
  EXPECT_FALSE(matches(kTinyC, "int x = 1"));           // no semicolon
  EXPECT_FALSE(matches(kTinyC, "while x < 10 { }"));     // no parentheses
  EXPECT_FALSE(matches(kTinyC, "intx;"));                // "int" needs a space
  EXPECT_FALSE(matches(kTinyC, "if (x) { x = 1; "));     // block not closed
}

TEST(Grammar, LiteralsClassesAndEscapes) {
  EXPECT_TRUE(matches(R"(root ::= "a\tb\x41\u00e9\U0001F600")", "a\tbAé😀"));
  EXPECT_TRUE(matches(R"(root ::= [^a-c]+)", "xyz"));
  EXPECT_FALSE(matches(R"(root ::= [^a-c]+)", "xbz"));
  EXPECT_TRUE(matches(R"(root ::= [\]\-]+)", "]-]"));
  EXPECT_TRUE(matches(R"(root ::= . . .)", "a€b"));
  EXPECT_TRUE(matches("root ::= \"x\" # a comment\n# another\n", "x"));
  EXPECT_TRUE(matches("root ::= a | b\na ::= \"1\"\nb ::= \"2\"", "2"));
  EXPECT_TRUE(matches("root ::= \"z\"?", ""));
}

TEST(Grammar, RootByName) {
  const auto g = Grammar::parse("start ::= \"ok\"", "start");
  EXPECT_TRUE(grammar_matches(g, "ok"));
  EXPECT_THROW(Grammar::parse("start ::= \"ok\""), GrammarError);
}

TEST(Grammar, MatcherFollowsTokensSplittingCodePoints) {
  GrammarMatcher m(Grammar::parse(R"(root ::= "é" [0-9]+)"));
  EXPECT_FALSE(m.accepting());
  EXPECT_TRUE(m.accept("\xC3"));  // the first byte of é: it can still become é
  EXPECT_FALSE(m.accepting());
  GrammarMatcher wrong = m;
  EXPECT_FALSE(wrong.accept("\xA8"));  // è, not é: refused, and the matcher is as before
  EXPECT_TRUE(wrong.accept("\xA9"));
  EXPECT_TRUE(m.accept("\xA9" "12"));
  EXPECT_TRUE(m.accepting());
  EXPECT_FALSE(m.finished());  // more digits may follow
  EXPECT_FALSE(m.accept("x"));
  EXPECT_TRUE(m.accepting());  // (the refused text changed nothing)

  GrammarMatcher fixed(Grammar::parse(R"(root ::= "yes" | "no")"));
  EXPECT_FALSE(fixed.accept("\xC3"));  // no alternative starts with a two-byte character
  EXPECT_TRUE(fixed.accept("n"));
  EXPECT_TRUE(fixed.accept("o"));
  EXPECT_TRUE(fixed.finished());
}

// A lead byte's possible code points start at its length's least (no overlong forms): "\xE0"
// begins U+0800 or above, never an ASCII letter.
TEST(Grammar, SplitCodePointsAreNotOverlong) {
  GrammarMatcher ascii(Grammar::parse(R"(root ::= "t" [a-z]*)"));
  EXPECT_FALSE(ascii.accept("\xE0"));
  EXPECT_FALSE(ascii.accept("\xF0"));
  EXPECT_FALSE(ascii.accept("\xC1"));
  GrammarMatcher wide(Grammar::parse(R"(root ::= [\u0800-\u0FFF])"));
  EXPECT_TRUE(wide.accept("\xE0"));
}

// All tokens at once (allowed_tokens) against each token tried alone (accept on a copy): two
// ways to the same answer, over texts that split code points, at several places in a grammar.
TEST(Grammar, AllowedTokensAgreeWithTryingEachToken) {
  const std::vector<std::string> pieces = {"{", "{\"", "\"", "\":", " ", "\n", "\n  ", "true", "tr", "t", "f", "fn",
                                           "fa", "n", "null", "1", "12", "-", "-0.5", "e+", ".", ",", "]", "}", "},",
                                           "[", "[]", "\xC3", "\xC3\xA9", "\xE0", "\xE2\x82", "\xE2\x82\xAC", "\x80",
                                           "\\", "\\u", "\\n", "abc", "\"a\"", "", "\xF0\x9F"};
  std::vector<GrammarMatcher::TokenText> texts;
  for (const std::string& p : pieces) texts.push_back(GrammarMatcher::decode_token(p));
  const GrammarMatcher::TokenIndex index(texts);
  const auto json = Grammar::parse(kJson);
  for (const char* prefix : {"", "{", "{\"a", "{\"a\": ", "{\"a\": 1", "[1, ", "[\"\xC3\xA9", "{\"a\": [tr"}) {
    GrammarMatcher m(json);
    ASSERT_TRUE(m.accept(prefix)) << prefix;
    std::vector<uint8_t> allowed;
    m.allowed_tokens(index, allowed);
    for (size_t i = 0; i < pieces.size(); ++i) {
      GrammarMatcher trial = m;
      const bool alone = !pieces[i].empty() && trial.accept(pieces[i]);
      EXPECT_EQ(allowed[i] != 0, alone) << "after '" << prefix << "', token '" << pieces[i] << "'";
    }
  }
}

void expect_refused(const std::string& gbnf, const std::string& words) {
  try {
    Grammar::parse(gbnf);
    ADD_FAILURE() << "accepted: " << gbnf.substr(0, 80);
  } catch (const GrammarError& e) {
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  }
}

TEST(Grammar, BadGrammarsAreNamedErrors) {
  expect_refused("root ::= value", "line 1, column 10: undefined rule 'value'");
  expect_refused("root ::= \"a\"\nroot ::= \"b\"", "line 2, column 1: rule 'root' is defined twice");
  expect_refused("root ::= \"abc", "not closed");
  expect_refused("root ::= [a-", "not closed");
  expect_refused("root ::= (\"a\"", "a group is not closed");
  expect_refused("root = \"a\"", "'::=' expected");
  expect_refused("root ::= [z-a]", "backwards");
  expect_refused("root ::= \"\\q\"", "unknown escape");
  expect_refused("root ::= \"a\"{3,1}", "below its minimum");
  expect_refused("other ::= \"a\"", "no rule named 'root'");
  expect_refused("root ::= expr\nexpr ::= expr \"+\" term | term\nterm ::= [0-9]", "'expr' is left-recursive");
  expect_refused("root ::= a\na ::= b? a \"x\"\nb ::= \"y\"", "left-recursive");  // through a nullable rule
}

TEST(Grammar, HostileGrammarsAreRefusedQuickly) {
  const auto start = std::chrono::steady_clock::now();
  std::string deep = "root ::= ";
  for (int i = 0; i < 5000; ++i) deep += "(";
  expect_refused(deep, "nested deeper than");
  expect_refused("root ::= \"a\"{1000000000}", "too large");
  expect_refused("root ::= (\"a\"{1000}){2000}{2000}", "elements");
  std::string alternation = "root ::= ";  // 100000 alternatives that all start alike
  for (int i = 0; i < 100000; ++i) alternation += (i ? " | \"a" : "\"a") + std::to_string(i) + "\"";
  expect_refused(alternation, "ways to parse the text at once");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 30.0);  // (a bound against a hang, not a timing)
}

}  // namespace
}  // namespace ringlm
