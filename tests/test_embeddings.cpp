// Embeddings: a sequence's final hidden states (after the output norm) pooled into one vector,
// without the vocabulary projection (SequenceTokens::pooling), and the scheduler's embedding
// requests. What is checked against what:
//  - the oracle is linearity: the output projection is a matrix W (output.weight, read from the
//    file here in double), so W · (the mean of the normed rows) is the mean of the rows' logits,
//    W · (the first row) row 0's logits and W · (the last row) the last row's. The logits come
//    from the plain all-logits pass, which the numpy reference checks (reference.tiny_*); W has
//    far more rows (49152) than columns (64), so only the right vector can project to them. The
//    model runs on the fp32 path: the identity then holds to float rounding;
//  - a prompt pooled in chunks (as the scheduler prefills it, and forward() past max_batch)
//    gives the vector of the same rows pooled in one pass, and the identity above across chunks;
//  - a sequence pooled beside others in one pass gets, bit for bit, what it gets alone;
//  - the pooling type is read from <arch>.pooling_type; rank and none are refused, as is a bad
//    value in the file;
//  - the scheduler's embedding requests give those vectors normalised, several in one pass and
//    beside a generating request whose text they do not change; the serving engine's streams
//    hand each input's vector back under its position.
#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "core/model/loader.h"
#include "core/scheduler/batch_scheduler.h"
#include "core/scheduler/serving_engine.h"
#include "tests/tiny_llama.h"

namespace ringlm {
namespace {

using namespace std::chrono_literals;

// F32 weights with a separate output.weight (make_tiny_gguf.py, the generated_models fixture).
const std::string kTinyModel = std::string(RINGLM_TEST_WORK_DIR) + "/tiny_f32_untied.gguf";

class Embeddings : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    omp_set_num_threads(1);
    loaded_ = new LoadedModel(load_model(kTinyModel, 1, ComputeType::kFp32));
    read_output_weight();
  }
  static void TearDownTestSuite() {
    delete loaded_;
    loaded_ = nullptr;
  }
  static LlamaModel& model() { return *loaded_->model; }
  static size_t n_embd() { return static_cast<size_t>(model().hparams().n_embd); }
  static size_t n_vocab() { return static_cast<size_t>(model().hparams().n_vocab); }

  // A prompt of n tokens: ids spread over the vocabulary, none repeated next to another.
  static std::vector<int32_t> prompt(size_t n, int32_t seed = 1) {
    std::vector<int32_t> ids(n);
    for (size_t i = 0; i < n; ++i) ids[i] = static_cast<int32_t>((seed * 7919 + i * 104729) % n_vocab());
    return ids;
  }

  // The file's own output.weight, [n_vocab][n_embd], opened apart from the model.
  static void read_output_weight() {
    const auto file = GgufFile::open(kTinyModel);
    const GgufTensorInfo* w = file->find_tensor("output.weight");
    ASSERT_NE(w, nullptr);
    ASSERT_EQ(w->type, TensorType::F32);
    ASSERT_EQ(static_cast<size_t>(w->n_elements()), n_vocab() * n_embd());
    output_weight_.resize(n_vocab() * n_embd());
    std::memcpy(output_weight_.data(), w->data, output_weight_.size() * sizeof(float));
  }

  // W · v, in double.
  static std::vector<double> project(const std::vector<float>& v) {
    std::vector<double> logits(n_vocab());
    for (size_t t = 0; t < n_vocab(); ++t) {
      double sum = 0;
      for (size_t j = 0; j < n_embd(); ++j) sum += static_cast<double>(output_weight_[t * n_embd() + j]) * v[j];
      logits[t] = sum;
    }
    return logits;
  }

  // Every row's logits of `tokens` on a fresh cache, and the chosen pooling of them in the same
  // pass (the pass asked for both).
  struct RowsAndPooled {
    std::vector<float> logits;  // [tokens][n_vocab]
    std::vector<float> pooled;  // [n_embd]
  };
  static RowsAndPooled run_both(const std::vector<int32_t>& tokens, Pooling pooling) {
    RowsAndPooled out{std::vector<float>(tokens.size() * n_vocab()), std::vector<float>(n_embd())};
    KvCache cache = model().make_cache(256);
    SequenceTokens s(tokens, &cache, out.logits.data());
    s.all_logits = true;
    s.pooling = pooling;
    s.embedding = out.pooled.data();
    model().forward(s);
    return out;
  }

