// `ringlm bench` end to end on the real model with tiny test sizes: llama-bench's JSON fields and
// markdown columns are there, the numbers are consistent, and bad lists are one-line errors.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "tests/command_runner.h"

namespace ringlm {
namespace {

using Result = test::CommandResult;

Result bench(const std::string& args, const std::string& model = RINGLM_TEST_MODEL) {
  return test::run_command(std::string(RINGLM_BINARY) + " bench -m " + model + " " + args,
                           test::work_dir_for("test_bench_command"));
}

TEST(BenchCommand, JsonHasLlamaBenchFieldsForEachTest) {
  const Result r = bench("-p 8 -n 2 -t 1 -r 2 -o json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  ASSERT_TRUE(j.is_array());
  ASSERT_EQ(j.size(), 2u);
  for (const char* field : {"model_filename", "model_type", "model_size", "model_n_params", "n_batch", "n_threads",
                            "n_prompt", "n_gen", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts", "samples_ns",
                            "samples_ts", "backends", "cpu_info", "test_time"}) {
    EXPECT_TRUE(j[0].contains(field)) << field;
  }
  EXPECT_EQ(j[0]["n_prompt"], 8);
  EXPECT_EQ(j[0]["n_gen"], 0);
  EXPECT_EQ(j[1]["n_prompt"], 0);
  EXPECT_EQ(j[1]["n_gen"], 2);
  EXPECT_EQ(j[0]["n_threads"], 1);
  EXPECT_EQ(j[0]["model_filename"], RINGLM_TEST_MODEL);
  for (const auto& t : j) {
    ASSERT_EQ(t["samples_ns"].size(), 2u);
    ASSERT_EQ(t["samples_ts"].size(), 2u);
    const double n_tokens = t["n_prompt"].get<double>() + t["n_gen"].get<double>();
    // t/s of each sample is tokens / its time; the average is the mean of those rates.
    const double ts0 = 1e9 * n_tokens / t["samples_ns"][0].get<double>();
    EXPECT_NEAR(t["samples_ts"][0].get<double>(), ts0, 1e-6 * ts0);
    const double mean = (t["samples_ts"][0].get<double>() + t["samples_ts"][1].get<double>()) / 2;
    EXPECT_NEAR(t["avg_ts"].get<double>(), mean, 1e-9 * mean);
    EXPECT_GT(t["avg_ts"].get<double>(), 0);
  }
}

TEST(BenchCommand, DepthRunsEachTestAfterThatManyTokens) {
  // llama-bench's -d: the tests run with d tokens already in the context (n_depth in JSON,
  // "@ dN" in the test name).
  const Result r = bench("-p 0 -n 2 -d 0,16 -t 1 -r 1 -o json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j.size(), 2u);
  EXPECT_EQ(j[0]["n_depth"], 0);
  EXPECT_EQ(j[1]["n_depth"], 16);
  const Result md = bench("-p 0 -n 2 -d 16 -t 1 -r 1 --softmax online");
  ASSERT_EQ(md.exit_code, 0) << md.err;
  EXPECT_NE(md.out.find("tg2 @ d16"), std::string::npos) << md.out;
}

TEST(BenchCommand, MarkdownTableHasLlamaBenchColumns) {
  const Result r = bench("-p 8 -n 0 -t 1 -r 1");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("| model"), std::string::npos) << r.out;
  for (const char* column : {"size", "params", "backend", "threads", "test", "t/s"}) {
    EXPECT_NE(r.out.find(column), std::string::npos) << column;
  }
  EXPECT_NE(r.out.find(" pp8 |"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("tg"), std::string::npos) << "-n 0 disables the tg test\n" << r.out;
  EXPECT_NE(r.out.find(" MiB |"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" M |"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" ± "), std::string::npos) << r.out;
}

TEST(BenchCommand, BadListsAreOneLineErrors) {
  for (const char* args : {"-p abc", "-n 1,,2", "-p -5", "-t x"}) {
    const Result r = bench(args);
    EXPECT_TRUE(test::exited_with_error(r)) << args;
    EXPECT_NE(r.err.find("comma-separated"), std::string::npos) << args << ": " << r.err;
  }
  const Result none = bench("-p 0 -n 0");
  EXPECT_TRUE(test::exited_with_error(none));
  EXPECT_NE(none.err.find("nothing to run"), std::string::npos) << none.err;
  const Result missing = bench("-o md", "/nonexistent/model.gguf");
  EXPECT_TRUE(test::exited_with_error(missing));
  EXPECT_NE(missing.err.find("/nonexistent/model.gguf"), std::string::npos) << missing.err;
}

}  // namespace
}  // namespace ringlm
