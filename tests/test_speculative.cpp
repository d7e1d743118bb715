// Speculative decoding (core/speculative/): prompt lookup's drafts, the KV cache's rollback
// against a cache that never saw the rolled-back tokens, the checking pass whose rows are bit for
// bit the decode steps, the speculative sampling rule against the model's exact distribution,
// and `ringlm run --lookup` / `-md` against plain greedy decoding: the same text, through a
// StreamingLLM shift and on Gemma 3's window ring; a draft model of another vocabulary refused.
#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "core/model/loader.h"
#include "core/session/chat_session.h"
#include "core/session/chat_template.h"
#include "core/speculative/draft_length.h"
#include "core/speculative/draft_model.h"
#include "core/speculative/prompt_lookup.h"
#include "core/session/generation.h"
#include "core/session/sequence_model.h"
#include "tests/build_scale.h"
#include "tests/command_runner.h"

namespace ringlm {
namespace {

using Tokens = std::vector<int32_t>;

TEST(PromptLookup, TheLongestNgramsLatestContinuation) {
  const PromptLookup lookup(4, 3, 1);
  // "7 8 9" occurs twice before the end: the later occurrence's continuation wins.
  EXPECT_EQ(lookup.propose(Tokens{7, 8, 9, 1, 2, 7, 8, 9, 3, 4, 5, 6, 7, 8, 9}, 10), (Tokens{3, 4, 5, 6}));
  // Only "9" (one token) matches earlier: its continuation, cut to the limit.
  EXPECT_EQ(lookup.propose(Tokens{9, 5, 6, 7, 1, 9}, 2), (Tokens{5, 6}));
  // A match near the end gives what is left after it.
  EXPECT_EQ(lookup.propose(Tokens{1, 2, 3, 1, 2}, 10), (Tokens{3, 1, 2}));
  // No earlier occurrence, no room, or too short a history: no draft.
  EXPECT_TRUE(lookup.propose(Tokens{1, 2, 3, 4}, 10).empty());
  EXPECT_TRUE(lookup.propose(Tokens{1, 2, 1}, 0).empty());
  EXPECT_TRUE(lookup.propose(Tokens{1}, 10).empty());
  // n-grams shorter than min_ngram do not count.
  EXPECT_TRUE(PromptLookup(4, 3, 2).propose(Tokens{9, 5, 6, 7, 1, 9}, 10).empty());
  EXPECT_THROW(PromptLookup(0), std::invalid_argument);
  EXPECT_THROW(PromptLookup(4, 1, 2), std::invalid_argument);
}

// The draft length maximizes the expected tokens per unit of a pass's cost: for acceptance a and
// row cost c, the geometric sum's closed form (1 - a^(k+1)) / (1 - a) over 1 + c k.
int best_draft(double a, double row_cost) {
  int best = 1;
  double best_rate = 0.0;
  for (int k = 1; k <= 64; ++k) {
    const double tokens = a == 1.0 ? k + 1.0 : (1.0 - std::pow(a, k + 1)) / (1.0 - a);
    if (tokens / (1.0 + row_cost * k) > best_rate * (1.0 + 1e-12)) best_rate = tokens / (1.0 + row_cost * k), best = k;
  }
  return best;
}

TEST(DraftLength, MaximizesTheExpectedTokensPerCost) {
  for (double row_cost : {0.1, 0.25, 0.5}) {
    DraftLength length(PassCost::linear(row_cost));
    EXPECT_EQ(length.next_limit(), best_draft(length.acceptance(), row_cost)) << "row cost " << row_cost;
    // Drafts taken whole: the acceptance rises towards 1 and the drafts grow.
    int last = 0;
    for (int i = 0; i < 30; ++i) {
      const int k = length.next_limit();
      ASSERT_EQ(k, best_draft(length.acceptance(), row_cost)) << "row cost " << row_cost << " after " << i << " drafts";
      ASSERT_GE(k, last);
      last = k;
      length.record(k, k);
    }
    EXPECT_GT(length.acceptance(), 0.99);
    EXPECT_GE(last, 16);
    // Drafts rejected at their third token: the share of tried tokens accepted tends to 2/3.
    for (int i = 0; i < 60; ++i) length.record(8, 2);
    EXPECT_NEAR(length.acceptance(), 2.0 / 3.0, 1e-3);
    EXPECT_EQ(length.next_limit(), best_draft(length.acceptance(), row_cost));
  }
  EXPECT_LT(DraftLength(PassCost::linear(0.5)).next_limit(), DraftLength(PassCost::linear(0.1)).next_limit())
      << "dearer rows, shorter drafts";
}

// A measured cost curve (ringlm tune): passes that cost a step and a bit up to 4 rows, then
// jump (the products leave the 4-token tile), as on 2 AVX2 cores.
TEST(DraftLength, FollowsMeasuredPassCosts) {
  const std::vector<double> measured = {1.05, 1.1, 1.15, 1.6, 1.65, 1.7, 1.75, 1.8};
  const PassCost cost = PassCost::measured(measured);
  ASSERT_TRUE(cost.is_measured());
  EXPECT_FALSE(PassCost().is_measured());
  EXPECT_EQ(cost.of(0), 1.0);
  for (int k = 1; k <= 8; ++k) EXPECT_EQ(cost.of(k), measured[static_cast<size_t>(k - 1)]) << k;
  // Past the measurement, each row costs the measured average: (1.8 - 1) / 8 = 0.1.
  EXPECT_NEAR(cost.of(10), 2.0, 1e-12);
  // A noisy measurement that says a longer pass is cheaper is raised to the shorter one's cost.
  const PassCost noisy = PassCost::measured({1.2, 1.1, 1.3});
  EXPECT_EQ(noisy.of(2), 1.2);
  EXPECT_EQ(noisy.of(3), 1.3);

  // The length is the best rate over the curve, found here by brute force over the acceptance.
  const auto best = [&](double a) {
    int best_k = 1;
    double best_rate = 0, tokens = 1, power = 1;
    for (int k = 1; k <= 64; ++k) {
      power *= a;
      tokens += power;
      if (tokens / cost.of(k) > best_rate) best_rate = tokens / cost.of(k), best_k = k;
    }
    return best_k;
  };
  DraftLength length(cost);
  EXPECT_EQ(length.next_limit(), best(length.acceptance()));
  EXPECT_EQ(best(0.8), 3) << "at 0.8 the jump after 4 rows is not worth it";
  for (int i = 0; i < 30; ++i) length.record(3, 3);
  EXPECT_EQ(length.next_limit(), best(length.acceptance()));
  EXPECT_GT(length.next_limit(), 4) << "drafts taken whole: past the jump";
}

TEST(DraftLength, RejectedSingleTokensPauseDrafting) {
  DraftLength length;
  while (length.next_limit() > 1) length.record(4, 0);  // nothing accepted: down to one token
  length.record(1, 0);
  for (int i = 0; i < 8; ++i) ASSERT_EQ(length.next_limit(), 0) << "paused, token " << i;
  ASSERT_EQ(length.next_limit(), 1);
  length.record(1, 0);  // again: twice as long
  for (int i = 0; i < 16; ++i) ASSERT_EQ(length.next_limit(), 0) << "second pause, token " << i;
  ASSERT_GE(length.next_limit(), 1);
  length.record(1, 1);  // an accepted token: the next pause is short again
  while (length.next_limit() > 1) length.record(4, 0);
  length.record(1, 0);
  int paused = 0;
  while (length.next_limit() == 0) ++paused;
  EXPECT_EQ(paused, 8);
}

class SpeculativeModel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    omp_set_num_threads(1);
    loaded_ = new LoadedModel(load_model(RINGLM_TEST_MODEL, 1));
  }
  static void TearDownTestSuite() {
    delete loaded_;
    loaded_ = nullptr;
  }
  static LlamaModel& model() { return *loaded_->model; }
  static size_t vocab() { return static_cast<size_t>(model().hparams().n_vocab); }
  static Tokens prompt() { return loaded_->tokenizer->encode("The quick brown fox jumps over the lazy dog. Once", true, true); }
  static int32_t argmax(std::span<const float> x) { return static_cast<int32_t>(std::max_element(x.begin(), x.end()) - x.begin()); }

