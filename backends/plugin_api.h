/* The C ABI between ringlm and a backend plugin (a shared library loaded at run time).
 *
 * A plugin exports one function, RINGLM_PLUGIN_ENTRY ("ringlm_plugin_entry"), that returns a
 * pointer to a static, immutable table (ringlm_plugin). ringlm loads a table whose abi_version
 * is any of RINGLM_PLUGIN_ABI_MIN_VERSION .. RINGLM_PLUGIN_ABI_VERSION (1 to 4) and uses only
 * that version's entries: each version adds entries at the end, so an older table is a prefix
 * of a newer one. It refuses any other version, and a table whose struct_size is smaller than
 * its version needs. New entries bump RINGLM_PLUGIN_ABI_VERSION; changing an existing struct
 * or signature would break the older versions still loaded.
 *
 * Plain C, fixed-size types, no exceptions across the boundary: every call that can fail
 * returns RINGLM_OK (0) or an error code, and the plugin keeps a human-readable reason for the
 * last failure of the calling thread (last_error), which ringlm shows to the user as is.
 *
 * Data formats are GGUF's: weight blocks are GGML's layouts (quant/formats.h documents them; the
 * K-quants and IQ4_XS in super-blocks of 256 weights, a product's k a multiple of that),
 * activations are fp32, KV cache rows fp16 or fp32. Every op is ordered after the ops and
 * uploads issued before it on the same context; download waits for them.
 */
#ifndef RINGLM_BACKENDS_PLUGIN_API_H
#define RINGLM_BACKENDS_PLUGIN_API_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define RINGLM_PLUGIN_ABI_VERSION 4u
#define RINGLM_PLUGIN_ABI_MIN_VERSION 1u
#define RINGLM_PLUGIN_ENTRY "ringlm_plugin_entry"

enum ringlm_status {
  RINGLM_OK = 0,
  RINGLM_ERROR = 1,               /* see last_error */
  RINGLM_ERROR_UNSUPPORTED = 2,   /* the op, shape or format is not one supports() accepts */
  RINGLM_ERROR_OUT_OF_MEMORY = 3,
  RINGLM_ERROR_INVALID_ARGUMENT = 4,
};

/* GGUF tensor type ids of the formats the ABI can name. */
enum ringlm_format {
  RINGLM_FORMAT_F32 = 0,
  RINGLM_FORMAT_F16 = 1,
  RINGLM_FORMAT_Q4_0 = 2,
  RINGLM_FORMAT_Q4_1 = 3,
  RINGLM_FORMAT_Q8_0 = 8,
  /* Named since version 3 (any version's supports() may take them: the ids are GGUF's). */
  RINGLM_FORMAT_Q5_0 = 6,
  RINGLM_FORMAT_Q5_1 = 7,
  RINGLM_FORMAT_Q4_K = 12,
  RINGLM_FORMAT_Q5_K = 13,
  RINGLM_FORMAT_Q6_K = 14,
  RINGLM_FORMAT_IQ4_NL = 20,
  RINGLM_FORMAT_IQ4_XS = 23,
  RINGLM_FORMAT_MXFP4 = 39,
};

enum ringlm_device_type {
  RINGLM_DEVICE_CPU = 0,
  RINGLM_DEVICE_GPU = 1,
  RINGLM_DEVICE_ACCELERATOR = 2,
  RINGLM_DEVICE_OTHER = 3,
};

typedef struct ringlm_device_info {
  char name[128];
  char version[128];       /* e.g. the OpenCL version and driver */
  uint32_t type;           /* ringlm_device_type */
  uint32_t compute_units;
  uint64_t memory_bytes;   /* global memory */
} ringlm_device_info;

enum ringlm_op {
  RINGLM_OP_MATMUL = 1,      /* y = x · Wᵀ, W quantized */
  RINGLM_OP_ATTENTION = 2,   /* causal attention over a slot cache */
  RINGLM_OP_ROPE_SHIFT = 3,  /* re-rotation of cached keys (StreamingLLM shift-RoPE) */
  /* Version 2. supports() answers for these only on a version-2 table. */
  RINGLM_OP_ROW_OPS = 4,     /* rms_norm, add, scale, glu, rope, store_kv (f32/f16 KV), get_rows (weight_format), copy */
  RINGLM_OP_WINDOW_ATTENTION = 5, /* attention2 with window > 0 (and everything attention takes) */
  /* Version 3. */
  RINGLM_OP_GEMM = 6,        /* matmul2 with m rows of x in one call, m past MATMUL's (a prompt chunk) */
};

