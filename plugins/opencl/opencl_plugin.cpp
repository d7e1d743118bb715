// libringlm-opencl.so: the plugin table of backends/plugin_api.h (ABI version 3) on OpenCL 1.2
// devices.
//
// One program (kernels.cl) per device and process, shared by every context opened on that device
// and cached on disk (program_cache.h); each context has its own in-order queue, kernel objects,
// staged asynchronous uploads and counters. Every entry point validates its arguments (buffers,
// offsets and sizes against the buffers' sizes, shapes against supports()) before a CL call sees
// them, turns any failure into a status and the thread's last error, and lets no C++ exception
// through.
#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <string_view>
#include <vector>

#include "backends/plugin_api.h"
#include "plugins/opencl/cl_util.h"
#include "plugins/opencl/kernel_source.h"  // kKernelSource, generated from kernels.cl
#include "plugins/opencl/program_cache.h"

namespace ringlm::opencl {
namespace {

constexpr char kBuildOptions[] = "-cl-std=CL1.2";

// The kernels' compile-time constants (kernels.cl).
constexpr int64_t kBlock = 32;      // BLOCK: matmul K is a multiple of it
constexpr int64_t kMaxM = 16;       // MAX_M: rows of x per matmul call
constexpr int kHeadDimPerItem = 4;  // HD_PER_ITEM: head_dim <= 4 * attention group size
constexpr int kSerialMaxHeadDim = 256;  // SERIAL_HD_MAX: the CPU device's attention
constexpr size_t kNormParts = 64;       // NORM_PARTS: partial sums of squares in the GEMV's norm
constexpr size_t kTopKFan = 16;         // TOP_K_FAN: top_k's second-round mergers per row
constexpr size_t kGemmTile = 64;        // GEMM_T: a GEMM group's tile of y is 64 x 64
constexpr size_t kGemmTileStride = 33;  // GEMM_LDS
constexpr int64_t kMaxGemmM = 4096;     // rows of x one matmul2 call takes (RINGLM_OP_GEMM)
constexpr size_t kGemmCodeStride = 9;   // GEMM_LDI: ints per tile row of gemm_q8's codes
constexpr size_t kTileKeys = 16;        // TILE_KEYS: key slots per block of the tiled attention
constexpr int64_t kTileMaxHeadDim = 256;  // TILE_HD_MAX

// Work-group caps: a group larger than this buys nothing for these kernels and costs occupancy.
constexpr size_t kMaxGroup = 256;
// The matmul's x chunk stays within this much local memory even where a device has more (a
// CPU's "local memory" is its cache; a GPU's is shared by the groups resident on a core).
constexpr size_t kMaxChunkBytes = 32 * 1024;

enum KernelId {
  kMatmulQ4_0,
  kMatmulQ4_1,
  kMatmulQ8_0,
  kMatmulF16,
  kMatmulF32,
  kAttentionF32,
  kAttentionF16,
  kRopeShiftF32,
  kRopeShiftF16,
  kRmsNorm,
  kAddRows,
  kScaleRows,
  kGlu,
  kRope,
  kStoreKvF32,
  kStoreKvF16,
  kGetRows,
  kGemvQ4_0,
  kGemvQ4_1,
  kGemvQ8_0,
  kGemvF16,
  kGemvF32,
  kAttentionSerialF32,
  kAttentionSerialF16,
  kRopeStore,
  kAttentionSplitF32,
  kAttentionSplitF16,
  kAttentionMerge,
  kTopKRows,
  kMatmulOther,
  kGemvQ5_0,
  kGemvQ5_1,
  kGemvIq4Nl,
  kGemvQ4K,
  kGemvQ5K,
  kGemvQ6K,
  kGemvIq4Xs,
  kGemvMxfp4,
  kGemm,
  kGemmQ8,
  kQuantizeRowsQ8,
  kAttentionTileF32,
  kAttentionTileF16,
  kKernelCount
};
constexpr std::array<const char*, kKernelCount> kKernelNames = {
    "matmul_q4_0",    "matmul_q4_1",    "matmul_q8_0",  "matmul_f16",   "matmul_f32", "attention_f32",
    "attention_f16",  "rope_shift_f32", "rope_shift_f16", "rms_norm",   "add_rows",   "scale_rows",
    "glu",            "rope",           "store_kv_f32", "store_kv_f16", "get_rows",
    "gemv_q4_0",      "gemv_q4_1",      "gemv_q8_0",    "gemv_f16",     "gemv_f32",
    "attention_serial_f32", "attention_serial_f16", "rope_store", "attention_split_f32", "attention_split_f16",
    "attention_merge", "top_k_rows", "matmul_other", "gemv_q5_0", "gemv_q5_1", "gemv_iq4_nl", "gemv_q4_k",
    "gemv_q5_k", "gemv_q6_k", "gemv_iq4_xs", "gemv_mxfp4", "gemm", "gemm_q8",
    "quantize_rows_q8", "attention_tile_f32", "attention_tile_f16",
};

// --- The thread's last error ------------------------------------------------------------------

thread_local std::string t_last_error;

void set_last_error(const char* message) noexcept {
  try {
    t_last_error = message;
  } catch (...) {  // no memory for the message: keep the old one rather than throw
  }
}

// Runs `body` and turns whatever it throws into a status and the thread's last error.
template <typename Body>
int32_t guarded(Body&& body) noexcept {
  try {
    body();
    return RINGLM_OK;
  } catch (const Error& e) {
    set_last_error(e.what());
    return e.status();
  } catch (const std::bad_alloc&) {
    set_last_error("out of host memory");
    return RINGLM_ERROR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    set_last_error(e.what());
    return RINGLM_ERROR;
  } catch (...) {
    set_last_error("unknown error");
    return RINGLM_ERROR;
  }
}

// --- Devices and programs ---------------------------------------------------------------------

// What the kernels' geometry depends on, queried once per device.
struct DeviceLimits {
  size_t max_group = 1;                // CL_DEVICE_MAX_WORK_GROUP_SIZE
  std::vector<size_t> max_item_sizes;  // CL_DEVICE_MAX_WORK_ITEM_SIZES, per dimension
  cl_uint compute_units = 1;           // CL_DEVICE_MAX_COMPUTE_UNITS
  cl_ulong local_mem = 0;              // CL_DEVICE_LOCAL_MEM_SIZE
};

// A device's CL context and built program, shared by every ringlm_context open on the device.
struct DeviceProgram {
  cl_device_id device = nullptr;
  std::string name;
  DeviceLimits limits;
  std::string options;      // the program's build options
  bool fast_dot4 = false;   // int8 dot products in hardware (PTX dp4a or cl_khr_integer_dot_product)
  ContextHandle context;
  ProgramHandle program;
};

DeviceLimits query_limits(cl_device_id device) {
  DeviceLimits l;
  l.max_group = device_value<size_t>(device, CL_DEVICE_MAX_WORK_GROUP_SIZE, "CL_DEVICE_MAX_WORK_GROUP_SIZE");
  const auto dims =
      device_value<cl_uint>(device, CL_DEVICE_MAX_WORK_ITEM_DIMENSIONS, "CL_DEVICE_MAX_WORK_ITEM_DIMENSIONS");
  l.max_item_sizes.assign(std::max<cl_uint>(dims, 3), 1);
  check(clGetDeviceInfo(device, CL_DEVICE_MAX_WORK_ITEM_SIZES, dims * sizeof(size_t), l.max_item_sizes.data(), nullptr),
        "clGetDeviceInfo", "CL_DEVICE_MAX_WORK_ITEM_SIZES");
  l.compute_units = device_value<cl_uint>(device, CL_DEVICE_MAX_COMPUTE_UNITS, "CL_DEVICE_MAX_COMPUTE_UNITS");
  l.local_mem = device_value<cl_ulong>(device, CL_DEVICE_LOCAL_MEM_SIZE, "CL_DEVICE_LOCAL_MEM_SIZE");
  return l;
}

cl_device_id device_at(int32_t index) {
  const std::vector<cl_device_id> devices = all_devices();
  require(index >= 0 && static_cast<size_t>(index) < devices.size(), RINGLM_ERROR_INVALID_ARGUMENT,
          "no OpenCL device " + std::to_string(index) + " (there are " + std::to_string(devices.size()) + ")");
  return devices[static_cast<size_t>(index)];
}

// How the kernels' dot4_add runs on a device: "PTX dp4a" on NVIDIA's driver (whose OpenCL lacks
// cl_khr_integer_dot_product but compiles inline PTX), "cl_khr_integer_dot_product" where the
// device has it, "" where four multiply-adds emulate it.
std::string dot4_kind(cl_device_id device) {
  const auto platform = device_value<cl_platform_id>(device, CL_DEVICE_PLATFORM, "CL_DEVICE_PLATFORM");
  if (platform_string(platform, CL_PLATFORM_NAME, "CL_PLATFORM_NAME").find("NVIDIA") != std::string::npos) {
    return "PTX dp4a";
  }
  if (device_string(device, CL_DEVICE_EXTENSIONS, "CL_DEVICE_EXTENSIONS").find("cl_khr_integer_dot_product") !=
      std::string::npos) {
    return "cl_khr_integer_dot_product";
  }
  return "";
}

// The program of device `index`, built once per process: a context opened while another one on
// the same device is open shares its program (and writes it to its own cache_dir if that lacks it).
std::shared_ptr<DeviceProgram> device_program(int32_t index, const ProgramSpec& spec) {
  static std::mutex mutex;
  static std::map<int32_t, std::weak_ptr<DeviceProgram>> programs;
  std::lock_guard lock(mutex);
  if (std::shared_ptr<DeviceProgram> shared = programs[index].lock()) {
    if (spec.verbose) std::fprintf(stderr, "ringlm-opencl: program shared with a context already open\n");
    ProgramSpec own = spec;
    own.options = shared->options;
    store_program_binary(shared->program.get(), shared->device, own);
    return shared;
  }
  auto dp = std::make_shared<DeviceProgram>();
  dp->device = device_at(index);
  dp->name = device_string(dp->device, CL_DEVICE_NAME, "CL_DEVICE_NAME");
  dp->limits = query_limits(dp->device);
  cl_int err = CL_SUCCESS;
  dp->context = ContextHandle(clCreateContext(nullptr, 1, &dp->device, nullptr, nullptr, &err));
  check(err, "clCreateContext");
  const std::string dot4 = dot4_kind(dp->device);
  dp->fast_dot4 = !dot4.empty();
  dp->options = std::string(spec.options) + (dot4 == "PTX dp4a" ? " -D DOT4_PTX" : "");
  ProgramSpec own = spec;
  own.options = dp->options;
  try {
    dp->program = build_program(dp->context.get(), dp->device, own);
  } catch (const Error& e) {
    if (dot4 != "PTX dp4a") throw;
    // A driver that refuses the inline PTX still runs the portable kernels.
    if (spec.verbose) std::fprintf(stderr, "ringlm-opencl: inline PTX refused, building without it: %s\n", e.what());
    dp->options = spec.options;
    dp->fast_dot4 = false;
    own.options = dp->options;
    dp->program = build_program(dp->context.get(), dp->device, own);
  }
  programs[index] = dp;
  return dp;
}

// A kernel object with the limits its compilation put on it.
struct Kernel {
  KernelHandle handle;
  const char* name = "";
  size_t max_group = 1;       // CL_KERNEL_WORK_GROUP_SIZE
  size_t group_multiple = 1;  // CL_KERNEL_PREFERRED_WORK_GROUP_SIZE_MULTIPLE
  cl_ulong local_used = 0;    // CL_KERNEL_LOCAL_MEM_SIZE: local memory taken before our arguments
};

Kernel make_kernel(const DeviceProgram& dp, const char* name) {
  Kernel k;
  k.name = name;
  cl_int err = CL_SUCCESS;
  k.handle = KernelHandle(clCreateKernel(dp.program.get(), name, &err));
  check(err, "clCreateKernel", name);
  const auto info = [&](cl_kernel_work_group_info param, size_t size, void* value) {
    check(clGetKernelWorkGroupInfo(k.handle.get(), dp.device, param, size, value, nullptr), "clGetKernelWorkGroupInfo",
          name);
  };
  info(CL_KERNEL_WORK_GROUP_SIZE, sizeof(k.max_group), &k.max_group);
  info(CL_KERNEL_PREFERRED_WORK_GROUP_SIZE_MULTIPLE, sizeof(k.group_multiple), &k.group_multiple);
  info(CL_KERNEL_LOCAL_MEM_SIZE, sizeof(k.local_used), &k.local_used);
  k.max_group = std::max<size_t>(k.max_group, 1);
  k.group_multiple = std::max<size_t>(k.group_multiple, 1);
  return k;
}

}  // namespace
}  // namespace ringlm::opencl

namespace ringlm::opencl {
namespace {

// The host copy of an upload_async, kept until its write has run.
struct StagedUpload {
  uint64_t seq = 0;                // the context's count of staged uploads when it was enqueued
  std::unique_ptr<uint8_t[]> bytes;
  EventHandle written;             // the write's event
};

// What a context did (ringlm_counters), updated by whichever thread calls in.
struct Counters {
  std::atomic<uint64_t> launches{0};
  std::atomic<uint64_t> upload_bytes{0};
  std::atomic<uint64_t> download_bytes{0};
  std::atomic<uint64_t> waits{0};
};

}  // namespace
}  // namespace ringlm::opencl

