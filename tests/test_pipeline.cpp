// Pipeline parallelism (core/model/pipeline.h, apps/pipeline_process.h): how layers are split over
// stages, and `mpirun -np N ringlm run|perplexity` against the same command in one process: the
// same greedy text and the same perplexity (logits equal to the last digit printed) for every
// family, a context that shifts, the TCP transport that runs between machines, and the faults:
// mismatched files, a rank that cannot open the file, a rank killed mid-run. And, in one process
// with a thread per stage, batch's micro-batches in flight against one model in one piece.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "core/model/hparams.h"
#include "core/model/loader.h"
#include "core/model/pipeline.h"
#include "core/scheduler/batch_scheduler.h"
#include "tests/build_scale.h"
#include "tests/command_runner.h"

namespace ringlm {
namespace {

TEST(PipelineSplit, EqualLayersSplitEvenlyAndUnevenOnesByTheirBytes) {
  const std::vector<size_t> equal(30, 100);
  EXPECT_EQ(split_layers_by_bytes(equal, 2), (std::vector<int>{15, 15}));
  EXPECT_EQ(split_layers_by_bytes(equal, 3), (std::vector<int>{10, 10, 10}));
  EXPECT_EQ(split_layers_by_bytes(equal, 1), (std::vector<int>{30}));
  // A heavy first layer (say, bigger quantization there): fewer layers go with it.
  const std::vector<size_t> heavy_first = {500, 100, 100, 100, 100, 100};
  EXPECT_EQ(split_layers_by_bytes(heavy_first, 2), (std::vector<int>{1, 5}));
  // Every stage keeps a layer, however the bytes fall.
  const std::vector<size_t> skewed = {1, 1, 1000};
  EXPECT_EQ(split_layers_by_bytes(skewed, 3), (std::vector<int>{1, 1, 1}));
  EXPECT_THROW(split_layers_by_bytes(skewed, 4), std::invalid_argument);
}

TEST(PipelineSplit, StagesOfASplitAndItsErrors) {
  const std::vector<int> counts = {10, 12, 8};
  const PipelineStage first = stage_of_split(counts, 30, 0), middle = stage_of_split(counts, 30, 1),
                      last = stage_of_split(counts, 30, 2);
  EXPECT_TRUE(first.first() && !first.last());
  EXPECT_EQ(first.first_layer, 0);
  EXPECT_EQ(first.end_layer, 10);
  EXPECT_TRUE(!middle.first() && !middle.last());
  EXPECT_EQ(middle.first_layer, 10);
  EXPECT_EQ(middle.end_layer, 22);
  EXPECT_TRUE(last.last());
  EXPECT_EQ(last.first_layer, 22);
  EXPECT_EQ(last.end_layer, 30);
  EXPECT_TRUE(last.runs_layer(29) && !last.runs_layer(21));
  EXPECT_THROW(stage_of_split(counts, 31, 0), std::invalid_argument);  // 30 layers named, 31 in the model
  EXPECT_THROW(stage_of_split(std::vector<int>{10, 0, 20}, 30, 0), std::invalid_argument);
  EXPECT_THROW(stage_of_split(counts, 30, 3), std::invalid_argument);
}

TEST(PipelineSplit, LayerSplitFlagIsAListOfPositiveCounts) {
  EXPECT_EQ(parse_layer_split("10,12,8"), (std::vector<int>{10, 12, 8}));
  EXPECT_EQ(parse_layer_split("7"), (std::vector<int>{7}));
  for (const char* bad : {"", "10,", ",10", "10,x", "0,5", "-1,5", "3.5"}) {
    EXPECT_THROW(parse_layer_split(bad), std::invalid_argument) << "'" << bad << "'";
  }
}

// --- The pipeline in one process: each stage on a thread of its own, linked by queues ---------

// A link between threads: every message is queued whole for its receiver (a send never waits),
// and a receive takes the oldest message from that sender, which must have the size expected.
class ThreadLinks {
 public:
  explicit ThreadLinks(int stages) : stages_(stages), queues_(static_cast<size_t>(stages * stages)) {}

