// A backend on a plugin's device (backends/plugin_api.h, opened by backends/plugin_loader.h).
//
// The products of every weight the plugin supports run on the device, the weight uploaded once
// at prepare; attention runs there over copies of the KV caches kept in the device's memory,
// with the StreamingLLM key shift done there too. With a plugin of ABI v2 the activations live
// on the device as well (alloc_activations: a device buffer with a host mirror), and so do the
// row-wise ops (RMSNorm, RoPE, the KV store, the gated activation, residual adds, biases, the
// embedding rows): a decode step sends token ids, RoPE angles and changed slot positions, and
// reads back the logits, one wait. Whatever the plugin does not take (a weight format, an
// attention geometry, a shared prompt segment; every row-wise op of an ABI v1 plugin) runs on
// the CPU backend it wraps, its inputs brought to the host first and its outputs sent back
// before the device next reads them.
//
// The parts, in backends/plugin/: device_link (the device and its buffers), residency (which copy
// of an activation is newest), device_products (weights and products), device_kv (the KV caches'
// device copies), plugin_backend.cpp (the Backend: each op's device kernel and CPU fallback, and
// the one place a held-back RoPE runs), backend_choice.cpp (make_backend).
#pragma once

#include <filesystem>
#include <memory>
#include <string>

#include "backends/backend.h"
#include "backends/cpu/cpu_backend.h"
#include "backends/plugin_loader.h"

namespace ringlm {

// `cpu` runs what the device does not take, and the first layers when gpu_layers (the last N
// layers and the output on the device; -1: all) leaves them off it. Throws std::runtime_error
// when the device cannot even take a small matmul (nothing would run there).
// Which layers' ops run on the device, as llama.cpp's -ngl, --cpu-moe and --n-cpu-moe say.
struct DevicePlacement {
  int gpu_layers = -1;     // the last N layers and the output on the device (-1: all)
  int cpu_moe_layers = 0;  // the experts of the first N layers on the CPU (-1: every layer's)
};

std::unique_ptr<Backend> make_plugin_backend(std::shared_ptr<OpenedDevice> device, std::unique_ptr<Backend> cpu,
                                             const DevicePlacement& placement = {});

// What --device, --plugin-dir, -t and --compute ask for.
struct BackendChoice {
  std::string device = "cpu";        // cpu | auto | <plugin>[:N]
  std::string plugin_dir;            // searched first (plugin_search_dirs)
  std::filesystem::path cache_dir;   // where plugins keep compiled programs; empty: none
  int n_threads = 0;
  ComputeType compute = ComputeType::kInt8;
  DevicePlacement placement;         // --gpu-layers, --cpu-moe, --n-cpu-moe
};

// The backend `choice` names. A named device that cannot run throws PluginError (or
// std::invalid_argument for a malformed --device) with the cause; "auto" takes the first GPU of
// any plugin and otherwise the CPU, setting `notice` to a one-line reason for the fallback.
std::unique_ptr<Backend> make_backend(const BackendChoice& choice, std::string& notice);

}  // namespace ringlm
