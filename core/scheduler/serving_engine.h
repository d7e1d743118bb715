// The continuous-batching scheduler behind a server: one thread owns the model and the
// scheduler and runs a step whenever a request is queued or running; any number of client
// threads submit requests and read each one's stream of events.
//
// Every client's tokens go only to its own stream (events are routed by the request's index,
// which the engine hands out). A client that goes away cancels its request, and its slots are
// free at the next step. A full queue refuses new requests (the caller answers 503). Stopping
// lets the running requests finish up to a deadline, then cancels what is left.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/scheduler/batch_scheduler.h"

namespace ringlm {

// What a request's stream receives, in order per sample: pieces, then that sample's end.
struct StreamEvent {
  enum class Kind { kPiece, kDone, kCancelled };
  Kind kind = Kind::kPiece;
  int sample = 0;
  // kPiece: text safe to show now (maybe empty: a token whose text is held back) and the token.
  std::string text;
  int32_t token = -1;
  std::optional<TokenLogprobs> logprobs;
  // kDone: the sample's result (its whole text, counts, finish_reason, timings).
  GenerationResult result;
};

// One request's events, written by the engine thread and read by the client's thread.
class RequestStream {
 public:
  explicit RequestStream(int n_samples) : remaining_(n_samples) {}

  // The events that arrived, waiting up to `timeout` for the first; empty on a timeout.
  std::vector<StreamEvent> wait(std::chrono::milliseconds timeout);
  // Whether every sample has ended (its kDone, or the request was cancelled) and was read.
  bool finished() const;
  // The client went away: the engine drops the request at its next step.
  void cancel();
  bool cancelled() const { return cancelled_.load(); }

 private:
  friend class ServingEngine;
  void push(StreamEvent event);

  mutable std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<StreamEvent> events_;
  int remaining_;  // samples not yet ended
  std::atomic<bool> cancelled_{false};
  std::function<void()> on_cancel_;  // wakes the engine
};

// The queue is full: try again later.
class EngineBusy : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct EngineStats {
  int running = 0;        // requests with a slot
  int queued = 0;         // requests waiting for one
  int64_t requests = 0;   // finished (cancelled ones not counted)
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  int64_t reused_prompt_tokens = 0;
  double tokens_per_second = 0;  // generated per second over the last 10 s
  size_t kv_bytes = 0;           // held by the running sequences
  size_t prompt_cache_bytes = 0;
  int n_parallel = 0;
  SpeculationStats speculation;  // drafts, when the server decodes speculatively
};

class ServingEngine {
 public:
  // max_queued: requests that may wait for a slot before submit() refuses more.
  ServingEngine(LlamaModel& model, const Tokenizer& tokenizer, const BatchOptions& options, int max_queued);
  ~ServingEngine();  // stops at once (see stop())

  // Queues a request (its index is set here) and returns its stream. std::invalid_argument when
  // it can never run (BatchScheduler::submit), EngineBusy when the queue is full, std::logic_error
  // once stopping.
  std::shared_ptr<RequestStream> submit(GenerationRequest request);
  // Queues the embedding of every input as one request (GenerationRequest::pooling): each input
  // takes a slot of its own as slots free up, those that fit going through the same passes. Its
  // stream gets one kDone per input, `sample` the input's position and `result.embedding` its
  // vector. The request counts once against the queue's limit when it arrives. Throws as submit().
  std::shared_ptr<RequestStream> submit_embeddings(std::vector<std::vector<int32_t>> inputs, Pooling pooling);

  EngineStats stats() const;

  // Takes no new request; lets the running and queued ones finish until `deadline`, then
  // cancels the rest; returns when the engine thread has ended.
  void stop(std::chrono::steady_clock::time_point deadline);

 private:
  void run();
  // Queues `parts` (checked already) as one request of `n_results` results: one index, one stream.
  std::shared_ptr<RequestStream> enqueue(std::vector<GenerationRequest> parts, int n_results);
  // Between steps: new requests into the scheduler, cancelled ones out of it.
  void take_submissions();
  void on_token(const TokenEvent& e);
  void on_done(GenerationResult result);
  // The scheduler's counts into stats_ (the engine thread's, read by stats()).
  void publish_stats();
  void cancel_all();

  BatchScheduler scheduler_;
  const int max_queued_;

  mutable std::mutex mutex_;  // guards everything below but the scheduler (the engine thread's)
  std::condition_variable wake_;
  std::deque<std::pair<GenerationRequest, std::shared_ptr<RequestStream>>> submitted_;
  std::vector<size_t> cancelled_;
  size_t next_index_ = 1;
  bool stopping_ = false;
  std::optional<std::chrono::steady_clock::time_point> deadline_;
  EngineStats stats_;
  // (time of a step, generated so far) for the steps of the last 10 s.
  std::deque<std::pair<std::chrono::steady_clock::time_point, int64_t>> rate_window_;

  std::map<size_t, std::shared_ptr<RequestStream>> streams_;  // the engine thread's: by request index
  std::thread thread_;
};

}  // namespace ringlm