  // Greedy decoding one token at a time: the logits before each of `n` tokens.
  static std::vector<std::vector<float>> decode(int n, Tokens& taken) {
    KvCache cache = model().make_cache(256);
    std::vector<float> logits(vocab());
    model().forward(prompt(), cache, logits.data());
    std::vector<std::vector<float>> before;
    for (int i = 0; i < n; ++i) {
      before.push_back(logits);
      taken.push_back(argmax(logits));
      model().forward(std::span<const int32_t>(&taken.back(), 1), cache, logits.data());
    }
    return before;
  }

  // A cache holding the prompt, as a decode starts from it.
  static KvCache prompt_cache() {
    KvCache cache = model().make_cache(256);
    std::vector<float> logits(vocab());
    model().forward(prompt(), cache, logits.data());
    return cache;
  }

  static LoadedModel* loaded_;
};

LoadedModel* SpeculativeModel::loaded_ = nullptr;

// The checking pass of k + 1 tokens gives each row exactly the logits its decode step gives
// (the int8 path: a plain pass of several rows would round otherwise).
TEST_F(SpeculativeModel, CheckingRowsAreTheDecodeStepsBitForBit) {
  const int n = test::scaled(40, 16);
  Tokens taken;
  const auto before = decode(n, taken);
  KvCache cache = prompt_cache();
  const int k = 4;
  for (int i = 0; i + k + 1 < n; i += k + 1) {
    std::vector<float> rows((k + 1) * vocab());
    model().forward_steps(std::span<const int32_t>(taken).subspan(static_cast<size_t>(i), k + 1), cache, rows.data());
    for (int j = 0; j <= k; ++j) {
      const auto row = std::span<const float>(rows).subspan(static_cast<size_t>(j) * vocab(), vocab());
      EXPECT_TRUE(std::equal(row.begin(), row.end(), before[static_cast<size_t>(i + j + 1)].begin())) << "row " << i + j;
    }
  }
}

