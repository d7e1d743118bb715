// `ringlm tokenize` run as a subprocess on llama.cpp's vocabulary-only GGUFs
// (../shared/data/vocab): the ids of test-tokenizer-0's vectors, llama-tokenize's output format,
// BOS and special-token switches, and the error cases.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/gguf/gguf.h"
#include "core/tokenizer/tokenizer.h"
#include "tests/command_runner.h"
#include "tests/vocab_vectors.h"
#include "tests/build_scale.h"

namespace ringlm {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

const std::string kVocabDir = std::string(RINGLM_SHARED_DATA) + "/vocab/";

std::string work_dir() { return test::work_dir_for("test_tokenize_cli"); }

std::string vocab_path(const std::string& name) { return kVocabDir + name + ".gguf"; }

// Writes `text` to a file of the work directory named after the running test and `tag`.
std::string write_text(const std::string& tag, const std::string& text) {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = std::string(info->test_suite_name()) + "." + info->name() + "." + tag;
  for (char& c : name) {
    if (c == '/') c = '_';
  }
  const std::string path = work_dir() + "/" + name + ".txt";
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  EXPECT_TRUE(out.good()) << path;
  return path;
}

// `ringlm tokenize ARGS` (arguments already quoted for the shell); no $RINGLM_MODEL, so every
// test names its model.
test::CommandResult tokenize(const std::string& args) {
  return test::run_command(std::string("env -u RINGLM_MODEL '") + RINGLM_BINARY + "' tokenize " + args, work_dir(),
                           60);
}

std::string describe(const test::CommandResult& r) {
  return "exit " + std::to_string(r.exit_code) + "\n--- stdout:\n" + r.out + "\n--- stderr:\n" + r.err;
}

std::string ids_line(const std::vector<int32_t>& ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size(); ++i) s += (i > 0 ? ", " : "") + std::to_string(ids[i]);
  return s + "]\n";
}

using test::read_vocab_cases;
using test::VocabCase;

class TokenizeVocabVectors : public ::testing::TestWithParam<const char*> {};

TEST_P(TokenizeVocabVectors, IdsAreTheExpectedOnes) {
  const std::string name = GetParam();
  const std::vector<VocabCase> cases = read_vocab_cases(kVocabDir + name + ".gguf");
  ASSERT_GE(cases.size(), 40u);
  // One process per text: the sanitizer build runs every eighth (test_tokenizer runs them all
  // in-process in both builds).
  for (size_t i = 0; i < cases.size(); i += static_cast<size_t>(test::scaled(1, 8))) {
    SCOPED_TRACE("text " + std::to_string(i) + ": '" + cases[i].text + "'");
    const std::string file = write_text(std::to_string(i), cases[i].text);
    const test::CommandResult r = tokenize("-m '" + vocab_path(name) + "' -f '" + file + "' --ids --no-bos");
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    EXPECT_EQ(r.out, ids_line(cases[i].ids));
  }
}

INSTANTIATE_TEST_SUITE_P(Ggml, TokenizeVocabVectors,
                         ::testing::Values("ggml-vocab-llama-spm", "ggml-vocab-gpt-2", "ggml-vocab-starcoder",
                                           "ggml-vocab-llama-bpe"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& ch : n) {
                             if (ch == '-') ch = '_';
                           }
                           return n;
                         });

TEST(TokenizeCli, DefaultOutputIsOneLinePerToken) {
  // llama-tokenize's format: "%6d -> '%s'", the piece's bytes as they are.
  const test::CommandResult r = tokenize("-m '" + vocab_path("ggml-vocab-gpt-2") + "' -p 'Hello world'");
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(r.out, " 15496 -> 'Hello'\n   995 -> ' world'\n");
}

TEST(TokenizeCli, BosAsTheVocabularyAsksUnlessNoBos) {
  // SentencePiece and Llama 3 add BOS by default (shown as its text), GPT-2 does not.
  const std::string spm = vocab_path("ggml-vocab-llama-spm");
  const test::CommandResult with = tokenize("-m '" + spm + "' -p 'Hello'");
  ASSERT_EQ(with.exit_code, 0) << describe(with);
  EXPECT_EQ(with.out, "     1 -> '<s>'\n 15043 -> ' Hello'\n");
  const test::CommandResult without = tokenize("-m '" + spm + "' -p 'Hello' --no-bos");
  ASSERT_EQ(without.exit_code, 0) << describe(without);
  EXPECT_EQ(without.out, " 15043 -> ' Hello'\n");

  const test::CommandResult llama3 = tokenize("-m '" + vocab_path("ggml-vocab-llama-bpe") + "' -p 'Hello' --ids");
  ASSERT_EQ(llama3.exit_code, 0) << describe(llama3);
  EXPECT_EQ(llama3.out, "[128000, 9906]\n");
  const test::CommandResult gpt2 = tokenize("-m '" + vocab_path("ggml-vocab-gpt-2") + "' -p 'Hello' --ids");
  ASSERT_EQ(gpt2.exit_code, 0) << describe(gpt2);
  EXPECT_EQ(gpt2.out, "[15496]\n");
}

