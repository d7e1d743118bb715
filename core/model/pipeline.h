// Pipeline parallelism: one model's layers split into contiguous stages, one per process, the
// hidden state of every token passed from each stage to the next. The first stage holds the
// embedding and drives: it tells the next stage each pass before it runs it (PipelineCommand,
// which each stage passes on to the next), and gets the last stage's logits back. The link that
// moves the bytes is an interface, so that core/ knows nothing of MPI (apps/pipeline_process.cpp
// has the MPI one).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace ringlm {

class GgufFile;

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

}  // namespace ringlm