// A rejected draft rolled back leaves the cache as one that never saw it: the same slots and
// positions, and the same logits (bit for bit) for the tokens after.
TEST_F(SpeculativeModel, ARolledBackDraftLeavesNoTrace) {
  const int n = test::scaled(24, 10);
  Tokens taken;
  const auto before = decode(n, taken);

  KvCache cache = prompt_cache();
  // Each step checks the right token followed by three wrong ones, then rolls the wrong ones back.
  for (int i = 0; i + 1 < n; ++i) {
    const Tokens pass = {taken[static_cast<size_t>(i)], 11, 12, 13};
    std::vector<float> rows(pass.size() * vocab());
    model().forward_steps(pass, cache, rows.data());
    cache.rollback(3);
    const auto row = std::span<const float>(rows).subspan(0, vocab());
    ASSERT_TRUE(std::equal(row.begin(), row.end(), before[static_cast<size_t>(i + 1)].begin())) << "token " << i;
  }
  KvCache never = prompt_cache();
  std::vector<float> logits(vocab());
  model().forward(std::span<const int32_t>(taken).first(static_cast<size_t>(n - 1)), never, logits.data());
  EXPECT_EQ(cache.size(), never.size());
  EXPECT_EQ(cache.next_position(), never.next_position());
  const auto used = [](const KvCache& c) {
    std::vector<int64_t> p(c.positions().begin(), c.positions().end());
    while (!p.empty() && p.back() < 0) p.pop_back();
    return p;
  };
  EXPECT_EQ(used(cache), used(never));
  EXPECT_THROW(cache.rollback(cache.size() + 1), std::invalid_argument);
}