  class Link final : public PipelineLink {
   public:
    Link(ThreadLinks& hub, int me) : hub_(hub), me_(me) {}
    void send(int stage, const void* data, size_t bytes) override {
      const auto* p = static_cast<const char*>(data);
      std::lock_guard lock(hub_.mutex_);
      hub_.queue(me_, stage).emplace_back(p, p + bytes);
      hub_.arrived_.notify_all();
    }
    void send_copy(int stage, const void* data, size_t bytes) override { send(stage, data, bytes); }
    void recv(int stage, void* data, size_t bytes) override {
      std::unique_lock lock(hub_.mutex_);
      auto& q = hub_.queue(stage, me_);
      hub_.arrived_.wait(lock, [&] { return !q.empty(); });
      if (q.front().size() != bytes) {
        throw std::runtime_error("stage " + std::to_string(me_) + " expected " + std::to_string(bytes) +
                                 " bytes from stage " + std::to_string(stage) + ", got " + std::to_string(q.front().size()));
      }
      std::copy(q.front().begin(), q.front().end(), static_cast<char*>(data));
      q.pop_front();
    }
    void start_recv(int stage, void* data, size_t bytes) override { begun_.push_back({stage, data, bytes}); }
    void finish_recv() override {
      const Begun b = begun_.front();
      begun_.pop_front();
      recv(b.stage, b.data, b.bytes);
    }

   private:
    struct Begun {
      int stage;
      void* data;
      size_t bytes;
    };
    ThreadLinks& hub_;
    int me_;
    std::deque<Begun> begun_;
  };

 private:
  std::deque<std::vector<char>>& queue(int from, int to) { return queues_[static_cast<size_t>(from * stages_ + to)]; }
  int stages_;
  std::mutex mutex_;
  std::condition_variable arrived_;
  std::vector<std::deque<std::vector<char>>> queues_;
};

std::string tiny_model(const std::string& name) { return std::string(RINGLM_TEST_WORK_DIR) + "/tiny_" + name + ".gguf"; }

// `file` split over three stages (the first and the last on this thread's caller, the others
// serving on threads of their own), against the same file in one piece.
class InProcessPipeline {
 public:
  InProcessPipeline(const std::string& file, std::vector<int> split) : links_(static_cast<int>(split.size())) {
    const int stages = static_cast<int>(split.size());
    for (int i = 0; i < stages; ++i) {
      const auto pick = [&, i](const GgufFile& gguf) {
        return stage_of_split(split, LlamaHparams::from_gguf(gguf).n_layer, i);
      };
      stages_.push_back(std::make_unique<LoadedModel>(load_model(file, make_cpu_backend(1), pick)));
      links_of_.push_back(std::make_unique<ThreadLinks::Link>(links_, i));
      stages_.back()->model->connect_pipeline(*links_of_.back());
    }
    for (int i = 1; i < stages; ++i) {
      threads_.emplace_back([this, i] {
        try {
          stages_[static_cast<size_t>(i)]->model->serve_pipeline();
        } catch (const std::exception& e) {
          ADD_FAILURE() << "stage " << i << ": " << e.what();
        }
      });
    }
  }
  ~InProcessPipeline() {
    stages_[0]->model->close_pipeline();
    for (std::thread& t : threads_) t.join();
  }
  LoadedModel& first() { return *stages_[0]; }

