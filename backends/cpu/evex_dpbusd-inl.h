// vpdpbusd in its AVX-512 (EVEX) encoding, for the kernels' AVX3_DL target. Included by
// foreach_target files inside their HWY_NAMESPACE, after hwy/highway.h (which brings the
// intrinsics), once per target (Highway's -inl.h toggle).
//
// Why not _mm256_dpbusd_epi32: Highway's AVX3_DL target enables GCC's "avxvnni", and GCC then
// emits the VEX form ({vex} vpdpbusd, AVX-VNNI) for 256-bit registers. Zen 4 and Ice Lake have
// AVX512-VNNI but not AVX-VNNI: the VEX form faults there (SIGILL). The EVEX form runs wherever
// the AVX3_DL target's run-time check passes, since that check requires AVX512-VNNI.
#if defined(RINGLM_EVEX_DPBUSD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef RINGLM_EVEX_DPBUSD_INL_H_
#undef RINGLM_EVEX_DPBUSD_INL_H_
#else
#define RINGLM_EVEX_DPBUSD_INL_H_
#endif

#if HWY_TARGET == HWY_AVX3_DL
// int32 lanes of acc += the sum over each lane's 4 bytes of u (unsigned) * s (signed).
// "%{evex%}": braces escaped, since GCC reads bare ones in asm as dialect alternatives.
HWY_INLINE __m256i DpbusdEvex(__m256i acc, __m256i u, __m256i s) {
  asm("%{evex%} vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
}
#endif

#endif  // RINGLM_EVEX_DPBUSD_INL_H_
