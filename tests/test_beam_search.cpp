// Beam search (core/session/beam_search.h) against an exhaustive search: with as many beams as
// a search can ever hold live, it must find the very best hypotheses; with one beam it is
// greedy decoding. First on scripted logits (a fixed function of the history), then on a tiny
// model through its caches, forks and batched passes, where the exhaustive search runs every
// sequence alone in a fresh cache.
#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "core/model/llama.h"
#include "core/session/beam_search.h"
#include "tests/build_scale.h"
#include "tests/command_runner.h"
#include "tests/tiny_llama.h"

namespace ringlm {
namespace {

using History = std::vector<int32_t>;
using LogitsOf = std::function<std::vector<float>(const History&)>;

double log_softmax_of(const std::vector<float>& logits, int32_t token) {
  double top = logits[0];
  for (const float x : logits) top = std::max(top, static_cast<double>(x));
  double sum = 0;
  for (const float x : logits) sum += std::exp(x - top);
  return logits[static_cast<size_t>(token)] - top - std::log(sum);
}

// Every sequence of at most max_tokens tokens that ends on the end token or at the limit, scored
// as beam search scores it; the best n, best first.
std::vector<BeamHypothesis> exhaustive(const LogitsOf& logits_of, int n_vocab, int32_t end, int max_tokens,
                                       double length_penalty, int n) {
  std::vector<BeamHypothesis> all;
  std::function<void(History, double)> extend = [&](const History& h, double log_prob) {
    const std::vector<float> logits = logits_of(h);
    for (int32_t t = 0; t < n_vocab; ++t) {
      History next = h;
      next.push_back(t);
      const double lp = log_prob + log_softmax_of(logits, t);
      const bool ended = t == end;
      if (ended || static_cast<int>(next.size()) == max_tokens) {
        all.push_back({next, lp, lp / std::pow(static_cast<double>(next.size()), length_penalty), ended});
      } else {
        extend(next, lp);
      }
    }
  };
  extend({}, 0.0);
  std::stable_sort(all.begin(), all.end(), [](const BeamHypothesis& a, const BeamHypothesis& b) { return a.score > b.score; });
  all.resize(std::min(all.size(), static_cast<size_t>(n)));
  return all;
}

// Beam search driven over logits_of: each beam's history kept by following the steps' parents.
std::vector<BeamHypothesis> search(const LogitsOf& logits_of, int n_vocab, const BeamOptions& options) {
  BeamSearch beams(options, static_cast<size_t>(n_vocab));
  std::vector<History> histories = {{}};
  while (!beams.done()) {
    std::vector<std::vector<float>> rows;
    for (const History& h : histories) rows.push_back(logits_of(h));
    const std::vector<std::span<const float>> views(rows.begin(), rows.end());
    const BeamSearch::Step step = beams.advance(views, /*room=*/true);
    std::vector<History> next;
    for (size_t i = 0; i < step.parents.size(); ++i) {
      next.push_back(histories[static_cast<size_t>(step.parents[i])]);
      next.back().push_back(step.tokens[i]);
    }
    histories = std::move(next);
  }
  return beams.hypotheses();
}

// Logits that are a fixed, uneven function of the whole history (a hash of it).
std::vector<float> scripted_logits(const History& h, int n_vocab) {
  uint64_t x = 1469598103934665603ull;
  for (const int32_t t : h) x = (x ^ static_cast<uint64_t>(t + 1)) * 1099511628211ull;
  std::vector<float> logits(static_cast<size_t>(n_vocab));
  for (int t = 0; t < n_vocab; ++t) {
    x = (x ^ static_cast<uint64_t>(t + 7)) * 1099511628211ull;
    logits[static_cast<size_t>(t)] = static_cast<float>((x >> 24) % 1000003) / 250000.0f;  // 0 .. 4
  }
  return logits;
}

void expect_same_hypotheses(const std::vector<BeamHypothesis>& got, const std::vector<BeamHypothesis>& want,
                            double tolerance) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    SCOPED_TRACE("hypothesis " + std::to_string(i));
    EXPECT_EQ(got[i].tokens, want[i].tokens);
    EXPECT_NEAR(got[i].score, want[i].score, tolerance);
    EXPECT_NEAR(got[i].log_prob, want[i].log_prob, tolerance);
    EXPECT_EQ(got[i].ended, want[i].ended);
  }
}

