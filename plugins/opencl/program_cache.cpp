#include "plugins/opencl/program_cache.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <system_error>
#include <vector>

namespace ringlm::opencl {
namespace {

// FNV-1a, 64 bits: not cryptographic, only a name that changes whenever an input does. Each
// field goes in with its length, so that no two different field lists hash the same text.
class Fnv1a {
 public:
  void add(std::string_view field) {
    const uint64_t length = field.size();
    bytes(&length, sizeof(length));
    bytes(field.data(), field.size());
  }
  std::string hex() const {
    char text[17];
    std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(hash_));
    return text;
  }

 private:
  void bytes(const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < n; ++i) hash_ = (hash_ ^ p[i]) * 0x100000001b3ull;
  }
  uint64_t hash_ = 0xcbf29ce484222325ull;
};

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

std::string build_log(cl_program program, cl_device_id device) {
  size_t size = 0;
  if (clGetProgramBuildInfo(program, device, CL_PROGRAM_BUILD_LOG, 0, nullptr, &size) != CL_SUCCESS || size == 0) {
    return "";
  }
  std::string log(size, '\0');
  if (clGetProgramBuildInfo(program, device, CL_PROGRAM_BUILD_LOG, size, log.data(), nullptr) != CL_SUCCESS) return "";
  while (!log.empty() && (log.back() == '\0' || log.back() == '\n' || log.back() == ' ')) log.pop_back();
  return log;
}

std::vector<unsigned char> read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return {};
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The cached binary as a built program; an empty handle when there is none or the driver does
// not take it (the caller then builds from source).
ProgramHandle load_cached(cl_context context, cl_device_id device, const std::filesystem::path& path,
                          const ProgramSpec& spec) {
  const std::vector<unsigned char> binary = read_file(path);
  if (binary.empty()) return {};
  const auto start = std::chrono::steady_clock::now();
  const unsigned char* data = binary.data();
  const size_t size = binary.size();
  cl_int binary_status = CL_SUCCESS;
  cl_int err = CL_SUCCESS;
  ProgramHandle program(clCreateProgramWithBinary(context, 1, &device, &size, &data, &binary_status, &err));
  if (err == CL_SUCCESS && binary_status == CL_SUCCESS) {
    err = clBuildProgram(program.get(), 1, &device, std::string(spec.options).c_str(), nullptr, nullptr);
  }
  if (err != CL_SUCCESS || binary_status != CL_SUCCESS) {
    if (spec.verbose) {
      std::fprintf(stderr, "ringlm-opencl: cached program %s rejected (%s), building from source\n", path.c_str(),
                   cl_error_name(err != CL_SUCCESS ? err : binary_status).c_str());
    }
    return {};
  }
  if (spec.verbose) {
    std::fprintf(stderr, "ringlm-opencl: program loaded from cache %s in %.0f ms\n", path.c_str(), ms_since(start));
  }
  return program;
}

ProgramHandle build_from_source(cl_context context, cl_device_id device, const ProgramSpec& spec) {
  const auto start = std::chrono::steady_clock::now();
  const char* text = spec.source.data();
  const size_t length = spec.source.size();
  cl_int err = CL_SUCCESS;
  ProgramHandle program(clCreateProgramWithSource(context, 1, &text, &length, &err));
  check(err, "clCreateProgramWithSource");
  err = clBuildProgram(program.get(), 1, &device, std::string(spec.options).c_str(), nullptr, nullptr);
  const std::string log = build_log(program.get(), device);
  if (err != CL_SUCCESS) {
    throw Error(RINGLM_ERROR, "clBuildProgram: " + cl_error_name(err) + (log.empty() ? "" : "\n" + log));
  }
  if (spec.verbose) {
    std::fprintf(stderr, "ringlm-opencl: program built from source in %.0f ms\n", ms_since(start));
    if (!log.empty()) std::fprintf(stderr, "ringlm-opencl: build log:\n%s\n", log.c_str());
  }
  return program;
}

