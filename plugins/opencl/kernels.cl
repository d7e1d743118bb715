// The kernels of ringlm's OpenCL plugin: flat GEMM on quantized weights, causal (optionally
// sliding-window) attention over a ring of KV slots, the shift-RoPE re-rotation of cached keys,
// and the row ops of ABI version 2 (RMS norm, add, scale, GLU, RoPE, KV stores, row gathers).
//
// OpenCL C 1.2 and nothing optional: fp16 data is read and written with vload_half /
// vstore_half_rte (core in 1.2), never as `half` arithmetic, so every OpenCL 1.2 device runs it.
// Quantized weights are GGML's packed blocks (18, 20 and 34 bytes: see quant/formats.h), read as
// bytes, never as structs whose alignment the device compiler could choose.
//
// The host (opencl_plugin.cpp) checks every shape and offset before launching; the kernels only
// guard the edges of their own grids.

// No fused multiply-adds behind our back: the rotation and the roundings then match the CPU's
// float arithmetic as closely as the operation order allows.
#pragma OPENCL FP_CONTRACT OFF

// The helpers below are plain functions, not `inline`: OpenCL C follows C99, where an inline
// function that the compiler decides not to inline has no definition to link against.

// ringlm_format ids (plugin_api.h).
#define FMT_F32 0
#define FMT_F16 1
#define FMT_Q4_0 2
#define FMT_Q4_1 3
#define FMT_Q8_0 8
#define FMT_Q5_0 6
#define FMT_Q5_1 7
#define FMT_Q4_K 12
#define FMT_Q5_K 13
#define FMT_Q6_K 14
#define FMT_IQ4_NL 20
#define FMT_IQ4_XS 23
#define FMT_MXFP4 39

#define BLOCK 32       // weights per quantized block; F32 and F16 rows are read in runs of 32 as well
#define MAX_M 16       // rows of x one matmul call takes (supports() says so; the host splits more)
#define HD_PER_ITEM 4  // head dimensions each attention work-item accumulates: head_dim <= 4 * group size

// --- Small helpers ----------------------------------------------------------------------------

float sum16(const float16 v) {
  const float8 a = v.lo + v.hi;
  const float4 b = a.lo + a.hi;
  const float2 c = b.lo + b.hi;
  return c.x + c.y;
}

// --- Matmul -----------------------------------------------------------------------------------

// 32 consecutive weights of a row: w[i] = scale * (i < 16 ? lo[i] : hi[i - 16]). For the formats
// with one scale per 32 integers (Q4_0, Q5_0, Q8_0, IQ4_NL) lo/hi hold the integers (or grid
// values) and the block's scale multiplies their dot product once; for the others they hold the
// weights themselves and scale is 1.
typedef struct {
  float16 lo;
  float16 hi;
  float scale;
} WeightBlock;

// Weights per stored block: the super-blocks of the K-quants and IQ4_XS hold 256 (8 blocks of 32
// with their own scales), every other format's blocks 32.
int block_weights(const int format) {
  return format == FMT_Q4_K || format == FMT_Q5_K || format == FMT_Q6_K || format == FMT_IQ4_XS ? 256 : 32;
}

// The 16 values of IQ4_NL's and IQ4_XS's 4-bit codes (quant/formats.h, kIq4nlValues).
__constant float kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// The 16 values of MXFP4's 4-bit codes: the E2M1 values times two (quant/formats.h, kMxfp4Values).
__constant float kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Half of MXFP4's E8M0 block scale e, 2^(e - 128), from its float bits (quant/formats.h,
// e8m0_half_to_fp32; e = 0 and 1 are subnormal, which a device may flush to zero).
float e8m0_half(const uchar e) { return as_float(e >= 2 ? (uint)(e - 1) << 23 : 1u << (21 + e)); }

// Bits `first` .. first + 15 of qh, each as 16 (the fifth bit of a 5-bit code) or 0.
uint16 fifth_bits(const uint qh, const int first) {
  const uint16 shifts = (uint16)(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15) + (uint)first;
  return (((uint16)qh >> shifts) & (uint16)1) << (uint16)4;
}

uint load_u32(__global const uchar* p) { return p[0] | (p[1] << 8) | (p[2] << 16) | ((uint)p[3] << 24); }

// Q4_K's and Q5_K's 6-bit scale and min of sub-block j, packed in 12 bytes (get_scale_min_k4).
float2 scale_min_k4(const int j, __global const uchar* q) {
  if (j < 4) return (float2)(q[j] & 63, q[j + 4] & 63);
  return (float2)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4));
}

// 32 consecutive weights of a quantized row as integer codes (int8: every format's codes fit):
// w[i] = (i < 16 ? scale_lo * lo[i] : scale_hi * hi[i - 16]) + min. Q6_K's two halves have scales
// of their own; every other format's scale_lo and scale_hi are equal. The integer GEMM multiplies
// the codes by int8 activations; load_block turns them into floats.
typedef struct {
  char16 lo;
  char16 hi;
  float scale_lo, scale_hi;
  float min;  // 0 for the formats of signed codes (Q4_0, Q5_0, Q8_0, Q6_K, IQ4_NL, IQ4_XS, MXFP4)
} CodeBlock;

// The formats whose weights are one scale times the codes: load_block keeps the codes (as floats)
// and the scale multiplies a block's dot product once. (Q6_K has two scales, the others a min.)
int codes_scaled_once(const int format) {
  return format == FMT_Q4_0 || format == FMT_Q5_0 || format == FMT_Q8_0 || format == FMT_IQ4_NL ||
         format == FMT_IQ4_XS || format == FMT_MXFP4;
}

char16 iq4_codes(const uchar16 nibbles) {
  char v[16];
  for (int i = 0; i < 16; ++i) v[i] = (char)kIq4Values[((uchar*)&nibbles)[i]];
  return vload16(0, v);
}

char16 mxfp4_codes(const uchar16 nibbles) {
  char v[16];
  for (int i = 0; i < 16; ++i) v[i] = (char)kMxfp4Values[((uchar*)&nibbles)[i]];
  return vload16(0, v);
}

