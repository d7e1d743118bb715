/* A fake backend plugin for test_plugin_loader: compiled several times, each time with -D
 * definitions that make it a working plugin or one particular kind of broken one.
 *
 *   FAKE_NAME="fake"        the plugin's name (required)
 *   FAKE_ABI=7              the abi_version it claims (default: 1, a plugin built before ABI 2)
 *   FAKE_STRUCT_SIZE=n      the struct_size it claims (default: a version-1 table's)
 *   FAKE_NO_ENTRY           exports a misspelt entry point instead of ringlm_plugin_entry
 *   FAKE_NULL_ENTRY         the entry point returns NULL
 *   FAKE_COUNT_FAILS        device_count returns -1, last_error "driver exploded"
 *   FAKE_CPU_ONLY           one CPU-type device instead of a GPU and a CPU
 *   FAKE_OPEN_FAILS         open returns NULL with a two-line "build log" as last_error
 *   FAKE_UNDEFINED_SYMBOL   calls a function nothing defines, so dlopen(RTLD_NOW) fails
 *   FAKE_NULL_MATMUL        a table without its matmul function
 *
 * The working devices do trivial things: a context is a static object, buffers are malloc'd.
 */
#include <stdlib.h>
#include <string.h>

#include "backends/plugin_api.h"

#ifndef FAKE_NAME
#error FAKE_NAME must be defined
#endif
#ifndef FAKE_ABI
#define FAKE_ABI 1
#endif
#ifndef FAKE_STRUCT_SIZE
#define FAKE_STRUCT_SIZE RINGLM_PLUGIN_V1_SIZE
#endif

#define FAKE_EXPORT __attribute__((visibility("default")))

struct ringlm_context {
  int index;
};
struct ringlm_buffer {
  size_t bytes;
  unsigned char data[];
};

static const char* last_error_text = "";

#ifdef FAKE_UNDEFINED_SYMBOL
void ringlm_fake_function_nobody_defines(void);
#endif

static const char* fake_last_error(const ringlm_context* ctx) {
  (void)ctx;
  return last_error_text;
}

static int32_t fake_device_count(void) {
#ifdef FAKE_UNDEFINED_SYMBOL
  ringlm_fake_function_nobody_defines();
#endif
#ifdef FAKE_COUNT_FAILS
  last_error_text = "driver exploded";
  return -1;
#elif defined(FAKE_CPU_ONLY)
  return 1;
#else
  return 2;
#endif
}

static void describe(ringlm_device_info* out, const char* name, uint32_t type, uint32_t units, uint64_t memory) {
  memset(out, 0, sizeof(*out));
  strncpy(out->name, name, sizeof(out->name) - 1);
  strncpy(out->version, "FakeCL 1.0", sizeof(out->version) - 1);
  out->type = type;
  out->compute_units = units;
  out->memory_bytes = memory;
}

static int32_t fake_device_info(int32_t index, ringlm_device_info* out) {
  if (index < 0 || index >= fake_device_count()) {
    last_error_text = "no such device";
    return RINGLM_ERROR_INVALID_ARGUMENT;
  }
#ifdef FAKE_CPU_ONLY
  describe(out, "Fake CPU", RINGLM_DEVICE_CPU, 4, (uint64_t)512 << 20);
#else
  if (index == 0) {
    describe(out, "Fake CPU", RINGLM_DEVICE_CPU, 4, (uint64_t)512 << 20);
  } else {
    describe(out, "Fake GPU", RINGLM_DEVICE_GPU, 32, (uint64_t)8 << 30);
  }
#endif
  return RINGLM_OK;
}

