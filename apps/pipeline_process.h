// This process's place in a pipeline of processes that mpirun started (core/model/pipeline.h):
// `mpirun -np N ringlm run ... [--layer-split 10,12,...]` splits the model's layers over the N
// processes (ranks), balanced by the bytes of their weights unless --layer-split says how. Rank 0
// runs the command (the prompt, the sampler, all output); every other rank loads only its layers
// and runs the passes rank 0 announces. Started without mpirun, a process is alone and nothing
// changes.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/gguf/gguf.h"
#include "core/model/loader.h"
#include "core/model/pipeline.h"

namespace ringlm {

class PipelineProcess {
 public:
  // Joins the pipeline when mpirun started this process among several (initialising MPI), else
  // returns an alone process. `argv` (the command and its options) is what every rank must agree
  // on besides the model file. Throws std::runtime_error when mpirun started several processes
  // and this ringlm was built without MPI.
  static std::unique_ptr<PipelineProcess> join(std::span<char* const> argv);
  virtual ~PipelineProcess() = default;

  bool alone() const { return size_ == 1; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& host() const { return host_; }

  // This rank's stage of the model in `gguf`: from `layer_split` (comma-separated layer counts
  // per rank), or balanced by the layers' bytes when it is empty. Every rank checks with the
  // others that they opened the same file (a hash of its header and size) with the same
  // options; a mismatch ends them all with an error naming the ranks. Collective.
  virtual PipelineStage stage_for(const GgufFile& gguf, const std::string& layer_split) = 0;
  virtual PipelineLink& link() = 0;

  // Ends every rank of the pipeline: prints `message` (naming this rank and its host) on stderr
  // and aborts the MPI job, so that no rank waits for a dead one.
  [[noreturn]] virtual void abort(const std::string& message) = 0;

 protected:
  int rank_ = 0, size_ = 1;
  std::string host_;
};

// The process main() joined (set once there; alone until then).
PipelineProcess& this_process();
void set_this_process(std::unique_ptr<PipelineProcess> process);

// What load_model needs to load only this process's stage (alone: the whole model; a
// --layer-split of one stage is fine, of several an error).
std::function<PipelineStage(const GgufFile&)> stage_picker(PipelineProcess& process, const std::string& layer_split);

// Connects a model loaded with stage_picker to the pipeline. On a later rank it then runs every
// pass rank 0 announces, until rank 0 closes the pipeline, and returns true: the command is done
// there (rank 0 has the input, the sampler and the output).
bool serve_as_later_rank(PipelineProcess& process, LoadedModel& m);

}  // namespace ringlm
