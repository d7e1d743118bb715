#include "apps/pipeline_process.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string_view>
#include <thread>
#include <vector>

#ifdef RINGLM_WITH_MPI
#include <mpi.h>
#endif

#include "core/model/hparams.h"

namespace ringlm {

namespace {

// How many processes mpirun (Open MPI, or any launcher that speaks PMI) started together; 1
// when this one was started alone.
int launched_world_size() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"}) {
    if (const char* v = std::getenv(name); v != nullptr && *v != '\0') return std::max(1, std::atoi(v));
  }
  return 1;
}

// FNV-1a, 64 bits: enough to tell two files or two command lines apart, not a defence.
struct Fnv {
  uint64_t h = 1469598103934665603ull;
  void add(const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  }
  void add(std::string_view s) {
    add(s.data(), s.size());
    add("\0", 1);
  }
  template <typename T>
  void add_value(const T& v) {
    add(&v, sizeof(v));
  }
};

// The file as its header describes it (size, keys, tensors' names, types, shapes and sizes).
uint64_t header_hash(const GgufFile& gguf) {
  Fnv f;
  f.add_value(gguf.file_size());
  f.add_value(gguf.version());
  for (const std::string& key : gguf.keys()) f.add(key);
  for (const GgufTensorInfo& t : gguf.tensors()) {
    f.add(t.name);
    f.add_value(t.type);
    for (const int64_t dim : t.shape) f.add_value(dim);
    f.add_value(t.n_bytes);
  }
  return f.h;
}

class AloneProcess final : public PipelineProcess {
 public:
  AloneProcess() { host_ = "localhost"; }
  PipelineStage stage_for(const GgufFile& /*gguf*/, const std::string& layer_split) override {
    if (!layer_split.empty() && parse_layer_split(layer_split).size() != 1) {
      throw std::invalid_argument("--layer-split " + layer_split + " names several stages, but this process runs alone "
                                  "(start one per stage with mpirun -np N)");
    }
    return PipelineStage{};
  }
  PipelineLink& link() override { throw std::logic_error("a process alone has no pipeline link"); }
  [[noreturn]] void abort(const std::string& message) override {
    std::fprintf(stderr, "ringlm: %s\n", message.c_str());
    std::exit(1);
  }
};

#ifdef RINGLM_WITH_MPI

void mpi_check(int err, const char* what) {
  if (err == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int n = 0;
  MPI_Error_string(err, text, &n);
  throw std::runtime_error(std::string(what) + ": " + std::string(text, static_cast<size_t>(n)));
}

// Waits for `requests` to complete. MPI's own waits spin all along, so a rank waiting for its
// turn (a later stage between passes, a server's ranks between requests) would take a core from
// the ranks that work, on one host. This one spins for a millisecond (a neighbour's answer is
// often that near), then tests every 50 µs, and past 100 ms every millisecond.
void wait_for(std::vector<MPI_Request>& requests) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  for (;;) {
    int done = 0;
    mpi_check(MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done, MPI_STATUSES_IGNORE), "MPI_Testall");
    if (done != 0) return;
    const auto waited = Clock::now() - start;
    if (waited < std::chrono::milliseconds(1)) continue;
    std::this_thread::sleep_for(waited < std::chrono::milliseconds(100) ? std::chrono::microseconds(50)
                                                                         : std::chrono::microseconds(1000));
  }
}