// A chat with --lookup: every reply, the tokens the session holds and its last logits are those
// of the same chat without, over turns that quote the conversation and a context that shifts.
TEST_F(SpeculativeModel, AChatWithLookupIsTheChatWithout) {
  const auto source = loaded_->gguf->get_string("tokenizer.chat_template");
  const ChatTemplate chat_template = ChatTemplate::detect(source.value_or("")).value_or(ChatTemplate::from_name("chatml"));
  PromptLookup lookup(6);
  const auto session = [&](Drafter* drafter) {
    ChatSessionOptions o;
    o.n_ctx = test::scaled(160, 80);
    o.cache.n_keep = 4;
    o.cache.context_shift = true;
    o.sampling.temperature = 0.0f;
    o.n_predict = test::scaled(40, 16);
    o.drafter = drafter;
    return ChatSession(model(), *loaded_->tokenizer, chat_template, o);
  };
  ChatSession plain = session(nullptr), spec = session(&lookup);
  int64_t accepted = 0;
  const std::vector<std::string> messages = {"Repeat after me: red, green, blue, red, green, blue, red, green.",
                                             "Say it again: red, green, blue, red, green, blue.", "And once more, please."};
  for (const std::string& message : std::span(messages).first(test::kSanitizedBuild ? 2 : 3)) {
    std::string plain_text, spec_text;
    plain.reply(message, [&](std::string_view t) { plain_text += t; });
    const ChatTurnStats stats = spec.reply(message, [&](std::string_view t) { spec_text += t; });
    EXPECT_EQ(spec_text, plain_text) << message;
    EXPECT_EQ(spec.context(), plain.context()) << message;
    EXPECT_TRUE(std::equal(spec.logits().begin(), spec.logits().end(), plain.logits().begin())) << message;
    accepted += stats.speculation.accepted;
  }
  EXPECT_GT(accepted, 0);
  EXPECT_GT(plain.cache().shifts(), 0);
}

// The speculative sampling rule on a tiny model, end to end: three tokens sampled at a
// temperature with drafts checked in one pass follow the model's exact distribution over the
// 27 sequences its top 3 allow, computed here from plain forward passes. The guesser knows the
// model's top 3 after each prefix and drafts two tokens from them, either certainly (the second
// most likely, q one-hot) or drawn from a distribution q unlike the model's, a token outside the
// top 3 included: accepted and rejected drafts, and rows after an accepted one, all occur.
// Then a draft model drafts, each token with the q it was drawn from: the model itself at
// another temperature.
std::string tiny(const std::string& name) { return std::string(RINGLM_TEST_WORK_DIR) + "/tiny_" + name + ".gguf"; }

class TopThreeOracle : public Drafter {
 public:
  using Tree = std::map<Tokens, std::vector<int32_t>>;  // generated prefix -> the model's top 3 after it
  TopThreeOracle(const Tree& tree, size_t prompt_size, bool certain, int32_t outsider)
      : tree_(tree), prompt_size_(prompt_size), certain_(certain), outsider_(outsider) {}

  Draft guess(std::span<const int32_t> history, int limit) override {
    Draft draft;
    Tokens prefix(history.begin() + static_cast<std::ptrdiff_t>(prompt_size_), history.end());
    while (static_cast<int>(draft.tokens.size()) < std::min(limit, 2) && tree_.count(prefix) != 0) {
      const std::vector<int32_t>& top = tree_.at(prefix);
      int32_t token = top[1];
      if (!certain_) {
        const std::vector<Sampler::Candidate> q = {{top[0], 0, 0.2f}, {top[1], 0, 0.5f}, {top[2], 0, 0.1f}, {outsider_, 0, 0.2f}};
        std::discrete_distribution<int> pick({0.2, 0.5, 0.1, 0.2});
        token = q[static_cast<size_t>(pick(rng_))].id;
        draft.q.push_back(q);
      }
      draft.tokens.push_back(token);
      prefix.push_back(token);
    }
    return draft;
  }

 private:
  const Tree& tree_;
  size_t prompt_size_;
  bool certain_;
  int32_t outsider_;
  std::mt19937_64 rng_{7};
};

