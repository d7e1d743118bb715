// The serving engine (core/scheduler/serving_engine.h) and the scheduler's prompt cache, on the
// real model (SmolLM2), greedy. What is checked against what:
//  - each request's stream holds its own text only: the pieces join into its kDone text, which
//    is the text a scheduler of its own gives the same request alone;
//  - a request read partly from the prompt cache gives the tokens that prefilling it whole gives
//    (a fresh scheduler without a cache), and the cache stays within its byte budget;
//  - cancel() frees the slot; a full queue refuses; stop() lets running requests finish or, past
//    the deadline, cancels them.
#include <gtest/gtest.h>

#include <omp.h>

#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/model/loader.h"
#include "core/scheduler/batch_scheduler.h"
#include "core/scheduler/serving_engine.h"

namespace ringlm {
namespace {

using namespace std::chrono_literals;

class ServingEngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    omp_set_num_threads(1);
    loaded_ = new LoadedModel(load_model(RINGLM_TEST_MODEL, 1));
  }
  static void TearDownTestSuite() {
    delete loaded_;
    loaded_ = nullptr;
  }

  static std::vector<int32_t> tokens(const std::string& text) { return loaded_->tokenizer->encode(text, true, false); }

  static GenerationRequest greedy(const std::string& prompt, int max_tokens) {
    GenerationRequest r;
    r.prompt = tokens(prompt);
    r.sampling.temperature = 0.0f;
    r.max_tokens = max_tokens;
    return r;
  }

  static BatchOptions options(int n_parallel, size_t prompt_cache_bytes = 0) {
    BatchOptions o;
    o.n_parallel = n_parallel;
    o.n_ctx = 512;
    o.prefill_chunk = 16;
    o.prompt_cache_bytes = prompt_cache_bytes;
    return o;
  }

  // The requests through one scheduler, to the end; results by request index.
  static std::vector<GenerationResult> run(BatchScheduler& scheduler, std::vector<GenerationRequest> requests) {
    std::vector<GenerationResult> results(requests.size());
    for (size_t i = 0; i < requests.size(); ++i) {
      requests[i].index = i;
      scheduler.submit(requests[i]);
    }
    while (scheduler.step([&](GenerationResult r) { results[r.index] = std::move(r); })) {
    }
    return results;
  }

  static std::string alone(const GenerationRequest& request, KvTypes cache_type = KvType::kF16) {
    BatchOptions o = options(1);
    o.cache_type = cache_type;
    BatchScheduler scheduler(*loaded_->model, *loaded_->tokenizer, o);
    return run(scheduler, {request})[0].text;
  }

  // Reads a stream to its end: the joined pieces and the kDone text of sample 0.
  struct Read {
    std::string pieces, done_text, finish_reason;
    bool cancelled = false;
  };
  static Read read_all(RequestStream& stream) {
    Read out;
    const auto until = std::chrono::steady_clock::now() + 120s;
    while (!stream.finished() && std::chrono::steady_clock::now() < until) {
      for (const StreamEvent& e : stream.wait(100ms)) {
        if (e.kind == StreamEvent::Kind::kPiece) out.pieces += e.text;
        if (e.kind == StreamEvent::Kind::kDone) {
          out.done_text = e.result.text;
          out.finish_reason = e.result.finish_reason;
        }
        if (e.kind == StreamEvent::Kind::kCancelled) out.cancelled = true;
      }
    }
    return out;
  }

  static LoadedModel* loaded_;
};

LoadedModel* ServingEngineTest::loaded_ = nullptr;

const std::string kLongPrompt =
    "The history of the city goes back two thousand years, to a settlement on an island in the river, "
    "where traders met and fishermen sold what they caught. Over the centuries it grew";

