#include "core/scheduler/serving_engine.h"

#include <algorithm>
#include <utility>

namespace ringlm {

namespace {

using Clock = std::chrono::steady_clock;
// tokens_per_second looks this far back.
constexpr auto kRateWindow = std::chrono::seconds(10);

}  // namespace

// --- RequestStream --------------------------------------------------------------------------

std::vector<StreamEvent> RequestStream::wait(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  ready_.wait_for(lock, timeout, [&] { return !events_.empty(); });
  std::vector<StreamEvent> out(std::make_move_iterator(events_.begin()), std::make_move_iterator(events_.end()));
  events_.clear();
  return out;
}

bool RequestStream::finished() const {
  std::lock_guard lock(mutex_);
  return remaining_ == 0 && events_.empty();
}

void RequestStream::cancel() {
  if (cancelled_.exchange(true)) return;
  std::function<void()> wake;
  {
    std::lock_guard lock(mutex_);
    wake = on_cancel_;
  }
  if (wake) wake();
}

void RequestStream::push(StreamEvent event) {
  {
    std::lock_guard lock(mutex_);
    if (event.kind == StreamEvent::Kind::kDone) --remaining_;
    if (event.kind == StreamEvent::Kind::kCancelled) remaining_ = 0;
    events_.push_back(std::move(event));
  }
  ready_.notify_all();
}

// --- ServingEngine --------------------------------------------------------------------------

ServingEngine::ServingEngine(LlamaModel& model, const Tokenizer& tokenizer, const BatchOptions& options, int max_queued)
    : scheduler_(model, tokenizer, options), max_queued_(max_queued) {
  stats_.n_parallel = options.n_parallel;
  scheduler_.set_token_listener([this](const TokenEvent& e) { on_token(e); });
  thread_ = std::thread([this] { run(); });
}

ServingEngine::~ServingEngine() { stop(Clock::now()); }

std::shared_ptr<RequestStream> ServingEngine::submit(GenerationRequest request) {
  scheduler_.check(request);  // reads only the options
  const int n_results = request.n_samples;
  std::vector<GenerationRequest> parts;
  parts.push_back(std::move(request));
  return enqueue(std::move(parts), n_results);
}

std::shared_ptr<RequestStream> ServingEngine::submit_embeddings(std::vector<std::vector<int32_t>> inputs, Pooling pooling) {
  if (inputs.empty()) throw std::invalid_argument("no input to embed");
  std::vector<GenerationRequest> parts(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    parts[i].prompt = std::move(inputs[i]);
    parts[i].pooling = pooling;
    parts[i].first_sample = static_cast<int>(i);
    parts[i].max_tokens = 0;
    scheduler_.check(parts[i]);
  }
  const auto n_results = static_cast<int>(parts.size());
  return enqueue(std::move(parts), n_results);
}

std::shared_ptr<RequestStream> ServingEngine::enqueue(std::vector<GenerationRequest> parts, int n_results) {
  auto stream = std::make_shared<RequestStream>(n_results);
  std::lock_guard lock(mutex_);
  if (stopping_) throw std::logic_error("the server is shutting down");
  if (static_cast<int>(submitted_.size()) + stats_.queued >= max_queued_) {
    throw EngineBusy("the queue is full (" + std::to_string(max_queued_) + " requests waiting)");
  }
  const size_t index = next_index_++;
  stream->on_cancel_ = [this, index] {
    {
      std::lock_guard engine_lock(mutex_);
      cancelled_.push_back(index);
    }
    wake_.notify_all();
  };
  for (GenerationRequest& part : parts) {
    part.index = index;
    submitted_.emplace_back(std::move(part), stream);
  }
  wake_.notify_all();
  return stream;
}

EngineStats ServingEngine::stats() const {
  std::lock_guard lock(mutex_);
  EngineStats s = stats_;
  s.queued += static_cast<int>(submitted_.size());
  // Generated over the steps of the last kRateWindow, per second of it (0 once idle that long).
  const Clock::time_point now = Clock::now();
  const auto recent = std::find_if(rate_window_.begin(), rate_window_.end(),
                                   [&](const auto& sample) { return now - sample.first <= kRateWindow; });
  const double seconds = recent == rate_window_.end() ? 0.0 : std::chrono::duration<double>(now - recent->first).count();
  s.tokens_per_second = seconds > 0 ? static_cast<double>(s.generated_tokens - recent->second) / seconds : 0.0;
  return s;
}

void ServingEngine::stop(Clock::time_point deadline) {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    deadline_ = deadline;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void ServingEngine::take_submissions() {
  std::deque<std::pair<GenerationRequest, std::shared_ptr<RequestStream>>> submitted;
  std::vector<size_t> cancelled;
  {
    std::lock_guard lock(mutex_);
    submitted.swap(submitted_);
    cancelled.swap(cancelled_);
    // They wait in the scheduler's queue from now on: counted there at once, so that submit()
    // never sees them in neither place and admits one more than --max-queue (the step's first
    // token and publish_stats() set the exact count).
    stats_.queued += static_cast<int>(submitted.size());
  }
  int64_t prompt_tokens = 0;
  for (auto& [request, stream] : submitted) {
    const size_t index = request.index;
    prompt_tokens += static_cast<int64_t>(request.prompt.size());
    scheduler_.submit(std::move(request));  // checked in submit()
    streams_[index] = std::move(stream);
  }
  if (prompt_tokens > 0) {
    std::lock_guard lock(mutex_);
    stats_.prompt_tokens += prompt_tokens;
  }
  for (size_t index : cancelled) {
    scheduler_.cancel(index);
    streams_.erase(index);
  }
  if (!cancelled.empty()) publish_stats();  // the slots are free now, not after the next step
}

void ServingEngine::publish_stats() {
  const Clock::time_point now = Clock::now();
  std::lock_guard lock(mutex_);
  stats_.running = scheduler_.n_running();
  stats_.queued = static_cast<int>(scheduler_.n_queued());
  stats_.generated_tokens = scheduler_.generated_tokens();
  stats_.reused_prompt_tokens = scheduler_.reused_prompt_tokens();
  stats_.kv_bytes = scheduler_.kv_bytes_in_use();
  stats_.prompt_cache_bytes = scheduler_.prompt_cache_bytes_in_use();
  stats_.speculation = scheduler_.speculation();
  rate_window_.emplace_back(now, stats_.generated_tokens);
  while (now - rate_window_.front().first > kRateWindow) rate_window_.pop_front();
}

void ServingEngine::on_token(const TokenEvent& e) {
  {
    // The step admitted its requests before its first token: the queue's depth is exact now,
    // before a client that sees this token can submit again (take_submissions() counted every
    // request it moved as queued until then).
    std::lock_guard lock(mutex_);
    stats_.queued = static_cast<int>(scheduler_.n_queued());
  }
  const auto it = streams_.find(e.index);
  if (it == streams_.end()) return;
  StreamEvent event;
  event.sample = e.sample;
  event.text = std::string(e.text);
  event.token = e.token;
  if (e.logprobs != nullptr) event.logprobs = *e.logprobs;
  it->second->push(std::move(event));
}

void ServingEngine::on_done(GenerationResult result) {
  const auto it = streams_.find(result.index);
  if (it == streams_.end()) return;
  {
    std::lock_guard lock(mutex_);
    ++stats_.requests;
  }
  const std::shared_ptr<RequestStream> stream = it->second;
  StreamEvent event;
  event.kind = StreamEvent::Kind::kDone;
  event.sample = result.sample;
  event.result = std::move(result);
  stream->push(std::move(event));
  std::lock_guard lock(stream->mutex_);
  if (stream->remaining_ == 0) streams_.erase(it);
}

void ServingEngine::cancel_all() {
  for (auto& [index, stream] : streams_) {
    scheduler_.cancel(index);
    StreamEvent event;
    event.kind = StreamEvent::Kind::kCancelled;
    stream->push(std::move(event));
  }
  streams_.clear();
}

void ServingEngine::run() {
  const auto on_done = [this](GenerationResult r) { this->on_done(std::move(r)); };
  while (true) {
    take_submissions();
    bool past_deadline = false;
    {
      std::unique_lock lock(mutex_);
      past_deadline = stopping_ && deadline_ && Clock::now() >= *deadline_;
    }
    if (past_deadline) cancel_all();
    if (scheduler_.idle()) {
      std::unique_lock lock(mutex_);
      if (stopping_ && submitted_.empty()) break;
      // Woken by a submission, a cancellation or stop(); the deadline needs no wake-up here:
      // an idle engine has nothing to cancel.
      wake_.wait(lock, [&] { return !submitted_.empty() || !cancelled_.empty() || stopping_; });
      continue;
    }
    scheduler_.step(on_done);
    publish_stats();
  }
  std::lock_guard lock(mutex_);
  stats_.running = stats_.queued = 0;
}

}  // namespace ringlm