  static std::vector<float> pooled_alone(const std::vector<int32_t>& tokens, Pooling pooling, int n_ctx = 256) {
    std::vector<float> v(n_embd());
    KvCache cache = model().make_cache(n_ctx);
    SequenceTokens s(tokens, &cache);
    s.pooling = pooling;
    s.embedding = v.data();
    model().forward(s);
    return v;
  }

  // The same, its passes `chunk` tokens long (as the scheduler prefills a prompt).
  static std::vector<float> pooled_in_chunks(const std::vector<int32_t>& tokens, Pooling pooling, size_t chunk,
                                             int n_ctx = 256) {
    std::vector<float> v(n_embd());
    KvCache cache = model().make_cache(n_ctx);
    for (size_t start = 0; start < tokens.size(); start += chunk) {
      SequenceTokens s(std::span<const int32_t>(tokens).subspan(start, std::min(chunk, tokens.size() - start)), &cache);
      s.pooling = pooling;
      s.embedding = v.data();
      s.pooled_before = static_cast<int64_t>(start);
      model().forward_batch(std::span(&s, 1));
    }
    return v;
  }

  // The mean of rows [first, first + n) of [rows][n_vocab] logits.
  static std::vector<double> mean_rows(const std::vector<float>& logits, size_t first, size_t n) {
    std::vector<double> mean(n_vocab(), 0.0);
    for (size_t r = first; r < first + n; ++r) {
      for (size_t t = 0; t < n_vocab(); ++t) mean[t] += logits[r * n_vocab() + t];
    }
    for (double& m : mean) m /= static_cast<double>(n);
    return mean;
  }

  // max |a - b| over the vocabulary, as a fraction of b's range.
  static double distance(const std::vector<double>& a, const std::vector<double>& b) {
    const auto [lo, hi] = std::minmax_element(b.begin(), b.end());
    double worst = 0;
    for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]));
    return worst / (*hi - *lo);
  }

  static LoadedModel* loaded_;
  static std::vector<float> output_weight_;
};

LoadedModel* Embeddings::loaded_ = nullptr;
std::vector<float> Embeddings::output_weight_;

std::vector<double> row_of(const std::vector<float>& logits, size_t row, size_t n_vocab) {
  return {logits.begin() + static_cast<std::ptrdiff_t>(row * n_vocab),
          logits.begin() + static_cast<std::ptrdiff_t>((row + 1) * n_vocab)};
}

double max_abs_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(static_cast<double>(a[i]) - b[i]));
  return worst;
}

double norm(const std::vector<float>& v) {
  double sum = 0;
  for (const float x : v) sum += static_cast<double>(x) * x;
  return std::sqrt(sum);
}

std::vector<float> normalized(std::vector<float> v) {
  const double n = norm(v);
  for (float& x : v) x = static_cast<float>(x / n);
  return v;
}

// Float rounding of a 64-long dot product and of a norm computed two ways (fused into the
// projection's input, or apart), over logits of a range of about 10: measured 2e-7 at most.
constexpr double kIdentityTolerance = 1e-5;

TEST_F(Embeddings, EachPoolingProjectsToThatPoolingOfTheRowsLogits) {
  const std::vector<int32_t> tokens = prompt(23);
  const size_t last = tokens.size() - 1;
  const RowsAndPooled mean = run_both(tokens, Pooling::kMean);
  EXPECT_LT(distance(project(mean.pooled), mean_rows(mean.logits, 0, tokens.size())), kIdentityTolerance);
  const RowsAndPooled cls = run_both(tokens, Pooling::kCls);
  EXPECT_LT(distance(project(cls.pooled), row_of(cls.logits, 0, n_vocab())), kIdentityTolerance);
  const RowsAndPooled final_row = run_both(tokens, Pooling::kLast);
  EXPECT_LT(distance(project(final_row.pooled), row_of(final_row.logits, last, n_vocab())), kIdentityTolerance);
  // The oracle tells the poolings apart (and so would tell a wrong row from the right one).
  EXPECT_GT(distance(project(cls.pooled), row_of(cls.logits, last, n_vocab())), 100 * kIdentityTolerance);
  EXPECT_GT(distance(project(mean.pooled), row_of(mean.logits, last, n_vocab())), 100 * kIdentityTolerance);
  // The same vectors without any logits asked for: the pooled output alone.
  EXPECT_EQ(pooled_alone(tokens, Pooling::kMean), mean.pooled);
  EXPECT_EQ(pooled_alone(tokens, Pooling::kLast), final_row.pooled);
}

