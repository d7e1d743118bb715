#include "core/model/pipeline.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <string>

#include "core/gguf/gguf.h"
#include "core/kv/kv_cache.h"
#include "core/model/llama.h"

namespace ringlm {

std::vector<int> split_layers_by_bytes(std::span<const size_t> layer_bytes, int stages) {
  const int n_layer = static_cast<int>(layer_bytes.size());
  if (stages < 1 || n_layer < stages) {
    throw std::invalid_argument("cannot split " + std::to_string(n_layer) + " layers into " + std::to_string(stages) +
                                " pipeline stages (one layer at least each)");
  }
  const double total = std::accumulate(layer_bytes.begin(), layer_bytes.end(), 0.0);
  std::vector<int> counts;
  int begin = 0;
  double before = 0;  // bytes of the layers of the stages so far
  for (int s = 0; s < stages - 1; ++s) {
    // The cut nearest to s + 1 equal shares, leaving a layer for each stage after this one.
    const double target = total * (s + 1) / stages;
    int end = begin + 1;
    double upto = before + static_cast<double>(layer_bytes[static_cast<size_t>(begin)]);
    while (end < n_layer - (stages - 1 - s)) {
      const double next = upto + static_cast<double>(layer_bytes[static_cast<size_t>(end)]);
      if (std::fabs(next - target) >= std::fabs(upto - target)) break;
      upto = next;
      ++end;
    }
    counts.push_back(end - begin);
    begin = end;
    before = upto;
  }
  counts.push_back(n_layer - begin);
  return counts;
}

PipelineStage stage_of_split(std::span<const int> layers_per_stage, int n_layer, int index) {
  int total = 0;
  for (const int n : layers_per_stage) {
    if (n < 1) throw std::invalid_argument("a pipeline stage needs at least one layer (got " + std::to_string(n) + ")");
    total += n;
  }
  if (total != n_layer) {
    throw std::invalid_argument("the layer split gives " + std::to_string(total) + " layers; the model has " +
                                std::to_string(n_layer));
  }
  const int count = static_cast<int>(layers_per_stage.size());
  if (index < 0 || index >= count) {
    throw std::invalid_argument("pipeline stage " + std::to_string(index) + " of a split into " + std::to_string(count));
  }
  PipelineStage stage{index, count, 0, 0};
  for (int s = 0; s < index; ++s) stage.first_layer += layers_per_stage[static_cast<size_t>(s)];
  stage.end_layer = stage.first_layer + layers_per_stage[static_cast<size_t>(index)];
  return stage;
}

std::vector<int> parse_layer_split(const std::string& text) {
  std::vector<int> counts;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    char* end = nullptr;
    const long n = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || n < 1 || n > (1 << 16)) {
      throw std::invalid_argument("--layer-split '" + text + "': '" + item + "' is not a positive layer count");
    }
    counts.push_back(static_cast<int>(n));
    at = comma + 1;
  }
  return counts;
}

std::vector<size_t> layer_weight_bytes(const GgufFile& gguf, int n_layer) {
  std::vector<size_t> bytes(static_cast<size_t>(n_layer), 0);
  for (const GgufTensorInfo& t : gguf.tensors()) {
    if (!t.name.starts_with("blk.")) continue;
    const int layer = std::atoi(t.name.c_str() + 4);
    if (layer >= 0 && layer < n_layer) bytes[static_cast<size_t>(layer)] += t.n_bytes;
  }
  return bytes;
}

// --- The protocol between stages ------------------------------------------------------------

// What the first stage tells the others before each pass (POD: it crosses as bytes): the kind
// of pass, how many sequences, and the caches the first stage dropped since the last one. The
// sequences' records follow, then the dropped ids.
struct PipelineHook::Command {
  enum Op : int32_t { kExit = 0, kTokens = 1, kBatch = 2 };
  int32_t op = kExit;
  int32_t n_sequences = 0;
  int64_t n_released = 0;
};

// One sequence of a pass: its cache (by id, with what another stage needs to make its copy of it
// and to check that the copy is in step: where the cache stands, its prefix), its tokens' count
// and what the pass hands back for it.
struct PipelineHook::Sequence {
  uint64_t cache_id = 0, prefix_id = 0;
  int64_t cache_size = 0, next_position = 0, n_tokens = 0;
  int32_t capacity = 0, prefix_tokens = 0;
  int32_t kv_key_type = 0, kv_value_type = 0, n_keep = 0, n_discard = 0, context_shift = 0;
  int32_t want_logits = 0, all_logits = 0, top_k = 0, stepwise_attention = 0;
  int32_t kivi_residual = 0;
  int32_t pooling = 0;  // Pooling: the last stage pools its rows (the first folds them in)
};

namespace {
// The caches that went since the first stage last announced a pass (KvCache's release observer).
std::mutex g_released_mutex;
std::vector<uint64_t> g_released;
void note_released(uint64_t id) {
  std::lock_guard lock(g_released_mutex);
  g_released.push_back(id);
}
}  // namespace