// The search takes its exponentials in float: its log-probabilities are a few 1e-8 off the
// reference's doubles.
constexpr int kScriptVocab = 3;
constexpr int32_t kScriptEnd = 2;
constexpr int kScriptLength = 4;
// Every sequence that has not ended kept live, and every candidate of a step ranked among the
// beams (an end token counts only there): (vocab - 1)^(length - 1) x vocab beams.
constexpr int kEveryBeam = 24;

TEST(BeamSearch, WithEveryBeamLiveItFindsTheExhaustiveBest) {
  const LogitsOf logits_of = [](const History& h) { return scripted_logits(h, kScriptVocab); };
  // A length penalty of 0: the stopping rule is exact, so the search must stop with the best.
  for (const int n : {kEveryBeam, 5}) {
    SCOPED_TRACE("beams " + std::to_string(n));
    BeamOptions o;
    o.n_beams = n;
    o.length_penalty = 0.0f;
    o.max_tokens = kScriptLength;
    o.end_tokens = {kScriptEnd};
    const std::vector<BeamHypothesis> want = exhaustive(logits_of, kScriptVocab, kScriptEnd, kScriptLength, 0.0, n);
    if (n == kEveryBeam) {
      expect_same_hypotheses(search(logits_of, kScriptVocab, o), want, 1e-6);
    } else {  // fewer beams may miss some, never invent better ones
      const std::vector<BeamHypothesis> got = search(logits_of, kScriptVocab, o);
      ASSERT_FALSE(got.empty());
      EXPECT_LE(got.front().score, want.front().score + 1e-6);
    }
  }
}

TEST(BeamSearch, LengthPenaltyScoresMatchTheExhaustiveSearch) {
  const LogitsOf logits_of = [](const History& h) { return scripted_logits(h, kScriptVocab); };
  for (const double penalty : {0.5, 1.0, 2.0}) {
    SCOPED_TRACE("length penalty " + std::to_string(penalty));
    BeamOptions o;
    o.n_beams = kEveryBeam;
    o.length_penalty = static_cast<float>(penalty);
    o.max_tokens = kScriptLength;
    o.end_tokens = {kScriptEnd};
    const std::vector<BeamHypothesis> got = search(logits_of, kScriptVocab, o);
    const std::vector<BeamHypothesis> all = exhaustive(logits_of, kScriptVocab, kScriptEnd, kScriptLength, penalty, 1000);
    ASSERT_FALSE(got.empty());
    // Each result is a real sequence with its exhaustive score, and they come best first.
    for (size_t i = 0; i < got.size(); ++i) {
      const auto same = std::find_if(all.begin(), all.end(), [&](const BeamHypothesis& h) { return h.tokens == got[i].tokens; });
      ASSERT_NE(same, all.end());
      EXPECT_NEAR(got[i].score, same->score, 1e-6);
      if (i > 0) {
        EXPECT_GE(got[i - 1].score, got[i].score);
      }
    }
    // All beams live: the stopping rule (Hugging Face's) may stop before a longer hypothesis,
    // but with every beam live and the limit reached, the best is found.
    EXPECT_NEAR(got.front().score, all.front().score, 1e-6);
  }
}

// Greedy decoding over the same logits: the most likely token until the end token or the limit.
History greedy(const LogitsOf& logits_of, int32_t end, int max_tokens) {
  History h;
  while (static_cast<int>(h.size()) < max_tokens) {
    const std::vector<float> logits = logits_of(h);
    const auto token = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    h.push_back(token);
    if (token == end) break;
  }
  return h;
}

TEST(BeamSearch, OneBeamIsGreedy) {
  for (const int vocab : {4, 9, 50}) {
    const LogitsOf logits_of = [vocab](const History& h) { return scripted_logits(h, vocab); };
    for (const float penalty : {0.0f, 1.0f, 2.0f}) {
      BeamOptions o;
      o.n_beams = 1;
      o.length_penalty = penalty;
      o.max_tokens = 12;
      o.end_tokens = {vocab - 1};
      const std::vector<BeamHypothesis> got = search(logits_of, vocab, o);
      ASSERT_EQ(got.size(), 1u);
      EXPECT_EQ(got[0].tokens, greedy(logits_of, vocab - 1, 12)) << "vocab " << vocab << ", penalty " << penalty;
    }
  }
}