// Chunks of 9, 9 and 5 tokens, each pass also giving its rows' logits: the mean folded over the
// chunks still projects to the mean of every row's logits, and equals one pass's mean.
TEST_F(Embeddings, MeanFoldsAcrossChunks) {
  const std::vector<int32_t> tokens = prompt(23, 5);
  std::vector<float> logits(tokens.size() * n_vocab()), pooled(n_embd());
  KvCache cache = model().make_cache(256);
  for (size_t start = 0; start < tokens.size(); start += 9) {
    const size_t n = std::min<size_t>(9, tokens.size() - start);
    SequenceTokens chunk(std::span<const int32_t>(tokens).subspan(start, n), &cache, logits.data() + start * n_vocab());
    chunk.all_logits = true;
    chunk.pooling = Pooling::kMean;
    chunk.embedding = pooled.data();
    chunk.pooled_before = static_cast<int64_t>(start);
    model().forward_batch(std::span(&chunk, 1));
  }
  EXPECT_LT(distance(project(pooled), mean_rows(logits, 0, tokens.size())), kIdentityTolerance);
  EXPECT_LT(max_abs_difference(pooled, pooled_alone(tokens, Pooling::kMean)), 1e-5);
}

// A prompt longer than one pass (max_batch): forward() pools it in two chunks.
TEST_F(Embeddings, APromptLongerThanAPassIsPooledWhole) {
  const size_t n = static_cast<size_t>(model().max_batch()) + 77;
  const std::vector<int32_t> tokens = prompt(n, 3);
  const std::vector<float> whole = pooled_alone(tokens, Pooling::kMean, static_cast<int>(n));
  // The same rows in passes of 100 tokens.
  EXPECT_LT(max_abs_difference(whole, pooled_in_chunks(tokens, Pooling::kMean, 100, static_cast<int>(n))), 1e-5);
  // ... and not merely its last pass's mean, nor its first's.
  const std::vector<int32_t> tail(tokens.end() - 77, tokens.end());
  EXPECT_GT(max_abs_difference(whole, pooled_alone(tail, Pooling::kMean)), 1e-3);
  // cls keeps the first chunk's first row: the first token's state, which sees only itself.
  const std::vector<float> cls_whole = pooled_alone(tokens, Pooling::kCls, static_cast<int>(n));
  EXPECT_LT(max_abs_difference(cls_whole, pooled_alone({tokens[0]}, Pooling::kLast)), 1e-5);
}

// Three pooled sequences and one that wants its logits, in one pass: each gets what it gets alone,
// bit for bit, on the int8 path (whose kernels give a row the same sums whatever the other rows:
// what makes continuous batching exact; the fp32 path's products change with the row count).
TEST_F(Embeddings, PooledBesideOthersEqualsAlone) {
  LoadedModel int8 = load_model(kTinyModel, 1, ComputeType::kInt8);
  LlamaModel& model = *int8.model;
  const auto pooled_alone = [&](const std::vector<int32_t>& tokens, Pooling pooling) {
    std::vector<float> v(n_embd());
    KvCache cache = model.make_cache(64);
    SequenceTokens s(tokens, &cache);
    s.pooling = pooling;
    s.embedding = v.data();
    model.forward(s);
    return v;
  };
  const std::vector<int32_t> a = prompt(11, 2), b = prompt(17, 3), c = prompt(5, 4), d = prompt(8, 6);
  std::vector<float> va(n_embd()), vb(n_embd()), vc(n_embd()), logits(n_vocab());
  KvCache ca = model.make_cache(64), cb = model.make_cache(64), cc = model.make_cache(64), cd = model.make_cache(64);
  std::vector<SequenceTokens> batch = {{a, &ca}, {d, &cd, logits.data()}, {b, &cb}, {c, &cc}};
  batch[0].pooling = Pooling::kMean;
  batch[0].embedding = va.data();
  batch[2].pooling = Pooling::kLast;
  batch[2].embedding = vb.data();
  batch[3].pooling = Pooling::kCls;
  batch[3].embedding = vc.data();
  model.forward_batch(batch);
  EXPECT_EQ(va, pooled_alone(a, Pooling::kMean));
  EXPECT_EQ(vb, pooled_alone(b, Pooling::kLast));
  EXPECT_EQ(vc, pooled_alone(c, Pooling::kCls));
  std::vector<float> alone(n_vocab());
  KvCache fresh = model.make_cache(64);
  model.forward(d, fresh, alone.data());
  EXPECT_EQ(logits, alone);
}