TEST(SpeculativeSampling, FollowsTheModelsDistribution) {
  omp_set_num_threads(1);
  const LoadedModel m = load_model(tiny("q4_0"), 1);
  LlamaModel& model = *m.model;
  const auto vocab = static_cast<size_t>(model.hparams().n_vocab);
  const Tokens prompt = {1, 20, 21, 22, 20, 21};
  const float temperature = 1.5f;
  SamplingParams params;
  params.temperature = temperature;
  params.top_k = 3;
  params.top_p = 1.0f;
  params.min_p = 0.0f;
  params.seed = 5;

  // The exact distribution: the top 3 after each prefix, softmax(logit / T) over them.
  TopThreeOracle::Tree tree;
  std::map<Tokens, std::vector<double>> probs;
  const std::function<void(const Tokens&)> expand = [&](const Tokens& generated) {
    KvCache cache = model.make_cache(64);
    std::vector<float> logits(vocab);
    Tokens all = prompt;
    all.insert(all.end(), generated.begin(), generated.end());
    model.forward(all, cache, logits.data());
    std::vector<int32_t> ids(vocab);
    std::iota(ids.begin(), ids.end(), 0);
    std::partial_sort(ids.begin(), ids.begin() + 3, ids.end(), [&](int32_t a, int32_t b) {
      return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)];
    });
    ids.resize(3);
    std::vector<double> p;
    double z = 0;
    for (int32_t id : ids) z += std::exp((logits[static_cast<size_t>(id)] - logits[static_cast<size_t>(ids[0])]) / temperature);
    for (int32_t id : ids) p.push_back(std::exp((logits[static_cast<size_t>(id)] - logits[static_cast<size_t>(ids[0])]) / temperature) / z);
    tree[generated] = ids;
    probs[generated] = p;
    if (generated.size() < 2) {
      for (int32_t id : ids) {
        Tokens next = generated;
        next.push_back(id);
        expand(next);
      }
    }
  };
  expand({});
  std::map<Tokens, double> exact;
  for (const auto& [prefix, top] : tree) {
    if (prefix.size() != 2) continue;
    for (size_t i = 0; i < 3; ++i) {
      const double p = probs.at({}).at(static_cast<size_t>(std::find(tree.at({}).begin(), tree.at({}).end(), prefix[0]) - tree.at({}).begin())) *
                       probs.at({prefix[0]}).at(static_cast<size_t>(std::find(tree.at({prefix[0]}).begin(), tree.at({prefix[0]}).end(), prefix[1]) - tree.at({prefix[0]}).begin())) *
                       probs.at(prefix)[i];
      exact[{prefix[0], prefix[1], top[i]}] = p;
    }
  }
  ASSERT_EQ(exact.size(), 27u);
  int32_t outsider = 0;
  while (std::find(tree.at({}).begin(), tree.at({}).end(), outsider) != tree.at({}).end()) ++outsider;

  const int n = test::scaled(800, 100);
  // The draft model: the model itself at another temperature, so that q and p differ but overlap.
  SamplingParams draft_params = params;
  draft_params.temperature = 0.6f;
  for (const std::string guesser : {"certain guesses", "guesses drawn from q", "a draft model's"}) {
    SCOPED_TRACE(guesser);
    std::unique_ptr<Drafter> drafter;
    if (guesser == "a draft model's") {
      drafter = std::make_unique<DraftModel>(model, 64, KvCacheOptions{}, draft_params,
                                             DraftModelOptions{.max_draft = 2, .min_draft = 0, .p_min = 0.0f});
    } else {
      drafter = std::make_unique<TopThreeOracle>(tree, prompt.size(), guesser == "certain guesses", outsider);
    }
    Sampler sampler(params, static_cast<int>(vocab));
    SequenceModel sequence(model, model.make_cache(64), /*top_k=*/0, drafter.get());
    SpeculationStats stats;
    GenerateOptions options;
    options.speculation = &stats;
    std::map<Tokens, int> counts;
    sequence.prefill(prompt);
    const std::vector<float> prompt_logits(sequence.logits().begin(), sequence.logits().end());
    for (int t = 0; t < n; ++t) {
      sequence.rollback(sequence.cache().size() - static_cast<int>(prompt.size()));  // back to the prompt alone
      std::ranges::copy(prompt_logits, sequence.scores().logits.begin());
      StopConditions stop;
      stop.max_tokens = 3;
      stop.ignore_eos = true;
      Generation g(*m.tokenizer, sampler, stop, prompt);
      generate(g, sequence, options);
      ASSERT_EQ(g.n_tokens(), 3);
      ++counts[Tokens(g.history().end() - 3, g.history().end())];
    }
    // Pearson's chi-square over the 27 sequences (a sequence outside them counts against it in
    // full), against its 1e-4 quantile for 26 degrees of freedom (Wilson-Hilferty).
    double chi2 = 0;
    for (const auto& [sequence_tokens, p] : exact) {
      const double expected = p * n, got = counts.count(sequence_tokens) ? counts.at(sequence_tokens) : 0;
      chi2 += (got - expected) * (got - expected) / expected;
    }
    for (const auto& [sequence_tokens, c] : counts) {
      EXPECT_EQ(exact.count(sequence_tokens), 1u) << "a sequence outside the top 3";
    }
    const double k = 26, z = 3.719;
    const double quantile = k * std::pow(1 - 2 / (9 * k) + z * std::sqrt(2 / (9 * k)), 3);
    EXPECT_LT(chi2, quantile);
    EXPECT_GT(stats.accepted, n / 10);
    EXPECT_LT(stats.accepted, stats.drafted);
  }
}

