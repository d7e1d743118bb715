// `ringlm batch` on the real model (SmolLM2), as a subprocess: JSON-lines in and out, bad lines,
// a run killed in the middle and resumed, greedy outputs that do not depend on --parallel, and
// n samples sharing one prompt prefill. One thread (ctest runs two suites at once).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <cstdio>
#include <map>
#include <regex>
#include <set>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tests/command_runner.h"
#include "tests/build_scale.h"

namespace ringlm {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;
using namespace std::chrono_literals;

std::string work_dir() { return test::work_dir_for("test_batch_cli"); }
using test::slurp;

std::vector<json> records(const std::string& path) {
  std::vector<json> out;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) out.push_back(json::parse(line));
  return out;
}

std::string batch_command(const std::string& in, const std::string& out, const std::string& extra,
                          const std::string& model = RINGLM_TEST_MODEL) {
  return std::string(RINGLM_BINARY) + " batch -m " + model + " -t 1 --temp 0 -i " + in + " -o " + out + " " + extra;
}

// The run's exit code and stderr (the results go to its output file).
using BatchRunResult = test::CommandResult;

BatchRunResult run_batch(const std::string& name, const std::string& input, const std::string& extra, bool fresh = true,
                         const std::string& model = RINGLM_TEST_MODEL) {
  const std::string in = work_dir() + "/" + name + ".in", out = work_dir() + "/" + name + ".out";
  std::ofstream(in) << input;
  if (fresh) std::filesystem::remove(out);
  return test::run_command(batch_command(in, out, extra, model), work_dir(), 300);
}

// id (as JSON text) -> text, for results without a sample index.
std::map<std::string, std::string> texts_by_id(const std::vector<json>& recs) {
  std::map<std::string, std::string> m;
  for (const json& r : recs) {
    if (!r.contains("error")) m[r["id"].dump()] = r["text"].get<std::string>();
  }
  return m;
}

// Prompts of different lengths with max_tokens, max_tokens - shorter_by, ...: sequences finish at
// different steps and others join.
std::string eight_prompts(int max_tokens, int shorter_by = 3) {
  const char* prompts[] = {"The capital of France is", "Once upon a time", "The best way to learn to cook is",
                           "In 1969, astronauts", "A recipe for bread: first,", "The three primary colours are",
                           "Write a haiku about the sea:", "def fibonacci(n):"};
  std::string s;
  for (int i = 0; i < 8; ++i) {
    json line = {{"prompt", prompts[i]}, {"max_tokens", max_tokens - shorter_by * i}};
    line["id"] = std::string("p").append(std::to_string(i));
    s.append(line.dump()).append("\n");
  }
  return s;
}

TEST(BatchCli, ValidAndInvalidLinesMixed) {
  const std::string input =
      R"({"id": "ok1", "prompt": "The capital of France is", "max_tokens": 8})" "\n"
      "{not json\n"
      R"({"id": "bad-type", "prompt": 42})" "\n"
      "\n"
      R"({"id": "both", "prompt": "x", "messages": []})" "\n"
      R"({"id": "chat", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8})" "\n"
      R"({"id": "neg", "prompt": "x", "max_tokens": -1})" "\n"
      R"({"id": "toomany", "prompt": "x", "n": 99})" "\n"
      R"({"id": "ok2", "prompt": "Once upon a time", "max_tokens": 8, "stop": ["\n"]})" "\n";
  const BatchRunResult r = run_batch("mixed", input, "--parallel 2");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const std::vector<json> recs = records(work_dir() + "/mixed.out");
  std::map<int, json> errors;
  std::map<std::string, json> results;
  for (const json& j : recs) {
    if (j.contains("error")) errors[j["line"].get<int>()] = j;
    else results[j["id"].get<std::string>()] = j;
  }
  ASSERT_EQ(errors.size(), 5u) << r.err;
  EXPECT_FALSE(errors[2].contains("id"));  // unreadable
  EXPECT_THAT(errors[2]["error"].get<std::string>(), HasSubstr("invalid JSON"));
  EXPECT_EQ(errors[3]["id"], "bad-type");
  EXPECT_THAT(errors[3]["error"].get<std::string>(), HasSubstr("\"prompt\" must be a string"));
  EXPECT_EQ(errors[5]["id"], "both");
  EXPECT_EQ(errors[7]["id"], "neg");
  EXPECT_EQ(errors[8]["id"], "toomany");
  EXPECT_THAT(r.err, HasSubstr("line 2"));
  ASSERT_EQ(results.size(), 3u);
  for (const auto& [id, j] : results) {
    EXPECT_GT(j["tokens"].get<int>(), 0) << id;
    EXPECT_GT(j["prompt_tokens"].get<int>(), 0) << id;
    EXPECT_TRUE(j["finish_reason"] == "stop" || j["finish_reason"] == "length") << id;
    EXPECT_TRUE(j["timings"].contains("decode_ms")) << id;
  }
  EXPECT_EQ(results["ok1"]["tokens"], 8);
  EXPECT_EQ(results["ok2"]["text"].get<std::string>().find('\n'), std::string::npos);  // cut at the stop string
}