TEST_F(Embeddings, RankNoneAndAMissingBufferAreRefused) {
  const std::vector<int32_t> tokens = prompt(4);
  std::vector<float> v(n_embd());
  KvCache cache = model().make_cache(64);
  SequenceTokens s(tokens, &cache);
  s.pooling = Pooling::kRank;
  s.embedding = v.data();
  try {
    model().forward(s);
    FAIL() << "rank pooling ran";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("rank"), std::string::npos) << e.what();
  }
  EXPECT_THROW(model().forward_batch(std::span(&s, 1)), std::invalid_argument);
  s.pooling = Pooling::kMean;
  s.embedding = nullptr;
  EXPECT_THROW(model().forward(s), std::invalid_argument);
  EXPECT_EQ(cache.size(), 0) << "a refused pass must not touch the cache";
}

// --- The pooling type in the file ------------------------------------------------------------

LlamaHparams hparams_with(std::optional<uint32_t> pooling_type) {
  test::LlamaSpec spec;
  if (pooling_type) spec.extra_uints["llama.pooling_type"] = *pooling_type;
  const test::TinyLlama file(spec);
  return LlamaHparams::from_gguf(file.gguf());
}

TEST(EmbeddingPooling, TheFilesPoolingTypeElseMeanForAGenerativeModel) {
  const LlamaHparams none_given = hparams_with(std::nullopt);
  EXPECT_EQ(none_given.pooling, Pooling::kMean);
  EXPECT_FALSE(none_given.pooling_from_file);
  for (const auto& [value, pooling] : std::map<uint32_t, Pooling>{
           {0, Pooling::kNone}, {1, Pooling::kMean}, {2, Pooling::kCls}, {3, Pooling::kLast}, {4, Pooling::kRank}}) {
    const LlamaHparams hp = hparams_with(value);
    EXPECT_EQ(hp.pooling, pooling) << value;
    EXPECT_TRUE(hp.pooling_from_file);
  }
  EXPECT_STREQ(pooling_name(hparams_with(2).pooling), "cls");
  try {
    hparams_with(9);
    FAIL() << "pooling_type 9 was accepted";
  } catch (const GgufError& e) {
    EXPECT_NE(std::string(e.what()).find("llama.pooling_type"), std::string::npos) << e.what();
  }
}

// --- The scheduler and the serving engine ------------------------------------------------------

class EmbeddingRequests : public Embeddings {
 protected:
  static BatchOptions options() {
    BatchOptions o;
    o.n_parallel = 4;
    o.n_ctx = 64;
    o.prefill_chunk = 16;
    return o;
  }
  static GenerationRequest embedding_request(size_t index, std::vector<int32_t> tokens, Pooling pooling) {
    GenerationRequest r;
    r.index = index;
    r.prompt = std::move(tokens);
    r.pooling = pooling;
    return r;
  }
  static GenerationRequest greedy_request(size_t index) {
    GenerationRequest r;
    r.index = index;
    r.prompt = prompt(12, 9);
    r.sampling.temperature = 0.0f;
    r.max_tokens = 6;
    return r;
  }
  static std::map<size_t, GenerationResult> run(BatchScheduler& scheduler) {
    std::map<size_t, GenerationResult> results;
    while (scheduler.step([&](GenerationResult r) { results[r.index] = std::move(r); })) {
    }
    return results;
  }
};