TEST(TokenizeCli, SpecialTokenTextIsParsedUnlessNoParseSpecial) {
  const std::string path = vocab_path("ggml-vocab-starcoder");
  const auto gguf = GgufFile::open(path);
  const auto tok = Tokenizer::from_gguf(*gguf);
  const int32_t fim = *tok->find_token("<fim_prefix>");
  const std::string text = "<fim_prefix>def f():";

  const test::CommandResult parsed = tokenize("-m '" + path + "' -f '" + write_text("text", text) + "' --ids");
  ASSERT_EQ(parsed.exit_code, 0) << describe(parsed);
  std::vector<int32_t> expected = {fim};
  for (int32_t id : tok->encode("def f():", false, false)) expected.push_back(id);
  EXPECT_EQ(parsed.out, ids_line(expected));

  const test::CommandResult plain =
      tokenize("-m '" + path + "' -f '" + write_text("text", text) + "' --ids --no-parse-special");
  ASSERT_EQ(plain.exit_code, 0) << describe(plain);
  const std::vector<int32_t> plain_ids = tok->encode(text, false, false);
  EXPECT_EQ(plain.out, ids_line(plain_ids));
  EXPECT_GT(plain_ids.size(), 3u);  // "<", "fim", "_", ... as ordinary text
  for (int32_t id : plain_ids) EXPECT_NE(id, fim);

  // The default output shows a parsed special token as its text.
  const test::CommandResult shown = tokenize("-m '" + path + "' -p '<fim_prefix>'");
  ASSERT_EQ(shown.exit_code, 0) << describe(shown);
  char line[64];
  std::snprintf(line, sizeof(line), "%6d -> '<fim_prefix>'\n", fim);
  EXPECT_EQ(shown.out, line);
}

TEST(TokenizeCli, EmptyText) {
  const test::CommandResult r = tokenize("-m '" + vocab_path("ggml-vocab-gpt-2") + "' -p '' --ids");
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(r.out, "[]\n");
}

// The error cases: a failure of ringlm's own (not a crash, not the time limit), nothing on
// stdout, and a "ringlm: error: ..." line that says what was wrong.
void expect_error(const test::CommandResult& r, const std::string& what) {
  EXPECT_TRUE(test::exited_with_error(r)) << describe(r);
  EXPECT_EQ(r.out, "") << describe(r);
  EXPECT_THAT(r.err, AllOf(HasSubstr("ringlm: error: "), HasSubstr(what))) << describe(r);
  EXPECT_THAT(r.err, AllOf(Not(HasSubstr("Sanitizer")), Not(HasSubstr("runtime error:")))) << describe(r);
}

TEST(TokenizeCliErrors, MissingModelFile) {
  expect_error(tokenize("-m /nonexistent/vocab.gguf -p hi"), "/nonexistent/vocab.gguf: cannot open");
}

TEST(TokenizeCliErrors, ModelThatIsNotAGguf) {
  const std::string path = write_text("model", "not a model\n");
  expect_error(tokenize("-m '" + path + "' -p hi"), "not a GGUF file");
}

TEST(TokenizeCliErrors, NeitherTextNorFile) {
  expect_error(tokenize("-m '" + vocab_path("ggml-vocab-gpt-2") + "'"), "-p TEXT or -f FILE");
}

TEST(TokenizeCliErrors, BothTextAndFile) {
  const std::string file = write_text("text", "hi");
  expect_error(tokenize("-m '" + vocab_path("ggml-vocab-gpt-2") + "' -p hi -f '" + file + "'"), "not both");
}

TEST(TokenizeCliErrors, MissingTextFile) {
  const std::string file = work_dir() + "/no-such-file.txt";
  expect_error(tokenize("-m '" + vocab_path("ggml-vocab-gpt-2") + "' -f '" + file + "'"),
               "cannot read text file '" + file + "': No such file or directory");
}

TEST(TokenizeCliErrors, DirectoryAsTextFile) {
  expect_error(tokenize("-m '" + vocab_path("ggml-vocab-gpt-2") + "' -f '" + work_dir() + "'"),
               "cannot read text file '" + work_dir() + "': Is a directory");
}

}  // namespace
}  // namespace ringlm
