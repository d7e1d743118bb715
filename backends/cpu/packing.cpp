// Packing weights into the layout of packed_format.h, and reading them back in fp32.
//
// Every source block is first decoded into plain numbers (one code per weight, the block's
// scale bits, the sub-block scales and mins), then those numbers are placed where the kernels
// read them. The codes are the file's own: packing rearranges bits, it never requantizes.
#include <omp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <stdexcept>

#include "backends/cpu/kernel_packed.h"
#include "backends/cpu/packed_format.h"
#include "quant/int4.h"

namespace ringlm::cpu {

bool packed_supported(TensorType type, int64_t cols) {
  const std::optional<PackedFormat> f = packed_format(type);
  return f && cols > 0 && cols % f->row_multiple() == 0;
}

namespace {

// One source block (the format's unit: 32, 128 or 256 weights) as plain numbers.
struct Decoded {
  uint8_t code[kSuperBlock];  // per weight: the code the packed layout stores
  uint32_t scale_bits = 0;    // block formats: the scale's stored bits (2 or 4 bytes)
  uint32_t min_bits = 0;      // ... and the min's
  uint16_t d = 0, dmin = 0;   // super formats: fp16 bits
  uint8_t sc[16] = {};        // super formats: per sub-block scale byte (signed ones as two's complement)
  uint8_t m[16] = {};         // Q4_K/Q5_K: per sub-block min
};

uint32_t load_bits(const uint8_t* p, size_t bytes) {
  uint32_t v = 0;
  std::memcpy(&v, p, bytes);  // little-endian: the low bytes hold a 16-bit value
  return v;
}

// 16 bytes of nibbles as 32 codes: low nibbles are weights 0..15, high ones 16..31.
void nibbles(const uint8_t* qs, uint8_t* code) {
  for (int j = 0; j < 16; ++j) {
    code[j] = qs[j] & 0x0F;
    code[j + 16] = qs[j] >> 4;
  }
}

// Q4_K / Q5_K pack eight 6-bit scales and mins into 12 bytes; Q3_K sixteen 6-bit scales.
void unpack_k_scale_min(const uint8_t* q, uint8_t* sc, uint8_t* m) {
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      sc[j] = q[j] & 63;
      m[j] = q[j + 4] & 63;
    } else {
      sc[j] = static_cast<uint8_t>((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4));
      m[j] = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
  }
}
int q3_k_scale(const uint8_t* s, int j) {
  const int low = (s[j % 8] >> (4 * (j / 8))) & 0x0F;
  const int high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
  return (low | high << 4) - 32;
}

void decode_q4_k_codes(const uint8_t* qs, uint8_t* code) {
  // Each 32 bytes hold two sub-blocks: the low nibbles, then the high ones.
  for (int c = 0; c < 4; ++c) {
    for (int l = 0; l < 32; ++l) {
      code[64 * c + l] = qs[32 * c + l] & 0x0F;
      code[64 * c + 32 + l] = qs[32 * c + l] >> 4;
    }
  }
}
void decode_q2_k_codes(const uint8_t* qs, uint8_t* code) {
  for (int e = 0; e < kSuperBlock; ++e) {
    const int h = e / 128, k = (e % 128) / 32, l = e % 32;
    code[e] = (qs[32 * h + l] >> (2 * k)) & 3;
  }
}
// Bit b of byte l of a 32-byte mask belongs to weight 32 b + l.
int mask_bit(const uint8_t* mask, int e) { return (mask[e % 32] >> (e / 32)) & 1; }

void decode(const PackedFormat& f, const uint8_t* src, Decoded& out) {
  switch (f.type) {
    case TensorType::Q5_0:
    case TensorType::Q5_1: {
      const size_t scales = f.min ? 4 : 2;
      out.scale_bits = load_bits(src, 2);
      if (f.min) out.min_bits = load_bits(src + 2, 2);
      const uint32_t qh = load_bits(src + scales, 4);
      nibbles(src + scales + 4, out.code);
      for (int j = 0; j < 32; ++j) out.code[j] |= static_cast<uint8_t>(((qh >> j) & 1) << 4);
      return;
    }
    case TensorType::Q8_0:
      out.scale_bits = load_bits(src, 2);
      std::memcpy(out.code, src + 2, 32);
      return;
    case TensorType::Q2_K: {
      const auto& b = *reinterpret_cast<const BlockQ2_K*>(src);
      out.d = b.d, out.dmin = b.dmin;
      std::memcpy(out.sc, b.scales, 16);
      decode_q2_k_codes(b.qs, out.code);
      return;
    }
    case TensorType::Q3_K: {
      const auto& b = *reinterpret_cast<const BlockQ3_K*>(src);
      out.d = b.d;
      for (int j = 0; j < 16; ++j) out.sc[j] = static_cast<uint8_t>(q3_k_scale(b.scales, j));
      decode_q2_k_codes(b.qs, out.code);
      // The high bit set means "no -4": code = low bits + 4 * bit, weight = code - 4.
      for (int e = 0; e < kSuperBlock; ++e) out.code[e] |= static_cast<uint8_t>(mask_bit(b.hmask, e) << 2);
      return;
    }
    case TensorType::Q4_K:
    case TensorType::Q5_K: {
      const bool q5 = f.type == TensorType::Q5_K;
      const uint8_t* base = src;
      uint16_t d, dmin;
      std::memcpy(&d, base, 2);
      std::memcpy(&dmin, base + 2, 2);
      out.d = d, out.dmin = dmin;
      unpack_k_scale_min(base + 4, out.sc, out.m);
      const uint8_t* qh = base + 4 + kKScaleBytes;
      decode_q4_k_codes(q5 ? qh + 32 : qh, out.code);
      if (q5) {
        for (int e = 0; e < kSuperBlock; ++e) out.code[e] |= static_cast<uint8_t>(mask_bit(qh, e) << 4);
      }
      return;
    }
    case TensorType::Q6_K: {
      const auto& b = *reinterpret_cast<const BlockQ6_K*>(src);
      out.d = b.d;
      std::memcpy(out.sc, b.scales, 16);
      // Two halves of 128; in each, ql byte l holds weights l (low) and l + 64 (high), ql byte
      // l + 32 weights l + 32 and l + 96, and qh byte l the top two bits of l, l+32, l+64, l+96.
      for (int h = 0; h < 2; ++h) {
        const uint8_t* ql = b.ql + 64 * h;
        const uint8_t* qh = b.qh + 32 * h;
        uint8_t* code = out.code + 128 * h;
        for (int l = 0; l < 32; ++l) {
          code[l] = static_cast<uint8_t>((ql[l] & 0x0F) | ((qh[l] >> 0) & 3) << 4);
          code[l + 32] = static_cast<uint8_t>((ql[l + 32] & 0x0F) | ((qh[l] >> 2) & 3) << 4);
          code[l + 64] = static_cast<uint8_t>((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4);
          code[l + 96] = static_cast<uint8_t>((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4);
        }
      }
      return;
    }
    case TensorType::IQ4_XS: {
      const auto& b = *reinterpret_cast<const BlockIQ4_XS*>(src);
      out.d = b.d;
      for (int j = 0; j < 8; ++j) {
        const int low = (b.scales_l[j / 2] >> (4 * (j % 2))) & 0x0F;
        const int high = (b.scales_h >> (2 * j)) & 3;
        out.sc[j] = static_cast<uint8_t>((low | high << 4) - 32);
        nibbles(b.qs + 16 * j, out.code + 32 * j);
      }
      return;
    }
    case TensorType::MXFP4: {
      // The E8M0 byte becomes the bf16 bits of the halved scale (the header's ScaleType::kBF16),
      // the number it stands for: a power of two, so the float's low 16 bits are zero.
      const auto& b = *reinterpret_cast<const BlockMXFP4*>(src);
      out.scale_bits = std::bit_cast<uint32_t>(e8m0_half_to_fp32(b.e)) >> 16;
      nibbles(b.qs, out.code);
      return;
    }
    default: {
      // Q4_0, Q4_1, IQ4_NL and ringlm's INT4 types: scale (and min), then sub-blocks of 32
      // weights as Q4_0's 16 bytes of nibbles.
      const size_t vb = f.value_bytes();
      out.scale_bits = load_bits(src, vb);
      if (f.min) out.min_bits = load_bits(src + vb, vb);
      const uint8_t* qs = src + vb * (f.min ? 2 : 1);
      for (int s = 0; s < f.group / 32; ++s) nibbles(qs + 16 * s, out.code + 32 * s);
      return;
    }
  }
}

size_t source_block_bytes(TensorType type) {
  const TypeTraits t = *type_traits(static_cast<uint32_t>(type));
  return t.block_bytes;
}

void put_value(uint8_t* dst, uint32_t bits, size_t bytes) { std::memcpy(dst, &bits, bytes); }

// Row r's 32 codes of one sub-block into its bytes of the sub-block's chunks (packed_format.h):
// the placement code_at reads (packed_format.h), a byte at a time.
void put_sub(Codes codes, const uint8_t* code, int r, uint8_t* sub) {
  const auto byte = [&](size_t chunk, int j) -> uint8_t& { return sub[chunk * kChunkBytes + static_cast<size_t>(4 * r + j)]; };
  // Bits `mask` of each quad's code (shifted down by `shift`) gathered into one byte per j.
  const auto gather = [&](int j, int quads, int first_quad, int shift, int mask, int width) {
    int b = 0;
    for (int k = 0; k < quads; ++k) b |= ((code[4 * (first_quad + k) + j] >> shift) & mask) << (width * k);
    return static_cast<uint8_t>(b);
  };
  for (int j = 0; j < 4; ++j) {
    switch (codes) {
      case Codes::kNib4:
      case Codes::kNib4Hb1:
      case Codes::kNib4Hb2:
        for (int c = 0; c < 4; ++c) byte(static_cast<size_t>(c), j) = static_cast<uint8_t>((code[8 * c + j] & 0x0F) | (code[8 * c + 4 + j] & 0x0F) << 4);
        if (codes == Codes::kNib4Hb1) byte(4, j) = gather(j, 8, 0, 4, 1, 1);
        if (codes == Codes::kNib4Hb2) {
          byte(4, j) = gather(j, 4, 0, 4, 3, 2);
          byte(5, j) = gather(j, 4, 4, 4, 3, 2);
        }
        break;
      case Codes::kCrumb2:
      case Codes::kCrumb2Hb1:
        byte(0, j) = gather(j, 4, 0, 0, 3, 2);
        byte(1, j) = gather(j, 4, 4, 0, 3, 2);
        if (codes == Codes::kCrumb2Hb1) byte(2, j) = gather(j, 8, 0, 2, 1, 1);
        break;
      case Codes::kBytes:
        for (int c = 0; c < 8; ++c) byte(static_cast<size_t>(c), j) = code[4 * c + j];
        break;
      default: break;
    }
  }
}

// Row r of a group: every K-block's header fields and codes.
void pack_row(const PackedFormat& f, const uint8_t* row, int r, int64_t cols, uint8_t* group) {
  if (f.floats()) {
    const size_t vb = f.codes == Codes::kFloat ? 4 : 2;
    for (int64_t k = 0; k < cols; ++k) {
      std::memcpy(group + (static_cast<size_t>(k) * kPackRows + static_cast<size_t>(r)) * vb, row + static_cast<size_t>(k) * vb, vb);
    }
    return;
  }
  const size_t src_block = source_block_bytes(f.type);
  Decoded dec;
  uint8_t* p = group;
  for (int64_t k0 = 0; k0 < cols; k0 += f.kblock) {
    const int64_t n = std::min<int64_t>(f.kblock, cols - k0);
    uint8_t* header = p;
    uint8_t* codes = p + f.header_bytes_for(n);
    const int blocks = static_cast<int>(n / f.group);
    for (int b = 0; b < blocks; ++b) {
      dec = Decoded{};
      decode(f, row + static_cast<size_t>((k0 + b * f.group) / f.group) * src_block, dec);
      if (f.super()) {
        std::memcpy(header + 2 * r, &dec.d, 2);
        if (f.min) std::memcpy(header + 32 + 2 * r, &dec.dmin, 2);
        for (int j = 0; j < f.subs(); ++j) {
          header[f.scales_offset() + static_cast<size_t>(kPackRows * j + r)] = dec.sc[j];
          if (f.min && !f.nibble_scale_min) header[f.mins_offset() + static_cast<size_t>(kPackRows * j + r)] = dec.m[j];
        }
      } else {
        const size_t vb = f.value_bytes();
        put_value(header + (static_cast<size_t>(b) * kPackRows + static_cast<size_t>(r)) * vb, dec.scale_bits, vb);
        if (f.min) {
          put_value(header + (static_cast<size_t>(blocks + b) * kPackRows + static_cast<size_t>(r)) * vb, dec.min_bits, vb);
        }
      }
      for (int i = 0; i < f.group; i += static_cast<int>(kSubWeights)) {
        const int64_t sub = (b * f.group + i) / kSubWeights;  // within the K-block
        put_sub(f.codes, dec.code + i, r, codes + static_cast<size_t>(sub) * f.sub_code_bytes());
      }
    }
    p = codes + static_cast<size_t>(n / kSubWeights) * f.sub_code_bytes();
  }
}

}  // namespace

void release_mapped_pages(const uint8_t* data, size_t bytes) {
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) / page * page;
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

PackedWeight pack_weight(TensorType type, const uint8_t* w, size_t row_stride, int64_t rows, int64_t cols,
                         WeightArena* arena, bool release_source) {
  PackedWeight p;
  const std::optional<PackedFormat> f = packed_format(type);
  if (!f || rows <= 0 || !packed_supported(type, cols)) return p;  // callers check packed_supported()
  p.type = type;
  p.rows = rows;
  p.cols = cols;
  p.group_bytes = (f->group_bytes(cols) + 63) / 64 * 64;
  p.data = arena != nullptr ? arena->allocate(p.bytes()) : allocate_weight_block(p.bytes());
  const int64_t groups = p.groups();
  uint8_t* base = p.data.get();
  // Each thread packs a contiguous run of groups and, asked to, gives back the source pages it
  // has read every kReleaseGroups groups: the file's copy of a large matrix (a vocabulary
  // projection) never sits in memory beside the whole packed one.
  constexpr int64_t kReleaseGroups = 64;
#pragma omp parallel
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t g0 = groups * t / nt, g1 = groups * (t + 1) / nt;
    const auto source_row = [&](int64_t g) { return w + static_cast<size_t>(std::min(rows, g * kPackRows)) * row_stride; };
    int64_t released = g0;
    for (int64_t g = g0; g < g1; ++g) {
      uint8_t* dst = base + p.group_bytes * static_cast<size_t>(g);
      std::memset(dst, 0, p.group_bytes);
      for (int r = 0; r < kPackRows && g * kPackRows + r < rows; ++r) {
        pack_row(*f, w + static_cast<size_t>(g * kPackRows + r) * row_stride, r, cols, dst);
      }
      if (release_source && g + 1 - released >= kReleaseGroups) {
        release_mapped_pages(source_row(released), static_cast<size_t>(source_row(g + 1) - source_row(released)));
        released = g + 1;
      }
    }
  }
  if (release_source) release_mapped_pages(w, row_stride * static_cast<size_t>(rows));
  return p;
}

namespace {

// Row r of a group in fp32, by the formulas of the formats (as quant/formats.cpp dequantizes
// the file's own blocks, so a packed weight reads back as the file defines it).
void unpack_row(const PackedFormat& f, const uint8_t* group, int r, int64_t cols, float* out) {
  if (f.floats()) {
    for (int64_t k = 0; k < cols; ++k) {
      const uint8_t* v = group + (static_cast<size_t>(k) * kPackRows + static_cast<size_t>(r)) * (f.codes == Codes::kFloat ? 4 : 2);
      uint32_t bits = 0;
      std::memcpy(&bits, v, f.codes == Codes::kFloat ? 4 : 2);
      out[k] = f.codes == Codes::kFloat ? std::bit_cast<float>(bits)
               : f.codes == Codes::kHalf ? fp16_to_fp32(static_cast<f16_bits>(bits))
                                         : bf16_to_fp32(static_cast<bf16_bits>(bits));
    }
    return;
  }
  const uint8_t* p = group;
  for (int64_t k0 = 0; k0 < cols; k0 += f.kblock) {
    const int64_t n = std::min<int64_t>(f.kblock, cols - k0);
    const uint8_t* header = p;
    const uint8_t* codes = p + f.header_bytes_for(n);
    const int blocks = static_cast<int>(n / f.group);
    for (int64_t w = 0; w < n; ++w) {
      const int code = code_at(f.codes, codes + static_cast<size_t>(w / kSubWeights) * f.sub_code_bytes(), r,
                               static_cast<int>(w % kSubWeights));
      const int b = static_cast<int>(w / f.group);
      float value;
      if (f.super()) {
        uint16_t d_bits, dmin_bits = 0;
        std::memcpy(&d_bits, header + 2 * r, 2);
        if (f.min) std::memcpy(&dmin_bits, header + 32 + 2 * r, 2);
        const int j = static_cast<int>(w / f.sub);
        const SubScale sm = sub_scale_at(f, header, j, r);
        const float q = f.has_codebook() ? codebook_values(f.codebook)[code] : static_cast<float>(code - f.offset);
        value = fp16_to_fp32(d_bits) * static_cast<float>(sm.scale) * q - fp16_to_fp32(dmin_bits) * static_cast<float>(sm.min);
      } else {
        const size_t vb = f.value_bytes();
        const float d = scale_at(header + (static_cast<size_t>(b) * kPackRows + static_cast<size_t>(r)) * vb, f.scale);
        if (f.codes == Codes::kBytes) {
          value = d * static_cast<float>(static_cast<int8_t>(code));
        } else if (f.has_codebook()) {
          value = d * static_cast<float>(codebook_values(f.codebook)[code]);
        } else if (f.min) {
          value = d * static_cast<float>(code) + scale_at(header + (static_cast<size_t>(blocks + b) * kPackRows + static_cast<size_t>(r)) * vb, f.scale);
        } else {
          value = d * static_cast<float>(code - f.offset);
        }
      }
      out[k0 + w] = value;
    }
    p = codes + static_cast<size_t>(n / kSubWeights) * f.sub_code_bytes();
  }
}

}  // namespace

void dequantize_packed(const PackedWeight& w, int64_t n0, int64_t n1, float* out) {
  const PackedFormat f = *packed_format(w.type);
  for (int64_t n = n0; n < n1; ++n) {
    unpack_row(f, w.group(n / kPackRows), static_cast<int>(n % kPackRows), w.cols, out + (n - n0) * w.cols);
  }
}

}  // namespace ringlm::cpu
