// x quantized to int8 for the products with int8 activations (quant_gemv_q8.cpp: decode rows;
// quant_gemm_q8.cpp: any number of rows): blocks of 32 values, d = max|x| / 127, xq = round(x / d)
// (round to nearest even, saturated to int8), one fp32 d per block. Done once per call.
//
// Two orders of the int8 values in a row: natural (k increasing), or the nibble order of the
// decode kernel's 4-bit chunks (quant_gemv_q8.cpp's header: per 4 blocks of 32, their weights
// 0..15 side by side, then their weights 16..31), which lets it dot the low and high nibbles of a
// 64-byte weight load with x directly.
#pragma once

#include "quant_storage.h"

#include <vector>

namespace zi_quant {

#define ZI_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))

struct XQ {                  // x quantized for one call: per row `ldq` int8 values, `ldd` block scales
  std::vector<int8_t> q;
  std::vector<float> d;      // per 32-weight block (zero-padded to whole chunks)
  int64_t ldq = 0, ldd = 0;
};

// An XQ for M rows of K, zero-filled (the padding past K stays zero).
inline XQ xq_alloc(int64_t M, int64_t K, bool nibble_order) {
  XQ o;
  const int64_t nb = K / 32, chunks = nibble_order ? (nb + 3) / 4 : (K + 63) / 64;
  o.ldq = nibble_order ? chunks * 128 : chunks * 64;
  o.ldd = nibble_order ? chunks * 4 : chunks * 2;
  o.q.assign(M * o.ldq, 0);
  o.d.assign(M * o.ldd, 0.f);
  return o;
}

// Rows [m0, m1) of x [M, K] (row stride ldx) quantized into `o` (from `xq_alloc`).
ZI_VNNI inline void quantize_rows(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, bool nibble_order,
                                  XQ& o) {
  const int64_t nb = K / 32;
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xr = x + m * ldx + b * 32;
      const __m512 v0 = _mm512_loadu_ps(xr), v1 = _mm512_loadu_ps(xr + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));   // F only, not DQ
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      const __m128i q0 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)));
      const __m128i q1 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv)));
      int8_t* row = o.q.data() + m * o.ldq;
      int8_t* lo = nibble_order ? row + (b / 4) * 128 + (b % 4) * 16 : row + b * 32;
      int8_t* hi = nibble_order ? lo + 64 : lo + 16;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), q0);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), q1);
      o.d[m * o.ldd + b] = amax / 127.f;
    }
}

// x [M, K] -> int8 blocks of 32 in the given order, on the calling thread.
ZI_VNNI inline XQ quantize_x(const float* x, int64_t ldx, int64_t M, int64_t K, bool nibble_order) {
  XQ o = xq_alloc(M, K, nibble_order);
  quantize_rows(x, ldx, 0, M, K, nibble_order, o);
  return o;
}

}  // namespace zi_quant
