// The plugin backend's handle on its device: the plugin's table and context, status checks that
// name the device, device buffers, and uploads that do not wait. Every unit of the plugin backend
// (residency.h, device_kv.h, plugin_backend.cpp) talks to the device through it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "backends/plugin_loader.h"

namespace ringlm {

std::string device_label(const OpenedDevice& device);
// Turns a plugin status into an exception naming the device, the call and the plugin's reason.
void check_status(const OpenedDevice& device, int32_t status, const char* what);

// Device memory; freed with the last owner. Holds the device open for as long as it lives.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(std::shared_ptr<OpenedDevice> device, size_t bytes);
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();

  ringlm_buffer* get() const { return buffer_; }
  size_t bytes() const { return bytes_; }
  void upload(size_t offset, const void* src, size_t n);
  void download(size_t offset, void* dst, size_t n) const;

 private:
  std::shared_ptr<OpenedDevice> device_;
  ringlm_buffer* buffer_ = nullptr;
  size_t bytes_ = 0;
};

// A place in device memory: a buffer and a byte offset into it.
struct DeviceSpan {
  ringlm_buffer* buffer = nullptr;
  size_t offset = 0;
};

class DeviceLink {
 public:
  explicit DeviceLink(std::shared_ptr<OpenedDevice> device);

  const std::shared_ptr<OpenedDevice>& opened() const { return device_; }
  const ringlm_plugin& api() const { return api_; }
  ringlm_context* context() const { return device_->context; }
  bool v2() const { return v2_; }  // ABI v2: activations and the row-wise ops on the device
  bool v3() const { return v3_; }  // ABI v3: GEMM of a whole chunk, top_k
  bool v4() const { return v4_; }  // ABI v4: attention sinks, gpt-oss's clamped SwiGLU
  std::string label() const { return device_label(*device_); }
  // "opencl:0": where a layer runs, for --stats.
  std::string short_name() const;

  // check_status on this device.
  void check(int32_t status, const char* what) const;
  // An upload that does not wait (ABI v2: the plugin copies the bytes), or the v1 upload.
  void upload_staged(DeviceBuffer& buffer, const void* src, size_t bytes, size_t offset = 0) const;
  // `buffer` at least `bytes` long (grown to twice its size or more: staging reused across calls).
  void ensure(DeviceBuffer& buffer, size_t bytes) const;
  DeviceBuffer alloc(size_t bytes) const { return DeviceBuffer(device_, bytes); }
  bool supports(const ringlm_op_desc& desc) const { return api_.supports(device_->context, &desc) != 0; }

 private:
  std::shared_ptr<OpenedDevice> device_;
  const ringlm_plugin& api_;
  bool v2_;
  bool v3_;
  bool v4_;
};

}  // namespace ringlm