PipelineHook::PipelineHook(LlamaModel& model, Backend& backend, PipelineLink& link, const PipelineStage& stage)
    : model_(model), backend_(backend), link_(link), stage_(stage) {
  if (stage_.first() && !stage_.alone()) KvCache::set_release_observer(note_released);
}

PipelineHook::~PipelineHook() {
  if (stage_.first() && !stage_.alone()) KvCache::set_release_observer(nullptr);
}

PipelineHook::Sequence PipelineHook::describe(const SequenceTokens& sequence) {
  const KvCache& cache = *sequence.cache;
  Sequence q;
  q.cache_id = cache.id();
  q.prefix_id = cache.prefix() != nullptr ? cache.prefix()->id() : 0;
  q.prefix_tokens = cache.prefix_tokens();
  q.cache_size = cache.size();
  q.next_position = cache.next_position();
  q.n_tokens = static_cast<int64_t>(sequence.tokens.size());
  q.capacity = cache.capacity();
  q.kv_key_type = static_cast<int32_t>(cache.options().type.keys);
  q.kv_value_type = static_cast<int32_t>(cache.options().type.values);
  q.n_keep = cache.options().n_keep;
  q.n_discard = cache.options().n_discard;
  q.context_shift = cache.options().context_shift ? 1 : 0;
  q.kivi_residual = cache.options().kivi_residual;
  q.want_logits = sequence.logits != nullptr ? 1 : 0;
  q.all_logits = sequence.all_logits || sequence.steps ? 1 : 0;
  q.top_k = static_cast<int32_t>(sequence.top.size());
  q.stepwise_attention = sequence.steps ? 1 : 0;
  q.pooling = static_cast<int32_t>(sequence.pooling);
  return q;
}

void PipelineHook::announce(int32_t op, std::vector<Sequence>& sequences) {
  std::vector<uint64_t> released;
  {
    std::lock_guard lock(g_released_mutex);
    released.swap(g_released);
  }
  Command c;
  c.op = op;
  c.n_sequences = static_cast<int32_t>(sequences.size());
  c.n_released = static_cast<int64_t>(released.size());
  link_.send_copy(1, &c, sizeof(c));
  link_.send_copy(1, sequences.data(), sequences.size() * sizeof(Sequence));
  link_.send_copy(1, released.data(), released.size() * sizeof(uint64_t));
}

void PipelineHook::announce_tokens(const SequenceTokens& sequence) {
  std::vector<Sequence> one = {describe(sequence)};
  announce(Command::kTokens, one);
}

void PipelineHook::announce_batch(std::span<const SequenceTokens> batch) {
  std::vector<Sequence> all;
  for (const SequenceTokens& b : batch) all.push_back(describe(b));
  announce(Command::kBatch, all);
}

void PipelineHook::receive_hidden(float* x, size_t n) {
  hidden_.resize(n);
  link_.recv(stage_.index - 1, hidden_.data(), n * sizeof(float));
  backend_.write(x, hidden_.data(), n);
}

void PipelineHook::send_hidden(const float* x, size_t n) {
  hidden_.resize(n);
  backend_.read(x, hidden_.data(), n);
  link_.send(stage_.index + 1, hidden_.data(), n * sizeof(float));
}

void PipelineHook::send_results(std::span<const TopLogit> picks, std::span<const float> logits,
                                std::span<const float> pooled) {
  link_.send(0, picks.data(), picks.size_bytes());
  link_.send(0, logits.data(), logits.size_bytes());
  link_.send(0, pooled.data(), pooled.size_bytes());
}

void PipelineHook::start_receiving_results(std::span<TopLogit> picks, std::span<float> logits, std::span<float> pooled) {
  link_.start_recv(stage_.count - 1, picks.data(), picks.size_bytes());
  link_.start_recv(stage_.count - 1, logits.data(), logits.size_bytes());
  link_.start_recv(stage_.count - 1, pooled.data(), pooled.size_bytes());
}

void PipelineHook::finish_receiving_results() {
  for (int part = 0; part < 3; ++part) link_.finish_recv();
}