// A line's "json_schema" and "grammar" hold its text to them (judged by nlohmann's parser and a
// regular expression); a bad grammar is that line's error record, naming what is wrong.
TEST(BatchCli, GrammarsAndSchemasPerLine) {
  const json schema = {{"type", "object"},
                       {"properties", {{"colour", {{"enum", {"red", "green", "blue"}}}}, {"count", {{"type", "integer"}}}}},
                       {"required", {"colour", "count"}},
                       {"additionalProperties", false}};
  std::string input;
  for (int i = 0; i < 3; ++i) {
    input += json{{"id", "s" + std::to_string(i)}, {"prompt", "A colour and a number as JSON:"}, {"json_schema", schema},
                  {"max_tokens", 60}, {"temperature", 0.9}, {"seed", i}}.dump() + "\n";
  }
  input += json{{"id", "g"}, {"prompt", "Is water wet?"}, {"grammar", "root ::= (\"yes\" | \"no\") \".\""}}.dump() + "\n";
  input += json{{"id", "bad"}, {"prompt", "x"}, {"grammar", "root ::= x"}}.dump() + "\n";
  input += json{{"id", "unsupported"}, {"prompt", "x"}, {"json_schema", {{"type", "string"}, {"contentEncoding", "base64"}}}}.dump() + "\n";
  const BatchRunResult r = run_batch("grammars", input, "--parallel 4");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::map<std::string, json> by_id;
  for (const json& j : records(work_dir() + "/grammars.out")) by_id[j["id"].get<std::string>()] = j;
  for (int i = 0; i < 3; ++i) {
    const json& rec = by_id["s" + std::to_string(i)];
    ASSERT_EQ(rec["finish_reason"], "stop") << rec.dump();
    const json value = json::parse(rec["text"].get<std::string>());
    EXPECT_THAT(value["colour"].get<std::string>(), ::testing::AnyOf("red", "green", "blue"));
    EXPECT_TRUE(value["count"].is_number_integer()) << rec.dump();
    EXPECT_EQ(value.size(), 2u);
  }
  EXPECT_TRUE(std::regex_match(by_id["g"]["text"].get<std::string>(), std::regex("(yes|no)\\."))) << by_id["g"].dump();
  EXPECT_THAT(by_id["bad"]["error"].get<std::string>(), HasSubstr("undefined rule 'x'"));
  EXPECT_THAT(by_id["unsupported"]["error"].get<std::string>(), HasSubstr("contentEncoding"));
}

TEST(BatchCli, GreedyOutputsDoNotDependOnParallel) {
  std::map<std::string, std::string> reference;
  for (const char* parallel : {"1", "3", "8"}) {
    const std::string name = std::string("parallel") + parallel;
    const BatchRunResult r =
        run_batch(name, eight_prompts(test::scaled(40, 16), test::scaled(3, 2)), std::string("--parallel ") + parallel + " --prefill-chunk 4");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto texts = texts_by_id(records(work_dir() + "/" + name + ".out"));
    ASSERT_EQ(texts.size(), 8u);
    if (reference.empty()) {
      reference = texts;
    } else {
      EXPECT_EQ(texts, reference) << "--parallel " << parallel;
    }
  }
}

