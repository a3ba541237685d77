// Shared by the GEMM-ordered products on quantized weights (quant_gemm_q8.cpp: int8 activations;
// quant_gemm_panels.cpp: fp32 activations on dequantized panels): the transpose that brings 16
// weight rows' bytes side by side, and the fp32 panel product's entry point.
#pragma once

#include "quant_layout.h"

namespace zi_quant {

// 16 rows' 16 bytes (row c at ptr[c] + off) as 4 vectors: vector d, 32-bit lane c = bytes
// 4d..4d+3 of row c. A 16 x 4 dword transpose: each 4-row register permuted so its 128-bit lane d
// holds dword d of its 4 rows, then a 4 x 4 transpose of 128-bit lanes across the 4 registers.
ZI_AVX512 ZI_INLINE void transpose16(const uint8_t* const* ptr, int64_t off, __m512i v[4]) {
  const __m512i by_dword = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  __m512i a[4];
  for (int j = 0; j < 4; ++j) {
    __m512i r = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ptr[4 * j] + off)));
    r = _mm512_inserti32x4(r, _mm_loadu_si128(reinterpret_cast<const __m128i*>(ptr[4 * j + 1] + off)), 1);
    r = _mm512_inserti32x4(r, _mm_loadu_si128(reinterpret_cast<const __m128i*>(ptr[4 * j + 2] + off)), 2);
    r = _mm512_inserti32x4(r, _mm_loadu_si128(reinterpret_cast<const __m128i*>(ptr[4 * j + 3] + off)), 3);
    a[j] = _mm512_permutexvar_epi32(by_dword, r);     // 128-bit lane L = row 4j + L -> lane d = dword d
  }
  const __m512i t0 = _mm512_shuffle_i32x4(a[0], a[1], _MM_SHUFFLE(1, 0, 1, 0));
  const __m512i t1 = _mm512_shuffle_i32x4(a[0], a[1], _MM_SHUFFLE(3, 2, 3, 2));
  const __m512i t2 = _mm512_shuffle_i32x4(a[2], a[3], _MM_SHUFFLE(1, 0, 1, 0));
  const __m512i t3 = _mm512_shuffle_i32x4(a[2], a[3], _MM_SHUFFLE(3, 2, 3, 2));
  v[0] = _mm512_shuffle_i32x4(t0, t2, _MM_SHUFFLE(2, 0, 2, 0));
  v[1] = _mm512_shuffle_i32x4(t0, t2, _MM_SHUFFLE(3, 1, 3, 1));
  v[2] = _mm512_shuffle_i32x4(t1, t3, _MM_SHUFFLE(2, 0, 2, 0));
  v[3] = _mm512_shuffle_i32x4(t1, t3, _MM_SHUFFLE(3, 1, 3, 1));
}

// out[M, w.n] = x[M, w.k] (row stride ldx) @ W^T (+ bias, float32 [w.n] or null), W dequantized a
// panel at a time into the blocked fp32 GEMM's layout and multiplied by its register kernel
// (quant_gemm_panels.cpp; AVX-512 F/BW). Any storage `make_qw` accepts.
void quant_panel_gemm(const QW& w, const float* x, int64_t ldx, int64_t M, float* out, const float* bias);

}  // namespace zi_quant
