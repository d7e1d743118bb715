#include "backends/plugin/device_link.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

namespace ringlm {

std::string device_label(const OpenedDevice& device) {
  return device.plugin->name() + ":" + std::to_string(device.index) + " (" + device.info.name + ")";
}

void check_status(const OpenedDevice& device, int32_t status, const char* what) {
  if (status == RINGLM_OK) return;
  throw std::runtime_error(device_label(device) + ": " + what + " failed: " + device.plugin->last_error(device.context));
}

DeviceBuffer::DeviceBuffer(std::shared_ptr<OpenedDevice> device, size_t bytes) : device_(std::move(device)), bytes_(bytes) {
  buffer_ = device_->plugin->api().alloc(device_->context, std::max<size_t>(bytes, 1));
  if (buffer_ == nullptr) {
    throw std::runtime_error(device_label(*device_) + ": cannot allocate " + std::to_string(bytes) +
                             " bytes: " + device_->plugin->last_error(device_->context) +
                             " (out of device memory? fewer --gpu-layers or a smaller -c need less)");
  }
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  std::swap(device_, other.device_);
  std::swap(buffer_, other.buffer_);
  std::swap(bytes_, other.bytes_);
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (buffer_ != nullptr) device_->plugin->api().free(device_->context, buffer_);
}

void DeviceBuffer::upload(size_t offset, const void* src, size_t n) {
  check_status(*device_, device_->plugin->api().upload(device_->context, buffer_, offset, src, n), "upload");
}

void DeviceBuffer::download(size_t offset, void* dst, size_t n) const {
  check_status(*device_, device_->plugin->api().download(device_->context, buffer_, offset, dst, n), "download");
}

DeviceLink::DeviceLink(std::shared_ptr<OpenedDevice> device)
    : device_(std::move(device)),
      api_(device_->plugin->api()),
      v2_(device_->plugin->abi_version() >= 2),
      v3_(device_->plugin->abi_version() >= 3),
      v4_(device_->plugin->abi_version() >= 4) {}

std::string DeviceLink::short_name() const { return device_->plugin->name() + ":" + std::to_string(device_->index); }

void DeviceLink::check(int32_t status, const char* what) const { check_status(*device_, status, what); }

void DeviceLink::upload_staged(DeviceBuffer& buffer, const void* src, size_t bytes, size_t offset) const {
  if (bytes == 0) return;
  if (v2_) {
    check(api_.upload_async(device_->context, buffer.get(), offset, src, bytes), "upload_async");
  } else {
    buffer.upload(offset, src, bytes);
  }
}

void DeviceLink::ensure(DeviceBuffer& buffer, size_t bytes) const {
  if (buffer.get() == nullptr || buffer.bytes() < bytes) buffer = alloc(std::max(bytes, 2 * buffer.bytes()));
}

}  // namespace ringlm