// Block j (0..7) of a super-block at s, as quant/formats.cpp dequantizes it.
CodeBlock load_sub_block_codes(const int format, __global const uchar* s, const int j) {
  CodeBlock b;
  b.min = 0.0f;
  if (format == FMT_Q4_K || format == FMT_Q5_K) {
    // {fp16 d; fp16 dmin; 12 bytes of scales and mins; (Q5_K: 32 bytes qh;) nibbles}: block j is
    // the low (j even) or high nibbles of bytes 32 (j / 2) .. + 31; Q5_K's fifth bit of element l
    // is bit j of qh[l]. w = d sc q - dmin m.
    const float d = vload_half(0, (__global const half*)s), dmin = vload_half(1, (__global const half*)s);
    const float2 sm = scale_min_k4(j, s + 4);
    __global const uchar* qs = s + (format == FMT_Q5_K ? 48 : 16) + 32 * (j / 2);
    const uchar16 a = vload16(0, qs), c = vload16(1, qs);
    uchar16 lo = j % 2 ? a >> (uchar16)4 : a & (uchar16)0x0F;
    uchar16 hi = j % 2 ? c >> (uchar16)4 : c & (uchar16)0x0F;
    if (format == FMT_Q5_K) {
      const uchar16 h0 = vload16(0, s + 16), h1 = vload16(1, s + 16);
      lo |= ((h0 >> (uchar)j) & (uchar16)1) << (uchar16)4;
      hi |= ((h1 >> (uchar)j) & (uchar16)1) << (uchar16)4;
    }
    b.lo = as_char16(lo);
    b.hi = as_char16(hi);
    b.scale_lo = b.scale_hi = d * sm.x;
    b.min = -(dmin * sm.y);
  } else if (format == FMT_Q6_K) {
    // {ql[128]; qh[64]; int8 scales[16]; fp16 d}: each half of 128 weights (n) holds four
    // blocks t: low nibbles of ql[l] (t 0) and ql[32 + l] (t 1), high nibbles of those (t 2, 3),
    // two bits of qh[l] at 2t on top; 16 weights a scale. w = d sc (q - 32).
    const int n = j / 4, t = j % 4;
    __global const uchar* ql = s + 64 * n + (t & 1 ? 32 : 0);
    __global const uchar* qh = s + 128 + 32 * n;
    __global const char* sc = (__global const char*)(s + 192) + 8 * n + 2 * t;
    const float d = vload_half(0, (__global const half*)(s + 208));
    const uchar16 l0 = vload16(0, ql), l1 = vload16(1, ql);
    const uchar16 h0 = vload16(0, qh), h1 = vload16(1, qh);
    const uchar16 n0 = t >= 2 ? l0 >> (uchar16)4 : l0 & (uchar16)0x0F;
    const uchar16 n1 = t >= 2 ? l1 >> (uchar16)4 : l1 & (uchar16)0x0F;
    const uchar shift = 2 * t;
    b.lo = as_char16(n0 | (((h0 >> shift) & (uchar16)3) << (uchar16)4)) - (char16)32;
    b.hi = as_char16(n1 | (((h1 >> shift) & (uchar16)3) << (uchar16)4)) - (char16)32;
    b.scale_lo = d * sc[0];
    b.scale_hi = d * sc[1];
  } else {  // FMT_IQ4_XS: {fp16 d; uint16 scales_h; scales_l[4]; nibbles[128]}, 6-bit scale ls per block
    const float d = vload_half(0, (__global const half*)s);
    const uint scales_h = s[2] | (s[3] << 8);
    const int ls = ((s[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((scales_h >> (2 * j)) & 3) << 4);
    const uchar16 q = vload16(0, s + 8 + 16 * j);
    b.lo = iq4_codes(q & (uchar16)0x0F);
    b.hi = iq4_codes(q >> (uchar16)4);
    b.scale_lo = b.scale_hi = d * (float)(ls - 32);
  }
  return b;
}

// Block b (32 weights from column 32 b) of a quantized row stored in blocks of block_bytes bytes.
CodeBlock load_codes(const int format, __global const uchar* row, const int b, const int block_bytes) {
  if (block_weights(format) == 256) return load_sub_block_codes(format, row + (ulong)(b / 8) * block_bytes, b % 8);
  __global const uchar* p = row + (ulong)b * block_bytes;
  CodeBlock c;
  c.min = 0.0f;
  if (format == FMT_MXFP4) {  // {E8M0 e; nibbles as Q4_0}, w = e8m0_half(e) kMxfp4Values[q]
    // (17-byte blocks: no fp16 to read, and none could be, at odd addresses)
    const uchar16 q = vload16(0, p + 1);
    c.scale_lo = c.scale_hi = e8m0_half(p[0]);
    c.lo = mxfp4_codes(q & (uchar16)0x0F);
    c.hi = mxfp4_codes(q >> (uchar16)4);
    return c;
  }
  c.scale_lo = c.scale_hi = vload_half(0, (__global const half*)p);
  if (format == FMT_Q4_0) {  // {fp16 d; 16 bytes: low nibbles = elements 0..15, high = 16..31}, w = d (q - 8)
    const uchar16 q = vload16(0, p + 2);
    c.lo = as_char16(q & (uchar16)0x0F) - (char16)8;
    c.hi = as_char16(q >> (uchar16)4) - (char16)8;
  } else if (format == FMT_Q4_1) {  // {fp16 d; fp16 m; nibbles as Q4_0}, w = d q + m
    const uchar16 q = vload16(0, p + 4);
    c.lo = as_char16(q & (uchar16)0x0F);
    c.hi = as_char16(q >> (uchar16)4);
    c.min = vload_half(1, (__global const half*)p);
  } else if (format == FMT_Q5_0 || format == FMT_Q5_1) {
    // {fp16 d; (Q5_1: fp16 m;) uint32 qh; nibbles as Q4_0}: element i's fifth bit is bit i of qh.
    // Q5_0: w = d (q - 16); Q5_1: w = d q + m.
    const int h = format == FMT_Q5_1 ? 4 : 2;
    const uint qh = load_u32(p + h);
    const uchar16 q = vload16(0, p + h + 4);
    c.lo = convert_char16(convert_uint16(q & (uchar16)0x0F) | fifth_bits(qh, 0));
    c.hi = convert_char16(convert_uint16(q >> (uchar16)4) | fifth_bits(qh, 16));
    if (format == FMT_Q5_0) {
      c.lo -= (char16)16;
      c.hi -= (char16)16;
    } else {
      c.min = vload_half(1, (__global const half*)p);
    }
  } else if (format == FMT_Q8_0) {  // {fp16 d; int8 q[32]}, w = d q
    __global const char* q = (__global const char*)(p + 2);
    c.lo = vload16(0, q);
    c.hi = vload16(1, q);
  } else {  // FMT_IQ4_NL: {fp16 d; nibbles as Q4_0}, w = d kIq4Values[q]
    const uchar16 q = vload16(0, p + 2);
    c.lo = iq4_codes(q & (uchar16)0x0F);
    c.hi = iq4_codes(q >> (uchar16)4);
  }
  return c;
}

// Block b (32 weights from column 32 b) of a row stored in blocks of block_bytes bytes: the codes
// and one scale for the formats codes_scaled_once names, else the weights themselves.
WeightBlock load_block(const int format, __global const uchar* row, const int b, const int block_bytes) {
  WeightBlock w;
  w.scale = 1.0f;
  if (format == FMT_F16 || format == FMT_F32) {
    __global const uchar* p = row + (ulong)b * block_bytes;
    w.lo = format == FMT_F16 ? vload_half16(0, (__global const half*)p) : vload16(0, (__global const float*)p);
    w.hi = format == FMT_F16 ? vload_half16(1, (__global const half*)p) : vload16(1, (__global const float*)p);
    return w;
  }
  const CodeBlock c = load_codes(format, row, b, block_bytes);
  w.lo = convert_float16(c.lo);
  w.hi = convert_float16(c.hi);
  if (codes_scaled_once(format)) {
    w.scale = c.scale_lo;
  } else {
    w.lo = c.scale_lo * w.lo + c.min;
    w.hi = c.scale_hi * w.hi + c.min;
  }
  return w;
}

// y[m][n] = sum_c x[m][c] W[n][c] for m < M (<= MAX_M), n < N, c < K (a multiple of 32): a flat
// GEMM, the shape of decode (M = 1) and of small batches, in the spirit of FlashDecoding++.
//
// A work-group takes get_local_size(1) weight rows; each row is shared by get_local_size(0)
// lanes that take its blocks in turn (lane l: blocks l, l + lanes, ...), so the row's bytes are
// read side by side. Every row of the group multiplies the same x, so x goes through local
// memory one chunk of `kc` columns (all M rows) at a time: global memory serves it once per group,
// not once per weight row. Each work-item keeps M sums (the M rows of x against its blocks); the
// lanes' sums of a row are added in lane order at the end.
//
// M is the same for every work-item, so the `m < M` tests below never diverge: a call with M = 1
// does one row of work, not MAX_M.
//
// `lm` (local) holds max(M * kc, group size * MAX_M) floats: the x chunk, then the lanes' sums.
void matmul_flat(const int format, const int block_bytes, __global const uchar* W, const int N, const int K,
                 __global const float* x, const int M, __global float* y, const int kc, __local float* lm) {
  const int lane = get_local_id(0), lanes = get_local_size(0);
  const int row = get_local_id(1);
  const int tid = row * lanes + lane, group_size = lanes * get_local_size(1);
  const int n = get_global_id(1);
  const bool active = n < N;  // the last group may run past N: its extra rows still load x
  __global const uchar* w_row = W + (ulong)(active ? n : 0) * (ulong)(K / block_weights(format)) * (ulong)block_bytes;

  float acc[MAX_M];
  for (int m = 0; m < MAX_M; ++m) acc[m] = 0.0f;

  for (int k0 = 0; k0 < K; k0 += kc) {
    const int len = min(kc, K - k0);
    barrier(CLK_LOCAL_MEM_FENCE);  // every work-item is done with the previous chunk
    for (int i = tid; i < M * len; i += group_size) {
      const int m = i / len, c = i - m * len;
      lm[m * kc + c] = x[(ulong)m * K + k0 + c];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (!active) continue;
    for (int b = lane; b < len / BLOCK; b += lanes) {
      const WeightBlock w = load_block(format, w_row, k0 / BLOCK + b, block_bytes);
#pragma unroll
      for (int m = 0; m < MAX_M; ++m) {
        if (m < M) {
          __local const float* xr = lm + m * kc + b * BLOCK;
          acc[m] += w.scale * (sum16(w.lo * vload16(0, xr)) + sum16(w.hi * vload16(1, xr)));
        }
      }
    }
  }

  // The lanes' partial sums, through the (now free) x chunk: lm[(row * MAX_M + m) * lanes + lane].
  barrier(CLK_LOCAL_MEM_FENCE);
#pragma unroll
  for (int m = 0; m < MAX_M; ++m) {
    if (m < M) lm[(row * MAX_M + m) * lanes + lane] = acc[m];
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  if (!active) return;
  for (int m = lane; m < M; m += lanes) {
    __local const float* partial = lm + (row * MAX_M + m) * lanes;
    float sum = 0.0f;
    for (int l = 0; l < lanes; ++l) sum += partial[l];
    y[(ulong)m * N + n] = sum;
  }
}

// One kernel per weight format; x_off and y_off are in floats.
#define MATMUL_KERNEL(name, format, block_bytes)                                                                    \
  __kernel void name(__global const uchar* W, const int N, const int K, __global const float* x, const ulong x_off, \
                     const int M, __global float* y, const ulong y_off, const int kc, __local float* lm) {          \
    matmul_flat(format, block_bytes, W, N, K, x + x_off, M, y + y_off, kc, lm);                                     \
  }

MATMUL_KERNEL(matmul_q4_0, FMT_Q4_0, 18)
MATMUL_KERNEL(matmul_q4_1, FMT_Q4_1, 20)
MATMUL_KERNEL(matmul_q8_0, FMT_Q8_0, 34)
MATMUL_KERNEL(matmul_f16, FMT_F16, 64)
MATMUL_KERNEL(matmul_f32, FMT_F32, 128)

// Every other format, named at run time (a version-1 plugin's product on the formats that came
// later): one kernel rather than one per format.
__kernel void matmul_other(__global const uchar* W, const int N, const int K, __global const float* x, const ulong x_off,
                           const int M, __global float* y, const ulong y_off, const int kc, __local float* lm,
                           const int format, const int block_bytes) {
  matmul_flat(format, block_bytes, W, N, K, x + x_off, M, y + y_off, kc, lm);
}

// --- GEMV: the decode product ----------------------------------------------------------------

#define NORM_PARTS 64  // partial sums of squares per row in the GEMV's fused norm

#define ACT_SILU 0
#define ACT_GELU_TANH 1
#define ACT_SWIGLU_OAI 2

// act(g) * u for a GLU's gate g and up u: SiLU, x / (1 + exp(-x)); GELU's tanh form,
// x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3))); or gpt-oss's clamped SwiGLU, which also
// clamps the up: a = min(g, 7), b = clamp(u, -7, 7), a / (1 + exp(-1.702 a)) * (b + 1).
float glu_of(const int activation, const float g, const float u) {
  if (activation == ACT_GELU_TANH) {
    const float sqrt_2_over_pi = 0.79788456080286535588f;
    return 0.5f * g * (1.0f + tanh(sqrt_2_over_pi * (g + 0.044715f * g * g * g))) * u;
  }
  if (activation == ACT_SWIGLU_OAI) {
    const float a = fmin(g, 7.0f), b = clamp(u, -7.0f, 7.0f);
    return a / (1.0f + exp(-1.702f * a)) * (b + 1.0f);
  }
  return g / (1.0f + exp(-g)) * u;  // ACT_SILU
}

// The weight rows a work-item multiplies: its row n of the parts' rows laid end to end (W0's N0
// rows, then W1's, then W2's), or with glu row n of W0 (gate) and of W1 (up).
typedef struct {
  __global const uchar* w;   // the row's bytes
  __global const uchar* up;  // glu: up's row
  __global float* y;         // where its outputs go: y[m * n_out + row]
  int row, n_out;
} GemvRow;

GemvRow gemv_row(const int n, const int format, const int block_bytes, const int K, const int glu, __global const uchar* W0,
                 __global const uchar* W1, __global const uchar* W2, const int N0, const int N1,
                 __global float* y0, __global float* y1, __global float* y2) {
  GemvRow g;
  const ulong row_bytes = (ulong)(K / block_weights(format)) * (ulong)block_bytes;
  g.row = n;
  g.w = W0;
  g.y = y0;
  g.n_out = N0;
  g.up = W1;
  if (!glu && g.row >= N0) {
    g.row -= N0;
    g.w = W1;
    g.y = y1;
    g.n_out = N1;
    if (g.row >= N1) {
      g.row -= N1;
      g.w = W2;
      g.y = y2;
      g.n_out = -1;  // set by the caller (N2)
    }
  }
  g.w += (ulong)g.row * row_bytes;
  g.up += (ulong)g.row * row_bytes;
  return g;
}

// y[m][n] = sum_c xn[m][c] W[n][c] for m < M (<= MAX_M rows: a decode step, a batch of them, a
// prompt in chunks), where xn is x or, with has_norm, x RMS-normalised and scaled by norm_w (the
// layer's norm fused into its product: nothing written out, no launch of its own); with
// accumulate, y[m][n] += that instead (the residual fused into the output projection). Up to
// three weights of the same format multiply the same x in one launch, each into its own y (q,
// k and v), or with glu two, gate and up, into act(gate) * up.
//
// A work-group takes R = get_local_size(1) weight rows, each shared by L = get_local_size(0)
// lanes that take its blocks in turn (lane l: blocks l, l + L, ...): on a GPU L is a warp, so a
// row's bytes are read side by side; on a CPU device L = 1 and each work-item runs a row with
// vector math. Each block is read once for all M rows of x. Row m of y comes out of the same
// operations in the same order whatever M is and whatever is fused, so a sequence's logits do
// not depend on the others in its batch. lsum: max(2 * MAX_M per work-item, MAX_M * NORM_PARTS)
// floats (the reductions), linv: MAX_M floats. Every barrier is at the kernel's top level, reached by every work-item
// (PoCL miscompiles barriers inside loops).
void gemv_rows(const int format, const int block_bytes, __global const uchar* W0, __global const uchar* W1,
               __global const uchar* W2, const int N0, const int N1, const int N2, const int K,
               __global const float* x, const int M, __global float* y0, __global float* y1, __global float* y2,
               __global const float* norm_w, const float eps, const int has_norm, const int accumulate, const int glu,
               const int activation, __local float* lsum, __local float* linv) {
  const int lane = get_local_id(0), L = get_local_size(0);
  const int r = get_local_id(1), R = get_local_size(1);
  const int tid = r * L + lane, G = L * R;
  const int n = get_group_id(1) * R + r;
  const int total = glu ? N0 : N0 + N1 + N2;

  // 1 / RMS of each row of x, in an order that does not depend on the group's shape (which
  // follows the number of rows): NORM_PARTS partial sums of squares per row, partial p over
  // columns p, p + NORM_PARTS, ... (lsum[m * NORM_PARTS + p], the work-items taking the partials
  // in turn), then work-item m adds row m's partials in order.
  if (has_norm) {
    for (int m = 0; m < M; ++m) {
      for (int part = tid; part < NORM_PARTS; part += G) {
        float ss = 0.0f;
        for (int c = part; c < K; c += NORM_PARTS) ss += x[(ulong)m * K + c] * x[(ulong)m * K + c];
        lsum[m * NORM_PARTS + part] = ss;
      }
    }
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  // (A group of fewer work-items than rows of x, a weight of a few rows such as a router's,
  // takes the rows in turn.)
  for (int m = tid; has_norm && m < M; m += G) {
    float ss = 0.0f;
    for (int part = 0; part < NORM_PARTS; ++part) ss += lsum[m * NORM_PARTS + part];
    linv[m] = 1.0f / sqrt(ss / (float)K + eps);
  }
  barrier(CLK_LOCAL_MEM_FENCE);

  GemvRow g = gemv_row(n < total ? n : 0, format, block_bytes, K, glu, W0, W1, W2, N0, N1, y0, y1, y2);
  if (g.n_out < 0) g.n_out = N2;
  float acc[MAX_M], acc_up[MAX_M];
  for (int m = 0; m < MAX_M; ++m) acc[m] = acc_up[m] = 0.0f;
  if (n < total) {
    for (int b = lane; b < K / BLOCK; b += L) {
      float16 nlo = (float16)1.0f, nhi = (float16)1.0f;
      if (has_norm) {
        nlo = vload16(0, norm_w + b * BLOCK);
        nhi = vload16(1, norm_w + b * BLOCK);
      }
      const WeightBlock w = load_block(format, g.w, b, block_bytes);
      for (int m = 0; m < M; ++m) {
        __global const float* xb = x + (ulong)m * K + b * BLOCK;
        acc[m] += w.scale * (sum16(w.lo * (vload16(0, xb) * nlo)) + sum16(w.hi * (vload16(1, xb) * nhi)));
      }
      if (glu) {
        const WeightBlock u = load_block(format, g.up, b, block_bytes);
        for (int m = 0; m < M; ++m) {
          __global const float* xb = x + (ulong)m * K + b * BLOCK;
          acc_up[m] += u.scale * (sum16(u.lo * (vload16(0, xb) * nlo)) + sum16(u.hi * (vload16(1, xb) * nhi)));
        }
      }
    }
  }

  // The lanes' sums of each row, added by lane 0 in lane order.
  for (int m = 0; m < M; ++m) {
    lsum[m * G + tid] = acc[m];
    lsum[(MAX_M + m) * G + tid] = acc_up[m];
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  if (n < total && lane == 0) {
    for (int m = 0; m < M; ++m) {
      float sum = 0.0f, sum_up = 0.0f;
      for (int l = 0; l < L; ++l) {
        sum += lsum[m * G + r * L + l];
        sum_up += lsum[(MAX_M + m) * G + r * L + l];
      }
      if (has_norm) {
        sum *= linv[m];
        sum_up *= linv[m];
      }
      if (glu) sum = glu_of(activation, sum, sum_up);
      __global float* out = g.y + (ulong)m * g.n_out + g.row;
      *out = accumulate ? *out + sum : sum;
    }
  }
}

#define GEMV_KERNEL(name, format, block_bytes)                                                                      \
  __kernel void name(__global const uchar* W0, __global const uchar* W1, __global const uchar* W2, const int N0,    \
                     const int N1, const int N2, const int K, __global const float* x, const ulong x_off,           \
                     const int M, __global float* y0, const ulong y0_off, __global float* y1, const ulong y1_off,  \
                     __global float* y2, const ulong y2_off, __global const float* norm_w, const ulong norm_off,   \
                     const float eps, const int has_norm, const int accumulate, const int glu, const int activation, \
                     __local float* lsum, __local float* linv) {                                                    \
    gemv_rows(format, block_bytes, W0, W1, W2, N0, N1, N2, K, x + x_off, M, y0 + y0_off, y1 + y1_off, y2 + y2_off,  \
              norm_w + norm_off, eps, has_norm, accumulate, glu, activation, lsum, linv);                            \
  }

GEMV_KERNEL(gemv_q4_0, FMT_Q4_0, 18)
GEMV_KERNEL(gemv_q4_1, FMT_Q4_1, 20)
GEMV_KERNEL(gemv_q8_0, FMT_Q8_0, 34)
GEMV_KERNEL(gemv_f16, FMT_F16, 64)
GEMV_KERNEL(gemv_f32, FMT_F32, 128)
GEMV_KERNEL(gemv_q5_0, FMT_Q5_0, 22)
GEMV_KERNEL(gemv_q5_1, FMT_Q5_1, 24)
GEMV_KERNEL(gemv_iq4_nl, FMT_IQ4_NL, 18)
GEMV_KERNEL(gemv_q4_k, FMT_Q4_K, 144)
GEMV_KERNEL(gemv_q5_k, FMT_Q5_K, 176)
GEMV_KERNEL(gemv_q6_k, FMT_Q6_K, 210)
GEMV_KERNEL(gemv_iq4_xs, FMT_IQ4_XS, 136)
GEMV_KERNEL(gemv_mxfp4, FMT_MXFP4, 17)

// --- GEMM: prompts and batches -----------------------------------------------------------------

#define GEMM_T 64        // a group's tile: GEMM_T rows of x by GEMM_T weight rows
#define GEMM_LDS 33      // floats per tile row in local memory (32 columns; + 1 against bank conflicts)

// Which weight row work-item tid of a GEMM group stages through local memory for each block of
// K: row n0 + tid % GEMM_T of the weights (tid < GEMM_T) or, with glu, of up (the next GEMM_T);
// the others stage nothing.
typedef struct {
  int n;           // the row among the parts' rows (>= total: past the end, staged as zeros)
  int weight, up;  // whether it stages the weight's row, or up's
  GemvRow row;
} GemmStager;

GemmStager gemm_stager(const int tid, const int n0, const int total, const int format, const int block_bytes,
                       const int K, const int glu, __global const uchar* W0, __global const uchar* W1,
                       __global const uchar* W2, const int N0, const int N1, __global float* y0, __global float* y1,
                       __global float* y2) {
  GemmStager st;
  st.n = n0 + (tid % GEMM_T);
  st.weight = tid < GEMM_T;
  st.up = glu && tid >= GEMM_T && tid < 2 * GEMM_T;
  st.row = gemv_row(st.n < total ? st.n : 0, format, block_bytes, K, glu, W0, W1, W2, N0, N1, y0, y1, y2);
  return st;
}

// Work-item (tx, ty)'s 4 x 4 sums of a GEMM tile into y: rows m0 + ty + 16 i of x, weight rows
// n0 + tx + 16 j of the parts laid end to end (gemv_row), with glu's activation and accumulate's add.
void gemm_store(float acc[4][4], float acc_up[4][4], const int m0, const int n0, const int M, const int format,
                const int block_bytes, const int K, const int glu, const int activation, const int accumulate,
                __global const uchar* W0, __global const uchar* W1, __global const uchar* W2, const int N0,
                const int N1, const int N2, __global float* y0, __global float* y1, __global float* y2) {
  const int tx = get_local_id(0), ty = get_local_id(1);
  const int total = glu ? N0 : N0 + N1 + N2;
  for (int i = 0; i < 4; ++i) {
    const int m = m0 + ty + 16 * i;
    if (m >= M) continue;
    for (int j = 0; j < 4; ++j) {
      const int n = n0 + tx + 16 * j;
      if (n >= total) continue;
      GemvRow g = gemv_row(n, format, block_bytes, K, glu, W0, W1, W2, N0, N1, y0, y1, y2);
      if (g.n_out < 0) g.n_out = N2;
      float sum = acc[i][j];
      if (glu) sum = glu_of(activation, sum, acc_up[i][j]);
      __global float* out = g.y + (ulong)m * g.n_out + g.row;
      *out = accumulate ? *out + sum : sum;
    }
  }
}

// The product of matmul2 for M > MAX_M rows of x (a prompt chunk, a large batch), with the same
// fusions as gemv_rows: the input's RMSNorm, the residual, up to three weights of one x, gate and
// up with the activation. A 16 x 16 group computes a 64 x 64 tile of y, work-item (tx, ty) its
// rows ty + 16 i and weight rows tx + 16 j (i, j < 4); K goes by in blocks of 32, each group
// staging x's 64 rows (scaled by the norm's weight) and its 64 weight rows, dequantized once,
// through local memory. The norm's 1 / RMS of each row multiplies the finished sums, as in the
// GEMV. Rows of y come out within float rounding of the GEMV's, not bit for bit (a pass of at
// most MAX_M rows takes the GEMV, whose rows do not depend on each other).
// lx, lw, lu: GEMM_T * GEMM_LDS floats each; linv: GEMM_T floats.
__kernel void gemm(__global const uchar* W0, __global const uchar* W1, __global const uchar* W2, const int N0,
                   const int N1, const int N2, const int K, __global const float* x, const ulong x_off, const int M,
                   __global float* y0, const ulong y0_off, __global float* y1, const ulong y1_off, __global float* y2,
                   const ulong y2_off, __global const float* norm_w, const ulong norm_off, const float eps,
                   const int has_norm, const int accumulate, const int glu, const int activation, const int format,
                   const int block_bytes, __local float* lx, __local float* lw, __local float* lu,
                   __local float* linv) {
  const int tx = get_local_id(0), ty = get_local_id(1), tid = ty * 16 + tx;
  const int m0 = get_group_id(1) * GEMM_T, n0 = get_group_id(0) * GEMM_T;
  const int total = glu ? N0 : N0 + N1 + N2;
  x += x_off;
  norm_w += norm_off;

  // 1 / RMS of the tile's rows, each summed in column order by one work-item.
  if (has_norm && tid < GEMM_T) {
    float ss = 0.0f;
    if (m0 + tid < M) {
      for (int c = 0; c < K; ++c) ss += x[(ulong)(m0 + tid) * K + c] * x[(ulong)(m0 + tid) * K + c];
    }
    linv[tid] = 1.0f / sqrt(ss / (float)K + eps);
  }

  const GemmStager st = gemm_stager(tid, n0, total, format, block_bytes, K, glu, W0, W1, W2, N0, N1, y0, y1, y2);

  float acc[4][4], acc_up[4][4];
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 4; ++j) acc[i][j] = acc_up[i][j] = 0.0f;
  }
  for (int b = 0; b < K / BLOCK; ++b) {
    barrier(CLK_LOCAL_MEM_FENCE);  // the previous block's tiles are read
    for (int e = tid; e < GEMM_T * BLOCK; e += 256) {
      const int r = e / BLOCK, c = e % BLOCK;
      const float scale = has_norm ? norm_w[b * BLOCK + c] : 1.0f;
      lx[r * GEMM_LDS + c] = m0 + r < M ? x[(ulong)(m0 + r) * K + b * BLOCK + c] * scale : 0.0f;
    }
    if (st.weight || st.up) {
      __local float* dst = (st.weight ? lw : lu) + (tid % GEMM_T) * GEMM_LDS;
      if (st.n < total) {
        const WeightBlock wb = load_block(format, st.weight ? st.row.w : st.row.up, b, block_bytes);
        vstore16(wb.lo * wb.scale, 0, dst);
        vstore16(wb.hi * wb.scale, 0, dst + 16);
      } else {
        vstore16((float16)0.0f, 0, dst);
        vstore16((float16)0.0f, 0, dst + 16);
      }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int c = 0; c < BLOCK; ++c) {
      float xv[4], wv[4];
      for (int i = 0; i < 4; ++i) xv[i] = lx[(ty + 16 * i) * GEMM_LDS + c];
      for (int j = 0; j < 4; ++j) wv[j] = lw[(tx + 16 * j) * GEMM_LDS + c];
      for (int i = 0; i < 4; ++i) {
        for (int j = 0; j < 4; ++j) acc[i][j] += xv[i] * wv[j];
      }
      if (glu) {
        for (int j = 0; j < 4; ++j) wv[j] = lu[(tx + 16 * j) * GEMM_LDS + c];
        for (int i = 0; i < 4; ++i) {
          for (int j = 0; j < 4; ++j) acc_up[i][j] += xv[i] * wv[j];
        }
      }
    }
  }

  if (has_norm) {
    for (int i = 0; i < 4; ++i) {
      for (int j = 0; j < 4; ++j) {
        acc[i][j] *= linv[ty + 16 * i];
        acc_up[i][j] *= linv[ty + 16 * i];
      }
    }
  }
  gemm_store(acc, acc_up, m0, n0, M, format, block_bytes, K, glu, activation, accumulate, W0, W1, W2, N0, N1, N2,
             y0 + y0_off, y1 + y1_off, y2 + y2_off);
}

// --- Integer GEMM: int8 activations times the weights' integer codes ----------------------------

// a · b over the four int8 lanes of each, plus acc: NVIDIA's dp4a through inline PTX where the
// host found NVIDIA's driver (DOT4_PTX), the integer dot product of cl_khr_integer_dot_product
// where the compiler has it, else four multiply-adds (the reference, and what PoCL runs).
int dot4_add(const int a, const int b, const int acc) {
#if defined(DOT4_PTX)
  int r;
  asm volatile("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(acc));
  return r;
#elif defined(cl_khr_integer_dot_product) && defined(__opencl_c_integer_dot_product_input_4x8bit_packed)
  return acc + dot_4x8packed_ss_int((uint)a, (uint)b);
#else
  const char4 x = as_char4(a), y = as_char4(b);
  return acc + x.x * y.x + x.y * y.y + x.z * y.z + x.w * y.w;
#endif
}

// Row m = get_group_id(0) of x (with has_norm RMS-normalised and scaled by norm_w first) quantized
// per block of 32 as the CPU's int8 kernels do (backends/cpu/quantize_acts.h): d = max|x| / 127,
// q = round-to-nearest-even(x * 127 / max|x|), s = d * (sum of the block's q). q: [M][K] int8;
// ds: [M][K / 32] pairs (d, s) from pair ds_off on. The 1 / RMS sums squares in get_local_size(0) strided partials,
// added in order by every work-item (no reduction tree: its barriers would sit in a loop).
// partial: get_local_size(0) floats.
__kernel void quantize_rows_q8(__global const float* x, const ulong x_off, const int K, __global const float* norm_w,
                               const ulong norm_off, const float eps, const int has_norm, __global char* q,
                               __global float* ds, const ulong ds_off, __local float* partial) {
  const int m = get_group_id(0), tid = get_local_id(0), G = get_local_size(0);
  __global const float* row = x + x_off + (ulong)m * K;
  norm_w += norm_off;
  float ss = 0.0f;
  if (has_norm) {
    for (int c = tid; c < K; c += G) ss += row[c] * row[c];
  }
  partial[tid] = ss;
  barrier(CLK_LOCAL_MEM_FENCE);
  float inv_rms = 1.0f;
  if (has_norm) {
    float total = 0.0f;
    for (int t = 0; t < G; ++t) total += partial[t];
    inv_rms = 1.0f / sqrt(total / (float)K + eps);
  }
  for (int b = tid; b < K / BLOCK; b += G) {
    float16 lo = vload16(0, row + b * BLOCK), hi = vload16(1, row + b * BLOCK);
    if (has_norm) {
      lo = lo * inv_rms * vload16(0, norm_w + b * BLOCK);
      hi = hi * inv_rms * vload16(1, norm_w + b * BLOCK);
    }
    const float16 a = fmax(fabs(lo), fabs(hi));
    const float8 a8 = fmax(a.lo, a.hi);
    const float4 a4 = fmax(a8.lo, a8.hi);
    const float amax = fmax(fmax(a4.x, a4.y), fmax(a4.z, a4.w));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const int16 qlo = convert_int16_rte(lo * inv), qhi = convert_int16_rte(hi * inv);
    const int16 both = qlo + qhi;
    int sum = 0;
    for (int i = 0; i < 16; ++i) sum += ((const int*)&both)[i];
    __global char* qb = q + (ulong)m * K + b * BLOCK;
    vstore16(convert_char16(qlo), 0, qb);
    vstore16(convert_char16(qhi), 1, qb);
    const float d = amax / 127.0f;
    vstore2((float2)(d, d * (float)sum), ds_off + (ulong)m * (K / BLOCK) + b, ds);
  }
}

#define GEMM_LDI 9  // ints per tile row of codes in local memory (8 words of 4 codes; + 1 against bank conflicts)

// The GEMM of matmul2 on integers: x already quantized by quantize_rows_q8 (the norm folded in
// there), the weights' blocks loaded as codes (load_codes), and per block of 32 and per pair
// (x row, weight row) the integer dots of the two halves scaled once:
//   y += dx (scale_lo dot_lo + scale_hi dot_hi) + min s.
// The tiles and the epilogue are gemm's: a 16 x 16 group, a 64 x 64 tile of y, 4 x 4 per work-item.
// lq, lw, lu: GEMM_T * GEMM_LDI ints; lxs: 2 GEMM_T floats (d, s per row); lws, lus: 3 GEMM_T
// floats (scale_lo, scale_hi, min per weight row).
__kernel void gemm_q8(__global const uchar* W0, __global const uchar* W1, __global const uchar* W2, const int N0,
                      const int N1, const int N2, const int K, __global const int* q, __global const float2* ds,
                      const ulong ds_off, const int M, __global float* y0, const ulong y0_off, __global float* y1, const ulong y1_off,
                      __global float* y2, const ulong y2_off, const int accumulate, const int glu,
                      const int activation, const int format, const int block_bytes, __local int* lq,
                      __local int* lw, __local int* lu, __local float* lxs, __local float* lws, __local float* lus) {
  const int tx = get_local_id(0), ty = get_local_id(1), tid = ty * 16 + tx;
  const int m0 = get_group_id(1) * GEMM_T, n0 = get_group_id(0) * GEMM_T;
  const int total = glu ? N0 : N0 + N1 + N2;
  const int words = K / 4, blocks = K / BLOCK;
  ds += ds_off;

  const GemmStager st = gemm_stager(tid, n0, total, format, block_bytes, K, glu, W0, W1, W2, N0, N1, y0, y1, y2);

  float acc[4][4], acc_up[4][4];
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 4; ++j) acc[i][j] = acc_up[i][j] = 0.0f;
  }
  for (int b = 0; b < blocks; ++b) {
    barrier(CLK_LOCAL_MEM_FENCE);  // the previous block's tiles are read
    for (int e = tid; e < GEMM_T * 8; e += 256) {
      const int r = e / 8, w = e % 8;
      lq[r * GEMM_LDI + w] = m0 + r < M ? q[(ulong)(m0 + r) * words + b * 8 + w] : 0;
    }
    if (tid < GEMM_T) {
      const float2 xds = m0 + tid < M ? ds[(ulong)(m0 + tid) * blocks + b] : (float2)(0.0f, 0.0f);
      lxs[2 * tid] = xds.x;
      lxs[2 * tid + 1] = xds.y;
    }
    if (st.weight || st.up) {
      const int r = tid % GEMM_T;
      __local int* dst = (st.weight ? lw : lu) + r * GEMM_LDI;
      __local float* scales = (st.weight ? lws : lus) + 3 * r;
      if (st.n < total) {
        const CodeBlock c = load_codes(format, st.weight ? st.row.w : st.row.up, b, block_bytes);
        vstore4(as_int4(c.lo), 0, dst);
        vstore4(as_int4(c.hi), 1, dst);
        scales[0] = c.scale_lo;
        scales[1] = c.scale_hi;
        scales[2] = c.min;
      } else {
        vstore8((int8)0, 0, dst);
        scales[0] = scales[1] = scales[2] = 0.0f;
      }
    }
    barrier(CLK_LOCAL_MEM_FENCE);

    int xq[4][8];
    for (int i = 0; i < 4; ++i) {
      for (int w = 0; w < 8; ++w) xq[i][w] = lq[(ty + 16 * i) * GEMM_LDI + w];
    }
    for (int part = 0; part < (glu ? 2 : 1); ++part) {
      __local const int* codes = part ? lu : lw;
      __local const float* scales = part ? lus : lws;
      for (int j = 0; j < 4; ++j) {
        const int r = tx + 16 * j;
        int wq[8];
        for (int w = 0; w < 8; ++w) wq[w] = codes[r * GEMM_LDI + w];
        const float s_lo = scales[3 * r], s_hi = scales[3 * r + 1], w_min = scales[3 * r + 2];
        for (int i = 0; i < 4; ++i) {
          int dot_lo = 0, dot_hi = 0;
          for (int w = 0; w < 4; ++w) {
            dot_lo = dot4_add(xq[i][w], wq[w], dot_lo);
            dot_hi = dot4_add(xq[i][w + 4], wq[w + 4], dot_hi);
          }
          const int row = ty + 16 * i;
          const float add = lxs[2 * row] * (s_lo * (float)dot_lo + s_hi * (float)dot_hi) + w_min * lxs[2 * row + 1];
          if (part) {
            acc_up[i][j] += add;
          } else {
            acc[i][j] += add;
          }
        }
      }
    }
  }
  gemm_store(acc, acc_up, m0, n0, M, format, block_bytes, K, glu, activation, accumulate, W0, W1, W2, N0, N1, N2,
             y0 + y0_off, y1 + y1_off, y2 + y2_off);
}

// --- Attention --------------------------------------------------------------------------------

// KV cache elements, fp16 or fp32, as floats.
float load_kv(const int f16, __global const void* base, const ulong i) {
  return f16 ? vload_half(0, (__global const half*)base + i) : ((__global const float*)base)[i];
}
float4 load_kv4(const int f16, __global const void* base, const ulong i) {
  return f16 ? vload_half4(0, (__global const half*)base + i) : vload4(0, (__global const float*)base + i);
}

// out[i][h] = softmax(q[i][h] · K_visibleᵀ · scale) · V_visible for query token i =
// get_group_id(1) at position p = q_pos0 + i and query head h = get_group_id(0), which reads KV
// head h / (n_head / n_head_kv). Slot j is visible when 0 <= positions[j] <= p and, with a
// sliding window (window > 0), positions[j] > p - window; window 0 is plain causal attention.
// The slots may be in any order (a ring), and a decode step and a prefill chunk are the same kernel.
//
// The keys are met a block of B = get_local_size(0) slots at a time, with the online softmax of
// FlashAttention: a running max, by which the output sums and the denominator are rescaled
// whenever a block raises it, so that local memory holds one block of scores whatever n_slots
// is. Work-item t scores slot j0 + t of the block (ls); for the value side the work-items switch
// roles: work-item t owns output dimensions t, t + B, ... (HD_PER_ITEM of them at most) and adds
// up the block's weighted values (lp), reading value rows side by side. The value side reads
// every probability of the block anyway, so each work-item also keeps the denominator, and the
// block max is a scan of ls by each work-item: the same numbers in the same order everywhere,
// and no reduction tree (with its barrier per step) at all.
//
// Masked slots are skipped, not multiplied by zero, so an empty slot's garbage (even NaN) never
// reaches the output. A query that sees no slot at all gets zeros.
//
// Local memory: lq (head_dim floats, the query row), ls and lp (B floats each).
//
// Flash-decoding: with `partial`, the group sees only slots j_begin .. j_end - 1 (one split of the
// keys, get_group_id(2) of n_splits) and leaves its share unnormalised, as a record of head_dim + 2
// floats: its running max, its denominator, then its output sums (attention_merge adds the
// splits up). Without, j_begin .. j_end is every slot and out gets the normalised result.
//
// A head's learned sink (gpt-oss; sinks not null) adds exp(sink - m) to the denominator of the
// normalised result, m the row's final max (sink_term; attention_merge adds it to the splits').
float sink_term(__global const float* sinks, const int h, const float m) {
  return sinks != 0 && m != -INFINITY ? exp(sinks[h] - m) : 0.0f;
}

void attention_one(const int f16, __global const float* q, __global float* out, __global const void* keys,
                   __global const void* values, const long row_stride, __global const int* positions, const int j_begin,
                   const int j_end, const long q_pos0, const int n_head, const int n_head_kv, const int head_dim,
                   const float scale, const int window, __global const float* sinks, __global float* partial,
                   const int n_splits, __local float* lq, __local float* ls, __local float* lp) {
  const int h = get_group_id(0), i = get_group_id(1);
  const int tid = get_local_id(0), B = get_local_size(0);
  const int g = h / (n_head / n_head_kv);
  const long pos = q_pos0 + i;
  const long oldest = window > 0 ? pos - window + 1 : 0;  // the first visible position
  const ulong q_row = ((ulong)i * n_head + h) * head_dim;
  const ulong kv_col = (ulong)g * head_dim;

  for (int d = tid; d < head_dim; d += B) lq[d] = q[q_row + d];
  barrier(CLK_LOCAL_MEM_FENCE);

  // Relative to m_run, the largest visible score so far (every work-item holds the same m_run and l).
  float m_run = -INFINITY;
  float l = 0.0f;          // the softmax denominator
  float acc[HD_PER_ITEM];  // output dimensions tid + t B
  for (int t = 0; t < HD_PER_ITEM; ++t) acc[t] = 0.0f;

  for (int j0 = j_begin; j0 < j_end; j0 += B) {
    const int n_block = min(B, j_end - j0);
    // Score of slot j0 + tid; -inf when the slot is past j_end, empty, in this query's future
    // or out of its window. (The previous block's readers of ls finished before its second barrier.)
    const int j = j0 + tid;
    float s = -INFINITY;
    if (j < j_end) {
      const int p = positions[j];
      if (p >= 0 && p <= pos && p >= oldest) {
        const ulong k_row = (ulong)j * row_stride + kv_col;
        float dot_qk = 0.0f;
        for (int c = 0; c < head_dim; c += 4) dot_qk += dot(vload4(0, lq + c), load_kv4(f16, keys, k_row + c));
        s = dot_qk * scale;
      }
    }
    ls[tid] = s;
    barrier(CLK_LOCAL_MEM_FENCE);

    float block_max = -INFINITY;
    for (int jj = 0; jj < n_block; ++jj) block_max = fmax(block_max, ls[jj]);
    const bool any_visible = block_max != -INFINITY;  // the same in every work-item
    const float m_new = fmax(m_run, block_max);
    const float rescale = any_visible ? exp(m_run - m_new) : 1.0f;  // exp(-inf) = 0: nothing visible before
    lp[tid] = s == -INFINITY ? 0.0f : exp(s - m_new);
    m_run = m_new;
    barrier(CLK_LOCAL_MEM_FENCE);  // lp written; and every scan of ls done before the next block writes it
    if (!any_visible) continue;

    l *= rescale;
    for (int t = 0; t < HD_PER_ITEM; ++t) acc[t] *= rescale;
    for (int jj = 0; jj < n_block; ++jj) {
      const float pj = lp[jj];
      if (pj == 0.0f) continue;  // masked (or underflowed): the same branch for every work-item
      l += pj;
      const ulong v_row = (ulong)(j0 + jj) * row_stride + kv_col;
      for (int t = 0; t < HD_PER_ITEM; ++t) {
        const int d = tid + t * B;
        if (d < head_dim) acc[t] += pj * load_kv(f16, values, v_row + d);
      }
    }
  }

  if (partial) {
    __global float* record = partial + (((ulong)i * n_head + h) * n_splits + get_group_id(2)) * (head_dim + 2);
    if (tid == 0) {
      record[0] = m_run;
      record[1] = l;
    }
    for (int t = 0; t < HD_PER_ITEM; ++t) {
      const int d = tid + t * B;
      if (d < head_dim) record[2 + d] = acc[t];
    }
    return;
  }
  l += sink_term(sinks, h, m_run);
  for (int t = 0; t < HD_PER_ITEM; ++t) {
    const int d = tid + t * B;
    if (d < head_dim) out[q_row + d] = l > 0.0f ? acc[t] / l : 0.0f;
  }
}

// q_off, out_off, k_off, v_off, sinks_off are in elements of their buffers' types; the sinks
// are read only when has_sinks (the host passes some buffer either way).
#define SINKS(sinks, sinks_off, has_sinks) ((has_sinks) ? (sinks) + (sinks_off) : (__global const float*)0)
#define ATTENTION_KERNEL(name, f16, kv_type)                                                                           \
  __kernel void name(__global const float* q, const ulong q_off, __global float* out, const ulong out_off,             \
                     __global const kv_type* keys, const ulong k_off, __global const kv_type* values,                  \
                     const ulong v_off, const long row_stride, __global const int* positions, const int n_slots,       \
                     const long q_pos0, const int n_head, const int n_head_kv, const int head_dim, const float scale,  \
                     const int window, __global const float* sinks, const ulong sinks_off, const int has_sinks,       \
                     __local float* lq, __local float* ls, __local float* lp) {                                        \
    attention_one(f16, q + q_off, out + out_off, keys + k_off, values + v_off, row_stride, positions, 0, n_slots,     \
                  q_pos0, n_head, n_head_kv, head_dim, scale, window, SINKS(sinks, sinks_off, has_sinks),             \
                  (__global float*)0, 1, lq, ls, lp);                                                                  \
  }

ATTENTION_KERNEL(attention_f32, 0, float)
ATTENTION_KERNEL(attention_f16, 1, half)

// --- Tiled attention: prompts --------------------------------------------------------------------

#define TILE_KEYS 16       // key slots per block of the tiled attention (its group's get_local_size(0))
#define TILE_HD_MAX 256    // head_dim up to TILE_KEYS * 16: 16 output dimensions per work-item

// attention_one for a tile of TQ = get_local_size(1) query tokens of one head at once (a prompt
// chunk): query tokens TQ get_group_id(1) .. + TQ - 1, head h = get_group_id(0). Each block of
// TILE_KEYS slots is read from global memory once per tile, not once per query: keys and values
// go through local memory (lk, lv), as do the tile's queries (lq) and the block's scores (ls).
// Work-item (t, r) scores slot j0 + t for query r; then, for the value side, it owns query r's
// output dimensions t, t + TILE_KEYS, ... and reads the row's scores itself for the max and the
// probabilities (each work-item of a row computing the same numbers in the same order, no
// reduction). The visibility rule, the online softmax and the empty-query zeros are attention_one's.
// Local memory: lq TQ * head_dim, lk and lv TILE_KEYS * head_dim, ls TQ * TILE_KEYS floats; lpos
// TILE_KEYS ints.
void attention_tile(const int f16, __global const float* q, __global float* out, __global const void* keys,
                    __global const void* values, const long row_stride, __global const int* positions,
                    const int n_slots, const int n_tokens, const long q_pos0, const int n_head, const int n_head_kv,
                    const int head_dim, const float scale, const int window, __global const float* sinks,
                    __local float* lq, __local float* lk, __local float* lv, __local float* ls, __local int* lpos) {
  const int h = get_group_id(0), t = get_local_id(0), r = get_local_id(1);
  const int TQ = get_local_size(1), tid = r * TILE_KEYS + t, G = TILE_KEYS * TQ;
  const int i = get_group_id(1) * TQ + r;  // this work-item's query token
  const int g = h / (n_head / n_head_kv);
  const long pos = q_pos0 + i;
  const long oldest = window > 0 ? pos - window + 1 : 0;
  const bool live = i < n_tokens;
  const ulong kv_col = (ulong)g * head_dim;

  for (int e = tid; e < TQ * head_dim; e += G) {
    const int rr = e / head_dim, d = e % head_dim, ii = get_group_id(1) * TQ + rr;
    lq[e] = ii < n_tokens ? q[((ulong)ii * n_head + h) * head_dim + d] : 0.0f;
  }
  // The tile's latest query position bounds the slots any of its queries sees.
  const long tile_last = q_pos0 + min((long)(get_group_id(1) * TQ + TQ), (long)n_tokens) - 1;

  float m_run = -INFINITY, l = 0.0f;
  float acc[TILE_HD_MAX / TILE_KEYS];
  for (int u = 0; u < TILE_HD_MAX / TILE_KEYS; ++u) acc[u] = 0.0f;

  for (int j0 = 0; j0 < n_slots; j0 += TILE_KEYS) {
    const int n_block = min(TILE_KEYS, n_slots - j0);
    barrier(CLK_LOCAL_MEM_FENCE);  // the previous block's readers are done (and lq is written)
    if (tid < TILE_KEYS) lpos[tid] = tid < n_block ? positions[j0 + tid] : -1;
    for (int e = tid; e < n_block * head_dim; e += G) {
      const int jj = e / head_dim, d = e % head_dim;
      const ulong at = (ulong)(j0 + jj) * row_stride + kv_col + d;
      lk[e] = load_kv(f16, keys, at);
      lv[e] = load_kv(f16, values, at);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    // A block whose slots are all empty or later than every query of the tile: nothing to do
    // (the same answer in every work-item, so the skip is uniform).
    bool any = false;
    for (int jj = 0; jj < n_block; ++jj) any = any || (lpos[jj] >= 0 && lpos[jj] <= tile_last);
    if (!any) continue;

    float s = -INFINITY;
    const int p = lpos[t];
    if (live && t < n_block && p >= 0 && p <= pos && p >= oldest) {
      float dot_qk = 0.0f;
      for (int c = 0; c < head_dim; c += 4) dot_qk += dot(vload4(0, lq + r * head_dim + c), vload4(0, lk + t * head_dim + c));
      s = dot_qk * scale;
    }
    ls[tid] = s;
    barrier(CLK_LOCAL_MEM_FENCE);

    __local const float* row = ls + r * TILE_KEYS;
    float block_max = -INFINITY;
    for (int jj = 0; jj < n_block; ++jj) block_max = fmax(block_max, row[jj]);
    // Branch-free from here (PoCL miscompiles work-items that leave a barrier loop's iteration
    // early on their own): a query that sees nothing here keeps its state (rescale 1, weights 0).
    const bool seen = block_max != -INFINITY;
    const float m_new = seen ? fmax(m_run, block_max) : m_run;
    const float rescale = seen ? exp(m_run - m_new) : 1.0f;  // exp(-inf) = 0: nothing visible before
    m_run = m_new;
    l *= rescale;
    for (int u = 0; u < TILE_HD_MAX / TILE_KEYS; ++u) acc[u] *= rescale;
    for (int jj = 0; jj < n_block; ++jj) {
      const bool visible = row[jj] != -INFINITY;
      const float pj = visible ? exp(row[jj] - m_new) : 0.0f;
      l += pj;
      for (int u = 0; u < TILE_HD_MAX / TILE_KEYS; ++u) {
        const int d = t + u * TILE_KEYS;
        // select, not a product: an empty slot's value may be garbage (NaN)
        acc[u] += visible && d < head_dim ? pj * lv[jj * head_dim + min(d, head_dim - 1)] : 0.0f;
      }
    }
  }
  if (!live) return;
  l += sink_term(sinks, h, m_run);
  const ulong q_row = ((ulong)i * n_head + h) * head_dim;
  for (int u = 0; u < TILE_HD_MAX / TILE_KEYS; ++u) {
    const int d = t + u * TILE_KEYS;
    if (d < head_dim) out[q_row + d] = l > 0.0f ? acc[u] / l : 0.0f;
  }
}

#define ATTENTION_TILE_KERNEL(name, f16, kv_type)                                                                     \
  __kernel void name(__global const float* q, const ulong q_off, __global float* out, const ulong out_off,            \
                     __global const kv_type* keys, const ulong k_off, __global const kv_type* values,                 \
                     const ulong v_off, const long row_stride, __global const int* positions, const int n_slots,      \
                     const int n_tokens, const long q_pos0, const int n_head, const int n_head_kv,                     \
                     const int head_dim, const float scale, const int window, __global const float* sinks,           \
                     const ulong sinks_off, const int has_sinks, __local float* lq, __local float* lk,                 \
                     __local float* lv, __local float* ls, __local int* lpos) {                                        \
    attention_tile(f16, q + q_off, out + out_off, keys + k_off, values + v_off, row_stride, positions, n_slots,      \
                   n_tokens, q_pos0, n_head, n_head_kv, head_dim, scale, window, SINKS(sinks, sinks_off, has_sinks), \
                   lq, lk, lv, ls, lpos);                                                                               \
  }

ATTENTION_TILE_KERNEL(attention_tile_f32, 0, float)
ATTENTION_TILE_KERNEL(attention_tile_f16, 1, half)

// One split of flash-decoding: split get_group_id(2) sees slots split * split_len .. (split + 1) *
// split_len - 1 and writes its record to partial ([n_tokens][n_head][n_splits] records).
#define ATTENTION_SPLIT_KERNEL(name, f16, kv_type)                                                                     \
  __kernel void name(__global const float* q, const ulong q_off, __global float* partial,                              \
                     __global const kv_type* keys, const ulong k_off, __global const kv_type* values,                  \
                     const ulong v_off, const long row_stride, __global const int* positions, const int n_slots,       \
                     const long q_pos0, const int n_head, const int n_head_kv, const int head_dim, const float scale,  \
                     const int window, const int split_len, const int n_splits, __local float* lq,                    \
                     __local float* ls, __local float* lp) {                                                           \
    const int j_begin = get_group_id(2) * split_len;                                                                   \
    attention_one(f16, q + q_off, partial, keys + k_off, values + v_off, row_stride, positions, j_begin,              \
                  min(n_slots, j_begin + split_len), q_pos0, n_head, n_head_kv, head_dim, scale, window,              \
                  (__global const float*)0, partial, n_splits, lq, ls, lp);                                           \
  }

ATTENTION_SPLIT_KERNEL(attention_split_f32, 0, float)
ATTENTION_SPLIT_KERNEL(attention_split_f16, 1, half)

// The splits of flash-decoding added up: output dimension d = get_global_id(0) of head
// get_global_id(1) of query token get_global_id(2). Each split's sums and denominator are
// relative to its own max; rescaled to the largest of them they add up exactly as one pass's
// online softmax would have them. A split that saw no slot (max -inf) adds nothing. A head's sink
// adds its term relative to the largest max.
__kernel void attention_merge(__global const float* partial, const int n_splits, const int n_head, const int head_dim,
                              __global float* out, const ulong out_off, __global const float* sinks,
                              const ulong sinks_off, const int has_sinks) {
  const int d = get_global_id(0), h = get_global_id(1), i = get_global_id(2);
  if (d >= head_dim) return;
  const int stride = head_dim + 2;
  __global const float* records = partial + ((ulong)i * n_head + h) * n_splits * stride;
  float m_max = -INFINITY;
  for (int s = 0; s < n_splits; ++s) m_max = fmax(m_max, records[s * stride]);
  float sum = 0.0f, denominator = 0.0f;
  if (m_max != -INFINITY) {
    for (int s = 0; s < n_splits; ++s) {
      const float m = records[s * stride];
      if (m == -INFINITY) continue;
      const float w = exp(m - m_max);
      sum += w * records[s * stride + 2 + d];
      denominator += w * records[s * stride + 1];
    }
  }
  denominator += sink_term(SINKS(sinks, sinks_off, has_sinks), h, m_max);
  out[out_off + ((ulong)i * n_head + h) * head_dim + d] = denominator > 0.0f ? sum / denominator : 0.0f;
}

// The same attention for a CPU device: one work-item per (query head, token) runs the whole
// online softmax over the slots itself, with vector math and no barriers (a CPU device's work-
// items are loop iterations: a group kernel's barriers cost more there than the work). The
// output accumulates in private memory (SERIAL_HD_MAX floats: head_dim up to that).
#define SERIAL_HD_MAX 256
void attention_serial_one(const int f16, __global const float* q, __global float* out, __global const void* keys,
                          __global const void* values, const long row_stride, __global const int* positions,
                          const int n_slots, const long q_pos0, const int n_head, const int n_head_kv,
                          const int head_dim, const float scale, const int window, __global const float* sinks) {
  const int h = get_global_id(0), i = get_global_id(1);
  const int g = h / (n_head / n_head_kv);
  const long pos = q_pos0 + i;
  const long oldest = window > 0 ? pos - window + 1 : 0;
  __global const float* qh = q + ((ulong)i * n_head + h) * head_dim;
  const ulong kv_col = (ulong)g * head_dim;
  float4 acc[SERIAL_HD_MAX / 4];
  for (int c = 0; c < head_dim / 4; ++c) acc[c] = (float4)0.0f;
  float running_max = -INFINITY, denominator = 0.0f;
  for (int j = 0; j < n_slots; ++j) {
    const int p = positions[j];
    if (p < 0 || p > pos || p < oldest) continue;
    const ulong row = (ulong)j * row_stride + kv_col;
    float s = 0.0f;
    for (int c = 0; c < head_dim; c += 4) s += dot(vload4(0, qh + c), load_kv4(f16, keys, row + c));
    s *= scale;
    const float new_max = fmax(running_max, s);
    const float rescale = exp(running_max - new_max), weight = exp(s - new_max);
    denominator = denominator * rescale + weight;
    for (int c = 0; c < head_dim / 4; ++c) acc[c] = acc[c] * rescale + weight * load_kv4(f16, values, row + 4 * c);
    running_max = new_max;
  }
  denominator += sink_term(sinks, h, running_max);
  __global float* oh = out + ((ulong)i * n_head + h) * head_dim;
  const float inv = denominator > 0.0f ? 1.0f / denominator : 0.0f;
  for (int c = 0; c < head_dim / 4; ++c) vstore4(acc[c] * inv, 0, oh + 4 * c);
}

#define ATTENTION_SERIAL_KERNEL(name, f16, kv_type)                                                                  \
  __kernel void name(__global const float* q, const ulong q_off, __global float* out, const ulong out_off,           \
                     __global const kv_type* keys, const ulong k_off, __global const kv_type* values,               \
                     const ulong v_off, const long row_stride, __global const int* positions, const int n_slots,    \
                     const long q_pos0, const int n_head, const int n_head_kv, const int head_dim, const float scale, \
                     const int window, __global const float* sinks, const ulong sinks_off, const int has_sinks) {    \
    attention_serial_one(f16, q + q_off, out + out_off, keys + k_off, values + v_off, row_stride, positions, n_slots, \
                         q_pos0, n_head, n_head_kv, head_dim, scale, window, SINKS(sinks, sinks_off, has_sinks));   \
  }

ATTENTION_SERIAL_KERNEL(attention_serial_f32, 0, float)
ATTENTION_SERIAL_KERNEL(attention_serial_f16, 1, half)

// --- Shift-RoPE -------------------------------------------------------------------------------

// Rotates pair i = get_global_id(0) (< n_rot / 2) of KV head get_global_id(1) of slot
// slots[z % n_moved] in layer z / n_moved, z = get_global_id(2), in place:
//   x_a' = x_a cos - x_b sin,  x_b' = x_a sin + x_b cos,
// the pair being (x[2i], x[2i+1]) when adjacent_pairs, else (x[i], x[i + n_rot/2]). fp16 keys
// are rounded back to nearest even. keys_off and layer_stride are in elements.
void rope_shift_one(const int f16, __global void* keys, const ulong layer_stride, const long row_stride,
                    __global const int* slots, const int n_moved, const int head_dim, const int n_rot,
                    const int adjacent_pairs, __global const float* cos_sin) {
  const int i = get_global_id(0), head = get_global_id(1), z = get_global_id(2);
  const int half_rot = n_rot / 2;
  const ulong row =
      (ulong)(z / n_moved) * layer_stride + (ulong)slots[z % n_moved] * row_stride + (ulong)head * head_dim;
  const ulong a = row + (adjacent_pairs ? 2 * i : i);
  const ulong b = row + (adjacent_pairs ? 2 * i + 1 : i + half_rot);
  const float c = cos_sin[i], s = cos_sin[half_rot + i];
  if (f16) {
    __global half* k = (__global half*)keys;
    const float xa = vload_half(a, k), xb = vload_half(b, k);
    vstore_half_rte(xa * c - xb * s, a, k);
    vstore_half_rte(xa * s + xb * c, b, k);
  } else {
    __global float* k = (__global float*)keys;
    const float xa = k[a], xb = k[b];
    k[a] = xa * c - xb * s;
    k[b] = xa * s + xb * c;
  }
}

#define ROPE_SHIFT_KERNEL(name, f16, kv_type)                                                                       \
  __kernel void name(__global kv_type* keys, const ulong keys_off, const ulong layer_stride, const long row_stride, \
                     __global const int* slots, const int n_moved, const int head_dim, const int n_rot,             \
                     const int adjacent_pairs, __global const float* cos_sin) {                                     \
    rope_shift_one(f16, keys + keys_off, layer_stride, row_stride, slots, n_moved, head_dim, n_rot, adjacent_pairs, \
                   cos_sin);                                                                                        \
  }

ROPE_SHIFT_KERNEL(rope_shift_f32, 0, float)
ROPE_SHIFT_KERNEL(rope_shift_f16, 1, half)

// --- Row ops (ABI version 2) ------------------------------------------------------------------

// Every offset below (x_off, ...) is in elements of its buffer's type. The element-wise kernels
// run on a grid rounded up to whole work-groups: the work-items past n do nothing.

// out[r][c] = x[r][c] / sqrt(mean_c(x[r][c]^2) + eps) * weight[c]: one work-group per row r =
// get_group_id(0), its get_local_size(0) work-items (a power of two) each summing the squares of
// columns tid, tid + G, ... in float, then a tree reduction in local memory (`partial`, G
// floats). Each work-item writes exactly the columns it read, after the reduction: out may be x.
__kernel void rms_norm(__global const float* x, const ulong x_off, __global float* out, const ulong out_off,
                       __global const float* weight, const ulong w_off, const int width, const float eps,
                       __local float* partial) {
  const int tid = get_local_id(0), G = get_local_size(0);
  const ulong row = (ulong)get_group_id(0) * (ulong)width;
  __global const float* xr = x + x_off + row;
  __global float* outr = out + out_off + row;
  __global const float* w = weight + w_off;

  float sum = 0.0f;
  for (int c = tid; c < width; c += G) {
    const float v = xr[c];
    sum += v * v;
  }
  partial[tid] = sum;
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int stride = G / 2; stride > 0; stride /= 2) {
    if (tid < stride) partial[tid] += partial[tid + stride];
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  const float inv = 1.0f / sqrt(partial[0] / (float)width + eps);
  for (int c = tid; c < width; c += G) outr[c] = xr[c] * inv * w[c];
}

// x[i] += delta[i % delta_n] for i < n: a residual (delta_n = n) or a bias on every row.
__kernel void add_rows(__global float* x, const ulong x_off, __global const float* delta, const ulong d_off,
                       const ulong n, const ulong delta_n) {
  const ulong i = get_global_id(0);
  if (i >= n) return;
  x[x_off + i] += delta[d_off + (delta_n == n ? i : i % delta_n)];
}

// x[i] *= factor for i < n.
__kernel void scale_rows(__global float* x, const ulong x_off, const ulong n, const float factor) {
  const ulong i = get_global_id(0);
  if (i >= n) return;
  x[x_off + i] *= factor;
}

// gate[i] = act(gate[i]) * up[i] for i < n (glu_of).
__kernel void glu(__global float* gate, const ulong g_off, __global const float* up, const ulong u_off,
                  const ulong n, const int activation) {
  const ulong i = get_global_id(0);
  if (i >= n) return;
  gate[g_off + i] = glu_of(activation, gate[g_off + i], up[u_off + i]);
}

// RoPE in place: pair i = get_global_id(0) (< n_rot / 2) of head get_global_id(1) of row
// r = get_global_id(2) (n_heads * head_dim floats) turns by the angle whose cosine and sine are
// cos_t[r][i] and sin_t[r][i] (rows of n_rot / 2 floats), the pair being (x[2i], x[2i+1]) when
// adjacent_pairs, else (x[i], x[i + n_rot/2]):
//   x_a' = x_a cos - x_b sin,  x_b' = x_a sin + x_b cos.
__kernel void rope(__global float* x, const ulong x_off, const int n_heads, const int head_dim, const int n_rot,
                   const int adjacent_pairs, __global const float* cos_t, const ulong cos_off,
                   __global const float* sin_t, const ulong sin_off) {
  const int i = get_global_id(0), head = get_global_id(1);
  const ulong r = get_global_id(2);
  const int half_rot = n_rot / 2;
  const ulong row = x_off + (r * (ulong)n_heads + (ulong)head) * (ulong)head_dim;
  const ulong a = row + (adjacent_pairs ? 2 * i : i);
  const ulong b = row + (adjacent_pairs ? 2 * i + 1 : i + half_rot);
  const ulong angle = r * (ulong)half_rot + (ulong)i;
  const float c = cos_t[cos_off + angle], s = sin_t[sin_off + angle];
  const float xa = x[a], xb = x[b];
  x[a] = xa * c - xb * s;
  x[b] = xa * s + xb * c;
}

// RoPE of q and k and the store of k and v into the cache, in one launch: work-item j (< head_dim)
// of head h of row r = get_global_id(2), the heads being q's n_head, then k's n_head_kv, then v's
// n_head_kv. For q and k, j < n_rot / 2 turns pair j as rope does (and for k stores both of its
// elements), j >= n_rot stores k's element j as it is; for v, every j stores its element. Each
// element is written by one work-item. kv_rows are the cache's rows of this pass (row r at
// r * n_head_kv * head_dim elements), fp16 (rounded to nearest even) or fp32.
void store_kv_element(const int f16, __global void* rows, const ulong i, const float value) {
  if (f16) {
    vstore_half_rte(value, i, (__global half*)rows);
  } else {
    ((__global float*)rows)[i] = value;
  }
}

__kernel void rope_store(__global float* q, const ulong q_off, const int n_head, __global float* k, const ulong k_off,
                         __global const float* v, const ulong v_off, const int n_head_kv, const int head_dim,
                         const int n_rot, const int adjacent_pairs, __global const float* cos_t, const ulong cos_off,
                         __global const float* sin_t, const ulong sin_off, __global void* keys, const ulong keys_off,
                         __global void* values, const ulong values_off, const int f16) {
  const int j = get_global_id(0), h = get_global_id(1);
  const ulong r = get_global_id(2);
  const int half_rot = n_rot / 2;
  const ulong kv_width = (ulong)n_head_kv * (ulong)head_dim;
  if (h >= n_head + n_head_kv) {  // a v head: its element j into the values
    const ulong at = r * kv_width + (ulong)(h - n_head - n_head_kv) * head_dim + j;
    store_kv_element(f16, values, values_off + at, v[v_off + at]);
    return;
  }
  const bool is_k = h >= n_head;
  __global float* x = is_k ? k + k_off + (r * (ulong)n_head_kv + (ulong)(h - n_head)) * head_dim
                           : q + q_off + (r * (ulong)n_head + (ulong)h) * head_dim;
  const ulong cache_at = keys_off + r * kv_width + (ulong)(h - n_head) * head_dim;  // k heads only
  if (j < half_rot) {
    const int a = adjacent_pairs ? 2 * j : j, b = adjacent_pairs ? 2 * j + 1 : j + half_rot;
    const ulong angle = r * (ulong)half_rot + (ulong)j;
    const float c = cos_t[cos_off + angle], s = sin_t[sin_off + angle];
    const float xa = x[a], xb = x[b];
    const float ya = xa * c - xb * s, yb = xa * s + xb * c;
    x[a] = ya;
    x[b] = yb;
    if (is_k) {
      store_kv_element(f16, keys, cache_at + a, ya);
      store_kv_element(f16, keys, cache_at + b, yb);
    }
  } else if (j >= n_rot && is_k) {
    store_kv_element(f16, keys, cache_at + j, x[j]);
  }
}

// dst[i] = src[i] for i < n, fp32 to the cache's element type (fp16: rounded to nearest even).
__kernel void store_kv_f32(__global const float* src, const ulong src_off, __global float* dst, const ulong dst_off,
                           const ulong n) {
  const ulong i = get_global_id(0);
  if (i >= n) return;
  dst[dst_off + i] = src[src_off + i];
}
__kernel void store_kv_f16(__global const float* src, const ulong src_off, __global half* dst, const ulong dst_off,
                           const ulong n) {
  const ulong i = get_global_id(0);
  if (i >= n) return;
  vstore_half_rte(src[src_off + i], dst_off + i, dst);
}

// Weight c of a row in `format`, stored in blocks of block_bytes bytes: the block layouts of
// load_block, dequantized as quant/formats.cpp does (Q4_0 d (q - 8), Q4_1 d q + m, Q8_0 d q read
// directly; the other formats through load_block).
float weight_at(const int format, const int block_bytes, __global const uchar* row, const int c) {
  const int j = c % BLOCK;
  if (format == FMT_Q4_0) {
    __global const uchar* p = row + (ulong)(c / BLOCK) * 18;
    const int q = j < 16 ? (p[2 + j] & 0x0F) : (p[2 + j - 16] >> 4);
    return vload_half(0, (__global const half*)p) * (float)(q - 8);
  } else if (format == FMT_Q4_1) {
    __global const uchar* p = row + (ulong)(c / BLOCK) * 20;
    const int q = j < 16 ? (p[4 + j] & 0x0F) : (p[4 + j - 16] >> 4);
    return vload_half(0, (__global const half*)p) * (float)q + vload_half(1, (__global const half*)p);
  } else if (format == FMT_Q8_0) {
    __global const uchar* p = row + (ulong)(c / BLOCK) * 34;
    return vload_half(0, (__global const half*)p) * (float)((__global const char*)(p + 2))[j];
  } else if (format == FMT_F16) {
    return vload_half(c, (__global const half*)row);
  } else if (format == FMT_F32) {
    return ((__global const float*)row)[c];
  }
  // The other formats through their block loader: block c / 32, element c % 32 of it.
  const WeightBlock b = load_block(format, row, c / BLOCK, block_bytes);
  float v[16];
  vstore16(j < 16 ? b.lo : b.hi, 0, v);
  return b.scale * v[j % 16];
}

// out[i][c] = row ids[i] of W (n_rows rows of row_bytes bytes), element c, dequantized: column
// c = get_global_id(0) (< cols), i = get_global_id(1). An id outside 0 .. n_rows - 1 gives zeros.
__kernel void get_rows(__global const uchar* W, const int format, const int block_bytes, const ulong row_bytes,
                       const long n_rows, const int cols, __global const int* ids, const ulong ids_off,
                       __global float* out, const ulong out_off) {
  const ulong column = get_global_id(0), i = get_global_id(1);
  if (column >= (ulong)cols) return;
  const int c = (int)column;
  const int id = ids[ids_off + i];
  const bool valid = id >= 0 && (long)id < n_rows;
  out[out_off + i * (ulong)cols + c] = valid ? weight_at(format, block_bytes, W + (ulong)id * row_bytes, c) : 0.0f;
}

// --- Top-k ------------------------------------------------------------------------------------

#define TOP_K_MAX 64  // RINGLM_TOP_K_MAX
#define TOP_K_FAN 16  // the second round's merging work-items per row (at most)

// Whether (a, ia) is picked before (b, ib): the larger value first, the lower index among equals.
int ranks_before(const float a, const int ia, const float b, const int ib) { return a > b || (a == b && ia < ib); }

// Puts (v, id) into the list of the best `count` so far (vals, ids: sorted, room for k) when it
// belongs there; returns the new count.
int keep_best(float* vals, int* ids, int count, const int k, const float v, const int id) {
  if (count == k && !ranks_before(v, id, vals[k - 1], ids[k - 1])) return count;
  int at = count < k ? count : k - 1;
  for (; at > 0 && ranks_before(v, id, vals[at - 1], ids[at - 1]); --at) {
    vals[at] = vals[at - 1];
    ids[at] = ids[at - 1];
  }
  vals[at] = v;
  ids[at] = id;
  return count < k ? count + 1 : count;
}

// Merges `n_lists` sorted lists of k (id, value bits) pairs, consecutive from `lists`, into the
// best k (an id of -1 ends a list early); returns how many there are.
int merge_lists(__global const int* lists, const int n_lists, const int k, float* vals, int* ids) {
  int count = 0;
  for (int list = 0; list < n_lists; ++list) {
    __global const int* entry = lists + (ulong)list * k * 2;
    for (int e = 0; e < k; ++e) {
      const int id = entry[2 * e];
      const float v = as_float(entry[2 * e + 1]);
      // The list is sorted: once one of its entries misses the best k, so do the rest.
      if (id < 0 || (count == k && !ranks_before(v, id, vals[k - 1], ids[k - 1]))) break;
      count = keep_best(vals, ids, count, k, v, id);
    }
  }
  return count;
}

void store_list(__global int* dst, const int count, const int k, const float* vals, const int* ids) {
  for (int e = 0; e < k; ++e) {
    dst[2 * e] = e < count ? ids[e] : -1;
    dst[2 * e + 1] = as_int(e < count ? vals[e] : -INFINITY);
  }
}

// The k largest values of row r = get_group_id(0) of x (n values), largest first, the lowest
// index first among equals, NaNs skipped, as (id, value bits) pairs into out[r]. Three rounds,
// each with its barrier at the top level: work-item t of the L = get_local_size(0) keeps the best
// k of values t, t + L, ... (reads side by side) and writes them to stage[r][t]; then TOP_K_FAN of
// them merge L / fan of those lists each into stage[r][L + t]; then work-item 0 merges those into
// out[r]. stage holds (L + fan) lists of k pairs per row. On a CPU device L is 1.
__kernel void top_k_rows(__global const float* x, const ulong x_off, const long n, const int k, __global int* stage,
                         __global int* out, const ulong out_off) {
  const int r = get_group_id(0), t = get_local_id(0), L = get_local_size(0);
  const int fan = min(L, TOP_K_FAN);
  const int per_merger = L / fan;
  __global const float* row = x + x_off + (ulong)r * n;
  __global int* rows_stage = stage + (ulong)r * (L + fan) * k * 2;
  float vals[TOP_K_MAX];
  int ids[TOP_K_MAX];

  int count = 0;
  for (long c = t; c < n; c += L) {
    const float v = row[c];
    if (!isnan(v)) count = keep_best(vals, ids, count, k, v, (int)c);
  }
  store_list(rows_stage + (ulong)t * k * 2, count, k, vals, ids);
  barrier(CLK_GLOBAL_MEM_FENCE);

  if (t < fan) {
    count = merge_lists(rows_stage + (ulong)t * per_merger * k * 2, per_merger, k, vals, ids);
    store_list(rows_stage + (ulong)(L + t) * k * 2, count, k, vals, ids);
  }
  barrier(CLK_GLOBAL_MEM_FENCE);

  if (t == 0) {
    count = merge_lists(rows_stage + (ulong)L * k * 2, fan, k, vals, ids);
    store_list(out + out_off + (ulong)r * k * 2, count, k, vals, ids);
  }
}
