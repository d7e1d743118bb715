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

void SequenceModel::reset(int top_k, Drafter* drafter) {
  clear();
  top_.assign(static_cast<size_t>(std::max(0, top_k)), TopLogit{});
  drafter_ = drafter;
  evaluated_ = 0;
}

DroppedTokens SequenceModel::prefill(std::span<const int32_t> tokens) {
  if (tokens.empty()) return {};
  return forward(tokens);
}

DroppedTokens SequenceModel::forward(std::span<const int32_t> tokens) {
  model_.forward(plan(tokens, Scores::kSampled));
  return passed();
}

SequenceTokens SequenceModel::plan(std::span<const int32_t> tokens, Scores scores) {
  const bool top = scores == Scores::kSampled && !top_.empty();
  planned_ = {tokens, /*check=*/false, top, cache_.discarded()};
  if (top) return SequenceTokens(tokens, &cache_, nullptr, top_);
  return SequenceTokens(tokens, &cache_, scores == Scores::kNone ? nullptr : logits_.data());
}

SequenceTokens SequenceModel::plan_check(int32_t token, std::span<const int32_t> draft) {
  pass_tokens_.assign(1, token);
  pass_tokens_.insert(pass_tokens_.end(), draft.begin(), draft.end());
  draft_rows_.resize(pass_tokens_.size() * logits_.size());
  planned_ = {pass_tokens_, /*check=*/true, /*top=*/false, cache_.discarded()};
  return SequenceTokens(pass_tokens_, &cache_, draft_rows_.data(), {}, /*steps=*/true);
}

DroppedTokens SequenceModel::passed() {
  const PlannedPass pass = std::exchange(planned_, PlannedPass{});
  // The model shifts the cache on its own when it fills. Each shift drops the oldest tokens
  // after the sinks, so all of them together are the oldest `count` after the sinks of the
  // context with the new tokens appended. (A draft never crosses a shift: draft_room().)
  tokens_.insert(tokens_.end(), pass.tokens.begin(), pass.tokens.end());
  const DroppedTokens dropped{static_cast<size_t>(cache_.n_keep()),
                              static_cast<size_t>(cache_.discarded() - pass.discarded_before)};
  const auto sinks = tokens_.begin() + cache_.n_keep();
  tokens_.erase(sinks, sinks + static_cast<std::ptrdiff_t>(dropped.count));
  evaluated_ += static_cast<int64_t>(pass.tokens.size());
  draft_pass_ = pass.check ? pass.tokens.size() : 0;
  scores_in_top_ = pass.top;
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
  model_.forward(plan_check(tokens.front(), tokens.subspan(1)));
  end_pass(pass, ms_since(start));
  passed();
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
  scores_in_top_ = false;
}

void SequenceModel::replace_cache(KvCache cache) {
  cache_ = std::move(cache);
  tokens_.clear();
  draft_pass_ = 0;
  scores_in_top_ = false;
}

std::shared_ptr<const KvCache> SequenceModel::share_cache(KvCache fresh) {
  auto shared = std::make_shared<KvCache>(std::move(cache_));
  cache_ = std::move(fresh);
  cache_.attach_prefix(shared);
  return shared;
}

void SequenceModel::read_prefix(std::shared_ptr<const KvCache> prefix, std::span<const int32_t> tokens,
                                std::span<const float> logits_after) {
  clear();
  cache_.attach_prefix(std::move(prefix), static_cast<int>(tokens.size()));
  tokens_.assign(tokens.begin(), tokens.end());
  if (!logits_after.empty()) std::copy(logits_after.begin(), logits_after.end(), logits_.begin());
}

}  // namespace ringlm