// Speculative decoding inside continuous batching: each sequence's draft rows go into the step
// with its token, and the greedy texts are those of plain batching (prompt lookup, then a draft
// model: the test model drafting for itself). The sanitizer build checks the memory of the same
// paths on a tiny model drafting for itself (every draft accepted).
TEST(BatchCli, SpeculativeDraftsGiveThePlainTexts) {
  const std::string model =
      test::kSanitizedBuild ? std::string(RINGLM_TEST_WORK_DIR) + "/tiny_q8_0.gguf" : std::string(RINGLM_TEST_MODEL);
  std::string input = eight_prompts(test::scaled(24, 12), 1);
  input += R"({"id": "copy", "prompt": "Copy the list: apples, pears, plums, cherries, grapes. Copy: apples, pears,", "max_tokens": 24})"
           "\n";
  const BatchRunResult plain = run_batch("spec-plain", input, "--parallel 3 --prefill-chunk 4", true, model);
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  const auto reference = texts_by_id(records(work_dir() + "/spec-plain.out"));
  ASSERT_EQ(reference.size(), 9u);
  const std::vector<std::string> guessers = test::kSanitizedBuild ? std::vector<std::string>{"-md " + model + " --draft-p-min 0"}
                                                                  : std::vector<std::string>{"--lookup 6", "-md " + model};
  for (const std::string& guesser : guessers) {
    const BatchRunResult r = run_batch("spec", input, "--parallel 3 --prefill-chunk 4 " + guesser, true, model);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(texts_by_id(records(work_dir() + "/spec.out")), reference) << guesser;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.err, m, std::regex(R"((\d+) tokens drafted, (\d+) accepted)"))) << r.err;
    EXPECT_GT(std::stoi(m[2]), 0) << r.err;
    EXPECT_LE(std::stoi(m[2]), std::stoi(m[1])) << r.err;
  }
}

// Short prompts join together: eight prompts of a few tokens fit one step's prompt budget
// (--prefill-chunk 64), so all eight are prefilled in the first step and each sequence then
// takes a step per token. One prompt per step would take 7 more steps before the last one
// starts.
TEST(BatchCli, ShortPromptsArePrefilledInOneStep) {
  const BatchRunResult r = run_batch("join", eight_prompts(12, 0), "--parallel 8");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  int most_tokens = 0;
  for (const json& j : records(work_dir() + "/join.out")) most_tokens = std::max(most_tokens, j["tokens"].get<int>());
  ASSERT_GT(most_tokens, 0) << r.err;
  const size_t at = r.err.find("(--parallel 8, ");
  ASSERT_NE(at, std::string::npos) << r.err;
  const int steps = std::stoi(r.err.substr(at + std::strlen("(--parallel 8, ")));
  // Step 1 prefills every prompt and gives each its first token; a sequence that ends by
  // end-of-generation needs one step more than its tokens.
  EXPECT_LE(steps, most_tokens + 1) << r.err;
}