// The program's binary for its one device (empty if the driver gives none).
std::vector<unsigned char> program_binary(cl_program program) {
  cl_uint n_devices = 0;
  check(clGetProgramInfo(program, CL_PROGRAM_NUM_DEVICES, sizeof(n_devices), &n_devices, nullptr), "clGetProgramInfo",
        "CL_PROGRAM_NUM_DEVICES");
  if (n_devices != 1) return {};
  size_t size = 0;
  check(clGetProgramInfo(program, CL_PROGRAM_BINARY_SIZES, sizeof(size), &size, nullptr), "clGetProgramInfo",
        "CL_PROGRAM_BINARY_SIZES");
  std::vector<unsigned char> binary(size);
  if (size == 0) return binary;
  unsigned char* data = binary.data();
  check(clGetProgramInfo(program, CL_PROGRAM_BINARIES, sizeof(data), &data, nullptr), "clGetProgramInfo",
        "CL_PROGRAM_BINARIES");
  return binary;
}

// Writes `bytes` to `path` as a whole or not at all: into a temporary file next to it, renamed
// over it at the end (rename is atomic within a directory), so that a crash or another process
// starting at the same time never reads half a binary.
bool write_atomically(const std::filesystem::path& path, const std::vector<unsigned char>& bytes) {
  static std::atomic<unsigned> counter{0};
  std::filesystem::path tmp = path;
  tmp += ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    out.close();
    if (!out) {
      std::error_code ignored;
      std::filesystem::remove(tmp, ignored);
      return false;
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) std::filesystem::remove(tmp, ec);
  return !ec;
}

void store_binary(cl_program program, const std::filesystem::path& path, bool verbose) {
  try {
    const std::vector<unsigned char> binary = program_binary(program);
    std::error_code ec;
    std::filesystem::create_directories(path.parent_path(), ec);
    const bool stored = !binary.empty() && !ec && write_atomically(path, binary);
    if (verbose) {
      std::fprintf(stderr,
                   stored ? "ringlm-opencl: program cached in %s\n" : "ringlm-opencl: cannot cache program in %s\n",
                   path.c_str());
    }
  } catch (const std::exception& e) {  // Error from a CL query, or the filesystem: no cache then
    if (verbose) std::fprintf(stderr, "ringlm-opencl: cannot cache program in %s: %s\n", path.c_str(), e.what());
  }
}

}  // namespace

std::filesystem::path program_cache_path(cl_device_id device, const ProgramSpec& spec) {
  Fnv1a hash;
  hash.add(device_string(device, CL_DEVICE_NAME, "CL_DEVICE_NAME"));
  hash.add(device_string(device, CL_DEVICE_VERSION, "CL_DEVICE_VERSION"));
  hash.add(device_string(device, CL_DRIVER_VERSION, "CL_DRIVER_VERSION"));
  hash.add(spec.source);
  hash.add(spec.options);
  return std::filesystem::path(spec.cache_dir) / "opencl" / (hash.hex() + ".bin");
}

ProgramHandle build_program(cl_context context, cl_device_id device, const ProgramSpec& spec) {
  if (spec.cache_dir == nullptr) return build_from_source(context, device, spec);
  const std::filesystem::path path = program_cache_path(device, spec);
  if (ProgramHandle cached = load_cached(context, device, path, spec)) return cached;
  ProgramHandle program = build_from_source(context, device, spec);
  store_binary(program.get(), path, spec.verbose);
  return program;
}

void store_program_binary(cl_program program, cl_device_id device, const ProgramSpec& spec) {
  if (spec.cache_dir == nullptr) return;
  try {
    const std::filesystem::path path = program_cache_path(device, spec);
    std::error_code ec;
    if (std::filesystem::exists(path, ec)) return;
    store_binary(program, path, spec.verbose);
  } catch (const std::exception& e) {
    if (spec.verbose) std::fprintf(stderr, "ringlm-opencl: cannot cache program: %s\n", e.what());
  }
}

}  // namespace ringlm::opencl