TEST(BeamSearch, WithoutEndTokensEveryHypothesisReachesTheLimit) {
  const LogitsOf logits_of = [](const History& h) { return scripted_logits(h, 3); };
  BeamOptions o;
  o.n_beams = 9;  // 3^2: every sequence of two tokens stays live
  o.max_tokens = 3;
  const std::vector<BeamHypothesis> got = search(logits_of, 3, o);
  ASSERT_EQ(got.size(), 9u);
  const std::vector<BeamHypothesis> want = exhaustive(logits_of, 3, /*end=*/-1, 3, 1.0, 9);
  expect_same_hypotheses(got, want, 1e-6);
}

TEST(BeamSearch, RefusesBadOptionsAndRows) {
  BeamOptions o;
  o.n_beams = 0;
  EXPECT_THROW(BeamSearch(o, 4), std::invalid_argument);
  o.n_beams = 2;
  o.max_tokens = 0;
  BeamSearch none(o, 4);
  EXPECT_TRUE(none.done());
  EXPECT_TRUE(none.hypotheses().empty());
  o.max_tokens = 3;
  BeamSearch beams(o, 4);
  const std::vector<float> short_row(3, 0.0f);
  const std::span<const float> rows[] = {short_row};
  EXPECT_THROW(beams.advance(rows, true), std::invalid_argument);
}

// --- on a tiny model: caches, forks and batched passes ----------------------------------------

constexpr int kModelVocab = kScriptVocab;
constexpr int32_t kModelEnd = kScriptEnd;

class BeamModel : public ::testing::Test {
 protected:
  static test::LlamaSpec spec() {
    test::LlamaSpec s;
    s.n_vocab = kModelVocab;
    s.matrix_range = 0.6f;  // logits far from uniform
    return s;
  }
  void SetUp() override {
    omp_set_num_threads(1);
    file_ = std::make_unique<test::TinyLlama>(spec());
    backend_ = make_cpu_backend(1);
    model_ = std::make_unique<LlamaModel>(file_->gguf(), *backend_);
  }

  // The logits after prompt + h, the whole sequence run alone in a fresh fp32 cache.
  std::vector<float> logits_alone(const History& h) {
    History all = prompt_;
    all.insert(all.end(), h.begin(), h.end());
    KvCache cache = model_->make_cache(64, {KvType::kF32});
    std::vector<float> logits(kModelVocab);
    model_->forward(all, cache, logits.data());
    return logits;
  }

  std::vector<BeamHypothesis> beams_on_model(const BeamOptions& o, int64_t* copied_rows = nullptr) {
    KvCache prompt_cache = model_->make_cache(64, {KvType::kF32});
    std::vector<float> logits(kModelVocab);
    model_->forward(prompt_, prompt_cache, logits.data());
    auto prompt = std::make_shared<const KvCache>(std::move(prompt_cache));
    BeamSequences beams(*model_, prompt, logits, 64, {KvType::kF32}, o);
    while (!beams.done()) {
      model_->forward_batch(beams.plan());
      beams.passed();
    }
    EXPECT_EQ(prompt->size(), static_cast<int>(prompt_.size())) << "the prompt's segment changed";
    if (copied_rows != nullptr) *copied_rows = beams.copied_rows();
    return beams.hypotheses();
  }

  History prompt_ = {1, 2, 0, 1, 1};
  std::unique_ptr<test::TinyLlama> file_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<LlamaModel> model_;
};

TEST_F(BeamModel, EveryBeamLiveFindsTheExhaustiveBest) {
  BeamOptions o;
  o.n_beams = kEveryBeam;
  o.length_penalty = 0.0f;
  o.max_tokens = kScriptLength;
  o.end_tokens = {kModelEnd};
  int64_t copied = 0;
  const std::vector<BeamHypothesis> got = beams_on_model(o, &copied);
  const LogitsOf alone = [this](const History& h) { return logits_alone(h); };
  const std::vector<BeamHypothesis> want = exhaustive(alone, kModelVocab, kModelEnd, kScriptLength, 0.0, kEveryBeam);
  expect_same_hypotheses(got, want, 1e-4);
  EXPECT_GT(copied, 0) << "no beam forked: the caches' copies went untested";
}

