// OpenCL host-side helpers of the plugin: the error that carries a ringlm_status and a message
// to the C boundary, checks that name the failing call and the CL error, owning handles for CL
// objects, and typed clGet*Info queries.
#pragma once

#ifndef CL_TARGET_OPENCL_VERSION
#define CL_TARGET_OPENCL_VERSION 120
#endif
#include <CL/cl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "backends/plugin_api.h"

namespace ringlm::opencl {

// A failure on its way to the C boundary, where it becomes a status and the thread's last error.
class Error : public std::runtime_error {
 public:
  Error(int32_t status, const std::string& message) : std::runtime_error(message), status_(status) {}
  int32_t status() const { return status_; }

 private:
  int32_t status_;
};

// "CL_OUT_OF_RESOURCES" for -5; "CL error -1234" for a code this list does not know.
std::string cl_error_name(cl_int err);

// Throws Error("<call>(<what>): <CL error name>") unless err is CL_SUCCESS. Allocation failures
// become RINGLM_ERROR_OUT_OF_MEMORY, everything else RINGLM_ERROR.
void check(cl_int err, std::string_view call, std::string_view what = {});

// Throws Error(status, message) unless ok.
inline void require(bool ok, int32_t status, const std::string& message) {
  if (!ok) throw Error(status, message);
}

// Owns one reference to a CL object (cl_context, cl_command_queue, ...).
template <typename T, cl_int (*Release)(T)>
class Handle {
 public:
  Handle() = default;
  explicit Handle(T object) : object_(object) {}
  ~Handle() { reset(); }
  Handle(Handle&& other) noexcept : object_(std::exchange(other.object_, nullptr)) {}
  Handle& operator=(Handle&& other) noexcept {
    if (this != &other) {
      reset();
      object_ = std::exchange(other.object_, nullptr);
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  T get() const { return object_; }
  explicit operator bool() const { return object_ != nullptr; }
  void reset() {
    if (object_ != nullptr) Release(std::exchange(object_, nullptr));
  }

 private:
  T object_ = nullptr;
};

using ContextHandle = Handle<cl_context, clReleaseContext>;
using QueueHandle = Handle<cl_command_queue, clReleaseCommandQueue>;
using ProgramHandle = Handle<cl_program, clReleaseProgram>;
using KernelHandle = Handle<cl_kernel, clReleaseKernel>;
using MemHandle = Handle<cl_mem, clReleaseMemObject>;
using EventHandle = Handle<cl_event, clReleaseEvent>;

// clGetDeviceInfo of a fixed-size value (cl_uint, cl_ulong, size_t, ...).
template <typename T>
T device_value(cl_device_id device, cl_device_info param, std::string_view name) {
  T value{};
  check(clGetDeviceInfo(device, param, sizeof(value), &value, nullptr), "clGetDeviceInfo", name);
  return value;
}

// clGetDeviceInfo of a string, without its terminating NUL and surrounding blanks.
std::string device_string(cl_device_id device, cl_device_info param, std::string_view name);
std::string platform_string(cl_platform_id platform, cl_platform_info param, std::string_view name);

// Every device of every platform, in platform order: the plugin's device indices. Throws Error
// when the platforms cannot be listed (no ICD, no driver).
std::vector<cl_device_id> all_devices();

}  // namespace ringlm::opencl