/* What supports() is asked about; fields an op does not use are 0. */
typedef struct ringlm_op_desc {
  uint32_t op;             /* ringlm_op */
  uint32_t weight_format;  /* MATMUL: ringlm_format of W */
  uint32_t kv_format;      /* ATTENTION, ROPE_SHIFT: RINGLM_FORMAT_F16 or _F32 */
  int64_t m, n, k;         /* MATMUL: rows of x, rows of W, columns of both */
  int32_t n_head, n_head_kv, head_dim, n_rot;
} ringlm_op_desc;

typedef struct ringlm_context ringlm_context; /* an opened device */
typedef struct ringlm_buffer ringlm_buffer;   /* device memory */

typedef struct ringlm_open_options {
  uint32_t struct_size;
  const char* cache_dir; /* where compiled device programs may be kept; NULL: no disk cache */
  int verbose;           /* nonzero: build logs and timings on stderr */
} ringlm_open_options;

/* y[i][j] = sum_c x[i][c] * W[j][c] for i < m, j < n, c < k: x is [m][k] fp32 at x_offset
 * bytes into x, y is [m][n] fp32, W is n rows of k weights in weight_format's blocks. */
typedef struct ringlm_matmul_args {
  const ringlm_buffer* weight;
  uint32_t weight_format;
  int64_t n, k;
  const ringlm_buffer* x;
  size_t x_offset;
  ringlm_buffer* y;
  size_t y_offset;
  int64_t m;
} ringlm_matmul_args;

/* out[i][h] = softmax(q[i][h] · K_visibleᵀ · scale) · V_visible for the n_tokens queries, query i
 * at position q_pos0 + i; it sees the slots j < n_slots with 0 <= positions[j] <= q_pos0 + i
 * (an empty slot has position -1; slots may be in any order, as in a ring). Query head h reads
 * KV head h / (n_head / n_head_kv). q and out are [n_tokens][n_head * head_dim] fp32. Slot j's
 * KV head g starts at element j * row_stride + g * head_dim of keys (values), from the byte
 * offsets given, in kv_format. positions is int32 [n_slots]. */
typedef struct ringlm_attention_args {
  const ringlm_buffer* q;
  size_t q_offset;
  ringlm_buffer* out;
  size_t out_offset;
  const ringlm_buffer* keys;
  size_t keys_offset;
  const ringlm_buffer* values;
  size_t values_offset;
  uint32_t kv_format;
  int64_t row_stride;
  const ringlm_buffer* positions;
  int32_t n_slots;
  int32_t n_tokens;
  int64_t q_pos0;
  int32_t n_head, n_head_kv, head_dim;
  float scale;
} ringlm_attention_args;

/* Rotates the keys of `n_moved` slots (int32 slot indices in `slots`) in each of n_layer
 * layers by the angles whose cosines and sines are cos_sin[0 .. n_rot/2) and
 * cos_sin[n_rot/2 .. n_rot) (fp32, computed by the host), pair i of every KV head being
 * (x[2i], x[2i+1]) when adjacent_pairs, else (x[i], x[i + n_rot/2]):
 *   x_a' = x_a cos - x_b sin,  x_b' = x_a sin + x_b cos.
 * Layer l's slot j row starts at byte keys_offset + l * layer_stride_bytes + j * row_stride
 * elements of kv_format. */
typedef struct ringlm_rope_shift_args {
  ringlm_buffer* keys;
  size_t keys_offset;
  size_t layer_stride_bytes;
  int32_t n_layer;
  uint32_t kv_format;
  int64_t row_stride;
  const ringlm_buffer* slots;
  int32_t n_moved;
  int32_t n_head_kv, head_dim, n_rot;
  int32_t adjacent_pairs;
  const ringlm_buffer* cos_sin;
} ringlm_rope_shift_args;

/* --- Version 2 ------------------------------------------------------------------------------
 * Every offset is in bytes, a multiple of 4 for fp32 data; n, rows and widths are element
 * counts, at least 1. An op's output either is exactly one of its inputs (in place) or overlaps
 * none of them. The ops are enqueued in order after everything issued before them on the context and
 * return without waiting; an op's arguments are checked (buffers, offsets and sizes) before
 * anything is enqueued. */