// `ringlm run --lookup` against plain greedy decoding: the same bytes, with drafts accepted.

test::CommandResult sh(const std::string& command) { return test::run_command(command, test::work_dir_for("speculative"), 120); }

nlohmann::json stats_of(const std::string& err) {
  const size_t at = err.rfind("\n{");
  return nlohmann::json::parse(err.substr(at == std::string::npos ? 0 : at + 1));
}

// The stats of the plain run.
nlohmann::json speculation_;  // the speculative run's counts, from the last expect_same_text

nlohmann::json expect_same_text(const std::string& args, const std::string& guesser = "--lookup 6") {
  SCOPED_TRACE(args + " " + guesser);
  const test::CommandResult plain = sh(std::string(RINGLM_BINARY) + " run --temp 0 --stats json " + args);
  EXPECT_EQ(plain.exit_code, 0) << plain.err;
  const test::CommandResult spec = sh(std::string(RINGLM_BINARY) + " run --temp 0 --stats json " + guesser + " " + args);
  EXPECT_EQ(spec.exit_code, 0) << spec.err;
  if (plain.exit_code != 0 || spec.exit_code != 0) return {};
  EXPECT_EQ(spec.out, plain.out);
  const nlohmann::json s = stats_of(spec.err), p = stats_of(plain.err);
  EXPECT_GT(s.at("speculative").at("accepted").get<int>(), 0) << spec.err;
  EXPECT_EQ(s.at("gen_tokens"), p.at("gen_tokens"));
  speculation_ = s.at("speculative");
  return p;
}

const std::string kCopyPrompt =
    "'Copy the list: apples, pears, plums, cherries, grapes, melons, lemons, limes. Copy: apples, pears,'";

TEST(SpeculativeCli, GreedyTextIsPlainDecodings) {
  if (test::kSanitizedBuild) GTEST_SKIP() << "the sanitizer build runs the same model and prompt through shifts (below)";
  expect_same_text("-m " + std::string(RINGLM_TEST_MODEL) + " -t 1 -n " + std::to_string(test::scaled(48, 16)) + " -p " + kCopyPrompt);
}

// A context that shifts (StreamingLLM, 4 sinks) several times while drafts are checked.
TEST(SpeculativeCli, GreedyTextIsPlainDecodingsThroughContextShifts) {
  const std::string n = std::to_string(test::scaled(64, 20));
  const nlohmann::json plain =
      expect_same_text("-c 40 --keep 4 --ignore-eos -t 1 -n " + n + " -m " + std::string(RINGLM_TEST_MODEL) + " -p " + kCopyPrompt);
  ASSERT_FALSE(plain.is_null());
  EXPECT_GT(plain.at("n_shifts").get<int>(), 0);
}