TEST_F(ServingEngineTest, AReusedPromptGivesTheTokensOfAWholePrefill) {
  BatchScheduler cached(*loaded_->model, *loaded_->tokenizer, options(2, size_t{64} << 20));
  const GenerationRequest first = greedy(kLongPrompt, 8);
  const GenerationRequest longer = greedy(kLongPrompt + " into a capital, and", 12);
  const GenerationRequest same = greedy(kLongPrompt, 8);
  ASSERT_GT(first.prompt.size(), 32u);

  EXPECT_EQ(run(cached, {first})[0].text, alone(first));
  EXPECT_EQ(cached.reused_prompt_tokens(), 0);
  EXPECT_EQ(cached.prompt_cache_entries(), 1u);
  EXPECT_GT(cached.prompt_cache_bytes_in_use(), 0u);

  // Begins with the kept prompt: reads it, prefills only the rest.
  EXPECT_EQ(run(cached, {longer})[0].text, alone(longer));
  const int64_t after_longer = cached.reused_prompt_tokens();
  EXPECT_GE(after_longer, static_cast<int64_t>(first.prompt.size()) - 1);

  // The same prompt again: nothing to prefill, the kept logits give the first token.
  EXPECT_EQ(run(cached, {same})[0].text, alone(same));
  EXPECT_EQ(cached.reused_prompt_tokens() - after_longer, static_cast<int64_t>(same.prompt.size()));
  EXPECT_EQ(cached.n_running(), 0);
  EXPECT_EQ(cached.kv_bytes_in_use(), 0u);  // what the sequences held is back; the cache keeps its own
}

// The prompt cache with quantized caches (q8_0 keys and q4_0 values): a kept segment's blocks
// read by later requests give the tokens a whole prefill into such a cache gives.
TEST_F(ServingEngineTest, AReusedQuantizedPromptGivesTheTokensOfAWholePrefill) {
  const KvTypes types(KvType::kQ8_0, KvType::kQ4_0);
  BatchOptions o = options(2, size_t{64} << 20);
  o.cache_type = types;
  BatchScheduler cached(*loaded_->model, *loaded_->tokenizer, o);
  const GenerationRequest first = greedy(kLongPrompt, 8);
  const GenerationRequest longer = greedy(kLongPrompt + " into a capital, and", 12);
  EXPECT_EQ(run(cached, {first})[0].text, alone(first, types));
  EXPECT_EQ(cached.prompt_cache_entries(), 1u);
  EXPECT_EQ(run(cached, {longer})[0].text, alone(longer, types));
  EXPECT_GE(cached.reused_prompt_tokens(), static_cast<int64_t>(first.prompt.size()) - 1);
  EXPECT_EQ(run(cached, {first})[0].text, alone(first, types));  // the whole prompt kept: its logits
}

TEST_F(ServingEngineTest, ThePromptCacheStaysWithinItsBudget) {
  // Room for about one of these prompts: each new one pushes out the least recently used.
  const GenerationRequest probe = greedy(kLongPrompt, 1);
  BatchScheduler measure(*loaded_->model, *loaded_->tokenizer, options(1, size_t{64} << 20));
  run(measure, {probe});
  const size_t one_prompt = measure.prompt_cache_bytes_in_use();
  ASSERT_GT(one_prompt, 0u);

  BatchScheduler scheduler(*loaded_->model, *loaded_->tokenizer, options(1, one_prompt + one_prompt / 2));
  for (const char* start : {"First, ", "Second, ", "Third, "}) {
    const GenerationRequest r = greedy(start + kLongPrompt, 4);
    EXPECT_EQ(run(scheduler, {r})[0].text, alone(r));
    EXPECT_LE(scheduler.prompt_cache_bytes_in_use(), one_prompt + one_prompt / 2);
    EXPECT_EQ(scheduler.prompt_cache_entries(), 1u);
  }
}