/* out[r][c] = x[r][c] / sqrt(mean_c(x[r][c]^2) + eps) * weight[c] for r < n_rows, c < width
 * (out may be x). */
typedef struct ringlm_rms_norm_args {
  const ringlm_buffer* x;
  size_t x_offset;
  ringlm_buffer* out;
  size_t out_offset;
  const ringlm_buffer* weight;
  size_t weight_offset;
  int64_t n_rows, width;
  float eps;
} ringlm_rms_norm_args;

/* x[i] += delta[i % delta_n] for i < n: a residual (delta_n = n) or a bias added to every row
 * (delta_n = the row width; n a multiple of it). */
typedef struct ringlm_add_args {
  ringlm_buffer* x;
  size_t x_offset;
  const ringlm_buffer* delta;
  size_t delta_offset;
  int64_t n, delta_n;
} ringlm_add_args;

enum ringlm_activation {
  RINGLM_ACT_SILU = 0,       /* x / (1 + exp(-x)) */
  RINGLM_ACT_GELU_TANH = 1,  /* x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3))) */
  /* Version 4 (gpt-oss; only glu and matmul2 take it, and only from a version-4 table): the
   * product of the clamped gate and up, a = min(gate, 7), b = clamp(up, -7, 7),
   * a / (1 + exp(-1.702 a)) * (b + 1), as ggml's swiglu_oai. */
  RINGLM_ACT_SWIGLU_OAI = 2,
};

/* gate[i] = act(gate[i]) * up[i] for i < n. */
typedef struct ringlm_glu_args {
  ringlm_buffer* gate;
  size_t gate_offset;
  const ringlm_buffer* up;
  size_t up_offset;
  int64_t n;
  uint32_t activation; /* ringlm_activation */
} ringlm_glu_args;

/* RoPE in place: row r (of n_rows, n_heads * head_dim floats each) turns the first n_rot
 * elements of each head by its angles, cos[r][i] and sin[r][i] for i < n_rot / 2 (rows of
 * n_rot / 2 floats), pairs as in ringlm_rope_shift_args:
 *   x_a' = x_a cos - x_b sin,  x_b' = x_a sin + x_b cos. */
typedef struct ringlm_rope_args {
  ringlm_buffer* x;
  size_t x_offset;
  int64_t n_rows;
  int32_t n_heads, head_dim, n_rot;
  int32_t adjacent_pairs;
  const ringlm_buffer* cos;
  size_t cos_offset;
  const ringlm_buffer* sin;
  size_t sin_offset;
} ringlm_rope_args;

/* RoPE of a pass's q and k and the store of its k and v rows, in one launch (a decode step's
 * attention input): q (rope.x: n_rows rows of rope.n_heads heads) and k (n_rows rows of n_head_kv
 * heads) rotated in place as ringlm_rope_args says, then the rows of k and v (n_head_kv *
 * head_dim elements each) stored into keys and values from their byte offsets, rows contiguous,
 * as ringlm_store_kv_args says. */
typedef struct ringlm_rope_store_args {
  ringlm_rope_args rope;
  ringlm_buffer* k;
  size_t k_offset;
  const ringlm_buffer* v;
  size_t v_offset;
  int32_t n_head_kv;
  ringlm_buffer* keys;
  size_t keys_offset;
  ringlm_buffer* values;
  size_t values_offset;
  uint32_t kv_format;
} ringlm_rope_store_args;

/* dst row r (row_width elements of kv_format, rows contiguous from dst_offset) = src row r
 * (row_width fp32) for r < n_rows, rounded to nearest-even for F16. */
typedef struct ringlm_store_kv_args {
  const ringlm_buffer* src;
  size_t src_offset;
  ringlm_buffer* dst;
  size_t dst_offset;
  uint32_t kv_format;
  int64_t n_rows, row_width;
} ringlm_store_kv_args;

/* out[i] = row ids[i] of the weight (n_weight_rows rows of cols, weight_format's blocks),
 * dequantized to fp32 ([n_ids][cols]); ids are int32, each checked on the device: an id
 * outside 0 .. n_weight_rows - 1 gives a row of zeros. */
typedef struct ringlm_get_rows_args {
  const ringlm_buffer* weight;
  uint32_t weight_format;
  int64_t n_weight_rows, cols;
  const ringlm_buffer* ids;
  size_t ids_offset;
  int64_t n_ids;
  ringlm_buffer* out;
  size_t out_offset;
} ringlm_get_rows_args;

