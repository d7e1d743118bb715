// `ringlm perplexity` end to end on the real model: the figure is sane, it matches the numpy
// reference's perplexity of the same chunk, and bad input gives a one-line error.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <utility>
#include <string_view>

#include "core/gguf/gguf.h"
#include "core/tokenizer/tokenizer.h"
#include "tests/command_runner.h"
#include "tests/build_scale.h"

namespace ringlm {
namespace {

const std::string kText = std::string(RINGLM_SHARED_DATA) + "/text/kjv-pentateuch.txt";

using Result = test::CommandResult;
using test::slurp;

std::string work_dir() { return test::work_dir_for("test_perplexity"); }

Result run(const std::string& command, int timeout_s = 600) { return test::run_command(command, work_dir(), timeout_s); }

std::string ringlm(const std::string& args) { return std::string(RINGLM_BINARY) + " perplexity " + args; }

// The X of the "Final estimate: PPL = X +/- Y" line, or NaN. (Parsed by hand: std::regex trips
// a false -Wmaybe-uninitialized of GCC 12 in the sanitizer build.)
double final_ppl(const std::string& out) {
  const std::string marker = "Final estimate: PPL = ";
  const size_t at = out.find(marker);
  if (at == std::string::npos) return NAN;
  const char* begin = out.c_str() + at + marker.size();
  char* end = nullptr;
  const double ppl = std::strtod(begin, &end);
  if (end == begin || std::string_view(end).substr(0, 5) != " +/- ") return NAN;
  return ppl;
}

TEST(Perplexity, MissingTextFileIsAClearError) {
  const Result r = run(ringlm("-m " + std::string(RINGLM_TEST_MODEL) + " -f " + work_dir() + "/no-such-file.txt"));
  EXPECT_TRUE(test::exited_with_error(r));
  EXPECT_NE(r.err.find("cannot read text file"), std::string::npos) << r.err;
}

TEST(Perplexity, TextShorterThanTwoChunksIsAClearError) {
  const std::string path = work_dir() + "/short.txt";
  std::ofstream(path) << "In the beginning God created the heaven and the earth.";
  const Result r = run(ringlm("-m " + std::string(RINGLM_TEST_MODEL) + " -f " + path + " -c 128"));
  EXPECT_TRUE(test::exited_with_error(r));
  EXPECT_NE(r.err.find("needs at least 256 tokens, has "), std::string::npos) << r.err;
}

TEST(Perplexity, MissingFileFlagIsAUsageError) {
  const Result r = run(ringlm("-c 128"));
  EXPECT_TRUE(test::exited_with_error(r));
  EXPECT_NE(r.err.find("--file"), std::string::npos) << r.err;
}

// The first 128-token chunk of the KJV text, tokenized as the command does (a prefix of the text
// is enough: the pre-tokenizer splits at word boundaries, so the first 128 tokens do not depend
// on what comes several kilobytes later).
std::vector<int32_t> first_chunk(int n_ctx) {
  auto gguf = GgufFile::open(RINGLM_TEST_MODEL);
  auto tok = Tokenizer::from_gguf(*gguf);
  std::vector<int32_t> ids = tok->encode(slurp(kText).substr(0, 8192), tok->add_bos_by_default(), false);
  ids.resize(static_cast<size_t>(n_ctx));
  if (tok->add_bos_by_default()) ids[0] = tok->bos_id();
  return ids;
}

// The same chunk's perplexity from the independent float64 numpy reference.
double reference_ppl(const std::vector<int32_t>& chunk) {
  std::string ids;
  for (const int32_t id : chunk) {
    if (!ids.empty()) ids += ',';
    ids += std::to_string(id);
  }
  const std::string script = work_dir() + "/ref_ppl.py";
  std::ofstream(script) << "import sys, numpy as np\n"
                           "sys.path.insert(0, '" RINGLM_SOURCE_DIR "/tests/reference')\n"
                           "from llama_ref import LlamaModel\n"
                           "toks = [int(t) for t in sys.argv[2].split(',')]\n"
                           "m = LlamaModel(sys.argv[1])\n"
                           "m.reset(len(toks))\n"
                           "lg = m.forward(toks, all_logits=True)\n"
                           "n = len(toks); nll = []\n"
                           "for p in range(n // 2, n - 1):\n"
                           "    x = lg[p] - lg[p].max()\n"
                           "    nll.append(np.log(np.exp(x).sum()) - x[toks[p + 1]])\n"
                           "print('%.8f' % np.exp(np.mean(nll)))\n";
  const Result r = run("python3 " + script + " " + RINGLM_TEST_MODEL + " " + ids, 300);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return r.exit_code == 0 ? std::stod(r.out) : NAN;
}

TEST(Perplexity, FirstKjvChunkIsSaneAndMatchesTheNumpyReference) {
  const std::string args = "-m " + std::string(RINGLM_TEST_MODEL) + " -f " + kText + " -c 128 --chunks 1 -t 2";
  const Result fp32 = run(ringlm(args + " --compute fp32"));
  ASSERT_EQ(fp32.exit_code, 0) << fp32.err;
  EXPECT_NE(fp32.err.find("[1]"), std::string::npos) << fp32.err;
  const double ppl = final_ppl(fp32.out);
  ASSERT_TRUE(std::isfinite(ppl)) << fp32.out;
  EXPECT_GT(ppl, 1.5);
  EXPECT_LT(ppl, 100.0);
  // The int8 kernels (batches of 16 tokens stay on them), whose activation rounding moves
  // the figure by about a percent.
  const double ppl_int8 = final_ppl(run(ringlm(args + " --compute int8 -b 16")).out);

  const double ref = reference_ppl(first_chunk(128));
  std::printf("first KJV chunk (c=128): ringlm PPL %.4f (fp32), %.4f (int8), numpy reference %.6f\n", ppl, ppl_int8, ref);
  // fp32 against float64: differences in the logits of ~1e-4 move the PPL by far less than
  // this; a wrong position, target or softmax moves it by percent.
  EXPECT_NEAR(ppl, ref, 1e-3 * ref) << "ringlm " << ppl << ", numpy reference " << ref;
  EXPECT_NEAR(ppl_int8, ref, 0.05 * ref) << "ringlm int8 " << ppl_int8 << ", numpy reference " << ref;
}

// Quantized caches score the first KJV chunk within their rounding's reach of an fp16 cache
// (the fp32 path: only the cache differs). On these 128 tokens q8_0 moves it by 0.6-1.2% and
// q4_0 by 8-16% (its heads turned by the Walsh-Hadamard matrix; not turned, by 81%): which codes
// a key's rounding lands on, and so a short text's score, moves with the last bits of the keys,
// which differ between the Release and sanitizer builds. Wrong blocks or scales move it by far
// more.
TEST(Perplexity, QuantizedCachesScoreNearTheF16Cache) {
  const std::string args = "-m " + std::string(RINGLM_TEST_MODEL) + " -f " + kText + " -c 128 --chunks 1 -t 2 --compute fp32";
  const Result f16 = run(ringlm(args + " --cache-type f16"));
  ASSERT_EQ(f16.exit_code, 0) << f16.err;
  const double base = final_ppl(f16.out);
  ASSERT_TRUE(std::isfinite(base)) << f16.out;
  for (const auto& [type, bound] : {std::pair<std::string, double>{"q8_0", 0.03}, {"q4_0", 0.3}}) {
    const Result quantized = run(ringlm(args + " --cache-type " + type));
    ASSERT_EQ(quantized.exit_code, 0) << quantized.err;
    const double ppl = final_ppl(quantized.out);
    EXPECT_NEAR(ppl, base, bound * base) << "f16 " << base << ", " << type << " " << ppl;
  }
}

// --stream through a context that never fills sees every earlier token, as does the sliding
// window when its window covers the whole text: the two must agree. Through a small ring they
// must not (the window loses context), and each shift must be counted.
TEST(Perplexity, StreamWithoutShiftsEqualsSlidingWindowOverTheWholeText) {
  // fp32 compute: the int8 path rounds activations, and float differences of 1e-7 between
  // batch shapes can flip a rounding, which moves the PPL of a short text by a percent or more.
  // (The sanitizer build scores 8 tokens in a context of 10, the Release build 24 in 32.)
  const int tokens = test::scaled(24, 8), ctx = test::scaled(32, 10), small_ctx = test::scaled(12, 6);
  const std::string base = "-m " + std::string(RINGLM_TEST_MODEL) + " -f " + kText + " --stream " +
                           std::to_string(tokens) + " -t 2 --cache-type f32 --compute fp32";
  const Result stream = run(ringlm(base + " -c " + std::to_string(ctx) + " -b 8"));
  const Result window = run(ringlm(base + " -c " + std::to_string(ctx) + " --sliding-window"));
  ASSERT_EQ(stream.exit_code, 0) << stream.err;
  ASSERT_EQ(window.exit_code, 0) << window.err;
  const double a = final_ppl(stream.out), b = final_ppl(window.out);
  ASSERT_TRUE(std::isfinite(a) && std::isfinite(b)) << stream.out << window.out;
  EXPECT_NEAR(a, b, 1e-3 * b) << "stream " << a << ", sliding window " << b;

  const Result shifted = run(ringlm(base + " -c " + std::to_string(small_ctx) + " --keep 2"));
  ASSERT_EQ(shifted.exit_code, 0) << shifted.err;
  EXPECT_NE(shifted.err.find("shifts"), std::string::npos) << shifted.err;
  EXPECT_GT(std::fabs(final_ppl(shifted.out) - b), 1e-3 * b) << "a small ring scored like the full context";
}

TEST(Perplexity, StreamPastTheContextWithoutShiftIsAClearError) {
  const Result r = run(ringlm("-m " + std::string(RINGLM_TEST_MODEL) + " -f " + kText + " --stream 64 -c 32 --no-context-shift"));
  EXPECT_TRUE(test::exited_with_error(r));
  EXPECT_NE(r.err.find("--no-context-shift"), std::string::npos) << r.err;
}

TEST(Perplexity, SlidingWindowNeedsStream) {
  const Result r = run(ringlm("-f " + kText + " --sliding-window"));
  EXPECT_TRUE(test::exited_with_error(r));
  EXPECT_NE(r.err.find("--stream"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace ringlm