// The C API's opaque types (global namespace).
struct ringlm_context {
  std::shared_ptr<ringlm::opencl::DeviceProgram> device;
  ringlm::opencl::QueueHandle queue;
  std::array<ringlm::opencl::Kernel, ringlm::opencl::kKernelCount> kernels;
  std::mutex mutex;  // a kernel's arguments are set and its launch enqueued as one step
  bool cpu_device = false;  // CL_DEVICE_TYPE_CPU: a GEMV row per work-item, not per warp
  bool int8_products = false;  // prompts' GEMM on int8 activations (gemm_q8), not on floats

  // upload_async's copies, in the order of their writes on the (in-order) queue. Under
  // staging_mutex a copy's write is enqueued and next_seq counts it as one step, so a blocking
  // call that read next_seq before it enqueued itself knows, once it returns, that every copy
  // with a smaller seq has been written.
  std::mutex staging_mutex;
  std::deque<ringlm::opencl::StagedUpload> staged;
  uint64_t next_seq = 0;

  ringlm::opencl::Counters counters;

  // Device memory of the context's own, for what passes between the launches of one op (flash-
  // decoding's partial results, top_k's lists): grown on demand, and held under scratch_mutex
  // from before its first launch to after its last, so two threads' ops never share it.
  std::mutex scratch_mutex;
  ringlm::opencl::MemHandle scratch;
  size_t scratch_bytes = 0;
};

struct ringlm_buffer {
  cl_context context = nullptr;  // the CL context it lives in (the mem object keeps it alive)
  ringlm::opencl::MemHandle mem;
  size_t bytes = 0;
};

