/* The OpenCL plugin as a plugin of an older ABI: what a plugin built before ABI 4 (or 3, or 2)
 * offers ringlm. It loads the real plugin (SHIM_TARGET, its path), copies the part of its table
 * that ABI SHIM_ABI has and says it speaks that version, under the name SHIM_NAME; the later
 * entries stay NULL. The tests run the model through it to check that ringlm still runs such a
 * plugin: version 1, products and attention on the device and every other op on the CPU;
 * version 2, the whole step on the device but the top-k picked on the host; version 3, gpt-oss's
 * sink attention and clamped SwiGLU on the CPU. With SHIM_NO_TOP_K it claims
 * version 3 without the version-3 entry, a table the loader must refuse; with SHIM_ALLOC_LIMIT
 * (bytes) its device memory is that small. (Freed buffers are not given back to the limit.) */
#include <dlfcn.h>
#include <string.h>

#include "backends/plugin_api.h"

#if !defined(SHIM_TARGET) || !defined(SHIM_ABI) || !defined(SHIM_NAME)
#error SHIM_TARGET (the plugin library to wrap), SHIM_ABI and SHIM_NAME must be defined
#endif

#if SHIM_ABI == 1
#define SHIM_SIZE RINGLM_PLUGIN_V1_SIZE
#elif SHIM_ABI == 2
#define SHIM_SIZE RINGLM_PLUGIN_V2_SIZE
#elif SHIM_ABI == 3
#define SHIM_SIZE RINGLM_PLUGIN_V3_SIZE
#else
#define SHIM_SIZE sizeof(ringlm_plugin)
#endif

static ringlm_plugin table;

#ifdef SHIM_ALLOC_LIMIT
/* A device with SHIM_ALLOC_LIMIT bytes of memory: allocations past it fail as a full device's
 * would (the tests of --gpu-layers' out-of-memory error). */
static const ringlm_plugin* real_table;
static size_t allocated;
static int refused;
static ringlm_buffer* limited_alloc(ringlm_context* ctx, size_t bytes) {
  if (allocated + bytes > (size_t)SHIM_ALLOC_LIMIT) {
    refused = 1;
    return NULL;
  }
  ringlm_buffer* buffer = real_table->alloc(ctx, bytes);
  if (buffer != NULL) allocated += bytes;
  refused = 0;
  return buffer;
}
static const char* limited_last_error(const ringlm_context* ctx) {
  return refused ? "CL_MEM_OBJECT_ALLOCATION_FAILURE (the test shim's memory is full)" : real_table->last_error(ctx);
}
#endif

__attribute__((visibility("default"))) const ringlm_plugin* ringlm_plugin_entry(void) {
  if (table.abi_version == 0) {
    void* library = dlopen(SHIM_TARGET, RTLD_NOW | RTLD_LOCAL);
    if (library == NULL) return NULL;
    ringlm_plugin_entry_fn entry = (ringlm_plugin_entry_fn)dlsym(library, RINGLM_PLUGIN_ENTRY);
    const ringlm_plugin* real = entry != NULL ? entry() : NULL;
    if (real == NULL) return NULL;
    memcpy(&table, real, SHIM_SIZE);
#ifdef SHIM_NO_TOP_K
    table.top_k = NULL;
#endif
#ifdef SHIM_ALLOC_LIMIT
    real_table = real;
    table.alloc = limited_alloc;
    table.last_error = limited_last_error;
#endif
    table.abi_version = SHIM_ABI;
    table.struct_size = SHIM_SIZE;
    table.name = SHIM_NAME;
    table.description = "the OpenCL plugin's entries of an older plugin ABI (a test shim)";
  }
  return &table;
}