// Point-to-point messages between neighbouring stages (and from the last to the first). Large
// transfers go in pieces of at most 1 GiB (MPI counts are ints); an empty one is no message.
class MpiLink final : public PipelineLink {
 public:
  void send(int stage, const void* data, size_t bytes) override {
    std::vector<MPI_Request> requests;
    for_pieces(bytes, [&](size_t at, int n) {
      mpi_check(MPI_Isend(static_cast<const char*>(data) + at, n, MPI_BYTE, stage, kTag, MPI_COMM_WORLD,
                          &requests.emplace_back()),
                "MPI_Isend");
    });
    wait_for(requests);
  }
  void send_copy(int stage, const void* data, size_t bytes) override {
    reap_copies();
    Copy& c = copies_.emplace_back();
    c.bytes.assign(static_cast<const char*>(data), static_cast<const char*>(data) + bytes);
    for_pieces(bytes, [&](size_t at, int n) {
      mpi_check(MPI_Isend(c.bytes.data() + at, n, MPI_BYTE, stage, kTag, MPI_COMM_WORLD, &c.requests.emplace_back()),
                "MPI_Isend");
    });
  }
  // Waits until every copy is sent (before MPI_Finalize).
  void flush() {
    for (Copy& c : copies_) wait_for(c.requests);
    copies_.clear();
  }
  void recv(int stage, void* data, size_t bytes) override {
    start_recv(stage, data, bytes);
    finish_recv();
  }
  void start_recv(int stage, void* data, size_t bytes) override {
    std::vector<MPI_Request>& requests = receiving_.emplace_back();
    for_pieces(bytes, [&](size_t at, int n) {
      mpi_check(MPI_Irecv(static_cast<char*>(data) + at, n, MPI_BYTE, stage, kTag, MPI_COMM_WORLD, &requests.emplace_back()),
                "MPI_Irecv");
    });
  }
  void finish_recv() override {
    if (receiving_.empty()) throw std::logic_error("finish_recv: no receive begun");
    wait_for(receiving_.front());
    receiving_.pop_front();
  }

 private:
  static constexpr int kTag = 7;
  std::deque<std::vector<MPI_Request>> receiving_;  // begun, oldest first
  struct Copy {
    std::vector<char> bytes;
    std::vector<MPI_Request> requests;
  };
  std::deque<Copy> copies_;  // send_copy()'s, until sent
  // Drops the copies already sent.
  void reap_copies() {
    while (!copies_.empty()) {
      int done = 0;
      std::vector<MPI_Request>& r = copies_.front().requests;
      mpi_check(MPI_Testall(static_cast<int>(r.size()), r.data(), &done, MPI_STATUSES_IGNORE), "MPI_Testall");
      if (done == 0) return;
      copies_.pop_front();
    }
  }
  template <typename Piece>
  static void for_pieces(size_t bytes, Piece piece) {
    constexpr size_t kMaxPiece = size_t{1} << 30;
    for (size_t at = 0; at < bytes; at += kMaxPiece) piece(at, static_cast<int>(std::min(kMaxPiece, bytes - at)));
  }
};

class MpiProcess final : public PipelineProcess {
 public:
  explicit MpiProcess(std::span<char* const> argv) {
    // serve runs its passes on the engine's thread, not main's: one thread at a time calls MPI.
    int provided = 0;
    mpi_check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
    if (provided < MPI_THREAD_SERIALIZED) {
      throw std::runtime_error("this MPI library cannot be called from more than one thread (MPI_THREAD_SERIALIZED)");
    }
    // Errors come back as codes (turned into exceptions, then into abort() with the rank named),
    // not as MPI's own abort without a word of ours.
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    char name[MPI_MAX_PROCESSOR_NAME];
    int n = 0;
    MPI_Get_processor_name(name, &n);
    host_.assign(name, static_cast<size_t>(n));
    Fnv f;
    for (size_t i = 1; i < argv.size(); ++i) f.add(argv[i] != nullptr ? argv[i] : "");
    options_hash_ = f.h;
  }
  ~MpiProcess() override {
    try {
      link_.flush();
    } catch (const std::exception&) {  // a neighbour is gone: nothing more to send
    }
    MPI_Finalize();
  }