TEST_F(EmbeddingRequests, ShortInputsGoThroughOnePassAsTheirNormalisedVectors) {
  const std::vector<int32_t> a = prompt(5, 1), b = prompt(6, 2), c = prompt(4, 3);
  BatchScheduler scheduler(model(), *loaded_->tokenizer, options());
  scheduler.submit(embedding_request(0, a, Pooling::kMean));
  scheduler.submit(embedding_request(1, b, Pooling::kCls));
  scheduler.submit(embedding_request(2, c, Pooling::kLast));
  const std::map<size_t, GenerationResult> results = run(scheduler);
  EXPECT_EQ(scheduler.steps(), 1) << "15 prompt tokens fit one pass of 16";
  ASSERT_EQ(results.size(), 3u);
  // (The same rows in the same passes as alone: only the normalisation's rounding may differ.)
  EXPECT_LT(max_abs_difference(results.at(0).embedding, normalized(pooled_alone(a, Pooling::kMean))), 1e-6);
  EXPECT_LT(max_abs_difference(results.at(1).embedding, normalized(pooled_alone(b, Pooling::kCls))), 1e-6);
  EXPECT_LT(max_abs_difference(results.at(2).embedding, normalized(pooled_alone(c, Pooling::kLast))), 1e-6);
  for (const auto& [index, r] : results) {
    EXPECT_NEAR(norm(r.embedding), 1.0, 1e-6);
    EXPECT_EQ(r.n_tokens, 0);
    EXPECT_EQ(r.prompt_tokens, static_cast<int>(r.index == 0 ? a.size() : r.index == 1 ? b.size() : c.size()));
  }
  EXPECT_TRUE(scheduler.idle());
  EXPECT_EQ(scheduler.kv_bytes_in_use(), 0u) << "an embedding keeps no cache";
}

// A 40-token input prefilled in chunks of 16 beside a generating request: the same vector as one
// pass, and the generated text that request gets alone.
TEST_F(EmbeddingRequests, ALongInputBesideGenerationChangesNeither) {
  const std::vector<int32_t> long_input = prompt(40, 7);
  BatchScheduler alone(model(), *loaded_->tokenizer, options());
  alone.submit(greedy_request(1));
  const std::string text_alone = run(alone).at(1).text;

  BatchScheduler scheduler(model(), *loaded_->tokenizer, options());
  scheduler.submit(embedding_request(0, long_input, Pooling::kMean));
  scheduler.submit(greedy_request(1));
  const std::map<size_t, GenerationResult> results = run(scheduler);
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results.at(1).text, text_alone);
  // (Its passes hold other rows too: on the fp32 path that may round the products otherwise.)
  EXPECT_LT(max_abs_difference(results.at(0).embedding, normalized(pooled_in_chunks(long_input, Pooling::kMean, 16))), 1e-6);
}

TEST_F(EmbeddingRequests, TheContextBoundsAnInputAndRankIsRefused) {
  BatchScheduler scheduler(model(), *loaded_->tokenizer, options());
  EXPECT_NO_THROW(scheduler.check(embedding_request(0, prompt(64), Pooling::kMean)));  // fills the context
  EXPECT_THROW(scheduler.check(embedding_request(0, prompt(65), Pooling::kMean)), std::invalid_argument);
  EXPECT_THROW(scheduler.check(embedding_request(0, {}, Pooling::kMean)), std::invalid_argument);
  try {
    scheduler.check(embedding_request(0, prompt(3), Pooling::kRank));
    FAIL() << "rank pooling was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("rank"), std::string::npos) << e.what();
  }
}

TEST_F(EmbeddingRequests, TheEngineHandsEachInputBackUnderItsPosition) {
  const std::vector<std::vector<int32_t>> inputs = {prompt(7, 1), prompt(30, 2), prompt(3, 3), prompt(9, 4), prompt(12, 5)};
  ServingEngine engine(model(), *loaded_->tokenizer, options(), 4);
  const std::shared_ptr<RequestStream> stream = engine.submit_embeddings(inputs, Pooling::kMean);
  std::map<int, std::vector<float>> got;
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (!stream->finished() && std::chrono::steady_clock::now() < until) {
    for (StreamEvent& e : stream->wait(100ms)) {
      ASSERT_EQ(e.kind, StreamEvent::Kind::kDone);
      got[e.sample] = std::move(e.result.embedding);
    }
  }
  ASSERT_EQ(got.size(), inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::vector<float> want = normalized(pooled_in_chunks(inputs[i], Pooling::kMean, 16));
    EXPECT_LT(max_abs_difference(got[static_cast<int>(i)], want), 1e-6) << i;
  }
  EXPECT_THROW(engine.submit_embeddings({}, Pooling::kMean), std::invalid_argument);
  EXPECT_THROW(engine.submit_embeddings({prompt(65)}, Pooling::kMean), std::invalid_argument);
}

}  // namespace
}  // namespace ringlm
