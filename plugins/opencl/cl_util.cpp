#include "plugins/opencl/cl_util.h"

namespace ringlm::opencl {

// cl_khr_icd's CL_PLATFORM_NOT_FOUND_KHR (cl_ext.h): what the ICD loader answers when it finds
// no driver at all.
constexpr cl_int kPlatformNotFound = -1001;

std::string cl_error_name(cl_int err) {
  switch (err) {
#define NAME(code) \
  case code:       \
    return #code;
    NAME(CL_SUCCESS)
    NAME(CL_DEVICE_NOT_FOUND)
    NAME(CL_DEVICE_NOT_AVAILABLE)
    NAME(CL_COMPILER_NOT_AVAILABLE)
    NAME(CL_MEM_OBJECT_ALLOCATION_FAILURE)
    NAME(CL_OUT_OF_RESOURCES)
    NAME(CL_OUT_OF_HOST_MEMORY)
    NAME(CL_PROFILING_INFO_NOT_AVAILABLE)
    NAME(CL_MEM_COPY_OVERLAP)
    NAME(CL_IMAGE_FORMAT_MISMATCH)
    NAME(CL_IMAGE_FORMAT_NOT_SUPPORTED)
    NAME(CL_BUILD_PROGRAM_FAILURE)
    NAME(CL_MAP_FAILURE)
    NAME(CL_MISALIGNED_SUB_BUFFER_OFFSET)
    NAME(CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST)
    NAME(CL_COMPILE_PROGRAM_FAILURE)
    NAME(CL_LINKER_NOT_AVAILABLE)
    NAME(CL_LINK_PROGRAM_FAILURE)
    NAME(CL_DEVICE_PARTITION_FAILED)
    NAME(CL_KERNEL_ARG_INFO_NOT_AVAILABLE)
    NAME(CL_INVALID_VALUE)
    NAME(CL_INVALID_DEVICE_TYPE)
    NAME(CL_INVALID_PLATFORM)
    NAME(CL_INVALID_DEVICE)
    NAME(CL_INVALID_CONTEXT)
    NAME(CL_INVALID_QUEUE_PROPERTIES)
    NAME(CL_INVALID_COMMAND_QUEUE)
    NAME(CL_INVALID_HOST_PTR)
    NAME(CL_INVALID_MEM_OBJECT)
    NAME(CL_INVALID_IMAGE_FORMAT_DESCRIPTOR)
    NAME(CL_INVALID_IMAGE_SIZE)
    NAME(CL_INVALID_SAMPLER)
    NAME(CL_INVALID_BINARY)
    NAME(CL_INVALID_BUILD_OPTIONS)
    NAME(CL_INVALID_PROGRAM)
    NAME(CL_INVALID_PROGRAM_EXECUTABLE)
    NAME(CL_INVALID_KERNEL_NAME)
    NAME(CL_INVALID_KERNEL_DEFINITION)
    NAME(CL_INVALID_KERNEL)
    NAME(CL_INVALID_ARG_INDEX)
    NAME(CL_INVALID_ARG_VALUE)
    NAME(CL_INVALID_ARG_SIZE)
    NAME(CL_INVALID_KERNEL_ARGS)
    NAME(CL_INVALID_WORK_DIMENSION)
    NAME(CL_INVALID_WORK_GROUP_SIZE)
    NAME(CL_INVALID_WORK_ITEM_SIZE)
    NAME(CL_INVALID_GLOBAL_OFFSET)
    NAME(CL_INVALID_EVENT_WAIT_LIST)
    NAME(CL_INVALID_EVENT)
    NAME(CL_INVALID_OPERATION)
    NAME(CL_INVALID_GL_OBJECT)
    NAME(CL_INVALID_BUFFER_SIZE)
    NAME(CL_INVALID_MIP_LEVEL)
    NAME(CL_INVALID_GLOBAL_WORK_SIZE)
    NAME(CL_INVALID_PROPERTY)
    NAME(CL_INVALID_IMAGE_DESCRIPTOR)
    NAME(CL_INVALID_COMPILER_OPTIONS)
    NAME(CL_INVALID_LINKER_OPTIONS)
    NAME(CL_INVALID_DEVICE_PARTITION_COUNT)
#undef NAME
    case kPlatformNotFound:
      return "CL_PLATFORM_NOT_FOUND_KHR";
    default:
      return "CL error " + std::to_string(err);
  }
}

void check(cl_int err, std::string_view call, std::string_view what) {
  if (err == CL_SUCCESS) return;
  std::string message(call);
  if (!what.empty()) message.append("(").append(what).append(")");
  message.append(": ").append(cl_error_name(err));
  const bool out_of_memory = err == CL_MEM_OBJECT_ALLOCATION_FAILURE || err == CL_OUT_OF_HOST_MEMORY;
  throw Error(out_of_memory ? RINGLM_ERROR_OUT_OF_MEMORY : RINGLM_ERROR, message);
}

namespace {

// Drivers pad some strings with NULs or blanks (and count the terminating NUL in the size).
std::string trimmed(std::string s) {
  const auto blank = [](char c) { return c == '\0' || c == ' ' || c == '\t' || c == '\n'; };
  while (!s.empty() && blank(s.back())) s.pop_back();
  size_t first = 0;
  while (first < s.size() && blank(s[first])) ++first;
  return s.substr(first);
}

template <typename Object, typename Param, typename Getter>
std::string info_string(Getter get, Object object, Param param, std::string_view call, std::string_view name) {
  size_t size = 0;
  check(get(object, param, 0, nullptr, &size), call, name);
  std::string value(size, '\0');
  if (size > 0) check(get(object, param, size, value.data(), nullptr), call, name);
  return trimmed(std::move(value));
}

}  // namespace

std::string device_string(cl_device_id device, cl_device_info param, std::string_view name) {
  return info_string(clGetDeviceInfo, device, param, "clGetDeviceInfo", name);
}

std::string platform_string(cl_platform_id platform, cl_platform_info param, std::string_view name) {
  return info_string(clGetPlatformInfo, platform, param, "clGetPlatformInfo", name);
}

std::vector<cl_device_id> all_devices() {
  cl_uint n_platforms = 0;
  const cl_int listed = clGetPlatformIDs(0, nullptr, &n_platforms);
  if (listed == kPlatformNotFound) {
    throw Error(RINGLM_ERROR,
                "clGetPlatformIDs: CL_PLATFORM_NOT_FOUND_KHR (no OpenCL driver is installed: the ICD "
                "loader found nothing in /etc/OpenCL/vendors)");
  }
  check(listed, "clGetPlatformIDs");
  std::vector<cl_platform_id> platforms(n_platforms);
  if (n_platforms > 0) check(clGetPlatformIDs(n_platforms, platforms.data(), nullptr), "clGetPlatformIDs");

  std::vector<cl_device_id> devices;
  for (cl_platform_id platform : platforms) {
    cl_uint n = 0;
    const cl_int err = clGetDeviceIDs(platform, CL_DEVICE_TYPE_ALL, 0, nullptr, &n);
    if (err == CL_DEVICE_NOT_FOUND || n == 0) continue;  // a platform without devices is not an error
    check(err, "clGetDeviceIDs");
    std::vector<cl_device_id> ids(n);
    check(clGetDeviceIDs(platform, CL_DEVICE_TYPE_ALL, n, ids.data(), nullptr), "clGetDeviceIDs");
    devices.insert(devices.end(), ids.begin(), ids.end());
  }
  return devices;
}

}  // namespace ringlm::opencl
