#include "core/session/sequence_model.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "core/session/timing.h"

namespace ringlm {

namespace {

using Clock = std::chrono::steady_clock;

DeviceCounters counters_since(const DeviceCounters& before, const DeviceCounters& after) {
  return {after.launches - before.launches, after.upload_bytes - before.upload_bytes,
          after.download_bytes - before.download_bytes, after.waits - before.waits};
}

}  // namespace

SequenceModel::SequenceModel(LlamaModel& model, KvCache cache, int top_k, Drafter* drafter)
    : model_(model),
      cache_(std::move(cache)),
      drafter_(drafter),
      logits_(static_cast<size_t>(model.hparams().n_vocab)),
      top_(static_cast<size_t>(std::max(0, top_k))) {}

DroppedTokens SequenceModel::prefill(std::span<const int32_t> tokens) {
  if (tokens.empty()) return {};
  return forward(tokens);
}

DroppedTokens SequenceModel::forward(std::span<const int32_t> tokens) {
  // The model shifts the cache on its own when it fills. Each shift drops the oldest tokens
  // after the sinks, so all of them together are the oldest `count` after the sinks of the
  // context with the new tokens appended.
  const int64_t discarded_before = cache_.discarded();
  if (top_.empty()) {
    model_.forward(tokens, cache_, logits_.data());
  } else {
    model_.forward_top(tokens, cache_, top_);
  }
  tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  const DroppedTokens dropped{static_cast<size_t>(cache_.n_keep()),
                              static_cast<size_t>(cache_.discarded() - discarded_before)};
  const auto sinks = tokens_.begin() + cache_.n_keep();
  tokens_.erase(sinks, sinks + static_cast<std::ptrdiff_t>(dropped.count));
  evaluated_ += static_cast<int64_t>(tokens.size());
  draft_pass_ = 0;
  return dropped;
}

DroppedTokens SequenceModel::evaluate(int32_t token) {
  const DecodePass pass = begin_pass(1);
  const Clock::time_point start = Clock::now();
  const DroppedTokens dropped = forward(std::span<const int32_t>(&token, 1));
  end_pass(pass, ms_since(start));
  return dropped;
}

std::span<float> SequenceModel::evaluate_draft(std::span<const int32_t> tokens) {
  const DecodePass pass = begin_pass(static_cast<int>(tokens.size()));
  const Clock::time_point start = Clock::now();
  draft_rows_.resize(tokens.size() * logits_.size());
  model_.forward_steps(tokens, cache_, draft_rows_.data());
  end_pass(pass, ms_since(start));
  // A draft never crosses a context shift (draft_room()): nothing is dropped.
  tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  evaluated_ += static_cast<int64_t>(tokens.size());
  draft_pass_ = tokens.size();
  return draft_rows_;
}

void SequenceModel::rollback(int n) {
  cache_.rollback(n);
  const auto forgotten = static_cast<size_t>(n);
  tokens_.resize(tokens_.size() - forgotten);
  evaluated_ -= n;
  draft_pass_ = draft_pass_ > forgotten ? draft_pass_ - forgotten : 0;
  if (draft_pass_ == 0 || !top_.empty()) return;
  const size_t row = draft_pass_ - 1;
  std::copy_n(draft_rows_.begin() + static_cast<std::ptrdiff_t>(row * logits_.size()), logits_.size(), logits_.begin());
}

void SequenceModel::record_passes(const Backend* device) {
  recording_ = true;
  device_ = device;
}

DecodePass SequenceModel::begin_pass(int tokens) const {
  DecodePass pass;
  pass.tokens = tokens;
  if (recording_ && device_ != nullptr) pass.device = device_->counters();
  return pass;
}

void SequenceModel::end_pass(DecodePass pass, double ms) {
  if (!recording_) return;
  pass.ms = ms;
  if (device_ != nullptr) pass.device = counters_since(pass.device, device_->counters());
  passes_.push_back(pass);
}

void SequenceModel::clear() {
  cache_.clear();
  tokens_.clear();
  draft_pass_ = 0;
}

void SequenceModel::replace_cache(KvCache cache) {
  cache_ = std::move(cache);
  tokens_.clear();
  draft_pass_ = 0;
}

}  // namespace ringlm