static ringlm_context* fake_open(int32_t index, const ringlm_open_options* options) {
  if (options == NULL || options->struct_size < sizeof(*options)) {
    last_error_text = "bad open options";
    return NULL;
  }
#ifdef FAKE_OPEN_FAILS
  (void)index;
  last_error_text = "kernel build failed: matmul.cl:3: error: use of undeclared identifier 'x'\nmore of the log";
  return NULL;
#else
  static struct ringlm_context contexts[2] = {{0}, {1}};
  if (index < 0 || index >= fake_device_count()) {
    last_error_text = "no such device";
    return NULL;
  }
  return &contexts[index];
#endif
}

static void fake_close(ringlm_context* ctx) { (void)ctx; }

static ringlm_buffer* fake_alloc(ringlm_context* ctx, size_t bytes) {
  (void)ctx;
  ringlm_buffer* buffer = malloc(sizeof(ringlm_buffer) + bytes);
  if (buffer != NULL) buffer->bytes = bytes;
  return buffer;
}

static void fake_free(ringlm_context* ctx, ringlm_buffer* buffer) {
  (void)ctx;
  free(buffer);
}

static int32_t fake_upload(ringlm_context* ctx, ringlm_buffer* dst, size_t offset, const void* src, size_t bytes) {
  (void)ctx;
  if (offset > dst->bytes || bytes > dst->bytes - offset) return RINGLM_ERROR_INVALID_ARGUMENT;
  memcpy(dst->data + offset, src, bytes);
  return RINGLM_OK;
}

static int32_t fake_download(ringlm_context* ctx, const ringlm_buffer* src, size_t offset, void* dst, size_t bytes) {
  (void)ctx;
  if (offset > src->bytes || bytes > src->bytes - offset) return RINGLM_ERROR_INVALID_ARGUMENT;
  memcpy(dst, src->data + offset, bytes);
  return RINGLM_OK;
}

static int32_t fake_supports(const ringlm_context* ctx, const ringlm_op_desc* desc) {
  (void)ctx;
  (void)desc;
  return 0;
}

/* unused in the FAKE_NULL_MATMUL build, whose table leaves it out */
__attribute__((unused)) static int32_t fake_matmul(ringlm_context* ctx, const ringlm_matmul_args* args) {
  (void)ctx;
  (void)args;
  return RINGLM_ERROR_UNSUPPORTED;
}

static int32_t fake_attention(ringlm_context* ctx, const ringlm_attention_args* args) {
  (void)ctx;
  (void)args;
  return RINGLM_ERROR_UNSUPPORTED;
}

static int32_t fake_rope_shift(ringlm_context* ctx, const ringlm_rope_shift_args* args) {
  (void)ctx;
  (void)args;
  return RINGLM_ERROR_UNSUPPORTED;
}

/* unused in the FAKE_NULL_ENTRY build, which never hands it out */
static const ringlm_plugin fake_table __attribute__((unused)) = {
    .abi_version = FAKE_ABI,
    .struct_size = FAKE_STRUCT_SIZE,
    .name = FAKE_NAME,
    .description = "a fake plugin for ringlm's loader tests",
    .last_error = fake_last_error,
    .device_count = fake_device_count,
    .device_info = fake_device_info,
    .open = fake_open,
    .close = fake_close,
    .alloc = fake_alloc,
    .free = fake_free,
    .upload = fake_upload,
    .download = fake_download,
    .supports = fake_supports,
#ifdef FAKE_NULL_MATMUL
    .matmul = NULL,
#else
    .matmul = fake_matmul,
#endif
    .attention = fake_attention,
    .rope_shift = fake_rope_shift,
};

#if defined(FAKE_NO_ENTRY)
/* Almost the right name: what a plugin built against a typo'd header would export. */
FAKE_EXPORT const ringlm_plugin* ringlm_plugin_entry_v0(void) { return &fake_table; }
#elif defined(FAKE_NULL_ENTRY)
FAKE_EXPORT const ringlm_plugin* ringlm_plugin_entry(void) { return NULL; }
#else
FAKE_EXPORT const ringlm_plugin* ringlm_plugin_entry(void) { return &fake_table; }
#endif
