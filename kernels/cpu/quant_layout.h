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
  const uint8_t* qs;
  const float* scale;                // fp32 scales (the kernels read only these) ...
  const float* minv;                 // nullptr: no min term
  int64_t n, k, group, zero, bits;
  const at::Half* scale_h = nullptr; // ... or, when the weight stores them as fp16, these (scale and
  const at::Half* minv_h = nullptr;  // minv null): `for_row_tiles` converts them a tile at a time
  int64_t row_bytes() const { return bits == 4 ? k / 2 : k; }
  float offset(int64_t row, int64_t g) const {   // min - zero * scale: w = scale * q + offset
    const float s = scale[row * (k / group) + g];
    return (minv ? minv[row * (k / group) + g] : 0.f) - static_cast<float>(zero) * s;
  }
};

inline QW make_qw(const at::Tensor& qs, const at::Tensor& scale, const c10::optional<at::Tensor>& minv, int64_t bits,
           int64_t group, int64_t zero, int64_t k) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_linear: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(group > 0 && group % (bits == 4 ? 32 : 16) == 0 && k % group == 0 && k % 32 == 0,
              "quant_linear: group ", group, " must divide K=", k, " and be a multiple of ", bits == 4 ? 32 : 16,
              " (K a multiple of 32)");
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() && qs.device().is_cpu() && qs.element_size() == 1 &&
                  qs.size(1) == (bits == 4 ? k / 2 : k),
              "quant_linear: qs must be a contiguous 1-byte CPU tensor [N, ", bits == 4 ? k / 2 : k, "], got ",
              qs.sizes());
  const int64_t n = qs.size(0);
  const bool half = scale.scalar_type() == at::kHalf;
  auto check_groups = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK((t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf) && t.is_contiguous() &&
                    t.dim() == 2 && t.size(0) == n && t.size(1) == k / group,
                "quant_linear: ", what, " must be contiguous float32 or float16 [", n, ", ", k / group, "], got ",
                t.sizes(), " ", t.scalar_type());
    TORCH_CHECK((t.scalar_type() == at::kHalf) == half, "quant_linear: scale and min must have one dtype");
  };
  check_groups(scale, "scale");
  QW w{static_cast<const uint8_t*>(qs.data_ptr()), nullptr, nullptr, n, k, group, zero, bits};
  const bool has_min = minv.has_value() && minv->defined();
  if (has_min) check_groups(*minv, "min");
  if (half) {
    w.scale_h = scale.data_ptr<at::Half>();
    w.minv_h = has_min ? minv->data_ptr<at::Half>() : nullptr;
  } else {
    w.scale = scale.data_ptr<float>();
    w.minv = has_min ? minv->data_ptr<float>() : nullptr;
  }
  return w;
}

__attribute__((target("avx512f"))) inline void half_to_float_avx512(const at::Half* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(d + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i))));
  for (; i < n; ++i) d[i] = static_cast<float>(s[i]);
}

inline void half_to_float(const at::Half* s, float* d, int64_t n) {   // exact: every fp16 is an fp32
  static const bool avx512 = (__builtin_cpu_init(), __builtin_cpu_supports("avx512f"));
  if (avx512) return half_to_float_avx512(s, d, n);
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<float>(s[i]);
}

// f(tile, r0, r1) for rows [n0, n1) in tiles of up to 64 rows: `tile` is the weight of rows r0..r1
// (its row 0 is row r0) with fp32 scales, converted from fp16 into a local buffer when the weight
// stores fp16 ones (L1-sized; the conversion is exact, so results do not depend on the storage).
template <class F>
inline void for_row_tiles(const QW& w, int64_t n0, int64_t n1, F&& f) {
  constexpr int64_t TILE = 64;
  const int64_t ng = w.k / w.group;
  std::vector<float> buf(w.scale_h ? TILE * ng * (w.minv_h ? 2 : 1) : 0);
  for (int64_t r0 = n0; r0 < n1; r0 += TILE) {
    const int64_t r1 = std::min(n1, r0 + TILE);
    QW t = w;
    t.qs = w.qs + r0 * w.row_bytes();
    t.n = r1 - r0;
    t.scale_h = t.minv_h = nullptr;
    if (w.scale_h) {
      half_to_float(w.scale_h + r0 * ng, buf.data(), t.n * ng);
      t.scale = buf.data();
      if (w.minv_h) {
        half_to_float(w.minv_h + r0 * ng, buf.data() + TILE * ng, t.n * ng);
        t.minv = buf.data() + TILE * ng;
      }
    } else {
      t.scale = w.scale + r0 * ng;
      t.minv = w.minv ? w.minv + r0 * ng : nullptr;
    }
    f(t, r0, r1);
  }
}

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
// bytes prefetched meanwhile) and each register tile of up to MR rows of x from row m0 on, calls
// tile(std::integral_constant<int, R>, n, m0) with R = min(MR, M - m0).
template <class F>
ZI_INLINE void for_each_tile(const QW& w, int64_t M, int64_t n0, int64_t n1, F&& tile) {
  for (int64_t n = n0; n < n1; ++n) {
    if (n + 1 < n1) {
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
  if (!w.minv && !w.minv_h && !w.zero) return xsum;
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