TEST_F(BeamModel, OneBeamIsGreedy) {
  BeamOptions o;
  o.n_beams = 1;
  o.max_tokens = 10;
  o.end_tokens = {kModelEnd};
  const std::vector<BeamHypothesis> got = beams_on_model(o);
  ASSERT_EQ(got.size(), 1u);
  const LogitsOf alone = [this](const History& h) { return logits_alone(h); };
  EXPECT_EQ(got[0].tokens, greedy(alone, kModelEnd, 10));
}

TEST_F(BeamModel, FourBeamsScoreTheirOwnSequences) {
  BeamOptions o;
  o.n_beams = 4;
  o.max_tokens = 6;
  o.end_tokens = {kModelEnd};
  const std::vector<BeamHypothesis> got = beams_on_model(o);
  ASSERT_EQ(got.size(), 4u);
  for (const BeamHypothesis& h : got) {  // each log-probability is its sequence's, run alone
    double lp = 0;
    for (size_t i = 0; i < h.tokens.size(); ++i) {
      lp += log_softmax_of(logits_alone(History(h.tokens.begin(), h.tokens.begin() + static_cast<std::ptrdiff_t>(i))),
                           h.tokens[i]);
    }
    EXPECT_NEAR(h.log_prob, lp, 1e-4);
  }
}

TEST(KvCacheCopy, RefusesAnotherShapeOrPrefix) {
  KvCache a(2, 16, 2, 32), b(2, 16, 2, 64), c(2, 16, 2, 32);
  EXPECT_THROW(a.copy_from(b), std::invalid_argument);
  auto prefix = std::make_shared<KvCache>(2, 16, 2, 32);
  prefix->append(3);
  c.attach_prefix(prefix);
  EXPECT_THROW(a.copy_from(c), std::invalid_argument);
}

// --- `ringlm run --beams` on the real model ------------------------------------------------------

test::CommandResult sh(const std::string& command) { return test::run_command(command, test::work_dir_for("beam_search"), 120); }

nlohmann::json stats_of(const std::string& err) {
  const size_t at = err.rfind("\n{");
  return nlohmann::json::parse(err.substr(at == std::string::npos ? 0 : at + 1));
}

std::string run_args(int n) {
  return std::string(" -t 1 --stats json -n ") + std::to_string(n) + " -m " + RINGLM_TEST_MODEL +
         " -p 'The three primary colors are'";
}

TEST(RunBeams, OneBeamPrintsTheGreedyText) {
  const int n = test::scaled(24, 8);
  const test::CommandResult greedy = sh(std::string(RINGLM_BINARY) + " run --temp 0" + run_args(n));
  const test::CommandResult beam = sh(std::string(RINGLM_BINARY) + " run --beams 1" + run_args(n));
  ASSERT_EQ(greedy.exit_code, 0) << greedy.err;
  ASSERT_EQ(beam.exit_code, 0) << beam.err;
  EXPECT_FALSE(beam.out.empty());
  EXPECT_EQ(beam.out, greedy.out);
  EXPECT_EQ(stats_of(beam.err)["beams"]["n"], 1);
}