// The model runs one pass at a time: what a request gives alone is found before an engine runs.
TEST_F(ServingEngineTest, EveryStreamHoldsItsOwnTextOnly) {
  const std::vector<std::string> prompts = {"The capital of France is", "Once upon a time", "My favourite colour is",
                                            "The three primary colors are", "In the year 2050,"};
  std::vector<std::string> expected;
  for (const std::string& p : prompts) expected.push_back(alone(greedy(p, 16)));
  ServingEngine engine(*loaded_->model, *loaded_->tokenizer, options(3), 16);
  std::vector<std::future<Read>> readers;
  for (const std::string& p : prompts) {
    readers.push_back(std::async(std::launch::async, [&engine, p] {
      std::shared_ptr<RequestStream> stream = engine.submit(greedy(p, 16));
      return read_all(*stream);
    }));
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    const Read r = readers[i].get();
    EXPECT_FALSE(r.cancelled);
    EXPECT_EQ(r.pieces, r.done_text) << prompts[i];
    EXPECT_EQ(r.done_text, expected[i]) << prompts[i];
  }
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (engine.stats().running != 0 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(1ms);
  const EngineStats s = engine.stats();
  EXPECT_EQ(s.requests, 5);
  EXPECT_GT(s.generated_tokens, 0);
  EXPECT_EQ(s.running, 0);
  EXPECT_EQ(s.queued, 0);
}

TEST_F(ServingEngineTest, ACancelledRequestFreesItsSlot) {
  const std::string expected = alone(greedy("The capital of France is", 6));
  ServingEngine engine(*loaded_->model, *loaded_->tokenizer, options(1), 4);
  std::shared_ptr<RequestStream> endless = engine.submit(greedy("Once upon a time", -1));
  while (endless->wait(100ms).empty()) {
  }
  endless->cancel();
  // The one slot serves the next request to its end.
  std::shared_ptr<RequestStream> next = engine.submit(greedy("The capital of France is", 6));
  const Read r = read_all(*next);
  EXPECT_EQ(r.done_text, expected);
  // The stats follow each step (published just after the step that ended the request).
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (engine.stats().running != 0 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(engine.stats().running, 0);
  EXPECT_EQ(engine.stats().kv_bytes, 0u);
}

TEST_F(ServingEngineTest, AFullQueueRefuses) {
  ServingEngine engine(*loaded_->model, *loaded_->tokenizer, options(1), 1);
  std::shared_ptr<RequestStream> running = engine.submit(greedy("Once upon a time", -1));
  while (running->wait(100ms).empty()) {
  }
  std::shared_ptr<RequestStream> waiting = engine.submit(greedy("Hello", 4));  // the one queue place
  EXPECT_THROW(engine.submit(greedy("Hello", 4)), EngineBusy);
  running->cancel();
  EXPECT_EQ(read_all(*waiting).finish_reason, "length");
  // A request that can never run is refused at once, whatever the queue holds.
  GenerationRequest too_long = greedy("x", 4);
  too_long.prompt.assign(600, too_long.prompt[0]);
  EXPECT_THROW(engine.submit(too_long), std::invalid_argument);
}

TEST_F(ServingEngineTest, StopFinishesWithinTheDeadlineOrCancels) {
  const std::string expected = alone(greedy("The capital of France is", 4));
  // A context the endless request cannot fill before the deadline (512 tokens took an idle
  // machine 1.9 s: it finished, "length", instead of being cancelled).
  BatchOptions o = options(2);
  o.n_ctx = 8192;
  ServingEngine engine(*loaded_->model, *loaded_->tokenizer, o, 4);
  std::shared_ptr<RequestStream> short_one = engine.submit(greedy("The capital of France is", 4));
  std::shared_ptr<RequestStream> endless = engine.submit(greedy("Once upon a time", -1));
  while (endless->wait(100ms).empty()) {
  }
  engine.stop(std::chrono::steady_clock::now() + 2s);  // returns when the engine thread has ended
  EXPECT_EQ(read_all(*short_one).done_text, expected);
  EXPECT_TRUE(read_all(*endless).cancelled);
  EXPECT_THROW(engine.submit(greedy("Hello", 4)), std::logic_error);
}

}  // namespace
}  // namespace ringlm
