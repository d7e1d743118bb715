// Pipeline parallelism: one model's layers split into contiguous stages, one per process, the
// hidden state of every token passed from each stage to the next. The first stage holds the
// embedding and drives: it tells the next stage each pass before it runs it (PipelineCommand,
// which each stage passes on to the next), and gets the last stage's logits back. The link that
// moves the bytes is an interface, so that core/ knows nothing of MPI (apps/pipeline_process.cpp
// has the MPI one).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/model/sequence_tokens.h"

namespace ringlm {

class Backend;
class GgufFile;
class LlamaModel;

// Which part of the model this process runs: stage `index` of `count`, layers
// [first_layer, end_layer). The default, one stage, is the whole model (end_layer < 0: every layer).
struct PipelineStage {
  int index = 0;
  int count = 1;
  int first_layer = 0;
  int end_layer = -1;

  bool first() const { return index == 0; }
  bool last() const { return index == count - 1; }
  bool alone() const { return count == 1; }
  bool runs_layer(int layer) const { return layer >= first_layer && (end_layer < 0 || layer < end_layer); }
};

// Layers per stage for `stages` stages over layers of the given sizes in bytes: contiguous runs
// whose sizes are as near an equal share as whole layers allow (each stage gets at least one).
// Throws std::invalid_argument when there are fewer layers than stages.
std::vector<int> split_layers_by_bytes(std::span<const size_t> layer_bytes, int stages);

// The stage `index` of a split given as layer counts per stage (split_layers_by_bytes, or the
// user's --layer-split). Throws std::invalid_argument when the counts do not add up to n_layer.
PipelineStage stage_of_split(std::span<const int> layers_per_stage, int n_layer, int index);

// The layer counts of --layer-split "10,12,...": std::invalid_argument when it is not a list of
// positive integers.
std::vector<int> parse_layer_split(const std::string& text);

// Bytes of each layer's tensors in the file ("blk.N."), what a balanced split balances.
std::vector<size_t> layer_weight_bytes(const GgufFile& gguf, int n_layer);

// Moves bytes between the stages, in order: the messages from one stage to another arrive in
// the order they were sent. send() and recv() return when their bytes are sent or received;
// send_copy() sends a copy and returns at once (a command must not wait for a busy stage to take
// it); a receive begun with start_recv() lets the caller work on until finish_recv() (which
// finishes the oldest receive begun and not yet finished). A stage that waits long leaves the
// cores to the others.
class PipelineLink {
 public:
  virtual ~PipelineLink() = default;
  virtual void send(int stage, const void* data, size_t bytes) = 0;
  virtual void send_copy(int stage, const void* data, size_t bytes) = 0;
  virtual void recv(int stage, void* data, size_t bytes) = 0;
  virtual void start_recv(int stage, void* data, size_t bytes) = 0;
  virtual void finish_recv() = 0;
};

// The pipeline protocol of one stage, as the forward pass sees it: what the first stage announces
// before each pass, the hidden states between stages, and the results from the last stage back to
// the first. The commands' wire format and the later stages' loop live behind it (pipeline.cpp).
//
// The first stage tells the next stage each pass before it runs it: a command and one record per
// sequence (its cache by KvCache::id(), where that cache stands, its prefix, the tokens' count,
// what the pass hands back), which each stage passes on to the next before it runs the pass.
// Every later stage's serve() runs the very same pass over its own copies of those caches, with
// the tokens' counts only: the same chunks, the same context shifts, the same slots, the same
// shared prompt segments, so nothing else about a cache ever needs to cross. A cache the first
// stage cleared starts over on the others, one it dropped is dropped there too, and one that is
// out of step is an error, not a wrong answer.
class PipelineHook {
 public:
  PipelineHook(LlamaModel& model, Backend& backend, PipelineLink& link, const PipelineStage& stage);
  ~PipelineHook();
  PipelineHook(const PipelineHook&) = delete;
  PipelineHook& operator=(const PipelineHook&) = delete;

  // The first stage, before a pass of one sequence (in chunks, shifting its cache as needed) or
  // of a batch.
  void announce_tokens(const SequenceTokens& sequence);
  void announce_batch(std::span<const SequenceTokens> batch);
  // A pass's hidden states, n floats in the backend's activation memory at x.
  void receive_hidden(float* x, size_t n);     // from the stage before
  void send_hidden(const float* x, size_t n);  // to the stage after
  // A pass's results: the picks, the logits, then the pooled sequences' parts of their embeddings
  // (any may be empty). The last stage sends them; the first begins receiving them and finishes
  // when it hands them out.
  void send_results(std::span<const TopLogit> picks, std::span<const float> logits, std::span<const float> pooled);
  void start_receiving_results(std::span<TopLogit> picks, std::span<float> logits, std::span<float> pooled);
  void finish_receiving_results();

  // A later stage: runs the passes the first stage announces until it closes the pipeline.
  void serve();
  // The first stage: finishes the passes in flight and tells the others to stop.
  void close();

 private:
  struct Command;
  struct Sequence;
  static Sequence describe(const SequenceTokens& sequence);
  void announce(int32_t op, std::vector<Sequence>& sequences);
  int32_t receive_command(std::vector<Sequence>& sequences);
  KvCache& cache_copy(const Sequence& q);
  uint64_t copied_id(uint64_t id) const;

  LlamaModel& model_;
  Backend& backend_;
  PipelineLink& link_;
  PipelineStage stage_;
  std::vector<float> hidden_;  // hidden states on their way between stages
  // Another stage's copies of the first stage's caches, by the first stage's KvCache::id(), kept
  // in step by running the same passes. Shared: a copy may be another one's prefix.
  std::map<uint64_t, std::shared_ptr<KvCache>> caches_;
};

}  // namespace ringlm