// Gemma 3's sliding-window layers keep a ring of their window: a rollback gives slots back there.
TEST(SpeculativeCli, GreedyTextIsPlainDecodingsOnAWindowRing) {
  expect_same_text("-m " + tiny("gemma3_q8_0") + " -t 1 -c 40 --ignore-eos -n 60 -p 'one two three one two three one two'");
}

// The real Gemma 3 270M (Q4_K_M: K-quant products, sliding-window and global layers) through a
// context shift.
TEST(SpeculativeCli, GreedyTextIsPlainDecodingsOnGemma3) {
  if (test::kSanitizedBuild) GTEST_SKIP() << "the sanitizer build runs the tiny Gemma 3's window ring (above)";
  const std::string n = std::to_string(test::scaled(40, 16));
  const nlohmann::json plain = expect_same_text("-c 40 --keep 4 --ignore-eos -t 1 -n " + n + " -m " +
                                                std::string(RINGLM_GEMMA3_MODEL) + " -p " + kCopyPrompt);
  ASSERT_FALSE(plain.is_null());
  EXPECT_GT(plain.at("n_shifts").get<int>(), 0);
}

// A draft model through context shifts: the real model drafting for itself requantized to Q8_0,
// whose drafts are mostly accepted but not always.
TEST(SpeculativeCli, DraftModelGreedyTextIsPlainDecodingsThroughContextShifts) {
  if (test::kSanitizedBuild) {
    GTEST_SKIP() << "the sanitizer build runs a draft model through shifts on the tiny Gemma 3 (below), and its "
                    "rejected drafts in SpeculativeSampling";
  }
  const std::string q8 = test::work_dir_for("speculative") + "/smollm2-q8_0.gguf";
  const test::CommandResult quantized =
      sh(std::string(RINGLM_BINARY) + " quantize " + std::string(RINGLM_TEST_MODEL) + " " + q8 + " --type Q8_0");
  ASSERT_EQ(quantized.exit_code, 0) << quantized.err;
  const std::string n = std::to_string(test::scaled(64, 32));
  const nlohmann::json plain = expect_same_text(
      "-c 32 --keep 4 --ignore-eos -t 1 -n " + n + " -m " + std::string(RINGLM_TEST_MODEL) + " -p 'Write a poem about the sea.'",
      "-md " + q8 + " --draft-p-min 0 --draft-max 8");
  ASSERT_FALSE(plain.is_null());
  EXPECT_GT(plain.at("n_shifts").get<int>(), 0);
  if (!test::kSanitizedBuild) {
    EXPECT_LT(speculation_.at("accepted").get<int>(), speculation_.at("drafted").get<int>()) << "no draft was rejected";
  }
}

// Gemma 3's window ring, for the target and for its draft model (itself: every draft accepted),
// through context shifts.
TEST(SpeculativeCli, DraftModelGreedyTextIsPlainDecodingsOnAWindowRing) {
  const nlohmann::json plain =
      expect_same_text("-m " + tiny("gemma3_q8_0") + " -t 1 -c 40 --ignore-eos -n 60 -p 'one two three one two three one two'",
                       "-md " + tiny("gemma3_q8_0") + " --draft-p-min 0");
  ASSERT_FALSE(plain.is_null());
  EXPECT_GT(plain.at("n_shifts").get<int>(), 0);  // the draft model's cache shifts with the target's
  EXPECT_EQ(speculation_.at("accepted"), speculation_.at("drafted"));
}

// A draft model of another vocabulary is refused at load, naming the first token that differs.
TEST(SpeculativeCli, ADraftModelOfAnotherVocabularyIsRefused) {
  const test::CommandResult r = sh(std::string(RINGLM_BINARY) + " run -md " + tiny("q8_0") + " -n 4 -p hi -m " +
                                   std::string(RINGLM_TEST_MODEL));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("vocabulary differs from the target's at token 1:"), std::string::npos) << r.err;
  const test::CommandResult sizes = sh(std::string(RINGLM_BINARY) + " run -md " + tiny("q4_0") + " -n 4 -p hi -m " + tiny("q8_0"));
  EXPECT_NE(sizes.exit_code, 0);
  EXPECT_NE(sizes.err.find("the draft model's vocabulary has 32000 tokens and the target's 49152"), std::string::npos)
      << sizes.err;
  const test::CommandResult both = sh(std::string(RINGLM_BINARY) + " run --lookup 4 -md " + tiny("q8_0") + " -n 4 -p hi -m " + tiny("q8_0"));
  EXPECT_NE(both.exit_code, 0);
  EXPECT_NE(both.err.find("excludes"), std::string::npos) << both.err;
}