namespace ringlm::opencl {
namespace {

// --- Geometry helpers -------------------------------------------------------------------------

size_t pow2_floor(size_t v) {
  size_t p = 1;
  while (p * 2 <= v) p *= 2;
  return p;
}
size_t pow2_ceil(size_t v) {
  size_t p = 1;
  while (p < v) p *= 2;
  return p;
}
size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }

// Local memory a kernel may take through its arguments.
size_t local_budget(const ringlm_context& ctx, const Kernel& k) {
  const cl_ulong total = ctx.device->limits.local_mem;
  return total > k.local_used ? static_cast<size_t>(total - k.local_used) : 0;
}

// The largest power-of-two group a kernel may use along dimension `dim` alone.
size_t group_cap(const ringlm_context& ctx, const Kernel& k, int dim) {
  const DeviceLimits& l = ctx.device->limits;
  return pow2_floor(std::min({kMaxGroup, k.max_group, l.max_group, l.max_item_sizes[static_cast<size_t>(dim)]}));
}

// --- Argument checks --------------------------------------------------------------------------

// How a weight format is stored: `weights` per block (32, or 256 in the super-blocks of the
// K-quants and IQ4_XS) in `bytes` bytes; the layouts are GGML's (quant/formats.h). Every format
// has a GEMV kernel of its own; the flat matmul has one for the first five and matmul_other,
// told the format at run time, for the rest.
struct FormatInfo {
  uint32_t format;
  const char* name;
  size_t weights, bytes;
  KernelId gemv, flat;
};
constexpr FormatInfo kFormats[] = {
    {RINGLM_FORMAT_F32, "F32", 32, 128, kGemvF32, kMatmulF32},
    {RINGLM_FORMAT_F16, "F16", 32, 64, kGemvF16, kMatmulF16},
    {RINGLM_FORMAT_Q4_0, "Q4_0", 32, 18, kGemvQ4_0, kMatmulQ4_0},
    {RINGLM_FORMAT_Q4_1, "Q4_1", 32, 20, kGemvQ4_1, kMatmulQ4_1},
    {RINGLM_FORMAT_Q8_0, "Q8_0", 32, 34, kGemvQ8_0, kMatmulQ8_0},
    {RINGLM_FORMAT_Q5_0, "Q5_0", 32, 22, kGemvQ5_0, kMatmulOther},
    {RINGLM_FORMAT_Q5_1, "Q5_1", 32, 24, kGemvQ5_1, kMatmulOther},
    {RINGLM_FORMAT_IQ4_NL, "IQ4_NL", 32, 18, kGemvIq4Nl, kMatmulOther},
    {RINGLM_FORMAT_Q4_K, "Q4_K", 256, 144, kGemvQ4K, kMatmulOther},
    {RINGLM_FORMAT_Q5_K, "Q5_K", 256, 176, kGemvQ5K, kMatmulOther},
    {RINGLM_FORMAT_Q6_K, "Q6_K", 256, 210, kGemvQ6K, kMatmulOther},
    {RINGLM_FORMAT_IQ4_XS, "IQ4_XS", 256, 136, kGemvIq4Xs, kMatmulOther},
    {RINGLM_FORMAT_MXFP4, "MXFP4", 32, 17, kGemvMxfp4, kMatmulOther},
};

// The format's entry; nullptr for one the plugin does not read.
const FormatInfo* format_info(uint32_t format) {
  for (const FormatInfo& f : kFormats) {
    if (f.format == format) return &f;
  }
  return nullptr;
}
const char* format_name(uint32_t format) {
  const FormatInfo* f = format_info(format);
  return f != nullptr ? f->name : nullptr;
}
// Bytes of a row of k weights (k a multiple of the format's block).
size_t row_bytes_of(uint32_t format, size_t k) {
  const FormatInfo& f = *format_info(format);
  return k / f.weights * f.bytes;
}

// Bytes of one KV cache element; 0 for a format the cache cannot have.
size_t kv_element_bytes(uint32_t format) {
  return format == RINGLM_FORMAT_F16 ? 2 : format == RINGLM_FORMAT_F32 ? 4 : 0;
}

// a * b, or an INVALID_ARGUMENT error naming `what` when it does not fit in size_t.
size_t mul(size_t a, size_t b, const char* what) {
  size_t r = 0;
  require(!__builtin_mul_overflow(a, b, &r), RINGLM_ERROR_INVALID_ARGUMENT, std::string(what) + " overflows");
  return r;
}
size_t add(size_t a, size_t b, const char* what) {
  size_t r = 0;
  require(!__builtin_add_overflow(a, b, &r), RINGLM_ERROR_INVALID_ARGUMENT, std::string(what) + " overflows");
  return r;
}

// The buffer behind an argument, which must exist, belong to ctx's device, and hold `bytes`
// bytes from `offset` on (offset a multiple of `align`).
cl_mem buffer_range(const ringlm_context& ctx, const ringlm_buffer* buffer, size_t offset, size_t bytes, size_t align,
                    const char* what) {
  const std::string name(what);
  require(buffer != nullptr, RINGLM_ERROR_INVALID_ARGUMENT, name + ": null buffer");
  require(buffer->context == ctx.device->context.get(), RINGLM_ERROR_INVALID_ARGUMENT,
          name + ": buffer of another device");
  require(offset % align == 0, RINGLM_ERROR_INVALID_ARGUMENT,
          name + ": offset " + std::to_string(offset) + " is not a multiple of " + std::to_string(align));
  const size_t end = add(offset, bytes, what);
  require(end <= buffer->bytes, RINGLM_ERROR_INVALID_ARGUMENT,
          name + ": bytes [" + std::to_string(offset) + ", " + std::to_string(end) + ") past the buffer's " +
              std::to_string(buffer->bytes));
  return buffer->mem.get();
}

// Why matmul cannot take these shapes ("" when it can).
std::string matmul_unsupported(uint32_t format, int64_t m, int64_t n, int64_t k) {
  if (format_name(format) == nullptr) return "matmul: unknown weight format " + std::to_string(format);
  if (m < 1 || m > kMaxM)
    return "matmul: m = " + std::to_string(m) + " (1.." + std::to_string(kMaxM) + " rows per call)";
  if (n < 1 || n > INT32_MAX) return "matmul: n = " + std::to_string(n);
  const int64_t block = static_cast<int64_t>(format_info(format)->weights);
  if (k < block || k % block != 0 || k > INT32_MAX) {
    return "matmul: k = " + std::to_string(k) + " (a positive multiple of " + std::to_string(block) + " for " +
           format_name(format) + ")";
  }
  return "";
}

// The largest head_dim the attention kernel takes on this context's device.
int max_head_dim(const ringlm_context& ctx) {
  const size_t group =
      std::min(group_cap(ctx, ctx.kernels[kAttentionF32], 0), group_cap(ctx, ctx.kernels[kAttentionF16], 0));
  return kHeadDimPerItem * static_cast<int>(group);
}

std::string attention_unsupported(const ringlm_context& ctx, uint32_t kv_format, int32_t n_head, int32_t n_head_kv,
                                  int32_t head_dim) {
  if (kv_element_bytes(kv_format) == 0) return "attention: KV format " + std::to_string(kv_format) + " (F16 or F32)";
  if (n_head < 1 || n_head_kv < 1 || n_head % n_head_kv != 0) {
    return "attention: n_head = " + std::to_string(n_head) +
           " is not a multiple of n_head_kv = " + std::to_string(n_head_kv);
  }
  if (head_dim < 4 || head_dim % 4 != 0 || head_dim > max_head_dim(ctx)) {
    return "attention: head_dim = " + std::to_string(head_dim) + " (a multiple of 4 up to " +
           std::to_string(max_head_dim(ctx)) + " on this device)";
  }
  return "";
}

std::string rope_shift_unsupported(uint32_t kv_format, int32_t n_head_kv, int32_t head_dim, int32_t n_rot) {
  if (kv_element_bytes(kv_format) == 0) return "rope_shift: KV format " + std::to_string(kv_format) + " (F16 or F32)";
  if (n_head_kv < 1 || head_dim < 1) return "rope_shift: n_head_kv and head_dim must be positive";
  if (n_rot < 2 || n_rot % 2 != 0 || n_rot > head_dim) {
    return "rope_shift: n_rot = " + std::to_string(n_rot) + " (even, up to head_dim = " + std::to_string(head_dim) +
           ")";
  }
  return "";
}

// --- Kernel launches --------------------------------------------------------------------------

struct LocalFloats {  // a __local float* argument of this many floats
  size_t count;
};
struct LocalInts {  // a __local int* argument of this many ints
  size_t count;
};

void set_arg(const Kernel& k, cl_uint i, size_t size, const void* value) {
  check(clSetKernelArg(k.handle.get(), i, size, value), "clSetKernelArg", k.name);
}
void set_arg(const Kernel& k, cl_uint i, cl_mem v) { set_arg(k, i, sizeof(v), &v); }
void set_arg(const Kernel& k, cl_uint i, cl_int v) { set_arg(k, i, sizeof(v), &v); }
void set_arg(const Kernel& k, cl_uint i, cl_long v) { set_arg(k, i, sizeof(v), &v); }
void set_arg(const Kernel& k, cl_uint i, cl_ulong v) { set_arg(k, i, sizeof(v), &v); }
void set_arg(const Kernel& k, cl_uint i, cl_float v) { set_arg(k, i, sizeof(v), &v); }
void set_arg(const Kernel& k, cl_uint i, LocalFloats v) { set_arg(k, i, v.count * sizeof(float), nullptr); }
void set_arg(const Kernel& k, cl_uint i, LocalInts v) { set_arg(k, i, v.count * sizeof(cl_int), nullptr); }

// Sets the kernel's arguments in order (each exactly of the kernel parameter's CL type) and
// enqueues it on the context's queue: one launch in the context's counters.
template <typename... Args>
void launch(ringlm_context& ctx, KernelId id, cl_uint dims, const size_t* global, const size_t* local,
            const Args&... args) {
  const Kernel& k = ctx.kernels[id];
  std::lock_guard lock(ctx.mutex);
  cl_uint i = 0;
  (set_arg(k, i++, args), ...);
  check(clEnqueueNDRangeKernel(ctx.queue.get(), k.handle.get(), dims, nullptr, global, local, 0, nullptr, nullptr),
        "clEnqueueNDRangeKernel", k.name);
  ctx.counters.launches.fetch_add(1, std::memory_order_relaxed);
}

// An element-wise kernel over n items (n >= 1): a 1-D grid of whole work-groups of the kernel's
// largest power-of-two size (up to kMaxGroup), the items past n idle.
template <typename... Args>
void launch_1d(ringlm_context& ctx, KernelId id, size_t n, const Args&... args) {
  const size_t group = group_cap(ctx, ctx.kernels[id], 0);
  const size_t global = mul(ceil_div(n, group), group, "grid size");
  launch(ctx, id, 1, &global, &group, args...);
}

cl_int as_int(int64_t v) { return static_cast<cl_int>(v); }

// --- Staged uploads and blocking calls --------------------------------------------------------

// Frees the staged upload_async copies whose writes have run: those older than `upto` (a
// blocking call that read next_seq before it enqueued itself has returned, and the queue is in
// order), and from the oldest on, those whose write event says so.
void release_staged(ringlm_context& ctx, uint64_t upto) {
  std::lock_guard lock(ctx.staging_mutex);
  while (!ctx.staged.empty()) {
    const StagedUpload& oldest = ctx.staged.front();
    if (oldest.seq >= upto) {
      cl_int status = CL_QUEUED;
      const cl_int err = clGetEventInfo(oldest.written.get(), CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof(status),
                                        &status, nullptr);
      // Complete, or ended in error (a negative status): either way the copy is no longer read.
      if (err != CL_SUCCESS || (status != CL_COMPLETE && status >= 0)) break;
    }
    ctx.staged.pop_front();
  }
}

// Runs `call`, a CL call that blocks until the device is done with it (a blocking read or
// write, clFinish): one wait in the counters, and then every staged copy enqueued before it is free.
template <typename Call>
void blocking(ringlm_context& ctx, Call call) {
  uint64_t upto = 0;
  {
    std::lock_guard lock(ctx.staging_mutex);
    upto = ctx.next_seq;
  }
  call();
  ctx.counters.waits.fetch_add(1, std::memory_order_relaxed);
  release_staged(ctx, upto);
}

void run_upload(ringlm_context& ctx, ringlm_buffer* dst, size_t offset, const void* src, size_t bytes) {
  const cl_mem mem = buffer_range(ctx, dst, offset, bytes, 1, "upload");
  if (bytes == 0) return;
  require(src != nullptr, RINGLM_ERROR_INVALID_ARGUMENT, "upload: null source");
  blocking(ctx, [&] {
    check(clEnqueueWriteBuffer(ctx.queue.get(), mem, CL_TRUE, offset, bytes, src, 0, nullptr, nullptr),
          "clEnqueueWriteBuffer");
  });
  ctx.counters.upload_bytes.fetch_add(bytes, std::memory_order_relaxed);
}

// The caller's bytes are copied into a StagedUpload, written from there without waiting, and
// the copy kept until the write has run (release_staged).
void run_upload_async(ringlm_context& ctx, ringlm_buffer* dst, size_t offset, const void* src, size_t bytes) {
  const cl_mem mem = buffer_range(ctx, dst, offset, bytes, 1, "upload_async");
  if (bytes == 0) return;
  require(src != nullptr, RINGLM_ERROR_INVALID_ARGUMENT, "upload_async: null source");
  release_staged(ctx, 0);  // the copies of writes already done
  std::unique_ptr<uint8_t[]> copy(new uint8_t[bytes]);
  std::memcpy(copy.get(), src, bytes);

  std::lock_guard lock(ctx.staging_mutex);
  // The copy joins the list before its write is enqueued (nothing can throw after the enqueue,
  // which would free a copy the device still reads) and counts as enqueued (next_seq) after.
  ctx.staged.push_back(StagedUpload{ctx.next_seq, std::move(copy), EventHandle()});
  StagedUpload& staged = ctx.staged.back();
  cl_event written = nullptr;
  const cl_int err = clEnqueueWriteBuffer(ctx.queue.get(), mem, CL_FALSE, offset, bytes, staged.bytes.get(), 0,
                                          nullptr, &written);
  if (err != CL_SUCCESS) {
    ctx.staged.pop_back();
    check(err, "clEnqueueWriteBuffer", "upload_async");
  }
  staged.written = EventHandle(written);
  ++ctx.next_seq;
  ctx.counters.upload_bytes.fetch_add(bytes, std::memory_order_relaxed);
}

void run_download(ringlm_context& ctx, const ringlm_buffer* src, size_t offset, void* dst, size_t bytes) {
  const cl_mem mem = buffer_range(ctx, src, offset, bytes, 1, "download");
  if (bytes == 0) return;
  require(dst != nullptr, RINGLM_ERROR_INVALID_ARGUMENT, "download: null destination");
  blocking(ctx, [&] {
    check(clEnqueueReadBuffer(ctx.queue.get(), mem, CL_TRUE, offset, bytes, dst, 0, nullptr, nullptr),
          "clEnqueueReadBuffer");
  });
  ctx.counters.download_bytes.fetch_add(bytes, std::memory_order_relaxed);
}

void run_finish(ringlm_context& ctx) {
  blocking(ctx, [&] { check(clFinish(ctx.queue.get()), "clFinish"); });
}

// Whether byte ranges [a_offset, + a_bytes) of a and [b_offset, + b_bytes) of b share a byte.
bool overlap(const ringlm_buffer* a, size_t a_offset, size_t a_bytes, const ringlm_buffer* b, size_t b_offset,
             size_t b_bytes) {
  return a == b && a_bytes > 0 && b_bytes > 0 && a_offset < b_offset + b_bytes && b_offset < a_offset + a_bytes;
}
// Whether they overlap other than as the very same range (which an element-wise op may update in place).
bool partly_overlap(const ringlm_buffer* a, size_t a_offset, size_t a_bytes, const ringlm_buffer* b,
                    size_t b_offset, size_t b_bytes) {
  return overlap(a, a_offset, a_bytes, b, b_offset, b_bytes) && !(a_offset == b_offset && a_bytes == b_bytes);
}

// Device-side copy. It is device work enqueued like a kernel, so the counters take it as one
// launch; it moves no bytes between host and device, so neither byte counter changes.
void run_copy(ringlm_context& ctx, ringlm_buffer* dst, size_t dst_offset, const ringlm_buffer* src,
              size_t src_offset, size_t bytes) {
  const cl_mem d = buffer_range(ctx, dst, dst_offset, bytes, 1, "copy dst");
  const cl_mem s = buffer_range(ctx, src, src_offset, bytes, 1, "copy src");
  require(!overlap(dst, dst_offset, bytes, src, src_offset, bytes), RINGLM_ERROR_INVALID_ARGUMENT,
          "copy: the source and destination ranges overlap");
  if (bytes == 0) return;
  check(clEnqueueCopyBuffer(ctx.queue.get(), s, d, src_offset, dst_offset, bytes, 0, nullptr, nullptr),
        "clEnqueueCopyBuffer");
  ctx.counters.launches.fetch_add(1, std::memory_order_relaxed);
}

// --- Matmul -----------------------------------------------------------------------------------

// How a matmul call is cut: `lanes` work-items share a weight row, `rows` rows make a group,
// `groups` groups cover n; x goes through local memory `kc` columns at a time.
struct MatmulGeometry {
  size_t lanes = 1, rows = 1, groups = 1;
  size_t kc = kBlock;
  size_t local_floats = 0;
};

MatmulGeometry matmul_geometry(const ringlm_context& ctx, const Kernel& kernel, int64_t m, int64_t n, int64_t k) {
  const size_t budget = local_budget(ctx, kernel) / sizeof(float);
  MatmulGeometry g;
  const size_t chunk_floats = std::min(budget, kMaxChunkBytes / sizeof(float));
  // Lanes per row: the device's preferred multiple (a warp, a SIMD width), but no more than the
  // blocks of a chunk of all kMaxM rows, or lanes would idle. Nothing here depends on m, so a
  // row of x meets the same blocks in the same lanes in the same order whatever m is: its
  // result does not depend on the other rows of the call (batched = alone, bit for bit).
  const size_t smallest_kc = std::clamp<size_t>(chunk_floats / kMaxM / kBlock * kBlock, kBlock, static_cast<size_t>(k));
  g.lanes = std::min({pow2_floor(kernel.group_multiple), pow2_floor(smallest_kc / kBlock), group_cap(ctx, kernel, 0)});
  g.rows = std::max<size_t>(
      1, std::min(group_cap(ctx, kernel, 1), pow2_floor(std::min(kernel.max_group, kMaxGroup) / g.lanes)));
  // Enough groups to keep every compute unit busy (two each), even for a short n.
  const size_t want_groups = 2 * static_cast<size_t>(ctx.device->limits.compute_units);
  while (g.rows > 1 && ceil_div(static_cast<size_t>(n), g.rows) < want_groups) g.rows /= 2;
  // The lanes' sums go through the same local memory at the end.
  while (g.rows > 1 && g.lanes * g.rows * kMaxM > budget) g.rows /= 2;
  while (g.lanes > 1 && g.lanes * g.rows * kMaxM > budget) g.lanes /= 2;
  // The x chunk: as many columns of all m rows as the budget holds, in whole rounds of the
  // lanes (each chunk then starts on lane 0's block), k at most.
  const size_t round = g.lanes * kBlock;
  g.kc = std::min<size_t>(std::max<size_t>(chunk_floats / static_cast<size_t>(m) / round * round, round),
                          static_cast<size_t>(k));
  g.groups = ceil_div(static_cast<size_t>(n), g.rows);
  g.local_floats = std::max(static_cast<size_t>(m) * g.kc, g.lanes * g.rows * kMaxM);
  require(g.local_floats <= budget, RINGLM_ERROR_UNSUPPORTED,
          std::string("matmul: ") + kernel.name + " needs more local memory than the device has");
  return g;
}

void run_matmul(ringlm_context& ctx, const ringlm_matmul_args& a) {
  const std::string why = matmul_unsupported(a.weight_format, a.m, a.n, a.k);
  if (!why.empty()) {
    const bool invalid = a.m < 1 || a.n < 1 || a.k < 1;
    throw Error(invalid ? RINGLM_ERROR_INVALID_ARGUMENT : RINGLM_ERROR_UNSUPPORTED, why);
  }
  const size_t m = static_cast<size_t>(a.m), n = static_cast<size_t>(a.n), k = static_cast<size_t>(a.k);
  const size_t row_bytes = row_bytes_of(a.weight_format, k);
  const cl_mem w = buffer_range(ctx, a.weight, 0, mul(n, row_bytes, "matmul: weight size"), 1, "matmul weight");
  const cl_mem x = buffer_range(ctx, a.x, a.x_offset, mul(mul(m, k, "matmul: x size"), sizeof(float), "matmul: x size"),
                                sizeof(float), "matmul x");
  const cl_mem y = buffer_range(ctx, a.y, a.y_offset, mul(mul(m, n, "matmul: y size"), sizeof(float), "matmul: y size"),
                                sizeof(float), "matmul y");

  const FormatInfo& f = *format_info(a.weight_format);
  const MatmulGeometry g = matmul_geometry(ctx, ctx.kernels[f.flat], a.m, a.n, a.k);
  const size_t global[2] = {g.lanes, g.groups * g.rows};
  const size_t local[2] = {g.lanes, g.rows};
  const auto go = [&](const auto&... format_args) {
    launch(ctx, f.flat, 2, global, local, w, as_int(a.n), as_int(a.k), x, cl_ulong{a.x_offset / sizeof(float)},
           as_int(a.m), y, cl_ulong{a.y_offset / sizeof(float)}, as_int(static_cast<int64_t>(g.kc)),
           LocalFloats{g.local_floats}, format_args...);
  };
  if (f.flat == kMatmulOther) {
    go(cl_int{static_cast<cl_int>(f.format)}, cl_int{static_cast<cl_int>(f.bytes)});
  } else {
    go();
  }
}


// --- Attention --------------------------------------------------------------------------------

// The context's scratch memory, at least `bytes` of it; the caller holds ctx.scratch_mutex. A
// smaller old buffer is released, which OpenCL defers until the launches that use it have run.
cl_mem scratch_buffer(ringlm_context& ctx, size_t bytes) {
  if (ctx.scratch_bytes < bytes) {
    const size_t grown = std::max(bytes, 2 * ctx.scratch_bytes);
    cl_int err = CL_SUCCESS;
    MemHandle mem(clCreateBuffer(ctx.device->context.get(), CL_MEM_READ_WRITE, grown, nullptr, &err));
    if (err == CL_MEM_OBJECT_ALLOCATION_FAILURE || err == CL_OUT_OF_RESOURCES) {
      throw Error(RINGLM_ERROR_OUT_OF_MEMORY, "scratch memory of " + std::to_string(grown) + " bytes: out of device memory");
    }
    check(err, "clCreateBuffer", "scratch of " + std::to_string(grown) + " bytes");
    ctx.scratch = std::move(mem);
    ctx.scratch_bytes = grown;
  }
  return ctx.scratch.get();
}

// Flash-decoding: how many splits of the keys attention runs in (1: one group per head and token).
// Only a GPU whose cores one group per (head, token) leaves idle, over a long cache, gains: a
// split must hold kMinSplitSlots slots to pay for the merge's launch, and the splits fill about
// kGroupsPerCore groups per compute unit. Each split is a whole number of key blocks.
constexpr size_t kMinSplitSlots = 512;
constexpr size_t kGroupsPerCore = 2;
constexpr size_t kMaxSplits = 64;
// Slots per split: a whole number of key blocks.
size_t split_length(size_t slots, size_t splits, size_t group) {
  return ceil_div(ceil_div(slots, splits), group) * group;
}
size_t attention_splits(const ringlm_context& ctx, const ringlm_attention_args& a, size_t group) {
  const size_t groups = static_cast<size_t>(a.n_head) * static_cast<size_t>(a.n_tokens);
  const size_t wanted = kGroupsPerCore * ctx.device->limits.compute_units;
  const size_t slots = static_cast<size_t>(a.n_slots);
  if (groups >= wanted || slots < 2 * kMinSplitSlots) return 1;
  const size_t splits = std::min({ceil_div(wanted, groups), slots / kMinSplitSlots, kMaxSplits});
  return ceil_div(slots, split_length(slots, splits, group));
}

// The attention kernels' sink arguments: the buffer, the offset in floats, whether to read them
// (without sinks, some buffer of the call that the kernel never reads).
struct SinkArgs {
  cl_mem buffer = nullptr;
  cl_ulong offset = 0;
  cl_int present = 0;
};

// The splits' launch (a group per head, token and split, each leaving a partial record in the
// scratch memory) and the merge's, which adds the sinks.
void run_attention_split(ringlm_context& ctx, const ringlm_attention_args& a, int32_t window, size_t group,
                         size_t splits, cl_mem q, cl_mem out, cl_mem keys, cl_mem values, cl_mem positions,
                         const SinkArgs& sinks) {
  const size_t elem = kv_element_bytes(a.kv_format);
  const size_t head_dim = static_cast<size_t>(a.head_dim);
  const size_t split_len = split_length(static_cast<size_t>(a.n_slots), splits, group);
  const size_t record_floats = head_dim + 2;
  const size_t partial_bytes =
      mul(mul(static_cast<size_t>(a.n_tokens) * static_cast<size_t>(a.n_head), splits, "attention: splits"),
          record_floats * sizeof(float), "attention: splits");
  std::lock_guard lock(ctx.scratch_mutex);
  const cl_mem partial = scratch_buffer(ctx, partial_bytes);
  const KernelId id = a.kv_format == RINGLM_FORMAT_F16 ? kAttentionSplitF16 : kAttentionSplitF32;
  const size_t global[3] = {static_cast<size_t>(a.n_head) * group, static_cast<size_t>(a.n_tokens), splits};
  const size_t local[3] = {group, 1, 1};
  launch(ctx, id, 3, global, local, q, cl_ulong{a.q_offset / sizeof(float)}, partial, keys,
         cl_ulong{a.keys_offset / elem}, values, cl_ulong{a.values_offset / elem}, cl_long{a.row_stride}, positions,
         cl_int{a.n_slots}, cl_long{a.q_pos0}, cl_int{a.n_head}, cl_int{a.n_head_kv}, cl_int{a.head_dim},
         cl_float{a.scale}, cl_int{window}, as_int(static_cast<int64_t>(split_len)),
         as_int(static_cast<int64_t>(splits)), LocalFloats{head_dim}, LocalFloats{group}, LocalFloats{group});
  const size_t merge_global[3] = {head_dim, static_cast<size_t>(a.n_head), static_cast<size_t>(a.n_tokens)};
  launch(ctx, kAttentionMerge, 3, merge_global, nullptr, partial, as_int(static_cast<int64_t>(splits)),
         cl_int{a.n_head}, cl_int{a.head_dim}, out, cl_ulong{a.out_offset / sizeof(float)}, sinks.buffer, sinks.offset,
         sinks.present);
}

// Prompt chunks of at least this many tokens take the tiled attention on a GPU: each block of keys
// and values is then read once per tile of queries instead of once per query.
constexpr int64_t kMinTileTokens = 8;

// Query tokens per group of the tiled attention: 16, or fewer where the tile's queries, keys and
// values do not fit the local memory (head_dim 256 on 48 KiB); 0 when not even 4 do.
size_t attention_tile_queries(const ringlm_context& ctx, const Kernel& k, size_t head_dim) {
  for (size_t tq = 16; tq >= 4; tq /= 2) {
    const size_t bytes = ((tq + 2 * kTileKeys) * head_dim + tq * kTileKeys) * sizeof(float) + kTileKeys * sizeof(cl_int);
    if (kTileKeys * tq <= std::min(k.max_group, kMaxGroup) && ctx.device->limits.max_item_sizes[1] >= tq &&
        bytes <= local_budget(ctx, k)) {
      return tq;
    }
  }
  return 0;
}

// Attention (v1: window 0), attention2 and attention3: one kernel, a key at position pos being
// visible to the query at position p iff 0 <= pos <= p and (window == 0 || pos > p - window), and
// with sinks (attention3) each head's sink in its denominator.
void run_attention_window(ringlm_context& ctx, const ringlm_attention_args& a, int32_t window,
                          const ringlm_buffer* sinks_buffer = nullptr, size_t sinks_offset = 0) {
  require(window >= 0, RINGLM_ERROR_INVALID_ARGUMENT, "attention2: window = " + std::to_string(window));
  const std::string why = attention_unsupported(ctx, a.kv_format, a.n_head, a.n_head_kv, a.head_dim);
  if (!why.empty()) throw Error(RINGLM_ERROR_UNSUPPORTED, why);
  require(a.n_tokens >= 1, RINGLM_ERROR_INVALID_ARGUMENT, "attention: n_tokens = " + std::to_string(a.n_tokens));
  require(a.n_slots >= 0, RINGLM_ERROR_INVALID_ARGUMENT, "attention: n_slots = " + std::to_string(a.n_slots));
  require(a.q_pos0 >= 0, RINGLM_ERROR_INVALID_ARGUMENT, "attention: q_pos0 = " + std::to_string(a.q_pos0));
  const size_t kv_width = static_cast<size_t>(a.n_head_kv) * static_cast<size_t>(a.head_dim);
  require(a.row_stride >= static_cast<int64_t>(kv_width), RINGLM_ERROR_INVALID_ARGUMENT,
          "attention: row_stride = " + std::to_string(a.row_stride) + " is less than n_head_kv * head_dim");

  const size_t elem = kv_element_bytes(a.kv_format);
  const size_t q_floats =
      mul(static_cast<size_t>(a.n_tokens), static_cast<size_t>(a.n_head) * a.head_dim, "attention: q size");
  // Slot j's row ends at j * row_stride + n_head_kv * head_dim elements.
  const size_t kv_elems =
      a.n_slots == 0
          ? 0
          : add(mul(static_cast<size_t>(a.n_slots) - 1, static_cast<size_t>(a.row_stride), "attention: cache size"),
                kv_width, "attention: cache size");
  const size_t kv_bytes = mul(kv_elems, elem, "attention: cache size");
  const cl_mem q = buffer_range(ctx, a.q, a.q_offset, q_floats * sizeof(float), sizeof(float), "attention q");
  const cl_mem out = buffer_range(ctx, a.out, a.out_offset, q_floats * sizeof(float), sizeof(float), "attention out");
  const cl_mem keys = buffer_range(ctx, a.keys, a.keys_offset, kv_bytes, elem, "attention keys");
  const cl_mem values = buffer_range(ctx, a.values, a.values_offset, kv_bytes, elem, "attention values");
  const cl_mem positions =
      buffer_range(ctx, a.positions, 0, static_cast<size_t>(a.n_slots) * sizeof(int32_t), 1, "attention positions");
  SinkArgs sinks{q, 0, 0};
  if (sinks_buffer != nullptr) {
    sinks = {buffer_range(ctx, sinks_buffer, sinks_offset, static_cast<size_t>(a.n_head) * sizeof(float), sizeof(float),
                          "attention sinks"),
             cl_ulong{sinks_offset / sizeof(float)}, 1};
  }

  // On a CPU device, a work-item per (query head, token), the online softmax run serially.
  if (ctx.cpu_device && a.head_dim <= kSerialMaxHeadDim) {
    const KernelId serial = a.kv_format == RINGLM_FORMAT_F16 ? kAttentionSerialF16 : kAttentionSerialF32;
    const size_t grid[2] = {static_cast<size_t>(a.n_head), static_cast<size_t>(a.n_tokens)};
    launch(ctx, serial, 2, grid, nullptr, q, cl_ulong{a.q_offset / sizeof(float)}, out,
           cl_ulong{a.out_offset / sizeof(float)}, keys, cl_ulong{a.keys_offset / elem}, values,
           cl_ulong{a.values_offset / elem}, cl_long{a.row_stride}, positions, cl_int{a.n_slots}, cl_long{a.q_pos0},
           cl_int{a.n_head}, cl_int{a.n_head_kv}, cl_int{a.head_dim}, cl_float{a.scale}, cl_int{window}, sinks.buffer,
           sinks.offset, sinks.present);
    return;
  }
  // A group of B work-items per (query head, token): B slots per block of keys, and B * 4 >= head_dim
  // output dimensions. B about head_dim balances the two halves of the work (scores: one key per
  // work-item; values: one dimension per work-item, every key of the block).
  const KernelId id = a.kv_format == RINGLM_FORMAT_F16 ? kAttentionF16 : kAttentionF32;
  const size_t head_dim = static_cast<size_t>(a.head_dim);
  const size_t group = std::min(group_cap(ctx, ctx.kernels[id], 0), pow2_ceil(head_dim));
  require(group * kHeadDimPerItem >= head_dim &&
              (head_dim + 2 * group) * sizeof(float) <= local_budget(ctx, ctx.kernels[id]),
          RINGLM_ERROR_UNSUPPORTED,
          "attention: head_dim " + std::to_string(head_dim) + " is too large for this device");
  if (a.n_tokens >= kMinTileTokens && a.head_dim <= kTileMaxHeadDim && !ctx.cpu_device) {
    const KernelId tiled = a.kv_format == RINGLM_FORMAT_F16 ? kAttentionTileF16 : kAttentionTileF32;
    if (const size_t tq = attention_tile_queries(ctx, ctx.kernels[tiled], head_dim); tq > 0) {
      const size_t global[2] = {static_cast<size_t>(a.n_head) * kTileKeys,
                                ceil_div(static_cast<size_t>(a.n_tokens), tq) * tq};
      const size_t local[2] = {kTileKeys, tq};
      launch(ctx, tiled, 2, global, local, q, cl_ulong{a.q_offset / sizeof(float)}, out,
             cl_ulong{a.out_offset / sizeof(float)}, keys, cl_ulong{a.keys_offset / elem}, values,
             cl_ulong{a.values_offset / elem}, cl_long{a.row_stride}, positions, cl_int{a.n_slots},
             as_int(a.n_tokens), cl_long{a.q_pos0}, cl_int{a.n_head}, cl_int{a.n_head_kv}, cl_int{a.head_dim},
             cl_float{a.scale}, cl_int{window}, sinks.buffer, sinks.offset, sinks.present,
             LocalFloats{tq * head_dim}, LocalFloats{kTileKeys * head_dim},
             LocalFloats{kTileKeys * head_dim}, LocalFloats{tq * kTileKeys}, LocalInts{kTileKeys});
      return;
    }
  }
  const size_t splits = attention_splits(ctx, a, group);
  if (splits > 1) {
    run_attention_split(ctx, a, window, group, splits, q, out, keys, values, positions, sinks);
    return;
  }
  const size_t global[2] = {static_cast<size_t>(a.n_head) * group, static_cast<size_t>(a.n_tokens)};
  const size_t local[2] = {group, 1};
  launch(ctx, id, 2, global, local, q, cl_ulong{a.q_offset / sizeof(float)}, out,
         cl_ulong{a.out_offset / sizeof(float)}, keys, cl_ulong{a.keys_offset / elem}, values,
         cl_ulong{a.values_offset / elem}, cl_long{a.row_stride}, positions, cl_int{a.n_slots}, cl_long{a.q_pos0},
         cl_int{a.n_head}, cl_int{a.n_head_kv}, cl_int{a.head_dim}, cl_float{a.scale}, cl_int{window}, sinks.buffer,
         sinks.offset, sinks.present, LocalFloats{head_dim}, LocalFloats{group}, LocalFloats{group});
}

void run_attention(ringlm_context& ctx, const ringlm_attention_args& a) { run_attention_window(ctx, a, 0); }
void run_attention2(ringlm_context& ctx, const ringlm_attention2_args& a) {
  run_attention_window(ctx, a.base, a.window);
}
void run_attention3(ringlm_context& ctx, const ringlm_attention3_args& a) {
  run_attention_window(ctx, a.base.base, a.base.window, a.sinks, a.sinks_offset);
}

// --- Shift-RoPE -------------------------------------------------------------------------------

// The slot list, read back to check it before the kernel writes through it: every slot must lie
// within the keys buffer in every layer, and appear once (twice would rotate it twice, racing).
// A blocking read, but a shift happens once per thousands of tokens.
void check_slots(ringlm_context& ctx, const ringlm_rope_shift_args& a, cl_mem slots, size_t max_slot) {
  std::vector<int32_t> sorted(static_cast<size_t>(a.n_moved));
  blocking(ctx, [&] {
    check(clEnqueueReadBuffer(ctx.queue.get(), slots, CL_TRUE, 0, sorted.size() * sizeof(int32_t), sorted.data(), 0,
                              nullptr, nullptr),
          "clEnqueueReadBuffer", "rope_shift slots");
  });
  std::sort(sorted.begin(), sorted.end());
  require(sorted.front() >= 0 && static_cast<size_t>(sorted.back()) <= max_slot, RINGLM_ERROR_INVALID_ARGUMENT,
          "rope_shift: slot " + std::to_string(sorted.front() < 0 ? sorted.front() : sorted.back()) +
              " outside the keys buffer (slots 0.." + std::to_string(max_slot) + ")");
  require(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(), RINGLM_ERROR_INVALID_ARGUMENT,
          "rope_shift: a slot appears twice in the list");
}

void run_rope_shift(ringlm_context& ctx, const ringlm_rope_shift_args& a) {
  const std::string why = rope_shift_unsupported(a.kv_format, a.n_head_kv, a.head_dim, a.n_rot);
  if (!why.empty()) throw Error(RINGLM_ERROR_UNSUPPORTED, why);
  require(a.n_layer >= 1 && a.n_moved >= 0, RINGLM_ERROR_INVALID_ARGUMENT,
          "rope_shift: n_layer = " + std::to_string(a.n_layer) + ", n_moved = " + std::to_string(a.n_moved));
  const size_t elem = kv_element_bytes(a.kv_format);
  const size_t kv_width = static_cast<size_t>(a.n_head_kv) * static_cast<size_t>(a.head_dim);
  require(a.row_stride >= static_cast<int64_t>(kv_width), RINGLM_ERROR_INVALID_ARGUMENT,
          "rope_shift: row_stride = " + std::to_string(a.row_stride) + " is less than n_head_kv * head_dim");
  require(a.layer_stride_bytes % elem == 0, RINGLM_ERROR_INVALID_ARGUMENT,
          "rope_shift: layer_stride_bytes is not a multiple of the element size");

  // Slot 0 of the last layer must fit; the slot list is checked against the rest of the buffer.
  const size_t last_layer = mul(static_cast<size_t>(a.n_layer) - 1, a.layer_stride_bytes, "rope_shift: keys size");
  const size_t first_row = add(last_layer, kv_width * elem, "rope_shift: keys size");
  const cl_mem keys = buffer_range(ctx, a.keys, a.keys_offset, first_row, elem, "rope_shift keys");
  const cl_mem cos_sin =
      buffer_range(ctx, a.cos_sin, 0, static_cast<size_t>(a.n_rot) * sizeof(float), 1, "rope_shift cos_sin");
  const cl_mem slots =
      buffer_range(ctx, a.slots, 0, static_cast<size_t>(a.n_moved) * sizeof(int32_t), 1, "rope_shift slots");
  if (a.n_moved == 0) return;
  const size_t row_bytes = mul(static_cast<size_t>(a.row_stride), elem, "rope_shift: row size");
  check_slots(ctx, a, slots, (a.keys->bytes - a.keys_offset - first_row) / row_bytes);

  const KernelId id = a.kv_format == RINGLM_FORMAT_F16 ? kRopeShiftF16 : kRopeShiftF32;
  const size_t global[3] = {static_cast<size_t>(a.n_rot / 2), static_cast<size_t>(a.n_head_kv),
                            mul(static_cast<size_t>(a.n_moved), static_cast<size_t>(a.n_layer), "rope_shift: grid")};
  launch(ctx, id, 3, global, nullptr, keys, cl_ulong{a.keys_offset / elem}, cl_ulong{a.layer_stride_bytes / elem},
         cl_long{a.row_stride}, slots, cl_int{a.n_moved}, cl_int{a.head_dim}, cl_int{a.n_rot}, cl_int{a.adjacent_pairs},
         cos_sin);
}

// --- Row ops (version 2) ----------------------------------------------------------------------

// Bytes of fp32 arrays of n elements (n >= 1, checked by the caller), overflow-checked.
size_t float_bytes(int64_t n, const char* what) { return mul(static_cast<size_t>(n), sizeof(float), what); }
size_t float_bytes(int64_t rows, int64_t cols, const char* what) {
  return mul(mul(static_cast<size_t>(rows), static_cast<size_t>(cols), what), sizeof(float), what);
}

void run_rms_norm(ringlm_context& ctx, const ringlm_rms_norm_args& a) {
  require(a.n_rows >= 1 && a.width >= 1 && a.width <= INT32_MAX, RINGLM_ERROR_INVALID_ARGUMENT,
          "rms_norm: n_rows = " + std::to_string(a.n_rows) + ", width = " + std::to_string(a.width));
  require(a.eps >= 0.0f, RINGLM_ERROR_INVALID_ARGUMENT, "rms_norm: eps = " + std::to_string(a.eps));
  const size_t bytes = float_bytes(a.n_rows, a.width, "rms_norm: x size");
  const size_t w_bytes = float_bytes(a.width, "rms_norm: weight size");
  const cl_mem x = buffer_range(ctx, a.x, a.x_offset, bytes, sizeof(float), "rms_norm x");
  const cl_mem out = buffer_range(ctx, a.out, a.out_offset, bytes, sizeof(float), "rms_norm out");
  const cl_mem w = buffer_range(ctx, a.weight, a.weight_offset, w_bytes, sizeof(float), "rms_norm weight");
  require(!partly_overlap(a.out, a.out_offset, bytes, a.x, a.x_offset, bytes), RINGLM_ERROR_INVALID_ARGUMENT,
          "rms_norm: out overlaps x without being x");
  require(!overlap(a.out, a.out_offset, bytes, a.weight, a.weight_offset, w_bytes), RINGLM_ERROR_INVALID_ARGUMENT,
          "rms_norm: out overlaps weight");

  // One group per row, of up to kMaxGroup work-items (a power of two, for the reduction tree).
  const Kernel& k = ctx.kernels[kRmsNorm];
  const size_t group = std::min(group_cap(ctx, k, 0), pow2_ceil(static_cast<size_t>(a.width)));
  require(group * sizeof(float) <= local_budget(ctx, k), RINGLM_ERROR_UNSUPPORTED,
          "rms_norm: not enough local memory on this device");
  const size_t global = mul(static_cast<size_t>(a.n_rows), group, "rms_norm: grid");
  launch(ctx, kRmsNorm, 1, &global, &group, x, cl_ulong{a.x_offset / sizeof(float)}, out,
         cl_ulong{a.out_offset / sizeof(float)}, w, cl_ulong{a.weight_offset / sizeof(float)}, as_int(a.width),
         cl_float{a.eps}, LocalFloats{group});
}

void run_add(ringlm_context& ctx, const ringlm_add_args& a) {
  require(a.n >= 1 && a.delta_n >= 1 && a.delta_n <= a.n && a.n % a.delta_n == 0, RINGLM_ERROR_INVALID_ARGUMENT,
          "add: n = " + std::to_string(a.n) + ", delta_n = " + std::to_string(a.delta_n) +
              " (both positive, delta_n dividing n)");
  const size_t bytes = float_bytes(a.n, "add: x size");
  const size_t d_bytes = float_bytes(a.delta_n, "add: delta size");
  const cl_mem x = buffer_range(ctx, a.x, a.x_offset, bytes, sizeof(float), "add x");
  const cl_mem delta = buffer_range(ctx, a.delta, a.delta_offset, d_bytes, sizeof(float), "add delta");
  require(!partly_overlap(a.x, a.x_offset, bytes, a.delta, a.delta_offset, d_bytes), RINGLM_ERROR_INVALID_ARGUMENT,
          "add: delta overlaps x");
  launch_1d(ctx, kAddRows, static_cast<size_t>(a.n), x, cl_ulong{a.x_offset / sizeof(float)}, delta,
            cl_ulong{a.delta_offset / sizeof(float)}, static_cast<cl_ulong>(a.n), static_cast<cl_ulong>(a.delta_n));
}

void run_scale(ringlm_context& ctx, ringlm_buffer* x_buffer, size_t x_offset, int64_t n, float factor) {
  require(n >= 1, RINGLM_ERROR_INVALID_ARGUMENT, "scale: n = " + std::to_string(n));
  const cl_mem x = buffer_range(ctx, x_buffer, x_offset, float_bytes(n, "scale: x size"), sizeof(float), "scale x");
  launch_1d(ctx, kScaleRows, static_cast<size_t>(n), x, cl_ulong{x_offset / sizeof(float)}, static_cast<cl_ulong>(n),
            cl_float{factor});
}

// The activations glu_of (kernels.cl) computes.
bool known_activation(uint32_t activation) {
  return activation == RINGLM_ACT_SILU || activation == RINGLM_ACT_GELU_TANH || activation == RINGLM_ACT_SWIGLU_OAI;
}

void run_glu(ringlm_context& ctx, const ringlm_glu_args& a) {
  require(known_activation(a.activation), RINGLM_ERROR_UNSUPPORTED,
          "glu: activation " + std::to_string(a.activation) + " (SILU, GELU_TANH or SWIGLU_OAI)");
  require(a.n >= 1, RINGLM_ERROR_INVALID_ARGUMENT, "glu: n = " + std::to_string(a.n));
  const size_t bytes = float_bytes(a.n, "glu: size");
  const cl_mem gate = buffer_range(ctx, a.gate, a.gate_offset, bytes, sizeof(float), "glu gate");
  const cl_mem up = buffer_range(ctx, a.up, a.up_offset, bytes, sizeof(float), "glu up");
  require(!partly_overlap(a.gate, a.gate_offset, bytes, a.up, a.up_offset, bytes), RINGLM_ERROR_INVALID_ARGUMENT,
          "glu: up overlaps gate");
  launch_1d(ctx, kGlu, static_cast<size_t>(a.n), gate, cl_ulong{a.gate_offset / sizeof(float)}, up,
            cl_ulong{a.up_offset / sizeof(float)}, static_cast<cl_ulong>(a.n), static_cast<cl_int>(a.activation));
}

void run_rope(ringlm_context& ctx, const ringlm_rope_args& a) {
  require(a.n_rows >= 1 && a.n_heads >= 1 && a.head_dim >= 1, RINGLM_ERROR_INVALID_ARGUMENT,
          "rope: n_rows = " + std::to_string(a.n_rows) + ", n_heads = " + std::to_string(a.n_heads) +
              ", head_dim = " + std::to_string(a.head_dim));
  require(a.n_rot >= 2 && a.n_rot % 2 == 0 && a.n_rot <= a.head_dim, RINGLM_ERROR_INVALID_ARGUMENT,
          "rope: n_rot = " + std::to_string(a.n_rot) + " (even, 2 up to head_dim = " + std::to_string(a.head_dim) +
              ")");
  const size_t width = static_cast<size_t>(a.n_heads) * static_cast<size_t>(a.head_dim);  // < 2^62
  const size_t bytes = float_bytes(a.n_rows, static_cast<int64_t>(width), "rope: x size");
  const size_t half = static_cast<size_t>(a.n_rot / 2);
  const size_t angle_bytes = float_bytes(a.n_rows, static_cast<int64_t>(half), "rope: cos/sin size");
  const cl_mem x = buffer_range(ctx, a.x, a.x_offset, bytes, sizeof(float), "rope x");
  const cl_mem cos_mem = buffer_range(ctx, a.cos, a.cos_offset, angle_bytes, sizeof(float), "rope cos");
  const cl_mem sin_mem = buffer_range(ctx, a.sin, a.sin_offset, angle_bytes, sizeof(float), "rope sin");
  require(!overlap(a.x, a.x_offset, bytes, a.cos, a.cos_offset, angle_bytes) &&
              !overlap(a.x, a.x_offset, bytes, a.sin, a.sin_offset, angle_bytes),
          RINGLM_ERROR_INVALID_ARGUMENT, "rope: cos or sin overlaps x");
  const size_t global[3] = {half, static_cast<size_t>(a.n_heads), static_cast<size_t>(a.n_rows)};
  launch(ctx, kRope, 3, global, nullptr, x, cl_ulong{a.x_offset / sizeof(float)}, cl_int{a.n_heads},
         cl_int{a.head_dim}, cl_int{a.n_rot}, cl_int{a.adjacent_pairs}, cos_mem,
         cl_ulong{a.cos_offset / sizeof(float)}, sin_mem, cl_ulong{a.sin_offset / sizeof(float)});
}

void run_store_kv(ringlm_context& ctx, const ringlm_store_kv_args& a) {
  const size_t elem = kv_element_bytes(a.kv_format);
  require(elem != 0, RINGLM_ERROR_UNSUPPORTED, "store_kv: KV format " + std::to_string(a.kv_format) + " (F16 or F32)");
  require(a.n_rows >= 1 && a.row_width >= 1, RINGLM_ERROR_INVALID_ARGUMENT,
          "store_kv: n_rows = " + std::to_string(a.n_rows) + ", row_width = " + std::to_string(a.row_width));
  const size_t n = mul(static_cast<size_t>(a.n_rows), static_cast<size_t>(a.row_width), "store_kv: size");
  const size_t src_bytes = mul(n, sizeof(float), "store_kv: size"), dst_bytes = mul(n, elem, "store_kv: size");
  const cl_mem src = buffer_range(ctx, a.src, a.src_offset, src_bytes, sizeof(float), "store_kv src");
  const cl_mem dst = buffer_range(ctx, a.dst, a.dst_offset, dst_bytes, elem, "store_kv dst");
  require(!overlap(a.src, a.src_offset, src_bytes, a.dst, a.dst_offset, dst_bytes), RINGLM_ERROR_INVALID_ARGUMENT,
          "store_kv: dst overlaps src");
  launch_1d(ctx, a.kv_format == RINGLM_FORMAT_F16 ? kStoreKvF16 : kStoreKvF32, n, src,
            cl_ulong{a.src_offset / sizeof(float)}, dst, cl_ulong{a.dst_offset / elem}, cl_ulong{n});
}

// rope of q and k, then the store of k and v, checked as run_rope and run_store_kv check theirs.
void run_rope_store(ringlm_context& ctx, const ringlm_rope_store_args& a) {
  const ringlm_rope_args& r = a.rope;
  const size_t elem = kv_element_bytes(a.kv_format);
  require(elem != 0, RINGLM_ERROR_UNSUPPORTED, "rope_store: KV format " + std::to_string(a.kv_format) + " (F16 or F32)");
  require(r.n_rows >= 1 && r.n_heads >= 1 && a.n_head_kv >= 1 && r.head_dim >= 1, RINGLM_ERROR_INVALID_ARGUMENT,
          "rope_store: n_rows = " + std::to_string(r.n_rows) + ", n_heads = " + std::to_string(r.n_heads) +
              ", n_head_kv = " + std::to_string(a.n_head_kv) + ", head_dim = " + std::to_string(r.head_dim));
  require(r.n_rot >= 2 && r.n_rot % 2 == 0 && r.n_rot <= r.head_dim, RINGLM_ERROR_INVALID_ARGUMENT,
          "rope_store: n_rot = " + std::to_string(r.n_rot) + " (even, 2 up to head_dim)");
  const auto floats = [&](int64_t heads) {
    return float_bytes(r.n_rows, heads * static_cast<int64_t>(r.head_dim), "rope_store: size");
  };
  const size_t q_bytes = floats(r.n_heads), kv_bytes = floats(a.n_head_kv);
  const size_t cache_bytes = kv_bytes / sizeof(float) * elem;
  const size_t angle_bytes = float_bytes(r.n_rows, r.n_rot / 2, "rope_store: cos/sin size");
  const cl_mem q = buffer_range(ctx, r.x, r.x_offset, q_bytes, sizeof(float), "rope_store q");
  const cl_mem k = buffer_range(ctx, a.k, a.k_offset, kv_bytes, sizeof(float), "rope_store k");
  const cl_mem v = buffer_range(ctx, a.v, a.v_offset, kv_bytes, sizeof(float), "rope_store v");
  const cl_mem cos_mem = buffer_range(ctx, r.cos, r.cos_offset, angle_bytes, sizeof(float), "rope_store cos");
  const cl_mem sin_mem = buffer_range(ctx, r.sin, r.sin_offset, angle_bytes, sizeof(float), "rope_store sin");
  const cl_mem keys = buffer_range(ctx, a.keys, a.keys_offset, cache_bytes, elem, "rope_store keys");
  const cl_mem values = buffer_range(ctx, a.values, a.values_offset, cache_bytes, elem, "rope_store values");
  const bool separate = !overlap(r.x, r.x_offset, q_bytes, a.k, a.k_offset, kv_bytes) &&
                        !overlap(r.x, r.x_offset, q_bytes, a.v, a.v_offset, kv_bytes) &&
                        !overlap(a.k, a.k_offset, kv_bytes, a.v, a.v_offset, kv_bytes) &&
                        !overlap(a.keys, a.keys_offset, cache_bytes, a.values, a.values_offset, cache_bytes) &&
                        !overlap(a.keys, a.keys_offset, cache_bytes, a.k, a.k_offset, kv_bytes) &&
                        !overlap(a.values, a.values_offset, cache_bytes, a.v, a.v_offset, kv_bytes);
  require(separate, RINGLM_ERROR_INVALID_ARGUMENT, "rope_store: q, k, v, keys and values must not overlap");
  const size_t global[3] = {static_cast<size_t>(r.head_dim), static_cast<size_t>(r.n_heads) + 2 * static_cast<size_t>(a.n_head_kv),
                            static_cast<size_t>(r.n_rows)};
  launch(ctx, kRopeStore, 3, global, nullptr, q, cl_ulong{r.x_offset / sizeof(float)}, cl_int{r.n_heads}, k,
         cl_ulong{a.k_offset / sizeof(float)}, v, cl_ulong{a.v_offset / sizeof(float)}, cl_int{a.n_head_kv},
         cl_int{r.head_dim}, cl_int{r.n_rot}, cl_int{r.adjacent_pairs}, cos_mem, cl_ulong{r.cos_offset / sizeof(float)},
         sin_mem, cl_ulong{r.sin_offset / sizeof(float)}, keys, cl_ulong{a.keys_offset / elem}, values,
         cl_ulong{a.values_offset / elem}, cl_int{a.kv_format == RINGLM_FORMAT_F16 ? 1 : 0});
}

void run_get_rows(ringlm_context& ctx, const ringlm_get_rows_args& a) {
  const char* format = format_name(a.weight_format);
  require(format != nullptr, RINGLM_ERROR_UNSUPPORTED,
          "get_rows: unknown weight format " + std::to_string(a.weight_format));
  require(a.n_weight_rows >= 1 && a.cols >= 1 && a.cols <= INT32_MAX && a.n_ids >= 1, RINGLM_ERROR_INVALID_ARGUMENT,
          "get_rows: n_weight_rows = " + std::to_string(a.n_weight_rows) + ", cols = " + std::to_string(a.cols) +
              ", n_ids = " + std::to_string(a.n_ids));
  const size_t cols = static_cast<size_t>(a.cols);
  const FormatInfo& f = *format_info(a.weight_format);
  size_t row_bytes = 0;
  if (a.weight_format == RINGLM_FORMAT_F32 || a.weight_format == RINGLM_FORMAT_F16) {
    row_bytes = cols * (a.weight_format == RINGLM_FORMAT_F32 ? 4 : 2);
  } else {
    require(cols % f.weights == 0, RINGLM_ERROR_INVALID_ARGUMENT,
            "get_rows: cols = " + std::to_string(a.cols) + " is not a multiple of " + std::to_string(f.weights) +
                " (a row of whole " + format + " blocks)");
    row_bytes = row_bytes_of(a.weight_format, cols);
  }
  const size_t w_bytes = mul(static_cast<size_t>(a.n_weight_rows), row_bytes, "get_rows: weight size");
  const size_t ids_bytes = mul(static_cast<size_t>(a.n_ids), sizeof(int32_t), "get_rows: ids size");
  const size_t out_bytes = float_bytes(a.n_ids, a.cols, "get_rows: out size");
  const cl_mem w = buffer_range(ctx, a.weight, 0, w_bytes, 1, "get_rows weight");
  const cl_mem ids = buffer_range(ctx, a.ids, a.ids_offset, ids_bytes, sizeof(int32_t), "get_rows ids");
  const cl_mem out = buffer_range(ctx, a.out, a.out_offset, out_bytes, sizeof(float), "get_rows out");
  require(!overlap(a.out, a.out_offset, out_bytes, a.weight, 0, w_bytes) &&
              !overlap(a.out, a.out_offset, out_bytes, a.ids, a.ids_offset, ids_bytes),
          RINGLM_ERROR_INVALID_ARGUMENT, "get_rows: out overlaps the weight or the ids");

  // A row of `group` work-items per id, one column each.
  const size_t group = std::min(group_cap(ctx, ctx.kernels[kGetRows], 0), pow2_ceil(cols));
  const size_t global[2] = {mul(ceil_div(cols, group), group, "get_rows: grid"), static_cast<size_t>(a.n_ids)};
  const size_t local[2] = {group, 1};
  launch(ctx, kGetRows, 2, global, local, w, static_cast<cl_int>(a.weight_format), static_cast<cl_int>(f.bytes),
         cl_ulong{row_bytes},
         cl_long{a.n_weight_rows}, as_int(a.cols), ids, cl_ulong{a.ids_offset / sizeof(int32_t)}, out,
         cl_ulong{a.out_offset / sizeof(float)});
}

// --- Matmul with its neighbours fused (ABI v2) ---------------------------------------------

KernelId gemv_kernel(uint32_t format) { return format_info(format)->gemv; }

// How a GEMV is cut: `lanes` work-items per row (a warp on a GPU, 1 on a CPU device, whose
// work-items each run a row with vector math), `rows` rows per group, enough groups to keep
// every compute unit busy. Nothing depends on m, so a row of x meets the same blocks in the same
// lanes in the same order whatever m is (batched = alone, bit for bit).
struct GemvGeometry {
  size_t lanes = 1, rows = 1, groups = 1;
};

GemvGeometry gemv_geometry(const ringlm_context& ctx, const Kernel& kernel, int64_t n) {
  GemvGeometry g;
  const size_t cap = std::min(kMaxGroup, kernel.max_group);
  g.lanes = ctx.cpu_device ? 1 : std::min({pow2_floor(kernel.group_multiple), size_t{64}, group_cap(ctx, kernel, 0)});
  g.rows = std::max<size_t>(1, std::min(group_cap(ctx, kernel, 1), pow2_floor(std::max<size_t>(cap / g.lanes, 1))));
  if (ctx.cpu_device) g.rows = std::min<size_t>(g.rows, 16);
  const size_t want_groups = 2 * static_cast<size_t>(ctx.device->limits.compute_units);
  while (g.rows > 1 && ceil_div(static_cast<size_t>(n), g.rows) < want_groups) g.rows /= 2;
  g.groups = ceil_div(static_cast<size_t>(n), g.rows);
  return g;
}

// Why matmul2 cannot take m rows (> kMaxM) in one call with the GEMM here ("" when it can): too
// many rows, a CPU device, or a device whose groups cannot be 16 x 16 or hold the tiles in local
// memory.
std::string gemm_unsupported(const ringlm_context& ctx, int64_t m) {
  if (m > kMaxGemmM) return "matmul2: m = " + std::to_string(m) + " (up to " + std::to_string(kMaxGemmM) + " rows per call)";
  // A CPU device runs a group's 256 work-items as loops cut at every barrier: there the GEMV's
  // chunks of kMaxM rows are 4x faster (PoCL, SmolLM2 pp64: 87 against 22 t/s).
  if (ctx.cpu_device) return "matmul2: m = " + std::to_string(m) + " on a CPU device (up to " + std::to_string(kMaxM) + " rows per call)";
  const Kernel& k = ctx.kernels[kGemm];
  const DeviceLimits& l = ctx.device->limits;
  const size_t local_floats = 3 * kGemmTile * kGemmTileStride + kGemmTile;
  if (k.max_group < 256 || l.max_item_sizes[0] < 16 || l.max_item_sizes[1] < 16 ||
      local_floats * sizeof(float) > local_budget(ctx, k)) {
    return "matmul2: this device cannot run the GEMM's 16 x 16 groups (m = " + std::to_string(m) + " rows)";
  }
  return "";
}

// matmul2's arguments that need no buffer: a shape the GEMV (or, past kMaxM rows, the GEMM)
// takes, and fusions that go together.
void check_matmul2_args(const ringlm_context& ctx, const ringlm_matmul2_args& a2) {
  const ringlm_matmul_args& a = a2.base;
  // Up to kMaxM rows the GEMV, past that the GEMM (gemm_unsupported says when it cannot).
  std::string why = matmul_unsupported(a.weight_format, std::min(a.m, kMaxM), a.n, a.k);
  if (why.empty() && a.m > kMaxM) why = gemm_unsupported(ctx, a.m);
  if (!why.empty()) {
    const bool invalid = a.m < 1 || a.n < 1 || a.k < 1;
    throw Error(invalid ? RINGLM_ERROR_INVALID_ARGUMENT : RINGLM_ERROR_UNSUPPORTED, why);
  }
  require(a2.rms_weight == nullptr || a2.rms_eps >= 0.0f, RINGLM_ERROR_INVALID_ARGUMENT,
          "matmul2: rms_eps = " + std::to_string(a2.rms_eps));
  require(a2.n_more >= 0 && a2.n_more <= 2, RINGLM_ERROR_INVALID_ARGUMENT,
          "matmul2: n_more = " + std::to_string(a2.n_more) + " (0 to 2)");
  const bool glu = a2.glu != 0;
  require(!glu || (a2.n_more == 1 && a2.more[0].n == a.n), RINGLM_ERROR_INVALID_ARGUMENT,
          "matmul2: glu takes one more weight of the same rows");
  require(!glu || known_activation(a2.activation), RINGLM_ERROR_UNSUPPORTED,
          "matmul2: activation " + std::to_string(a2.activation));
  require(a2.accumulate == 0 || a2.n_more == 0, RINGLM_ERROR_INVALID_ARGUMENT,
          "matmul2: accumulate takes a single weight");
}

// One weight of a matmul2 (n rows) and its y ([m][n]).
struct Matmul2Part {
  const ringlm_buffer* weight;
  int64_t n;
  ringlm_buffer* y;
  size_t y_offset;
  cl_mem w_mem = nullptr, y_mem = nullptr;
};

// A matmul2's buffers, checked: x, the norm's weight (x itself without a norm: never read) and
// the three parts the kernels take (unused parts repeat the first).
struct Matmul2Operands {
  std::array<Matmul2Part, 3> parts;
  int64_t total_rows = 0;
  cl_mem x = nullptr, norm_w = nullptr;
  bool norm = false, glu = false;