/* A further weight of a fused product (ringlm_matmul2_args::more): n rows of the first weight's
 * format and k, multiplied by the same x into its own y ([m][n] fp32 at y_offset). */
typedef struct ringlm_matmul_part {
  const ringlm_buffer* weight;
  int64_t n;
  ringlm_buffer* y;
  size_t y_offset;
} ringlm_matmul_part;

/* The product of ringlm_matmul_args with the ops around it fused, in one launch (m as supports()
 * says for RINGLM_OP_MATMUL or, from version 3, for RINGLM_OP_GEMM):
 *  - rms_weight: each row of x is first RMS-normalised and scaled by rms_weight (k floats), as
 *    ringlm_rms_norm_args, without being written out;
 *  - accumulate: y += x · Wᵀ instead of y = (a residual connection; only without `more`);
 *  - n_more (0..2): more weights multiplied by the same x, each into its own y (q, k and v);
 *  - glu: with n_more = 1 and more[0].n = base.n, base.y = act(x · Wᵀ) * (x · more[0].weightᵀ),
 *    the gated feed-forward's gate and up (more[0].y is not written). */
typedef struct ringlm_matmul2_args {
  ringlm_matmul_args base;
  const ringlm_buffer* rms_weight; /* NULL: x as it is */
  size_t rms_weight_offset;
  float rms_eps;
  int32_t accumulate;
  int32_t n_more;
  ringlm_matmul_part more[2];
  int32_t glu;
  uint32_t activation; /* ringlm_activation, with glu */
} ringlm_matmul2_args;

/* Attention as ringlm_attention_args, and with window > 0 a query at position p sees only the
 * slots of positions p - window + 1 .. p. */
typedef struct ringlm_attention2_args {
  ringlm_attention_args base;
  int32_t window;
} ringlm_attention2_args;

/* What a context did since it was opened: kernels launched (a copy counts as one), bytes moved
 * each way (upload, upload_async, download), and the times the host waited for the device (a
 * blocking call: download, the version-1 upload, finish, rope_shift's check of its slots). */
/* --- Version 3 ------------------------------------------------------------------------------ */

/* The most values top_k picks per row. */
#define RINGLM_TOP_K_MAX 64

/* One of top_k's picks: a value's index in its row, and the value. */
typedef struct ringlm_top_entry {
  int32_t id;
  float value;
} ringlm_top_entry;

/* The k largest of each row's n fp32 values (n_rows rows, contiguous from x_offset; a step's
 * logits), largest first and the lowest index first among equals; a NaN is never picked. Row r's
 * picks are out[r][0 .. k) (ringlm_top_entry, rows of k entries from out_offset); when a row has
 * fewer than k values that are not NaN, its last entries are {-1, -INFINITY}. 1 <= k <=
 * min(n, RINGLM_TOP_K_MAX). What a sampler needs from a step, without the whole vocabulary. */
typedef struct ringlm_top_k_args {
  const ringlm_buffer* x;
  size_t x_offset;
  int64_t n_rows, n;
  int32_t k;
  ringlm_buffer* out;
  size_t out_offset;
} ringlm_top_k_args;

/* --- Version 4 ------------------------------------------------------------------------------ */

/* Attention as ringlm_attention2_args with a learned sink per query head (gpt-oss): sinks is fp32
 * [n_head] from sinks_offset (NULL: none, attention2 itself), and head h's softmax denominator
 * gains exp(sinks[h] - m), m the largest score the query's row saw (a row that saw no slot is
 * zeros, as without sinks). The sink takes weight from the slots and gives the output nothing. */
typedef struct ringlm_attention3_args {
  ringlm_attention2_args base;
  const ringlm_buffer* sinks;
  size_t sinks_offset;
} ringlm_attention3_args;

typedef struct ringlm_counters {
  uint64_t launches;
  uint64_t upload_bytes;
  uint64_t download_bytes;
  uint64_t waits;
} ringlm_counters;