// This stage's copy of one of the first stage's caches: made when first named, made afresh when
// the first stage's cache starts over (empty there: cleared, maybe given a prefix), and
// otherwise exactly as far along, or an error.
KvCache& PipelineHook::cache_copy(const Sequence& q) {
  auto it = caches_.find(q.cache_id);
  const auto in_step = [&](const KvCache& c) {
    const uint64_t prefix = c.prefix() != nullptr ? c.prefix()->id() : 0;
    return c.size() == q.cache_size && c.next_position() == q.next_position && prefix == copied_id(q.prefix_id) &&
           c.prefix_tokens() == q.prefix_tokens;
  };
  if (it != caches_.end() && q.cache_size == 0 && !in_step(*it->second)) {
    caches_.erase(it);
    it = caches_.end();
  }
  if (it == caches_.end()) {
    const KvCacheOptions options{KvTypes(static_cast<KvType>(q.kv_key_type), static_cast<KvType>(q.kv_value_type)), q.n_keep,
                                 q.n_discard, q.context_shift != 0, q.kivi_residual};
    auto made = std::make_shared<KvCache>(model_.make_cache(q.capacity, options));
    if (q.prefix_id != 0) {
      const auto prefix = caches_.find(q.prefix_id);
      if (prefix == caches_.end()) {
        throw std::logic_error("pipeline stage " + std::to_string(stage_.index) + ": prefix cache " +
                               std::to_string(q.prefix_id) + " is unknown here");
      }
      made->attach_prefix(prefix->second, q.prefix_tokens);
    }
    it = caches_.emplace(q.cache_id, std::move(made)).first;
  }
  KvCache& cache = *it->second;
  // The first stage rolled back a speculative draft's rejected tokens: the copy forgets them too.
  const int64_t ahead = cache.size() - q.cache_size;
  if (ahead > 0 && cache.next_position() - q.next_position == ahead && ahead <= cache.max_rollback()) {
    cache.rollback(static_cast<int>(ahead));
  }
  if (!in_step(cache)) {
    throw std::logic_error("pipeline stage " + std::to_string(stage_.index) + ": cache " + std::to_string(q.cache_id) +
                           " holds " + std::to_string(cache.size()) + " tokens up to position " +
                           std::to_string(cache.next_position()) + ", the first stage's " +
                           std::to_string(q.cache_size) + " up to " + std::to_string(q.next_position));
  }
  return cache;
}

// The id this stage's copy of cache `id` carries (its own KvCache, its own id); 0 for 0.
uint64_t PipelineHook::copied_id(uint64_t id) const {
  if (id == 0) return 0;
  const auto it = caches_.find(id);
  return it != caches_.end() ? it->second->id() : ~uint64_t{0};
}

// Receives the next command and its records from the stage before, passes them on to the next
// stage, and drops the caches the first stage dropped. Returns the command's op.
int32_t PipelineHook::receive_command(std::vector<Sequence>& sequences) {
  const int from = stage_.index - 1, to = stage_.last() ? -1 : stage_.index + 1;
  Command c;
  link_.recv(from, &c, sizeof(c));
  if (to >= 0) link_.send_copy(to, &c, sizeof(c));
  if (c.op == Command::kExit) return c.op;
  if ((c.op != Command::kTokens && c.op != Command::kBatch) || c.n_sequences < 1 || c.n_released < 0 ||
      (c.op == Command::kTokens && c.n_sequences != 1)) {
    throw std::runtime_error("pipeline stage " + std::to_string(stage_.index) + ": a command it cannot read (op " +
                             std::to_string(c.op) + ")");
  }
  sequences.resize(static_cast<size_t>(c.n_sequences));
  std::vector<uint64_t> released(static_cast<size_t>(c.n_released));
  link_.recv(from, sequences.data(), sequences.size() * sizeof(Sequence));
  link_.recv(from, released.data(), released.size() * sizeof(uint64_t));
  if (to >= 0) {
    link_.send_copy(to, sequences.data(), sequences.size() * sizeof(Sequence));
    link_.send_copy(to, released.data(), released.size() * sizeof(uint64_t));
  }
  for (const uint64_t id : released) caches_.erase(id);
  return c.op;
}

void PipelineHook::serve() {
  if (stage_.first()) throw std::logic_error("serve_pipeline: not a later stage of a connected pipeline");
  std::vector<Sequence> sequences;
  std::vector<std::vector<int32_t>> tokens;  // the first stage embeds: later stages need only the counts
  std::vector<std::vector<float>> logits;    // what the last stage computes, before it sends it on
  std::vector<std::vector<TopLogit>> top;
  std::vector<SequenceTokens> batch;
  for (;;) {
    const int32_t op = receive_command(sequences);
    if (op == Command::kExit) return;
    tokens.resize(sequences.size());
    logits.resize(sequences.size());
    top.resize(sequences.size());
    batch.clear();
    for (size_t i = 0; i < sequences.size(); ++i) {
      const Sequence& q = sequences[i];
      tokens[i].assign(static_cast<size_t>(std::max<int64_t>(q.n_tokens, 0)), 0);
      SequenceTokens& s = batch.emplace_back(tokens[i], &cache_copy(q));
      s.steps = q.stepwise_attention != 0;
      s.all_logits = q.all_logits != 0 && !s.steps;
      s.pooling = static_cast<Pooling>(q.pooling);  // checked by the pass (check_pooling)
      // The last stage computes what the pass hands back (and sends it to the first); a middle
      // stage hands back nothing.
      if (stage_.last() && q.top_k > 0) {
        top[i].resize(static_cast<size_t>(q.top_k));
        s.top = top[i];
      } else if (stage_.last() && q.want_logits != 0) {
        logits[i].resize((q.all_logits != 0 ? tokens[i].size() : 1) * static_cast<size_t>(model_.hparams().n_vocab));
        s.logits = logits[i].data();
      }
    }
    if (op == Command::kTokens) {
      model_.forward(batch[0]);
    } else {
      model_.forward_batch(batch);
    }
  }
}

void PipelineHook::close() {
  while (model_.batches_in_flight() > 0) model_.finish_batch();
  Command c;
  c.op = Command::kExit;
  link_.send_copy(1, &c, sizeof(c));
}

}  // namespace ringlm
