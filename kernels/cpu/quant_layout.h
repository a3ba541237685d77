// The quantized weight layout shared by the linears on quantized weights (quant_gemm.cpp: exact
// fp32 paths; quant_gemv_q8.cpp: int8 activations x quantized weights with VNNI dot products).
// models/quant.py `QuantWeight` builds it; quant_gemm.cpp's header comment describes it.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <cstdint>
#include <vector>

namespace zi_quant {

constexpr int64_t DECODE_ROWS = 16;  // more rows: dequantize tiles once, multiply with at::mm
constexpr int MR = 4;                // rows of x per register tile in the decode kernels

#define ZI_AVX512 __attribute__((target("avx512f,avx512bw,avx2,fma")))

struct QW {                          // one quantized weight, as the kernels read it
  const uint8_t* qs;
  const float* scale;
  const float* minv;                 // nullptr: no min term
  int64_t n, k, group, zero, bits;
  int64_t row_bytes() const { return bits == 4 ? k / 2 : k; }
  float offset(int64_t row, int64_t g) const {   // min - zero * scale: w = scale * q + offset
    const float s = scale[row * (k / group) + g];
    return (minv ? minv[row * (k / group) + g] : 0.f) - static_cast<float>(zero) * s;
  }
};

// sum over groups of (min - zero * scale) * xsum: the part of a row's product that does not depend on q
inline float offset_dot(const QW& w, int64_t row, const float* xsum) {
  const int64_t ng = w.k / w.group;
  float acc = 0.f;
  for (int64_t g = 0; g < ng; ++g) acc += w.offset(row, g) * xsum[g];
  return acc;
}

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
  auto check_groups = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 2 && t.size(0) == n &&
                    t.size(1) == k / group,
                "quant_linear: ", what, " must be contiguous float32 [", n, ", ", k / group, "], got ", t.sizes());
  };
  check_groups(scale, "scale");
  const float* mp = nullptr;
  if (minv.has_value() && minv->defined()) {
    check_groups(*minv, "min");
    mp = minv->data_ptr<float>();
  }
  return QW{static_cast<const uint8_t*>(qs.data_ptr()), scale.data_ptr<float>(), mp, n, k, group, zero, bits};
}

ZI_AVX512 inline float offset_dot512(const QW& w, int64_t row, const float* xsum) {   // offset_dot, 16 groups a step
  const int64_t ng = w.k / w.group;
  const float* sp = w.scale + row * ng;
  const float* mp = w.minv ? w.minv + row * ng : nullptr;
  const __m512 z = _mm512_set1_ps(static_cast<float>(w.zero));
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; g += 16) {
    const __mmask16 k = g + 16 <= ng ? __mmask16(0xFFFF) : __mmask16((1u << (ng - g)) - 1);
    const __m512 mv = mp ? _mm512_maskz_loadu_ps(k, mp + g) : _mm512_setzero_ps();
    const __m512 off = _mm512_fnmadd_ps(z, _mm512_maskz_loadu_ps(k, sp + g), mv);
    acc = _mm512_fmadd_ps(off, _mm512_maskz_loadu_ps(k, xsum + g), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// x [M, K] (row stride ldx) summed per group of `group`: [M, K / group], for the min / zero term
// (min - zero * scale) * sum(x) of each group; empty when the weight has neither.
inline std::vector<float> group_sums(const QW& w, const float* x, int64_t ldx, int64_t M) {
  std::vector<float> xsum;
  if (!w.minv && !w.zero) return xsum;
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