typedef struct ringlm_plugin {
  uint32_t abi_version; /* RINGLM_PLUGIN_ABI_VERSION */
  uint32_t struct_size; /* sizeof(ringlm_plugin) */
  const char* name;     /* what --device names it by, e.g. "opencl" */
  const char* description;

  /* Why the last failed call on this thread failed (never NULL; "" when none did). ctx may be
   * NULL for the calls that take none. */
  const char* (*last_error)(const ringlm_context* ctx);

  /* Devices: count (-1 on error, e.g. no driver), and the description of one. */
  int32_t (*device_count)(void);
  int32_t (*device_info)(int32_t index, ringlm_device_info* out);

  /* Opens device `index` (builds its programs); NULL on failure, with last_error(NULL). */
  ringlm_context* (*open)(int32_t index, const ringlm_open_options* options);
  void (*close)(ringlm_context* ctx);

  /* Buffers. alloc returns NULL on failure; upload and download are synchronous. */
  ringlm_buffer* (*alloc)(ringlm_context* ctx, size_t bytes);
  void (*free)(ringlm_context* ctx, ringlm_buffer* buffer);
  int32_t (*upload)(ringlm_context* ctx, ringlm_buffer* dst, size_t offset, const void* src, size_t bytes);
  int32_t (*download)(ringlm_context* ctx, const ringlm_buffer* src, size_t offset, void* dst, size_t bytes);

  /* Nonzero when the op can run with these shapes and formats on this device. */
  int32_t (*supports)(const ringlm_context* ctx, const ringlm_op_desc* desc);

  int32_t (*matmul)(ringlm_context* ctx, const ringlm_matmul_args* args);
  int32_t (*attention)(ringlm_context* ctx, const ringlm_attention_args* args);
  int32_t (*rope_shift)(ringlm_context* ctx, const ringlm_rope_shift_args* args);

  /* --- Version 2 --- */
  /* Copies `bytes` from src before it returns and uploads them without waiting for the device. */
  int32_t (*upload_async)(ringlm_context* ctx, ringlm_buffer* dst, size_t offset, const void* src, size_t bytes);
  /* Waits until everything enqueued on the context has run. */
  int32_t (*finish)(ringlm_context* ctx);
  /* dst[dst_offset ..] = src[src_offset ..], `bytes` bytes, on the device (the ranges may not overlap). */
  int32_t (*copy)(ringlm_context* ctx, ringlm_buffer* dst, size_t dst_offset, const ringlm_buffer* src,
                  size_t src_offset, size_t bytes);
  int32_t (*rms_norm)(ringlm_context* ctx, const ringlm_rms_norm_args* args);
  int32_t (*add)(ringlm_context* ctx, const ringlm_add_args* args);
  /* x[i] *= factor for i < n. */
  int32_t (*scale)(ringlm_context* ctx, ringlm_buffer* x, size_t x_offset, int64_t n, float factor);
  int32_t (*glu)(ringlm_context* ctx, const ringlm_glu_args* args);
  int32_t (*rope)(ringlm_context* ctx, const ringlm_rope_args* args);
  int32_t (*store_kv)(ringlm_context* ctx, const ringlm_store_kv_args* args);
  int32_t (*get_rows)(ringlm_context* ctx, const ringlm_get_rows_args* args);
  int32_t (*attention2)(ringlm_context* ctx, const ringlm_attention2_args* args);
  int32_t (*matmul2)(ringlm_context* ctx, const ringlm_matmul2_args* args);
  int32_t (*rope_store)(ringlm_context* ctx, const ringlm_rope_store_args* args);
  int32_t (*counters)(const ringlm_context* ctx, ringlm_counters* out);

  /* --- Version 3 --- */
  int32_t (*top_k)(ringlm_context* ctx, const ringlm_top_k_args* args);

  /* --- Version 4 --- */
  int32_t (*attention3)(ringlm_context* ctx, const ringlm_attention3_args* args);
} ringlm_plugin;

/* The size of a version-1 table: a version-1 plugin's struct_size is at least this. */
#define RINGLM_PLUGIN_V1_SIZE (offsetof(ringlm_plugin, rope_shift) + sizeof(void*))
/* ... and of a version-2 table. */
#define RINGLM_PLUGIN_V2_SIZE (offsetof(ringlm_plugin, counters) + sizeof(void*))
/* ... and of a version-3 table. */
#define RINGLM_PLUGIN_V3_SIZE (offsetof(ringlm_plugin, top_k) + sizeof(void*))

typedef const ringlm_plugin* (*ringlm_plugin_entry_fn)(void);

#ifdef __cplusplus
}
#endif

#endif /* RINGLM_BACKENDS_PLUGIN_API_H */
