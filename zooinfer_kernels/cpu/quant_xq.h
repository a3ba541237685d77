// x quantized to int8 for the products with int8 activations (quant_gemv_q8.cpp: decode rows;
// quant_gemm_q8.cpp: any number of rows): blocks of 32 values, d = max|x| / 127, xq = round(x / d)
// (round to nearest even, saturated to int8), one fp32 d per block. Done once per call.
//
// Two orders of the int8 values in a row: natural (k increasing), or the nibble order of the
// decode kernel's 4-bit chunks (quant_gemv_q8.cpp's header: per 4 blocks of 32, their weights
// 0..15 side by side, then their weights 16..31), which lets it dot the low and high nibbles of a
// 64-byte weight load with x directly. Two implementations of the same rounding, bit for bit (the
// same fp32 multiply by 127 / max|x|, round to nearest even, saturation): AVX-512 and AVX2.
//
// Also the one CPU check of the int8-activation paths (`q8_best_isa`) and the declaration of the
// AVX2 + FMA product (quant_q8_avx2.cpp) that both ops run where the CPU has no VNNI.
#pragma once

#include "quant_storage.h"

#include <vector>

namespace zi_quant {

#define ZI_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))

// The int8-activation instruction path this CPU runs: 2 AVX-512 F/BW/VL + VNNI (vpdpbusd), 1 AVX2 +
// FMA (vpmaddubsw + vpmaddwd, quant_q8_avx2.cpp), 0 none. The only copy of this check.
inline int64_t q8_best_isa() {
  static const int64_t isa = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
      return int64_t{2};
    return int64_t{__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0};
  }();
  return isa;
}

inline bool q8_available() { return q8_best_isa() > 0; }

// The path an op runs for its `isa` argument: -1 the best this CPU has, 1 AVX2 + FMA, 2 AVX-512
// VNNI (tests force 1 on a VNNI CPU); one-line errors naming the op.
inline int64_t q8_pick_isa(int64_t isa, const char* op) {
  TORCH_CHECK(isa == -1 || isa == 1 || isa == 2, op, ": isa must be -1 (best), 1 (AVX2) or 2 (AVX-512 VNNI), got ",
              isa);
  const int64_t best = q8_best_isa();
  TORCH_CHECK(best > 0, op, ": this CPU lacks AVX2 + FMA");
  TORCH_CHECK(isa <= best, op, ": isa 2 needs AVX-512 VNNI, which this CPU lacks");
  return isa == -1 ? best : isa;
}

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

// quantize_rows on AVX2: the same values bit for bit (max|x| is exact in any order; the scale, the
// product and the rounding are the same fp32 operations; saturating int32 -> int16 -> int8 packs
// saturate as int32 -> int8 does). The packs interleave 128-bit lanes; one dword permute restores
// the order.
ZI_AVX2 inline void quantize_rows_avx2(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K,
                                       bool nibble_order, XQ& o) {
  const int64_t nb = K / 32;
  const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xr = x + m * ldx + b * 32;
      __m256 v[4];
      for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(xr + 8 * j);
      const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absm), _mm256_and_ps(v[1], absm)),
                                     _mm256_max_ps(_mm256_and_ps(v[2], absm), _mm256_and_ps(v[3], absm)));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
      const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      __m256i i[4];
      for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
      const __m256i q = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3])), order);
      int8_t* row = o.q.data() + m * o.ldq;
      int8_t* lo = nibble_order ? row + (b / 4) * 128 + (b % 4) * 16 : row + b * 32;
      int8_t* hi = nibble_order ? lo + 64 : lo + 16;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm256_castsi256_si128(q));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm256_extracti128_si256(q, 1));
      o.d[m * o.ldd + b] = amax / 127.f;
    }
}

// x [M, K] -> int8 blocks of 32 in the given order, on the calling thread, on the path `isa`
// (q8_pick_isa's: 2 AVX-512, 1 AVX2; the same values either way).
inline XQ quantize_x(const float* x, int64_t ldx, int64_t M, int64_t K, bool nibble_order, int64_t isa = 2) {
  XQ o = xq_alloc(M, K, nibble_order);
  if (isa == 2) quantize_rows(x, ldx, 0, M, K, nibble_order, o);
  else quantize_rows_avx2(x, ldx, 0, M, K, nibble_order, o);
  return o;
}

// out [M, N] (row stride ldo) = x [M, K] (row stride K) @ W^T with int8 activations on AVX2 + FMA,
// for any M (quant_q8_avx2.cpp; `quant_linear_q8`, and `quant_linear_q8_gemm` with gemm_order: the
// GEMM-ordered kernel for 4-bit weights). W's K is x's.
void q8_linear_avx2(const QW& w, const float* x, int64_t M, float* out, int64_t ldo, bool gemm_order);

}  // namespace zi_quant