// With `ringlm tune`'s checking passes for the model in the tuning table, the drafts' lengths
// follow them: passes that cost a step and a bit give long drafts, passes that cost about a step
// per drafted token (and more from two on) drafts of one token; the text stays the same.
TEST(SpeculativeCli, DraftLengthsFollowTheTunedPasses) {
  const std::string model = RINGLM_TEST_MODEL;
  const std::string dir = test::work_dir_for("speculative");
  const auto table = [&](const std::string& name, const std::string& cost) {
    const std::string path = dir + "/" + name + ".json";
    std::ofstream(path) << R"({"ringlm_tuning": 1, "entries": [], "checking_passes": [{"model": ")"
                        << std::filesystem::path(model).filename().string() << R"(", "bytes": )"
                        << std::filesystem::file_size(model) << R"(, "threads": 1, "cost": )" << cost << "}]}";
    return path;
  };
  const std::string cheap = table("cheap_passes", "[1.01, 1.02, 1.03, 1.04, 1.05, 1.06, 1.07, 1.08]");
  const std::string dear = table("dear_passes", "[1.9, 3, 4, 5, 6, 7, 8, 9]");
  const auto run = [&](const std::string& tuning) {
    return sh("env RINGLM_TUNING=" + tuning + " " + RINGLM_BINARY + " run --temp 0 --lookup 8 --stats json -t 1 -n " +
              std::to_string(test::scaled(48, 16)) + " -m " + model + " -p " + kCopyPrompt);
  };
  const test::CommandResult long_drafts = run(cheap), short_drafts = run(dear), estimated = run("off");
  ASSERT_EQ(long_drafts.exit_code, 0) << long_drafts.err;
  ASSERT_EQ(short_drafts.exit_code, 0) << short_drafts.err;
  ASSERT_EQ(estimated.exit_code, 0) << estimated.err;
  EXPECT_EQ(long_drafts.out, short_drafts.out);
  EXPECT_EQ(long_drafts.out, estimated.out);
  const nlohmann::json l = stats_of(long_drafts.err).at("speculative"), s = stats_of(short_drafts.err).at("speculative");
  EXPECT_EQ(l.at("pass_cost"), "tuned");
  EXPECT_EQ(s.at("pass_cost"), "tuned");
  EXPECT_EQ(stats_of(estimated.err).at("speculative").at("pass_cost"), "estimated");
  EXPECT_EQ(s.at("drafted"), s.at("passes")) << "one token a draft: " << s;
  EXPECT_GT(l.at("drafted").get<int>(), 2 * l.at("passes").get<int>()) << l;
  EXPECT_GT(l.at("accepted").get<int>(), s.at("accepted").get<int>()) << l << s;
}

// `ringlm run --lookup` at a temperature: the speculative sampling rule, with drafts accepted.
TEST(SpeculativeCli, LookupSamplesAtATemperature) {
  const test::CommandResult r = sh(std::string(RINGLM_BINARY) + " run --lookup 4 --temp 0.7 --seed 3 --stats json -n " + std::to_string(test::scaled(40, 12)) + " "
                                   "--ignore-eos -t 1 -m " + std::string(RINGLM_TEST_MODEL) + " -p " + kCopyPrompt);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json s = stats_of(r.err);
  EXPECT_EQ(s.at("gen_tokens").get<int>(), test::scaled(40, 12));
  EXPECT_GT(s.at("speculative").at("accepted").get<int>(), 0) << r.err;
}

}  // namespace
}  // namespace ringlm
