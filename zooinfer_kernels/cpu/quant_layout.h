// The quantized weight layout shared by the linears on quantized weights (quant_gemm.cpp: exact
// fp32 paths; quant_gemv_q8.cpp: int8 activations x quantized weights with VNNI dot products).
// models/quant.py `QuantWeight` builds it; quant_gemm.cpp's header comment describes it.
//
// Also what the SIMD paths share, written once over the instruction set: `Avx2` / `Avx512` are
// traits (the float vector and the few intrinsics the shared code needs); `offset_dot(ISA{}, ...)`
// is one body over them (quant_isa_body.h, compiled for each ISA's target), and the decode loop
// `for_each_tile` one template for every path. Each path is compiled for its own instruction set
// whatever -march the library was built with.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace zi_quant {

constexpr int64_t DECODE_ROWS = 16;  // more rows: dequantize tiles once, multiply with at::mm
constexpr int MR = 4;                // rows of x per register tile in the decode kernels

#define ZI_AVX2 __attribute__((target("avx2,fma")))
#define ZI_AVX512 __attribute__((target("avx512f,avx512bw,avx2,fma")))
#define ZI_INLINE __attribute__((always_inline)) inline

struct QW {                          // one quantized weight, as the kernels read it
  const uint8_t* qs;                 // bits 4: nibbles [n, k / 2]; 8: int8 [n, k]
  const float* scale;                // fp32 scales (the kernels read only these) ...
  const float* minv;                 // nullptr: no min term
  int64_t n, k, group, zero, bits;
  // ... or storage the kernels never read: `for_row_tiles` (quant_storage.h) expands it into the
  // fields above a tile of rows at a time, exactly, so results do not depend on the storage.
  const at::Half* scale_h = nullptr; // fp16 scale / min (scale, minv null)
  const at::Half* minv_h = nullptr;
  const int8_t* scale_q = nullptr;   // two-level (K-quants): scale = scale_d[n, k / super] * scale_q[n, k / group]
  const int8_t* minv_q = nullptr;    //   and min = minv_d * minv_q likewise
  const at::Half* scale_d = nullptr;
  const at::Half* minv_d = nullptr;
  int64_t super = 0;
  const uint32_t* qh = nullptr;      // bits 5 / 6: qs holds the low 4 bits, qh [n, k / 32, bits - 4] the rest
  int64_t row_bytes() const { return bits == 8 ? k : k / 2; }
  bool has_min() const { return minv || minv_h || minv_q; }
  int64_t tile_zero() const { return bits == 5 || bits == 6 ? 0 : zero; }   // 5 / 6 bits: folded into the expanded q
  float offset(int64_t row, int64_t g) const {   // min - zero * scale: w = scale * q + offset
    const float s = scale[row * (k / group) + g];
    return (minv ? minv[row * (k / group) + g] : 0.f) - static_cast<float>(tile_zero()) * s;
  }
};

// ------------------------------------------------------------------ per-ISA vector traits
struct Avx2 {                        // 8 floats
  using V = __m256;
  static constexpr int64_t W = 8;
  ZI_AVX2 ZI_INLINE static V zero() { return _mm256_setzero_ps(); }
  ZI_AVX2 ZI_INLINE static V set1(float a) { return _mm256_set1_ps(a); }
  ZI_AVX2 ZI_INLINE static V load(const float* p) { return _mm256_loadu_ps(p); }
  ZI_AVX2 ZI_INLINE static V load_n(const float* p, int64_t n) {   // p[0, n) (n < W), zeros after
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane));
  }
  ZI_AVX2 ZI_INLINE static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  ZI_AVX2 ZI_INLINE static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  ZI_AVX2 ZI_INLINE static float sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
};

struct Avx512 {                      // 16 floats
  using V = __m512;
  static constexpr int64_t W = 16;
  ZI_AVX512 ZI_INLINE static V zero() { return _mm512_setzero_ps(); }
  ZI_AVX512 ZI_INLINE static V set1(float a) { return _mm512_set1_ps(a); }
  ZI_AVX512 ZI_INLINE static V load(const float* p) { return _mm512_loadu_ps(p); }
  ZI_AVX512 ZI_INLINE static V load_n(const float* p, int64_t n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
  }
  ZI_AVX512 ZI_INLINE static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  ZI_AVX512 ZI_INLINE static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  ZI_AVX512 ZI_INLINE static float sum(V v) { return _mm512_reduce_add_ps(v); }
};

// The ISA-generic SIMD code (`offset_dot`) is written once, in quant_isa_body.h, and compiled
// once per ISA: included below with ZI_ISA naming the traits and ZI_TARGET their target. (GCC
// gives a function template the target of its declaration, so a template over the traits would
// compile every ISA's instance for one target and could not inline the other's intrinsics.)
#define ZI_ISA Avx2
#define ZI_TARGET ZI_AVX2
#include "quant_isa_body.h"
#undef ZI_ISA
#undef ZI_TARGET
#define ZI_ISA Avx512
#define ZI_TARGET ZI_AVX512
#include "quant_isa_body.h"
#undef ZI_ISA
#undef ZI_TARGET

// The decode loop of every SIMD path: for each output row n of [n0, n1) (row n + 1's quantized
// bytes prefetched meanwhile, unless the tile prefetches its own stream: `Prefetch` false) and each
// register tile of up to MR rows of x from row m0 on, calls tile(std::integral_constant<int, R>, n,
// m0) with R = min(MR, M - m0).
template <bool Prefetch = true, class F>
ZI_INLINE void for_each_tile(const QW& w, int64_t M, int64_t n0, int64_t n1, F&& tile) {
  for (int64_t n = n0; n < n1; ++n) {
    if (Prefetch && n + 1 < n1) {
      const char* next = reinterpret_cast<const char*>(w.qs + (n + 1) * w.row_bytes());
      for (int64_t b = 0; b < w.row_bytes(); b += 64) __builtin_prefetch(next + b, 0, 0);
    }
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
      switch (std::min<int64_t>(MR, M - m0)) {
        case 1: tile(std::integral_constant<int, 1>{}, n, m0); break;
        case 2: tile(std::integral_constant<int, 2>{}, n, m0); break;
        case 3: tile(std::integral_constant<int, 3>{}, n, m0); break;
        default: tile(std::integral_constant<int, 4>{}, n, m0); break;
      }
    }
  }
}

// x [M, K] (row stride ldx) summed per group of `group`: [M, K / group], for the min / zero term
// (min - zero * scale) * sum(x) of each group; empty when the weight has neither.
inline std::vector<float> group_sums(const QW& w, const float* x, int64_t ldx, int64_t M) {
  std::vector<float> xsum;
  if (!w.has_min() && !w.tile_zero()) return xsum;
  const int64_t ng = w.k / w.group;
  xsum.assign(M * ng, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < ng; ++g) {
      float a = 0.f;
      for (int64_t j = 0; j < w.group; ++j) a += x[m * ldx + g * w.group + j];
      xsum[m * ng + g] = a;
    }
  return xsum;
}

}  // namespace zi_quant