  cl_ulong y_offset(int i) const { return cl_ulong{parts[static_cast<size_t>(i)].y_offset / sizeof(float)}; }
};

Matmul2Operands matmul2_operands(ringlm_context& ctx, const ringlm_matmul2_args& a2) {
  const ringlm_matmul_args& a = a2.base;
  Matmul2Operands ops;
  ops.norm = a2.rms_weight != nullptr;
  ops.glu = a2.glu != 0;
  const size_t row_bytes = row_bytes_of(a.weight_format, static_cast<size_t>(a.k));
  const size_t x_bytes = float_bytes(a.m, a.k, "matmul: x size");
  ops.x = buffer_range(ctx, a.x, a.x_offset, x_bytes, sizeof(float), "matmul x");
  auto& parts = ops.parts;
  parts = {Matmul2Part{a.weight, a.n, a.y, a.y_offset}, Matmul2Part{a.weight, 0, a.y, a.y_offset},
           Matmul2Part{a.weight, 0, a.y, a.y_offset}};
  for (int i = 0; i < a2.n_more; ++i) {
    const ringlm_matmul_part& more = a2.more[i];
    require(more.n >= 1 && more.n <= INT32_MAX, RINGLM_ERROR_INVALID_ARGUMENT,
            "matmul2: more[" + std::to_string(i) + "].n = " + std::to_string(more.n));
    parts[static_cast<size_t>(i) + 1] = Matmul2Part{more.weight, more.n, more.y, more.y_offset};
  }
  for (int i = 0; i <= a2.n_more; ++i) {
    Matmul2Part& p = parts[static_cast<size_t>(i)];
    const std::string name = i == 0 ? "matmul" : "matmul2 more[" + std::to_string(i - 1) + "]";
    p.w_mem = buffer_range(ctx, p.weight, 0, mul(static_cast<size_t>(p.n), row_bytes, "matmul: weight size"), 1,
                           (name + " weight").c_str());
    ops.total_rows += p.n;
    if (ops.glu && i == 1) continue;  // up's products stay inside the kernel
    const size_t y_bytes = float_bytes(a.m, p.n, "matmul: y size");
    p.y_mem = buffer_range(ctx, p.y, p.y_offset, y_bytes, sizeof(float), (name + " y").c_str());
    require(!overlap(p.y, p.y_offset, y_bytes, a.x, a.x_offset, x_bytes), RINGLM_ERROR_INVALID_ARGUMENT,
            name + ": y overlaps x");
  }
  require(ops.total_rows <= INT32_MAX, RINGLM_ERROR_INVALID_ARGUMENT, "matmul2: too many rows");
  for (Matmul2Part& p : parts) {  // the kernel's unused arguments: valid buffers it never touches
    if (p.w_mem == nullptr) p.w_mem = parts[0].w_mem;
    if (p.y_mem == nullptr) p.y_mem = parts[0].y_mem;
  }
  ops.norm_w = ops.norm ? buffer_range(ctx, a2.rms_weight, a2.rms_weight_offset, float_bytes(a.k, "matmul2: norm size"),
                                       sizeof(float), "matmul2 rms_weight")
                        : ops.x;
  return ops;
}

// The integer GEMM: x to int8 in the scratch memory ([m][k] codes, then [m][k / 32] pairs
// (d, s)), then the GEMM on it.
void launch_gemm_q8(ringlm_context& ctx, const ringlm_matmul2_args& a2, const Matmul2Operands& ops,
                    const size_t* global, const size_t* local) {
  const ringlm_matmul_args& a = a2.base;
  const FormatInfo& f = *format_info(a.weight_format);
  const auto& parts = ops.parts;
  const size_t tile = kGemmTile, m = static_cast<size_t>(a.m), k = static_cast<size_t>(a.k);
  const size_t code_bytes = mul(m, k, "matmul2: int8 x size");
  const size_t ds_offset = ceil_div(code_bytes, 64) * 64;
  const size_t ds_bytes = mul(m * (k / kBlock), 2 * sizeof(float), "matmul2: int8 x scales");
  std::lock_guard lock(ctx.scratch_mutex);
  const cl_mem scratch = scratch_buffer(ctx, ds_offset + ds_bytes);
  const cl_ulong ds_pairs{ds_offset / (2 * sizeof(float))};
  const size_t group = std::min<size_t>(64, group_cap(ctx, ctx.kernels[kQuantizeRowsQ8], 0));
  const size_t q_global = mul(m, group, "matmul2: quantize grid");
  launch(ctx, kQuantizeRowsQ8, 1, &q_global, &group, ops.x, cl_ulong{a.x_offset / sizeof(float)}, as_int(a.k), ops.norm_w,
         cl_ulong{ops.norm ? a2.rms_weight_offset / sizeof(float) : 0}, cl_float{a2.rms_eps}, cl_int{ops.norm ? 1 : 0},
         scratch, scratch, ds_pairs, LocalFloats{group});
  launch(ctx, kGemmQ8, 2, global, local, parts[0].w_mem, parts[1].w_mem, parts[2].w_mem, as_int(parts[0].n),
         as_int(parts[1].n), as_int(parts[2].n), as_int(a.k), scratch, scratch, ds_pairs, as_int(a.m),
         parts[0].y_mem, ops.y_offset(0), parts[1].y_mem, ops.glu ? cl_ulong{0} : ops.y_offset(1),
         parts[2].y_mem, ops.y_offset(2), cl_int{a2.accumulate != 0 ? 1 : 0}, cl_int{ops.glu ? 1 : 0},
         cl_int{static_cast<cl_int>(a2.activation)}, cl_int{static_cast<cl_int>(f.format)},
         cl_int{static_cast<cl_int>(f.bytes)}, LocalInts{tile * kGemmCodeStride},
         LocalInts{tile * kGemmCodeStride}, LocalInts{tile * kGemmCodeStride}, LocalFloats{2 * tile},
         LocalFloats{3 * tile}, LocalFloats{3 * tile});
}

// Past kMaxM rows: the tiled GEMM, on int8 where the context multiplies int8 (launch_gemm_q8).
void launch_gemm(ringlm_context& ctx, const ringlm_matmul2_args& a2, const Matmul2Operands& ops) {
  const ringlm_matmul_args& a = a2.base;
  const auto& parts = ops.parts;
  const size_t tile = kGemmTile;
  const size_t global[2] = {ceil_div(static_cast<size_t>(ops.glu ? a.n : ops.total_rows), tile) * 16,
                            ceil_div(static_cast<size_t>(a.m), tile) * 16};
  const size_t local[2] = {16, 16};
  const FormatInfo& f = *format_info(a.weight_format);
  if (ctx.int8_products && f.weights > 0 && a.weight_format != RINGLM_FORMAT_F32 &&
      a.weight_format != RINGLM_FORMAT_F16) {
    return launch_gemm_q8(ctx, a2, ops, global, local);
  }
  launch(ctx, kGemm, 2, global, local, parts[0].w_mem, parts[1].w_mem, parts[2].w_mem, as_int(parts[0].n),
         as_int(parts[1].n), as_int(parts[2].n), as_int(a.k), ops.x, cl_ulong{a.x_offset / sizeof(float)}, as_int(a.m),
         parts[0].y_mem, ops.y_offset(0), parts[1].y_mem, ops.glu ? cl_ulong{0} : ops.y_offset(1), parts[2].y_mem,
         ops.y_offset(2), ops.norm_w, cl_ulong{ops.norm ? a2.rms_weight_offset / sizeof(float) : 0},
         cl_float{a2.rms_eps}, cl_int{ops.norm ? 1 : 0}, cl_int{a2.accumulate != 0 ? 1 : 0}, cl_int{ops.glu ? 1 : 0},
         cl_int{static_cast<cl_int>(a2.activation)}, cl_int{static_cast<cl_int>(f.format)},
         cl_int{static_cast<cl_int>(f.bytes)}, LocalFloats{tile * kGemmTileStride},
         LocalFloats{tile * kGemmTileStride}, LocalFloats{tile * kGemmTileStride}, LocalFloats{tile});
}

// Up to kMaxM rows: the GEMV.
void launch_gemv(ringlm_context& ctx, const ringlm_matmul2_args& a2, const Matmul2Operands& ops) {
  const ringlm_matmul_args& a = a2.base;
  const auto& parts = ops.parts;
  const KernelId id = gemv_kernel(a.weight_format);
  const GemvGeometry g = gemv_geometry(ctx, ctx.kernels[id], ops.glu ? a.n : ops.total_rows);
  const size_t lsum_floats = std::max(2 * g.lanes * g.rows, kNormParts) * kMaxM;
  require((lsum_floats + kMaxM) * sizeof(float) <= local_budget(ctx, ctx.kernels[id]), RINGLM_ERROR_UNSUPPORTED,
          "matmul2: not enough local memory on this device");
  const size_t global[2] = {g.lanes, g.groups * g.rows};
  const size_t local[2] = {g.lanes, g.rows};
  launch(ctx, id, 2, global, local, parts[0].w_mem, parts[1].w_mem, parts[2].w_mem, as_int(parts[0].n),
         as_int(parts[1].n), as_int(parts[2].n), as_int(a.k), ops.x, cl_ulong{a.x_offset / sizeof(float)}, as_int(a.m),
         parts[0].y_mem, ops.y_offset(0), parts[1].y_mem, ops.glu ? cl_ulong{0} : ops.y_offset(1), parts[2].y_mem,
         ops.y_offset(2), ops.norm_w, cl_ulong{ops.norm ? a2.rms_weight_offset / sizeof(float) : 0},
         cl_float{a2.rms_eps}, cl_int{ops.norm ? 1 : 0}, cl_int{a2.accumulate != 0 ? 1 : 0}, cl_int{ops.glu ? 1 : 0},
         cl_int{static_cast<cl_int>(a2.activation)}, LocalFloats{lsum_floats}, LocalFloats{static_cast<size_t>(kMaxM)});
}

// matmul with what surrounds it fused (the GEMV kernel: up to kMaxM rows of x per call, as
// matmul): the norm of its input, the residual after it, up to three weights of one input (q, k,
// v) or the gated activation of two (gate and up).
void run_matmul2(ringlm_context& ctx, const ringlm_matmul2_args& a2) {
  check_matmul2_args(ctx, a2);
  const Matmul2Operands ops = matmul2_operands(ctx, a2);
  if (a2.base.m > kMaxM) return launch_gemm(ctx, a2, ops);
  launch_gemv(ctx, a2, ops);
}

// --- Top-k -----------------------------------------------------------------------------------

// A group per row: L work-items scan it side by side (one on a CPU device, where a work-item
// is a loop), then merge their lists in two rounds through the scratch memory.
void run_top_k(ringlm_context& ctx, const ringlm_top_k_args& a) {
  require(a.n_rows >= 1 && a.n >= 1 && a.n <= INT32_MAX, RINGLM_ERROR_INVALID_ARGUMENT,
          "top_k: n_rows = " + std::to_string(a.n_rows) + ", n = " + std::to_string(a.n));
  require(a.k >= 1 && a.k <= RINGLM_TOP_K_MAX && a.k <= a.n, RINGLM_ERROR_INVALID_ARGUMENT,
          "top_k: k = " + std::to_string(a.k) + " (1 to min(n, " + std::to_string(RINGLM_TOP_K_MAX) + "))");
  const size_t rows = static_cast<size_t>(a.n_rows), k = static_cast<size_t>(a.k);
  const cl_mem x = buffer_range(ctx, a.x, a.x_offset, float_bytes(a.n_rows, a.n, "top_k: x size"), sizeof(float),
                                "top_k x");
  const size_t pair_bytes = sizeof(ringlm_top_entry);
  const cl_mem out =
      buffer_range(ctx, a.out, a.out_offset, mul(rows * k, pair_bytes, "top_k: out size"), sizeof(int32_t), "top_k out");
  require(!overlap(a.out, a.out_offset, rows * k * pair_bytes, a.x, a.x_offset,
                   float_bytes(a.n_rows, a.n, "top_k: x size")),
          RINGLM_ERROR_INVALID_ARGUMENT, "top_k: out overlaps x");
  const size_t group =
      ctx.cpu_device ? 1 : std::min(group_cap(ctx, ctx.kernels[kTopKRows], 0), pow2_floor(static_cast<size_t>(a.n)));
  const size_t fan = std::min(group, kTopKFan);
  const size_t stage_bytes = mul(mul(rows, (group + fan) * k, "top_k: stage size"), pair_bytes, "top_k: stage size");
  std::lock_guard lock(ctx.scratch_mutex);
  const cl_mem stage = scratch_buffer(ctx, stage_bytes);
  const size_t global = rows * group;
  launch(ctx, kTopKRows, 1, &global, &group, x, cl_ulong{a.x_offset / sizeof(float)}, cl_long{a.n}, cl_int{a.k}, stage,
         out, cl_ulong{a.out_offset / sizeof(int32_t)});
}

// --- The C entry points -----------------------------------------------------------------------

const char* api_last_error(const ringlm_context* /*ctx: errors are kept per thread*/) { return t_last_error.c_str(); }

int32_t api_device_count(void) {
  int32_t count = -1;
  guarded([&] { count = static_cast<int32_t>(all_devices().size()); });
  return count;
}

void copy_text(const std::string& text, char* dst, size_t size) {
  const size_t n = std::min(text.size(), size - 1);
  std::memcpy(dst, text.data(), n);
  dst[n] = '\0';
}

int32_t api_device_info(int32_t index, ringlm_device_info* out) {
  return guarded([&] {
    require(out != nullptr, RINGLM_ERROR_INVALID_ARGUMENT, "device_info: null output");
    const cl_device_id device = device_at(index);
    ringlm_device_info info{};
    copy_text(device_string(device, CL_DEVICE_NAME, "CL_DEVICE_NAME"), info.name, sizeof(info.name));
    const std::string dot4 = dot4_kind(device);
    copy_text(device_string(device, CL_DEVICE_VERSION, "CL_DEVICE_VERSION") + " " +
                  device_string(device, CL_DRIVER_VERSION, "CL_DRIVER_VERSION") +
                  (dot4.empty() ? "" : ", int8 products: " + dot4),
              info.version, sizeof(info.version));
    const auto type = device_value<cl_device_type>(device, CL_DEVICE_TYPE, "CL_DEVICE_TYPE");
    info.type = (type & CL_DEVICE_TYPE_GPU)           ? RINGLM_DEVICE_GPU
                : (type & CL_DEVICE_TYPE_CPU)         ? RINGLM_DEVICE_CPU
                : (type & CL_DEVICE_TYPE_ACCELERATOR) ? RINGLM_DEVICE_ACCELERATOR
                                                      : RINGLM_DEVICE_OTHER;
    info.compute_units = device_value<cl_uint>(device, CL_DEVICE_MAX_COMPUTE_UNITS, "CL_DEVICE_MAX_COMPUTE_UNITS");
    info.memory_bytes = device_value<cl_ulong>(device, CL_DEVICE_GLOBAL_MEM_SIZE, "CL_DEVICE_GLOBAL_MEM_SIZE");
    *out = info;
  });
}

// Whether the kernels take their CPU-device shapes (a GEMV row and an attention head per
// work-item) or their GPU shapes (a warp per row, a work-group per head): the device's type, or
// RINGLM_OPENCL_KERNELS=cpu|gpu (the tests run the GPU shapes on PoCL's CPU device with it).
bool kernel_shapes_for_cpu(cl_device_id device) {
  if (const char* forced = std::getenv("RINGLM_OPENCL_KERNELS")) {
    if (std::strcmp(forced, "gpu") == 0) return false;
    if (std::strcmp(forced, "cpu") == 0) return true;
  }
  return (device_value<cl_device_type>(device, CL_DEVICE_TYPE, "CL_DEVICE_TYPE") & CL_DEVICE_TYPE_CPU) != 0;
}

// Whether prompts' GEMM quantizes x to int8 (gemm_q8): where the device multiplies int8 in
// hardware, or as RINGLM_OPENCL_INT8=1|0 says (the tests run both paths on PoCL with it).
bool int8_products_wanted(const DeviceProgram& dp) {
  if (const char* forced = std::getenv("RINGLM_OPENCL_INT8")) {
    if (std::strcmp(forced, "1") == 0) return true;
    if (std::strcmp(forced, "0") == 0) return false;
  }
  return dp.fast_dot4;
}

ringlm_context* api_open(int32_t index, const ringlm_open_options* options) {
  ringlm_context* opened = nullptr;
  guarded([&] {
    // Fields past the caller's struct_size are left at their defaults.
    const auto has = [&](size_t field_end) { return options != nullptr && options->struct_size >= field_end; };
    ProgramSpec spec{kKernelSource, kBuildOptions};
    if (has(offsetof(ringlm_open_options, cache_dir) + sizeof(options->cache_dir)) && options->cache_dir != nullptr &&
        options->cache_dir[0] != '\0') {
      spec.cache_dir = options->cache_dir;
    }
    spec.verbose = has(offsetof(ringlm_open_options, verbose) + sizeof(options->verbose)) && options->verbose != 0;

    auto ctx = std::make_unique<ringlm_context>();
    ctx->device = device_program(index, spec);
    cl_int err = CL_SUCCESS;
    ctx->queue = QueueHandle(clCreateCommandQueue(ctx->device->context.get(), ctx->device->device, 0, &err));
    check(err, "clCreateCommandQueue");
    for (int id = 0; id < kKernelCount; ++id) ctx->kernels[id] = make_kernel(*ctx->device, kKernelNames[id]);
    ctx->cpu_device = kernel_shapes_for_cpu(ctx->device->device);
    ctx->int8_products = int8_products_wanted(*ctx->device);
    if (spec.verbose) std::fprintf(stderr, "ringlm-opencl: opened device %d (%s)\n", index, ctx->device->name.c_str());
    opened = ctx.release();
  });
  return opened;
}

void api_close(ringlm_context* ctx) {
  if (ctx == nullptr) return;
  clFinish(ctx->queue.get());  // let queued work end before its kernels and queue go
  delete ctx;
}

ringlm_buffer* api_alloc(ringlm_context* ctx, size_t bytes) {
  ringlm_buffer* made = nullptr;
  guarded([&] {
    require(ctx != nullptr, RINGLM_ERROR_INVALID_ARGUMENT, "alloc: null context");
    require(bytes > 0, RINGLM_ERROR_INVALID_ARGUMENT, "alloc: 0 bytes");
    auto buffer = std::make_unique<ringlm_buffer>();
    cl_int err = CL_SUCCESS;
    buffer->context = ctx->device->context.get();
    buffer->mem = MemHandle(clCreateBuffer(buffer->context, CL_MEM_READ_WRITE, bytes, nullptr, &err));
    check(err, "clCreateBuffer", std::to_string(bytes) + " bytes");
    buffer->bytes = bytes;
    made = buffer.release();
  });
  return made;
}

void api_free(ringlm_context* /*ctx*/, ringlm_buffer* buffer) { delete buffer; }

// An entry point on a context: the context checked, then body(context), its errors caught.
template <typename Body>
int32_t on_context(ringlm_context* ctx, const char* name, Body body) {
  return guarded([&] {
    require(ctx != nullptr, RINGLM_ERROR_INVALID_ARGUMENT, std::string(name) + ": null context");
    body(*ctx);
  });
}

int32_t api_upload(ringlm_context* ctx, ringlm_buffer* dst, size_t offset, const void* src, size_t bytes) {
  return on_context(ctx, "upload", [&](ringlm_context& c) { run_upload(c, dst, offset, src, bytes); });
}

int32_t api_download(ringlm_context* ctx, const ringlm_buffer* src, size_t offset, void* dst, size_t bytes) {
  return on_context(ctx, "download", [&](ringlm_context& c) { run_download(c, src, offset, dst, bytes); });
}

int32_t api_supports(const ringlm_context* ctx, const ringlm_op_desc* d) {
  if (ctx == nullptr || d == nullptr) return 0;
  int32_t yes = 0;
  guarded([&] {
    switch (d->op) {
      case RINGLM_OP_MATMUL:
        yes = matmul_unsupported(d->weight_format, d->m, d->n, d->k).empty();
        break;
      case RINGLM_OP_ATTENTION:
        yes = attention_unsupported(*ctx, d->kv_format, d->n_head, d->n_head_kv, d->head_dim).empty();
        break;
      case RINGLM_OP_ROPE_SHIFT:
        yes = rope_shift_unsupported(d->kv_format, d->n_head_kv, d->head_dim, d->n_rot).empty();
        break;
      case RINGLM_OP_ROW_OPS:
        // kv_format 0 (not asked) is F32 and weight_format 0 is F32: both are fine.
        yes = kv_element_bytes(d->kv_format) != 0 && format_name(d->weight_format) != nullptr;
        break;
      case RINGLM_OP_WINDOW_ATTENTION:
        yes = attention_unsupported(*ctx, d->kv_format, d->n_head, d->n_head_kv, d->head_dim).empty();
        break;
      case RINGLM_OP_GEMM:
        yes = matmul_unsupported(d->weight_format, std::min<int64_t>(d->m, kMaxM), d->n, d->k).empty() &&
              (d->m <= kMaxM || gemm_unsupported(*ctx, d->m).empty());
        break;
      default:
        break;
    }
  });
  return yes;
}

// The ops: a context and arguments, checked, then the run_* above.
template <typename Args, typename Run>
int32_t op(ringlm_context* ctx, const Args* args, const char* name, Run run) {
  return on_context(ctx, name, [&](ringlm_context& c) {
    require(args != nullptr, RINGLM_ERROR_INVALID_ARGUMENT, std::string(name) + ": null arguments");
    run(c, *args);
  });
}

int32_t api_matmul(ringlm_context* ctx, const ringlm_matmul_args* args) { return op(ctx, args, "matmul", run_matmul); }
int32_t api_matmul2(ringlm_context* ctx, const ringlm_matmul2_args* args) {
  return op(ctx, args, "matmul2", run_matmul2);
}
int32_t api_attention(ringlm_context* ctx, const ringlm_attention_args* args) {
  return op(ctx, args, "attention", run_attention);
}
int32_t api_rope_shift(ringlm_context* ctx, const ringlm_rope_shift_args* args) {
  return op(ctx, args, "rope_shift", run_rope_shift);
}

int32_t api_upload_async(ringlm_context* ctx, ringlm_buffer* dst, size_t offset, const void* src, size_t bytes) {
  return on_context(ctx, "upload_async", [&](ringlm_context& c) { run_upload_async(c, dst, offset, src, bytes); });
}
int32_t api_finish(ringlm_context* ctx) { return on_context(ctx, "finish", run_finish); }
int32_t api_copy(ringlm_context* ctx, ringlm_buffer* dst, size_t dst_offset, const ringlm_buffer* src,
                 size_t src_offset, size_t bytes) {
  return on_context(ctx, "copy", [&](ringlm_context& c) { run_copy(c, dst, dst_offset, src, src_offset, bytes); });
}
int32_t api_rms_norm(ringlm_context* ctx, const ringlm_rms_norm_args* args) {
  return op(ctx, args, "rms_norm", run_rms_norm);
}
int32_t api_add(ringlm_context* ctx, const ringlm_add_args* args) { return op(ctx, args, "add", run_add); }
int32_t api_scale(ringlm_context* ctx, ringlm_buffer* x, size_t x_offset, int64_t n, float factor) {
  return on_context(ctx, "scale", [&](ringlm_context& c) { run_scale(c, x, x_offset, n, factor); });
}
int32_t api_glu(ringlm_context* ctx, const ringlm_glu_args* args) { return op(ctx, args, "glu", run_glu); }
int32_t api_rope(ringlm_context* ctx, const ringlm_rope_args* args) { return op(ctx, args, "rope", run_rope); }
int32_t api_store_kv(ringlm_context* ctx, const ringlm_store_kv_args* args) {
  return op(ctx, args, "store_kv", run_store_kv);
}
int32_t api_rope_store(ringlm_context* ctx, const ringlm_rope_store_args* args) {
  return op(ctx, args, "rope_store", run_rope_store);
}
int32_t api_get_rows(ringlm_context* ctx, const ringlm_get_rows_args* args) {
  return op(ctx, args, "get_rows", run_get_rows);
}
int32_t api_attention3(ringlm_context* ctx, const ringlm_attention3_args* args) {
  return op(ctx, args, "attention3", run_attention3);
}
int32_t api_attention2(ringlm_context* ctx, const ringlm_attention2_args* args) {
  return op(ctx, args, "attention2", run_attention2);
}
int32_t api_top_k(ringlm_context* ctx, const ringlm_top_k_args* args) { return op(ctx, args, "top_k", run_top_k); }
int32_t api_counters(const ringlm_context* ctx, ringlm_counters* out) {
  return guarded([&] {
    require(ctx != nullptr && out != nullptr, RINGLM_ERROR_INVALID_ARGUMENT,
            std::string("counters: null ") + (ctx == nullptr ? "context" : "output"));
    const Counters& c = ctx->counters;
    *out = ringlm_counters{.launches = c.launches.load(std::memory_order_relaxed),
                           .upload_bytes = c.upload_bytes.load(std::memory_order_relaxed),
                           .download_bytes = c.download_bytes.load(std::memory_order_relaxed),
                           .waits = c.waits.load(std::memory_order_relaxed)};
  });
}

constexpr const char* kDescription =
    "OpenCL 1.2 devices: flat GEMM on F32/F16/Q4_0/Q4_1/Q8_0/Q5_0/Q5_1/IQ4_NL/Q4_K/Q5_K/Q6_K/IQ4_XS/MXFP4 weights, "
    "causal and sliding-window attention (split over the keys on long caches), shift-RoPE, row ops, top-k";

// The description named 5 of the 12 formats once the others had come: a format added to
// kFormats and not to the description does not build.
constexpr bool names_every_format(std::string_view description) {
  return std::all_of(std::begin(kFormats), std::end(kFormats),
                     [&](const FormatInfo& f) { return description.find(f.name) != std::string_view::npos; });
}
static_assert(names_every_format(kDescription));

constexpr ringlm_plugin kPlugin = {
    .abi_version = RINGLM_PLUGIN_ABI_VERSION,
    .struct_size = sizeof(ringlm_plugin),
    .name = "opencl",
    .description = kDescription,
    .last_error = api_last_error,
    .device_count = api_device_count,
    .device_info = api_device_info,
    .open = api_open,
    .close = api_close,
    .alloc = api_alloc,
    .free = api_free,
    .upload = api_upload,
    .download = api_download,
    .supports = api_supports,
    .matmul = api_matmul,
    .attention = api_attention,
    .rope_shift = api_rope_shift,
    .upload_async = api_upload_async,
    .finish = api_finish,
    .copy = api_copy,
    .rms_norm = api_rms_norm,
    .add = api_add,
    .scale = api_scale,
    .glu = api_glu,
    .rope = api_rope,
    .store_kv = api_store_kv,
    .get_rows = api_get_rows,
    .attention2 = api_attention2,
    .matmul2 = api_matmul2,
    .rope_store = api_rope_store,
    .counters = api_counters,
    .top_k = api_top_k,
    .attention3 = api_attention3,
};

}  // namespace
}  // namespace ringlm::opencl

extern "C" __attribute__((visibility("default"))) const ringlm_plugin* ringlm_plugin_entry(void) {
  return &ringlm::opencl::kPlugin;
}
