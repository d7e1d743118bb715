/* The OpenCL plugin as a version-1 plugin: what a plugin built before ABI 2 offers ringlm. It
 * loads the real plugin (SHIM_TARGET, its path), copies the version-1 part of its table and
 * says it speaks ABI 1, under the name "openclv1"; the version-2 entries stay NULL. The tests
 * run the model through it to check that ringlm still runs a version-1 plugin as before
 * (products and attention on the device, every other op on the CPU). */
#include <dlfcn.h>
#include <string.h>

#include "backends/plugin_api.h"

#ifndef SHIM_TARGET
#error SHIM_TARGET must name the plugin library to wrap
#endif

static ringlm_plugin v1_table;

__attribute__((visibility("default"))) const ringlm_plugin* ringlm_plugin_entry(void) {
  if (v1_table.abi_version == 0) {
    void* library = dlopen(SHIM_TARGET, RTLD_NOW | RTLD_LOCAL);
    if (library == NULL) return NULL;
    ringlm_plugin_entry_fn entry = (ringlm_plugin_entry_fn)dlsym(library, RINGLM_PLUGIN_ENTRY);
    const ringlm_plugin* real = entry != NULL ? entry() : NULL;
    if (real == NULL) return NULL;
    memcpy(&v1_table, real, RINGLM_PLUGIN_V1_SIZE);
    v1_table.abi_version = 1;
    v1_table.struct_size = RINGLM_PLUGIN_V1_SIZE;
    v1_table.name = "openclv1";
    v1_table.description = "the OpenCL plugin's version-1 entries (a test shim)";
  }
  return &v1_table;
}
