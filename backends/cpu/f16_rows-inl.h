// fp16 rows to fp32, for the kernels that read fp16 KV rows (attention, kv_rows). Included by
// foreach_target files inside their HWY_NAMESPACE, after hwy/highway.h and quant/formats.h,
// once per target (Highway's -inl.h toggle).
#if defined(RINGLM_F16_ROWS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef RINGLM_F16_ROWS_INL_H_
#undef RINGLM_F16_ROWS_INL_H_
#else
#define RINGLM_F16_ROWS_INL_H_
#endif

// dst[i] = src[i] as fp32 for i < n: whole vectors, then the scalar conversion (exact either way).
HWY_INLINE void F16RowToF32(const uint16_t* src, int64_t n, float* dst) {
  namespace hn = hwy::HWY_NAMESPACE;
  const hn::ScalableTag<float> df;
  const hn::Rebind<hwy::float16_t, decltype(df)> dh;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(df));
  const auto* in = reinterpret_cast<const hwy::float16_t*>(src);
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, in + i)), df, dst + i);
  for (; i < n; ++i) dst[i] = fp16_to_fp32(src[i]);
}

#endif  // RINGLM_F16_ROWS_INL_H_ toggle
