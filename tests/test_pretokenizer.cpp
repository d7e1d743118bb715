// The regex pre-tokenizers of core/tokenizer/pretokenizer.cpp against an independent oracle:
// tests/reference/pretokenizer_splits.py writes each `tokenizer.ggml.pre` name's patterns as the
// models' tokenizer.json files have them and splits the same texts with PyPI's `regex` module.
// Every name ringlm knows must be there, and every split must be identical.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "core/tokenizer/pretokenizer.h"
#include "tests/command_runner.h"

namespace ringlm {
namespace {

std::vector<std::string> split(const PreTokenizerSpec& spec, std::string_view text) {
  const PreTokenizer pre(spec.patterns);
  std::vector<std::string_view> pieces;
  pre.split(text, pieces);
  return {pieces.begin(), pieces.end()};
}

std::vector<std::string> split(std::string_view name, std::string_view text) {
  const PreTokenizerSpec* spec = find_pre_tokenizer(name);
  if (spec == nullptr) throw std::runtime_error("no pre-tokenizer " + std::string(name));
  return split(*spec, text);
}

// Texts that tell the patterns apart: contractions in every case, digit runs of 1 to 7 and
// longer, scripts with and without case and with combining marks, CJK with its punctuation,
// emoji sequences, whitespace runs of every kind, punctuation runs, leading and trailing spaces,
// and the special shapes some patterns look for (sentinels, image tokens, paths, case changes).
// Characters whose Unicode properties changed after Unicode 14 (PCRE2 10.42's tables) are left
// out, as is U+017F after an apostrophe (see pretokenizer_splits.py).
const std::vector<std::string> kTexts = {
    "",
    " ",
    "Hello world",
    "I'm you're we've they'll she'd it's don't",
    "I'M YOU'RE WE'VE THEY'LL SHE'D IT'S DON'T You'Re We'Ve",
    "'s 't 're 've 'm 'll 'd ''s x'S y'D rock'n'roll",
    "1 12 123 1234 12345 123456 1234567 12345678901234",
    "x1y22z333w4444 abc12345def 3.14159 1,000,000 v2.0.1 0x1F",
    "\u0661\u0662\u0663\u0664 \u2167 \u00b2\u00b3 \u00bd \uff11\uff12\uff13\uff14",
    "   leading spaces",
    "trailing spaces   ",
    "tabs\t\tand\nnewlines\n\n\nand\r\nCRLF \n \t\n  end\n",
    "a\u00a0b\u3000c\u2003d\u2028e\u0085f\x0bg\x0ch",
    "x                                        y     z",
    "!!!...?? ?---+++=== <<<>>> $$$ ^^^ ~~~ ||| ``` (((foo))) [bar] {baz} @#% &*_",
    "path/to/file.txt a/b\n/c // comment /* block */\n",
    "\u4f60\u597d\u4e16\u754c\uff0c\u8fd9\u662f\u4e2d\u6587\u3002\u65e5\u672c\u8a9e\u306e\u3072\u3089\u304c\u306a"
    "\u3068\u30ab\u30bf\u30ab\u30ca\u3002\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8\uc785\ub2c8\ub2e4.",
    "\u3001\u4f60\u597d\u3001\u4e16\u754c\u3002abc\u300c\u5f15\u7528\u300d\u201cquote\u201d\u2026\u2014\uff1a\uff1b",
    "mixed\u4e2d\u6587English\u6df7\u5408text123\u6570\u5b57 \u3131\u3134\u3137 \u3105\u3106\u3107",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645\u060c \u0661\u0662\u0663 "
    "\u0627\u0644\u0639\u0631\u0628\u064a\u0629\u06d4",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac "
    "\u1f00\u1f7d\u1fbe \u00dcn\u00efc\u00f6d\u00e9 \u00e7\u00e0f\u00e9 na\u00efve",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e\u0964 "
    "\u0e20\u0e32\u0e29\u0e32\u0e44\u0e17\u0e22 \u0e9e\u0eb2\u0eaa\u0eb2 \u1781\u17d2\u1798\u17c2\u179a "
    "\u1019\u103c\u1014\u103a\u1019\u102c",
    "e\u0301 cafe\u0301 A\u0308bc \u0301x",
    "emoji \U0001F999\U0001F680\U0001F44D\U0001F3FD \u2764\uFE0F \U0001F1EB\U0001F1F7 "
    "family\U0001F468\u200D\U0001F469\u200D\U0001F467!",
    "CamelCaseWords HTTPServer getHTTPResponse iPhone XMLHttpRequest \u01c4emo \u01c5a \u01c8b",
    "\u00b5s \u2126 \u212a \u2102 \uff21\uff22\uff23\uff41\uff42 \U00010400\U00010428 \U0001E900",
    "<sentinel:12>IMGIMGABZ<sentinel:3> IMGIMGABCDEZ <s> <|im_start|>user",
    "hello world foo  bar\nbaz",
    "$+<=>^~|` a$b a+b a<b a=b a>b a^b a~b a|b a`b",
    "a.b,c!d?e\u2026f\u3002g\uff0ch\u3001i\u0964j\u06d4k\u060cl (x|y)",
};

// The oracle's splits of kTexts: {name: [[piece, ...] per text]}.
nlohmann::json reference_splits() {
  const std::string dir = test::work_dir_for("test_pretokenizer");
  const std::string texts_path = dir + "/texts.json";
  {
    std::ofstream out(texts_path, std::ios::binary | std::ios::trunc);
    out << nlohmann::json(kTexts).dump();
    if (!out) throw std::runtime_error("cannot write " + texts_path);
  }
  const test::CommandResult r =
      test::run_command("python3 " RINGLM_SOURCE_DIR "/tests/reference/pretokenizer_splits.py '" + texts_path + "'",
                        dir, 300);
  if (r.exit_code != 0) {
    ADD_FAILURE() << "pretokenizer_splits.py exited with " << r.exit_code << ":\n" << r.err;
    return nlohmann::json::object();
  }
  return nlohmann::json::parse(r.out);
}

TEST(PreTokenizerReference, EveryNameSplitsAsPythonRegexDoes) {
  const nlohmann::json reference = reference_splits();
  ASSERT_TRUE(reference.is_object());
  ASSERT_FALSE(reference.empty());

  std::set<std::string> ours;
  for (const PreTokenizerSpec& spec : known_pre_tokenizers()) {
    const std::string name(spec.name);
    EXPECT_TRUE(ours.insert(name).second) << "'" << name << "' appears twice in the table";
    if (!reference.contains(name)) {
      ADD_FAILURE() << "the oracle has no pre-tokenizer '" << name << "'";
      continue;
    }
    const nlohmann::json& expected = reference.at(name);
    ASSERT_EQ(expected.size(), kTexts.size()) << name;
    for (size_t i = 0; i < kTexts.size(); ++i) {
      SCOPED_TRACE("pre-tokenizer '" + name + "', text " + std::to_string(i) + ": '" + kTexts[i] + "'");
      EXPECT_EQ(split(spec, kTexts[i]), expected[i].get<std::vector<std::string>>());
    }
  }
  // ...and the oracle knows no name that ringlm has lost.
  for (const auto& [name, splits] : reference.items()) {
    EXPECT_TRUE(ours.count(name) != 0) << "ringlm has no pre-tokenizer '" << name << "'";
  }
}

// The oracle can fail: a pattern that differs in one detail gives different splits.
TEST(PreTokenizerReference, NamesThatDifferSplitDifferently) {
  EXPECT_NE(split("llama-bpe", "1234567"), split("qwen2", "1234567"));
  EXPECT_NE(split("gpt-4o", "CamelCase"), split("llama-bpe", "CamelCase"));
  EXPECT_NE(split("deepseek-v3", "\u4f60\u597d\u3001"), split("kimi-k2", "\u4f60\u597d\u3001"));
}

TEST(PreTokenizer, SpotChecks) {
  using V = std::vector<std::string>;
  // Digit groups: Llama 3 from the left, AFMoE / SuperBPE / Tiny Aya from the right.
  EXPECT_EQ(split("llama-bpe", "1234567"), (V{"123", "456", "7"}));
  EXPECT_EQ(split("afmoe", "1234567"), (V{"1", "234", "567"}));
  EXPECT_EQ(split("superbpe", "1234567"), (V{"1", "234", "567"}));  // empty matches cut
  EXPECT_EQ(split("superbpe", "123456"), (V{"123", "456"}));
  EXPECT_EQ(split("tiny_aya", "1234567 "), (V{"1", "234", "567", " "}));
  EXPECT_EQ(split("qwen2", "12"), (V{"1", "2"}));
  // GPT-4o cuts words where the case changes, Llama 3 does not.
  EXPECT_EQ(split("gpt-4o", "getHTTPResponse"), (V{"get", "HTTPResponse"}));
  EXPECT_EQ(split("llama-bpe", "getHTTPResponse"), (V{"getHTTPResponse"}));
  // Kimi K2 takes Han runs (with CJK punctuation, a Han script extension) apart from letters.
  EXPECT_EQ(split("kimi-k2", "\u4f60\u597d\u3001world"), (V{"\u4f60\u597d\u3001", "world"}));
  // DeepSeek V3: ASCII punctuation starts a word; newlines stay with the whitespace before.
  EXPECT_EQ(split("deepseek-v3", "a.b \n"), (V{"a", ".b", " \n"}));
  // DeepSeek LLM's letter class has U+212A KELVIN SIGN but not the Arabic that a misread "K-"
  // range start would let in.
  EXPECT_EQ(split("deepseek-llm", "\u212a\u0645"), (V{"\u212a", "\u0645"}));
}

TEST(PreTokenizer, PiecesCoverAnyBytes) {
  // Invalid UTF-8 cannot go through the oracle (JSON), so here only the contract is checked:
  // non-empty pieces that put together give the text back, for every pattern set.
  const std::vector<std::string> texts = {
      "a\x80 b\xE2\x82 c\xC3", "\xFF\xFE 12345 \xF0\x9F\x98",
      "\xE4\xBD\xA0\x80\xE5\xA5\xBD 1234567 IMGIMGABZ\n\n  x"};
  for (const PreTokenizerSpec& spec : known_pre_tokenizers()) {
    for (const std::string& text : texts) {
      SCOPED_TRACE(std::string(spec.name));
      std::string joined;
      for (const std::string& piece : split(spec, text)) {
        EXPECT_FALSE(piece.empty());
        joined += piece;
      }
      EXPECT_EQ(joined, text);
    }
  }
}

TEST(PreTokenizer, FlagsAsLlamaCppSetsThem) {
  for (std::string_view name : {"llama-bpe", "llama3", "pixtral", "lfm2", "tekken"}) {
    SCOPED_TRACE(std::string(name));
    ASSERT_NE(find_pre_tokenizer(name), nullptr);
    EXPECT_TRUE(find_pre_tokenizer(name)->ignore_merges);
    EXPECT_TRUE(find_pre_tokenizer(name)->add_bos);
  }
  for (std::string_view name : {"youtu", "minicpm5", "granite-embed-multi-97m"}) {
    SCOPED_TRACE(std::string(name));
    EXPECT_TRUE(find_pre_tokenizer(name)->ignore_merges);
    EXPECT_FALSE(find_pre_tokenizer(name)->add_bos);
  }
  EXPECT_TRUE(find_pre_tokenizer("chameleon")->add_bos);
  EXPECT_FALSE(find_pre_tokenizer("chameleon")->ignore_merges);
  for (std::string_view name : {"dbrx", "smaug-bpe", "qwen2", "deepseek-v3", "gpt-4o", "kimi-k2", "default"}) {
    SCOPED_TRACE(std::string(name));
    EXPECT_FALSE(find_pre_tokenizer(name)->ignore_merges);
    EXPECT_FALSE(find_pre_tokenizer(name)->add_bos);
  }
  EXPECT_EQ(find_pre_tokenizer("no-such-pre"), nullptr);
  EXPECT_EQ(default_pre_tokenizer().name, "default");
}

}  // namespace
}  // namespace ringlm