TEST(RunBeams, FourBeamsScoreAtLeastGreedyAndFork) {
  // With a length penalty of 0 the score is the text's log-probability. Over two tokens four beams
  // weigh every continuation of the four most likely first tokens, greedy's path among them, so
  // their best can only match or beat it. (Over more tokens greedy's path may fall out of the
  // four and end up the better one: beam search is not exhaustive.)
  const test::CommandResult one = sh(std::string(RINGLM_BINARY) + " run --beams 1 --length-penalty 0 --ignore-eos" + run_args(2));
  const test::CommandResult four = sh(std::string(RINGLM_BINARY) + " run --beams 4 --length-penalty 0 --ignore-eos" + run_args(2));
  ASSERT_EQ(one.exit_code, 0) << one.err;
  ASSERT_EQ(four.exit_code, 0) << four.err;
  EXPECT_GE(stats_of(four.err)["beams"]["score"].get<double>(), stats_of(one.err)["beams"]["score"].get<double>() - 1e-4);
  // Longer: the search runs to the token limit, forking beams (their rows copied).
  const int n = test::scaled(16, 8);
  const test::CommandResult longer = sh(std::string(RINGLM_BINARY) + " run --beams 4 --length-penalty 0 --ignore-eos" + run_args(n));
  ASSERT_EQ(longer.exit_code, 0) << longer.err;
  const nlohmann::json s4 = stats_of(longer.err);
  EXPECT_EQ(s4["gen_tokens"], n);
  EXPECT_EQ(s4["stop_reason"], "limit");
  EXPECT_GT(s4["beams"]["copied_rows"].get<int>(), 0);
}

TEST(RunBeams, BadCombinationsAreClearErrors) {
  const std::string base = std::string(RINGLM_BINARY) + " run -n 4 -p hi -m " + RINGLM_TEST_MODEL;
  const test::CommandResult negative = sh(base + " --beams -1");
  EXPECT_TRUE(test::exited_with_error(negative));
  EXPECT_NE(negative.err.find("--beams"), std::string::npos) << negative.err;
  const test::CommandResult lookup = sh(base + " --beams 2 --lookup 4");
  EXPECT_TRUE(test::exited_with_error(lookup));
  EXPECT_NE(lookup.err.find("speculative"), std::string::npos) << lookup.err;
}

// `ringlm batch` lines with "beams": their rows share passes with sampled lines, and give what
// `run --beams` gives alone (a row's result does not depend on the pass's other rows).
TEST(BatchBeams, LinesWithBeamsGiveRunsTextsAndBadOnesAreErrorLines) {
  const int n = test::scaled(16, 8);
  const std::string dir = test::work_dir_for("beam_search");
  const std::string input = dir + "/beams.jsonl", output = dir + "/beams.out.jsonl";
  const std::string prompt = "The three primary colors are";
  {
    std::ofstream in(input);
    const std::string fields = "\"prompt\": \"" + prompt + "\", \"max_tokens\": " + std::to_string(n);
    in << "{\"id\": \"four\", " << fields << ", \"beams\": 4, \"n\": 2}\n"
       << "{\"id\": \"greedy\", " << fields << ", \"temperature\": 0}\n"
       << "{\"id\": \"one\", " << fields << ", \"beams\": 1}\n"
       << "{\"id\": \"more results than beams\", " << fields << ", \"beams\": 2, \"n\": 3}\n"
       << "{\"id\": \"more beams than slots\", " << fields << ", \"beams\": 9}\n";
  }
  std::filesystem::remove(output);
  const test::CommandResult r = sh(std::string(RINGLM_BINARY) + " batch --parallel 4 -t 1 -m " + RINGLM_TEST_MODEL +
                                   " -i " + input + " -o " + output);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::map<std::string, std::vector<nlohmann::json>> by_id;
  std::istringstream lines(test::slurp(output));
  for (std::string line; std::getline(lines, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    by_id[j["id"].get<std::string>()].push_back(j);
  }
  const test::CommandResult alone = sh(std::string(RINGLM_BINARY) + " run --beams 4" + run_args(n));
  ASSERT_EQ(alone.exit_code, 0) << alone.err;
  ASSERT_EQ(by_id["four"].size(), 2u);
  for (const nlohmann::json& j : by_id["four"]) {
    const bool best = j["sample"] == 0;
    EXPECT_EQ(j["text"] == alone.out, best) << j.dump();
  }
  ASSERT_EQ(by_id["greedy"].size(), 1u);
  ASSERT_EQ(by_id["one"].size(), 1u);
  EXPECT_EQ(by_id["one"][0]["text"], by_id["greedy"][0]["text"]);
  for (const char* bad : {"more results than beams", "more beams than slots"}) {
    ASSERT_EQ(by_id[bad].size(), 1u) << bad;
    EXPECT_TRUE(by_id[bad][0].contains("error")) << by_id[bad][0].dump();
  }
}

}  // namespace
}  // namespace ringlm