 private:
  ThreadLinks links_;
  std::vector<std::unique_ptr<LoadedModel>> stages_;
  std::vector<std::unique_ptr<ThreadLinks::Link>> links_of_;
  std::vector<std::thread> threads_;
};

std::vector<GenerationRequest> mixed_requests(const Tokenizer& tok) {
  std::vector<GenerationRequest> requests;
  const auto add = [&](const char* prompt, int max_tokens, float temp, int n) {
    GenerationRequest r;
    r.index = requests.size();
    r.prompt = tok.encode(prompt, true, true);
    r.max_tokens = max_tokens;
    r.sampling.temperature = temp;
    r.sampling.seed = 11 + r.index;
    r.n_samples = n;
    requests.push_back(std::move(r));
  };
  add("Once upon a time", 12, 0.0f, 1);
  add("The capital of France is a city with a very long history of kings, revolutions and", 9, 0.0f, 1);
  add("In the beginning", 10, 0.9f, 3);
  add("Write a list of fruits:", 7, 0.7f, 1);
  add("One, two, three,", 11, 0.0f, 1);
  add("Once upon a time there was", 8, 0.0f, 1);
  return requests;
}

// Every result by request and sample: its text, its token count and why it ended.
using Results = std::map<std::pair<size_t, int>, std::string>;

Results run_all(LlamaModel& model, const Tokenizer& tok, const std::vector<GenerationRequest>& requests,
                std::optional<size_t> cancel_after_a_step = std::nullopt) {
  BatchOptions options;
  options.n_parallel = 5;
  options.n_ctx = 64;
  options.prefill_chunk = 8;
  options.prompt_cache_bytes = 1 << 20;
  BatchScheduler scheduler(model, tok, options);
  for (const GenerationRequest& r : requests) scheduler.submit(r);
  Results results;
  const auto on_done = [&](GenerationResult r) {
    results[{r.index, r.sample}] = r.text + " | " + std::to_string(r.n_tokens) + " " + r.finish_reason;
  };
  for (int step = 0; scheduler.step(on_done); ++step) {
    if (step == 2 && cancel_after_a_step) {
      EXPECT_TRUE(scheduler.cancel(*cancel_after_a_step));
    }
  }
  return results;
}

// Three stages of the 7-layer Gemma 3 (sliding-window layers, a middle stage): batch's results,
// with the groups of sequences in flight at once, greedy and sampled, n samples sharing their
// prompt and a prompt cache, are those of one process.
TEST(PipelineInProcess, MicroBatchesInFlightGiveTheResultsOfOneProcess) {
  const std::string file = tiny_model("gemma3_q8_0");
  LoadedModel alone = load_model(file, make_cpu_backend(1));
  const std::vector<GenerationRequest> requests = mixed_requests(*alone.tokenizer);
  const Results want = run_all(*alone.model, *alone.tokenizer, requests);
  ASSERT_EQ(want.size(), 8u);

  InProcessPipeline pipeline(file, {2, 3, 2});
  EXPECT_EQ(pipeline.first().model->pipeline_depth(), 3);
  EXPECT_EQ(run_all(*pipeline.first().model, *pipeline.first().tokenizer, requests), want);
  EXPECT_EQ(pipeline.first().model->batches_in_flight(), 0u);
}

// Embedding requests (mean over a prompt longer than a chunk, cls, last) beside generating ones:
// the last stage pools the rows, the first folds the parts in; every vector and text as in one
// process, bit for bit.
std::map<std::pair<size_t, int>, std::vector<float>> embeddings_beside_generation(LlamaModel& model, const Tokenizer& tok,
                                                                                  Results& texts) {
  std::vector<GenerationRequest> requests = mixed_requests(tok);
  const auto embed = [&](const char* text, Pooling pooling) {
    GenerationRequest r;
    r.index = requests.size();
    r.prompt = tok.encode(text, true, true);
    r.pooling = pooling;
    requests.push_back(std::move(r));
  };
  embed("A prompt of more tokens than one chunk of the scheduler's passes, pooled over all of them", Pooling::kMean);
  embed("The first token's state", Pooling::kCls);
  embed("The last token's state", Pooling::kLast);
  BatchOptions options;
  options.n_parallel = 5;
  options.n_ctx = 64;
  options.prefill_chunk = 8;
  BatchScheduler scheduler(model, tok, options);
  for (const GenerationRequest& r : requests) scheduler.submit(r);
  std::map<std::pair<size_t, int>, std::vector<float>> vectors;
  while (scheduler.step([&](GenerationResult r) {
    if (r.embedding.empty()) {
      texts[{r.index, r.sample}] = r.text;
    } else {
      vectors[{r.index, r.sample}] = std::move(r.embedding);
    }
  })) {
  }
  return vectors;
}

TEST(PipelineInProcess, EmbeddingsAreThoseOfOneProcess) {
  const std::string file = tiny_model("gemma3_q8_0");
  LoadedModel alone = load_model(file, make_cpu_backend(1));
  Results want_texts, texts;
  const auto want = embeddings_beside_generation(*alone.model, *alone.tokenizer, want_texts);
  ASSERT_EQ(want.size(), 3u);
  InProcessPipeline pipeline(file, {2, 3, 2});
  EXPECT_EQ(embeddings_beside_generation(*pipeline.first().model, *pipeline.first().tokenizer, texts), want);
  EXPECT_EQ(texts, want_texts);
}

// A request cancelled while its pass is in flight gives no result, and the others are unchanged.
TEST(PipelineInProcess, ACancelWhileInFlightLeavesTheOthersAlone) {
  const std::string file = tiny_model("q4_0");
  LoadedModel alone = load_model(file, make_cpu_backend(1));
  const std::vector<GenerationRequest> requests = mixed_requests(*alone.tokenizer);
  Results want = run_all(*alone.model, *alone.tokenizer, requests);
  std::erase_if(want, [](const auto& kv) { return kv.first.first == 0; });

  InProcessPipeline pipeline(file, {1, 1});
  EXPECT_EQ(run_all(*pipeline.first().model, *pipeline.first().tokenizer, requests, size_t{0}), want);
}

// A prompt with every position's logits (what perplexity reads), then greedy tokens one at a
// time through a context that fills and shifts (StreamingLLM, with sinks): the logits of every
// step, on three stages and in one piece.
std::vector<float> logits_of_a_shifting_run(LlamaModel& model, const Tokenizer& tok) {
  const std::vector<int32_t> prompt = tok.encode("Once upon a time, in a land far away,", true, true);
  const size_t vocab = static_cast<size_t>(model.hparams().n_vocab);
  KvCache cache = model.make_cache(24, KvCacheOptions{KvType::kF16, 2, 0, true});
  std::vector<float> all(prompt.size() * vocab);
  model.forward(prompt, cache, all.data(), true);
  std::vector<float> logits(all.end() - static_cast<std::ptrdiff_t>(vocab), all.end());
  for (int i = 0; i < 40; ++i) {
    const auto next = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    model.forward(std::span<const int32_t>(&next, 1), cache, logits.data());
    all.insert(all.end(), logits.begin(), logits.end());
  }
  return all;
}

TEST(PipelineInProcess, EveryLogitThroughAShiftingContextIsAsInOneProcess) {
  const std::string file = tiny_model("gemma3_q8_0");
  LoadedModel alone = load_model(file, make_cpu_backend(1));
  const std::vector<float> want = logits_of_a_shifting_run(*alone.model, *alone.tokenizer);
  InProcessPipeline pipeline(file, {2, 3, 2});
  EXPECT_EQ(logits_of_a_shifting_run(*pipeline.first().model, *pipeline.first().tokenizer), want);
}

#ifdef RINGLM_MPIRUN

const std::string kRingLm = RINGLM_BINARY;
// mpirun as CI runs it (as root, more ranks than cores); --mca btl tcp,self where a test wants
// the transport that runs between machines. Under the sanitizers, LeakSanitizer unwinds fully in
// the ranks: Open MPI's own allocations are then seen through libevent's loop and ignored
// (tests/lsan_suppressions.txt); with fast unwinding their frames end in components that
// MPI_Finalize has unloaded, which no suppression can name.
const std::string kMpirun = "env LSAN_OPTIONS=\"$LSAN_OPTIONS:fast_unwind_on_malloc=0\" " + std::string(RINGLM_MPIRUN) +
                            " --allow-run-as-root --oversubscribe";

std::string tiny(const std::string& name) { return std::string(RINGLM_TEST_WORK_DIR) + "/tiny_" + name + ".gguf"; }

test::CommandResult sh(const std::string& command) { return test::run_command(command, test::work_dir_for("pipeline"), 120); }

// The same command alone and under mpirun (with `split_args` added there): the same stdout, both
// exiting 0.
void expect_same_output(const std::string& args, int ranks, const std::string& mpirun_flags = "",
                        const std::string& split_args = "") {
  SCOPED_TRACE(args + " on " + std::to_string(ranks) + " ranks " + mpirun_flags + " " + split_args);
  const test::CommandResult alone = sh(kRingLm + " " + args);
  ASSERT_EQ(alone.exit_code, 0) << alone.err;
  ASSERT_FALSE(alone.out.empty());
  const test::CommandResult split =
      sh(kMpirun + " " + mpirun_flags + " -np " + std::to_string(ranks) + " " + kRingLm + " " + args + " " + split_args);
  ASSERT_EQ(split.exit_code, 0) << split.err;
  EXPECT_EQ(split.out, alone.out);
  // Each rank said which layers it runs.
  for (int r = 0; r < ranks; ++r) {
    EXPECT_NE(split.err.find("rank " + std::to_string(r) + " of " + std::to_string(ranks)), std::string::npos) << split.err;
  }
}

// Greedy text on two ranks for every family (Llama, Qwen 2 with biases, Qwen 3 with QK-norm and
// an untied output, Gemma 3 with its sliding-window layers and post-norms, Phi-3 with fused
// matrices), and on three ranks of the 7-layer Gemma 3 over TCP with a split given by hand.
TEST(PipelineCli, GreedyTextEqualsOneProcessForEveryFamily) {
  const std::string gen = " -t 1 --temp 0 --ignore-eos -n " + std::to_string(test::scaled(12, 6)) + " -p 'Once upon a time'";
  // The sanitizer build checks the pipeline's memory, not every family's numbers: there only the
  // three-rank run below, which has a middle stage too (each mpirun costs it seconds of full
  // unwinding).
  std::vector<std::string> families = {"q4_0", "qwen2_q5_0", "qwen3_q4_k", "gemma3_q8_0", "phi3_q4_0"};
  if (test::kSanitizedBuild) families.clear();
  for (const std::string& model : families) expect_same_output("run -m " + tiny(model) + gen, 2);
  expect_same_output("run -m " + tiny("gemma3_q8_0") + gen, 3, "--mca btl tcp,self", "--layer-split 2,4,1");
}

// A context that fills and shifts (StreamingLLM) on every rank in step, and sampling with a seed.
TEST(PipelineCli, ContextShiftsAndSamplingStayInStep) {
  if (test::kSanitizedBuild) GTEST_SKIP() << "the sanitizer build runs the shifting context in one process (PipelineInProcess)";
  expect_same_output("run -m " + tiny("q4_0") + " -t 1 -c 24 --keep 2 --ignore-eos -n " +
                         std::to_string(test::scaled(60, 30)) + " --temp 0.8 -s 7 -p 'Once upon a time'",
                     2);
}

// Speculative decoding across ranks: the checking pass runs stepwise on every rank, and a later
// rank rolls its copy of the cache back with the first rank's, through a context shift.
TEST(PipelineCli, PromptLookupDraftsStayInStep) {
  if (test::kSanitizedBuild) GTEST_SKIP() << "the sanitizer build checks rollback in one process (test_speculative)";
  expect_same_output("run -m " + std::string(RINGLM_TEST_MODEL) + " -t 1 --temp 0 -c 48 --keep 4 --ignore-eos -n 40 "
                     "--lookup 6 -p 'Copy the list: apples, pears, plums, cherries, grapes, melons, lemons, limes. Copy: apples, pears,'",
                     2);
}

// Perplexity reads every position's logits back from the last rank: the estimate is the same to
// the last printed digit.
TEST(PipelineCli, PerplexityEqualsOneProcess) {
  if (test::kSanitizedBuild) GTEST_SKIP() << "the sanitizer build reads every position's logits in one process (PipelineInProcess)";
  const std::string text = std::string(RINGLM_SHARED_DATA) + "/text/kjv-pentateuch.txt";
  expect_same_output("perplexity -m " + tiny("gemma3_q8_0") + " -f " + text + " -c 32 --chunks " +
                         std::to_string(test::scaled(2, 1)) + " -t 1",
                     3);
}

// batch on three ranks over TCP: the same results as one process, with --parallel 4, samples
// that share their prompt (a prompt segment every rank keeps in step) and sampling with seeds.
TEST(PipelineCli, BatchResultsEqualOneProcess) {
  const std::string dir = test::work_dir_for("pipeline");
  const std::string in = dir + "/batch.in";
  std::ofstream(in) << R"({"id":"a","prompt":"Once upon a time","max_tokens":12})" "\n"
                    << R"({"id":"b","prompt":"The capital of France is","max_tokens":8})" "\n"
                    << R"({"id":"c","prompt":"In the beginning","max_tokens":10,"n":3,"temperature":0.9,"seed":3})" "\n"
                    << R"({"id":"d","prompt":"Write a list of fruits:","max_tokens":6})" "\n";
  const auto texts = [&](const std::string& out) {
    std::map<std::string, std::string> by_id;
    std::ifstream lines(out);
    for (std::string line; std::getline(lines, line);) {
      const nlohmann::json j = nlohmann::json::parse(line);
      by_id[j.at("id").get<std::string>() + "/" + std::to_string(j.value("sample", 0))] = j.at("text").get<std::string>();
    }
    return by_id;
  };
  const std::string args = " batch -m " + tiny("gemma3_q8_0") + " -t 1 --parallel 4 --temp 0 -i " + in + " -o ";
  std::filesystem::remove(dir + "/alone.out");
  std::filesystem::remove(dir + "/split.out");
  const test::CommandResult alone = sh(kRingLm + args + dir + "/alone.out");
  ASSERT_EQ(alone.exit_code, 0) << alone.err;
  const test::CommandResult split = sh(kMpirun + " --mca btl tcp,self -np 3 " + kRingLm + args + dir + "/split.out");
  ASSERT_EQ(split.exit_code, 0) << split.err;
  const auto want = texts(dir + "/alone.out");
  EXPECT_EQ(want.size(), 6u);
  EXPECT_EQ(texts(dir + "/split.out"), want);
}

// serve on two ranks: rank 0 answers HTTP (curl), the other runs its layers; the text of a
// completion is `run`'s, and a second prompt that begins like the first reads the prompt cache.
TEST(PipelineCli, ServeAnswersAsOneProcessRuns) {
  const std::string dir = test::work_dir_for("pipeline");
  const std::string port = std::to_string(20000 + ::getpid() % 20000);
  const std::string script = dir + "/serve.sh";
  const auto completion = [&](const std::string& prompt) {
    return "curl -s localhost:" + port + "/v1/completions -H 'Content-Type: application/json' -d '{\"prompt\":\"" +
           prompt + "\",\"max_tokens\":8,\"temperature\":0}'; echo\n";
  };
  std::ofstream(script) << kMpirun << " -np 2 " << kRingLm << " serve -m " << tiny("q4_0") << " -t 1 --prompt-cache 16 --port "
                        << port << " >" << dir << "/serve.log 2>&1 &\n"
                        << "for i in $(seq 1 100); do curl -s localhost:" << port
                        << "/health | grep -q ok && break; sleep 0.2; done\n"
                        << completion("Once upon a time") << completion("Once upon a time there")
                        << "kill -INT $!; wait\n";
  const test::CommandResult r = sh("bash " + script);
  std::vector<std::string> texts;
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << line << "\n" << test::slurp(dir + "/serve.log");
    texts.push_back(j.at("choices").at(0).at("text").get<std::string>());
  }
  ASSERT_EQ(texts.size(), 2u) << r.out << test::slurp(dir + "/serve.log");
  for (const auto& [prompt, text] : {std::pair{"Once upon a time", texts[0]}, std::pair{"Once upon a time there", texts[1]}}) {
    const test::CommandResult run = sh(kRingLm + " run -m " + tiny("q4_0") + " -t 1 --temp 0 -n 8 -p '" + prompt + "'");
    ASSERT_EQ(run.exit_code, 0) << run.err;
    EXPECT_EQ(text, run.out) << prompt;
  }
}

// Ranks started with different files, or one that cannot open its file: every rank ends with an
// error naming the rank, at start.
TEST(PipelineCli, MismatchedOrMissingFilesEndEveryRankWithTheError) {
  if (test::kSanitizedBuild) GTEST_SKIP() << "faults of processes: the Release build's (each mpirun costs the sanitizers seconds)";
  const std::string gen = " -t 1 -n 4 -p hi";
  const test::CommandResult mismatch =
      sh(kMpirun + " -np 1 " + kRingLm + " run -m " + tiny("q4_0") + gen + " : -np 1 " + kRingLm + " run -m " + tiny("phi3_q4_0") + gen);
  EXPECT_NE(mismatch.exit_code, 0);
  EXPECT_NE(mismatch.err.find("rank 1 opened another model file than rank 0"), std::string::npos) << mismatch.err;

  const test::CommandResult missing =
      sh(kMpirun + " -np 1 " + kRingLm + " run -m " + tiny("q4_0") + gen + " : -np 1 " + kRingLm + " run -m /nonexistent.gguf" + gen);
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.err.find("rank 1 of 2"), std::string::npos) << missing.err;
  EXPECT_NE(missing.err.find("/nonexistent.gguf"), std::string::npos) << missing.err;
}

