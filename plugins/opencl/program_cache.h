// Building the plugin's OpenCL program, with a disk cache of compiled binaries.
//
// Compiling OpenCL C takes from a fraction of a second (GPU drivers) to seconds (PoCL runs LLVM),
// at every start. With a cache directory, the binary the driver produced (CL_PROGRAM_BINARIES) is
// kept in <cache_dir>/opencl/<hash>.bin, the hash covering everything that could change it: the
// device's name and version, the driver version, the kernel source and the build options. The
// next start loads it with clCreateProgramWithBinary; a binary the driver rejects (a driver
// update it cannot read, a damaged file) falls back to the source, which then replaces it.
#pragma once

#include <filesystem>
#include <string_view>

#include "plugins/opencl/cl_util.h"

namespace ringlm::opencl {

struct ProgramSpec {
  std::string_view source;
  std::string_view options;         // clBuildProgram's
  const char* cache_dir = nullptr;  // nullptr: no disk cache
  bool verbose = false;             // where the program came from, build logs and times on stderr
};

// The program for `device` in `context`, built and ready for clCreateKernel. Throws Error when
// the source does not build (the message carries the build log).
ProgramHandle build_program(cl_context context, cl_device_id device, const ProgramSpec& spec);

// Writes the binary of `program` (built for `device` from `spec`) to spec.cache_dir unless the
// cache already has it: for a program built earlier in this process for another cache directory.
// Never throws: a cache that cannot be written is no error.
void store_program_binary(cl_program program, cl_device_id device, const ProgramSpec& spec);

// The cache file of `spec`'s program on `device` (spec.cache_dir must be set).
std::filesystem::path program_cache_path(cl_device_id device, const ProgramSpec& spec);

}  // namespace ringlm::opencl