TEST(BatchCli, KilledRunResumesAndLosesNothing) {
  const std::string name = "resume";
  const std::string in = work_dir() + "/" + name + ".in", out = work_dir() + "/" + name + ".out";
  const int max_tokens = test::scaled(60, 24);
  std::ofstream(in) << eight_prompts(max_tokens);
  std::filesystem::remove(out);

  const pid_t child = fork();
  if (child == 0) {
    execl("/bin/sh", "sh", "-c", ("exec " + batch_command(in, out, "--parallel 2") + " 2>/dev/null").c_str(), nullptr);
    _exit(127);
  }
  // Kill it (no chance to clean up) once some, not all, results are written.
  const auto deadline = std::chrono::steady_clock::now() + 120s;
  while (records(out).size() < 2 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(20ms);
  kill(child, SIGKILL);
  int status = 0;
  waitpid(child, &status, 0);
  const size_t before = records(out).size();
  ASSERT_GE(before, 2u);
  ASSERT_LT(before, 8u) << "the run finished before it could be killed";

  const BatchRunResult again = run_batch(name, eight_prompts(max_tokens), "--parallel 2", /*fresh=*/false);
  EXPECT_EQ(again.exit_code, 0) << again.err;
  EXPECT_THAT(again.err, HasSubstr(std::to_string(before) + " skipped"));
  const std::vector<json> recs = records(out);
  std::map<std::string, int> count;
  for (const json& j : recs) ++count[j["id"].get<std::string>()];
  EXPECT_EQ(count.size(), 8u);
  for (const auto& [id, n] : count) EXPECT_EQ(n, 1) << id;

  // And the resumed results are the ones an uninterrupted run gives.
  const BatchRunResult clean = run_batch("resume_clean", eight_prompts(max_tokens), "--parallel 2");
  ASSERT_EQ(clean.exit_code, 0) << clean.err;
  EXPECT_EQ(texts_by_id(recs), texts_by_id(records(work_dir() + "/resume_clean.out")));
}

// "KV cache peak A MiB (B MiB without sharing prompts)" from the summary; {-1, -1} when absent.
// (sscanf, not std::regex: GCC 12 reports false maybe-uninitialized errors inside <regex> under
// the sanitizer build.)
std::pair<double, double> kv_peaks(const std::string& err) {
  const size_t at = err.find("KV cache peak ");
  double held = -1, would_hold = -1;
  if (at == std::string::npos ||
      std::sscanf(err.c_str() + at, "KV cache peak %lf MiB (%lf MiB without sharing prompts)", &held, &would_hold) != 2) {
    return {-1, -1};
  }
  return {held, would_hold};
}

std::map<int, std::string> texts_by_sample(const std::vector<json>& recs) {
  std::map<int, std::string> texts;
  for (const json& j : recs) texts[j["sample"].get<int>()] = j["text"].get<std::string>();
  return texts;
}

// n = 3 samples of one prompt: the prompt is prefilled once and its KV cache is shared (the
// segment cache). The oracle is the same request without sharing (each sample prefills and holds
// the prompt itself): the same samples, for more memory. A sample reading the shared segment
// rounds exactly as one holding the prompt itself (test_attention), so the rest must be exact
// too: fp32 compute (int8 activations turn any last-bit difference into logits a percent apart)
// and prefill chunks of 8, which keep every product below the sgemm path, where a row's rounding
// depends on the rows it shares the call with (without sharing, a sample's prompt is prefilled
// next to the other samples' decode rows).
TEST(BatchCli, ThreeSamplesShareOnePromptPrefill) {
  // (fp32 is slow under the sanitizers: that build shares a prompt of its first ten words.)
  const std::string poem = test::kSanitizedBuild ? "Roses are red, violets are blue, the sea is wide"
                                                 : "Roses are red, violets are blue, the sea is wide and the sky is too. "
                                                   "Write the next four lines of this poem about a sailor who comes home "
                                                   "after many years away";
  const std::string input = json{{"id", "s"}, {"prompt", poem}, {"n", 3}, {"temperature", 1.0}, {"seed", 11},
                                 {"max_tokens", test::scaled(16, 4)}}.dump() + "\n";
  const BatchRunResult r = run_batch("samples", input, "--parallel 4 --compute fp32 --prefill-chunk 8");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::vector<json> recs = records(work_dir() + "/samples.out");
  ASSERT_EQ(recs.size(), 3u);
  std::set<std::string> texts;
  for (const json& j : recs) {
    EXPECT_EQ(j["id"], "s");
    texts.insert(j["text"].get<std::string>());
    EXPECT_EQ(j["prompt_tokens"], recs[0]["prompt_tokens"]);
  }
  const std::map<int, std::string> shared = texts_by_sample(recs);
  EXPECT_EQ(shared.size(), 3u);
  EXPECT_EQ(shared.begin()->first, 0);
  EXPECT_EQ(shared.rbegin()->first, 2);
  EXPECT_GT(texts.size(), 1u);  // different seeds, different samples
  // The prompt was prefilled once: the two other samples started from its cache.
  const int prompt = recs[0]["prompt_tokens"].get<int>();
  EXPECT_THAT(r.err, HasSubstr("prompt prefill shared by samples: " + std::to_string(2 * prompt) + " tokens"));

  const BatchRunResult alone =
      run_batch("samples_unshared", input, "--parallel 4 --compute fp32 --prefill-chunk 8 --no-prompt-sharing");
  ASSERT_EQ(alone.exit_code, 0) << alone.err;
  EXPECT_EQ(texts_by_sample(records(work_dir() + "/samples_unshared.out")), shared);
  EXPECT_THAT(alone.err, HasSubstr("prompt prefill shared by samples: 0 tokens"));

  // Memory: the prompt once instead of three times; without sharing both figures agree.
  const auto [held, would_hold] = kv_peaks(r.err);
  const auto [held_alone, would_hold_alone] = kv_peaks(alone.err);
  ASSERT_GT(held, 0) << r.err;
  EXPECT_LT(held, would_hold);
  EXPECT_NEAR(held_alone, would_hold_alone, 0.05);
}

// A "messages" line of a model whose format keeps its reasoning apart (the scripted harmony and
// think-tag models): "text" is the answer and "reasoning" the reasoning, as serve splits them; a
// "prompt" line of the same model keeps the text as generated.
TEST(BatchCli, ChatRepliesOfReasoningModelsAreSplit) {
  for (const std::string name : {"harmony", "think"}) {
    SCOPED_TRACE(name);
    const json spec = json::parse(slurp(std::string(RINGLM_SOURCE_DIR) + "/tests/data/scripted_" + name + ".json"));
    const std::string model = std::string(RINGLM_TEST_WORK_DIR) + "/scripted_" + name + ".gguf";
    const std::string input = R"({"id": "chat", "messages": [{"role": "user", "content": "Hi"}]})"
                              "\n" R"({"id": "raw", "prompt": "<|start|>assistant", "max_tokens": 5})" "\n";
    const BatchRunResult r = run_batch("reasoning_" + name, input, "", true, model);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const std::vector<json> recs = records(work_dir() + "/reasoning_" + name + ".out");
    ASSERT_EQ(recs.size(), 2u);
    const json& chat = recs[0]["id"] == "chat" ? recs[0] : recs[1];
    const json& raw = recs[0]["id"] == "raw" ? recs[0] : recs[1];
    EXPECT_EQ(chat["text"], spec["content"]);
    EXPECT_EQ(chat["reasoning"], spec["reasoning"]);
    EXPECT_FALSE(raw.contains("reasoning"));
  }
}

TEST(BatchCli, PlainTextLinesAreNumbered) {
  const BatchRunResult r = run_batch("plain", "The capital of France is\n\nOnce upon a time\n", "-n 6");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto texts = texts_by_id(records(work_dir() + "/plain.out"));
  EXPECT_EQ(texts.size(), 2u);
  EXPECT_EQ(texts.count("1"), 1u);
  EXPECT_EQ(texts.count("3"), 1u);
}

TEST(BatchCli, PromptLongerThanTheContextIsAnErrorRecord) {
  std::string long_prompt;
  for (int i = 0; i < 200; ++i) long_prompt += "word ";
  const BatchRunResult r = run_batch("long", json{{"id", "long"}, {"prompt", long_prompt}}.dump() + "\n" +
                                      R"({"id": "short", "prompt": "Hi", "max_tokens": 4})" "\n",
                          "-c 64");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const std::vector<json> recs = records(work_dir() + "/long.out");
  ASSERT_EQ(recs.size(), 2u);
  EXPECT_EQ(recs[0]["id"], "long");
  EXPECT_THAT(recs[0]["error"].get<std::string>(), HasSubstr("raise -c"));
  EXPECT_EQ(recs[1]["id"], "short");
}

TEST(BatchCli, MissingInputFileIsAClearError) {
  const test::CommandResult r =
      test::run_command(batch_command(work_dir() + "/no-such.jsonl", work_dir() + "/x.out", ""), work_dir(), 300);
  EXPECT_TRUE(test::exited_with_error(r));
  EXPECT_THAT(r.err, HasSubstr("cannot read input file"));
}

}  // namespace
}  // namespace ringlm