// A rank killed while the pipeline generates: every rank is gone within 10 s, and the run fails.
// (pkill -n: the newest process that carries the marker, a rank: mpirun started them.)
TEST(PipelineCli, AKilledRankEndsTheRunNotAHang) {
  if (test::kSanitizedBuild) GTEST_SKIP() << "faults of processes: the Release build's (each mpirun costs the sanitizers seconds)";
  const std::string marker = "pipeline-kill-" + std::to_string(::getpid());
  const std::string script_path = test::work_dir_for("pipeline") + "/kill_a_rank.sh";
  std::ofstream(script_path) << "(" << kMpirun << " -np 2 " << kRingLm << " run -m " << tiny("q4_0")
                             << " -t 1 -c 64 --ignore-eos -n 100000000 -p '" << marker
                             << "' >/dev/null 2>&1; echo exit=$?) &\n"
                             << "sleep 2\npkill -9 -n -f -- '" << marker << "'\nwait\n";
  const auto t0 = std::chrono::steady_clock::now();
  const test::CommandResult r = sh("bash " + script_path);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.out.find("exit="), std::string::npos) << r.out << r.err;
  EXPECT_EQ(r.out.find("exit=0"), std::string::npos) << r.out;
  EXPECT_LT(seconds, 2 + 10) << r.out;
}

#endif  // RINGLM_MPIRUN

}  // namespace
}  // namespace ringlm