  PipelineStage stage_for(const GgufFile& gguf, const std::string& layer_split) override {
    check_same_everywhere(gguf);
    const int n_layer = LlamaHparams::from_gguf(gguf).n_layer;
    const std::vector<int> counts = layer_split.empty() ? split_layers_by_bytes(layer_weight_bytes(gguf, n_layer), size_)
                                                        : parse_layer_split(layer_split);
    if (static_cast<int>(counts.size()) != size_) {
      throw std::invalid_argument("--layer-split " + layer_split + " names " + std::to_string(counts.size()) +
                                  " stages for " + std::to_string(size_) + " ranks");
    }
    const PipelineStage stage = stage_of_split(counts, n_layer, rank_);
    std::fprintf(stderr, "ringlm: rank %d of %d (%s): layers %d..%d of %d%s%s\n", rank_, size_, host_.c_str(),
                 stage.first_layer, stage.end_layer - 1, n_layer, stage.first() ? ", the embedding" : "",
                 stage.last() ? ", the output" : "");
    return stage;
  }
  PipelineLink& link() override { return link_; }

  [[noreturn]] void abort(const std::string& message) override {
    std::fprintf(stderr, "ringlm: rank %d of %d (%s): %s\n", rank_, size_, host_.c_str(), message.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    std::_Exit(1);
  }

 private:
  // The model file's header and the options, hashed on every rank and compared with rank 0's.
  void check_same_everywhere(const GgufFile& gguf) {
    const uint64_t mine[2] = {header_hash(gguf), options_hash_};
    std::vector<uint64_t> all(2 * static_cast<size_t>(size_));
    mpi_check(MPI_Allgather(mine, 2, MPI_UINT64_T, all.data(), 2, MPI_UINT64_T, MPI_COMM_WORLD), "MPI_Allgather");
    std::string files, options;
    for (int r = 1; r < size_; ++r) {
      if (all[2 * static_cast<size_t>(r)] != all[0]) files += (files.empty() ? "" : ", ") + std::to_string(r);
      if (all[2 * static_cast<size_t>(r) + 1] != all[1]) options += (options.empty() ? "" : ", ") + std::to_string(r);
    }
    if (!files.empty()) {
      throw std::runtime_error("rank " + files + " opened another model file than rank 0 (" + gguf.path() +
                               "): every rank must load the same file");
    }
    if (!options.empty()) {
      throw std::runtime_error("rank " + options + " started with other options than rank 0: every rank must run the "
                               "same command line");
    }
  }

  MpiLink link_;
  uint64_t options_hash_ = 0;
};

#endif  // RINGLM_WITH_MPI

}  // namespace

std::unique_ptr<PipelineProcess> PipelineProcess::join(std::span<char* const> argv) {
  if (launched_world_size() == 1) return std::make_unique<AloneProcess>();
#ifdef RINGLM_WITH_MPI
  return std::make_unique<MpiProcess>(argv);
#else
  (void)argv;
  throw std::runtime_error("mpirun started " + std::to_string(launched_world_size()) +
                           " processes, but this ringlm was built without MPI (install libopenmpi-dev and rebuild)");
#endif
}

namespace {
std::unique_ptr<PipelineProcess>& joined() {
  static std::unique_ptr<PipelineProcess> process;
  return process;
}
}  // namespace

PipelineProcess& this_process() {
  if (joined() == nullptr) joined() = std::make_unique<AloneProcess>();
  return *joined();
}

void set_this_process(std::unique_ptr<PipelineProcess> process) { joined() = std::move(process); }

std::function<PipelineStage(const GgufFile&)> stage_picker(PipelineProcess& process, const std::string& layer_split) {
  return [&process, layer_split](const GgufFile& gguf) { return process.stage_for(gguf, layer_split); };
}

bool serve_as_later_rank(PipelineProcess& process, LoadedModel& m) {
  if (process.alone()) return false;
  m.model->connect_pipeline(process.link());
  if (m.model->stage().first()) return false;
  m.model->serve_pipeline();
  return true;
}

}  // namespace ringlm
