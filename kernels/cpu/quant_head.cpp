// The candidate rows of a quantized greedy head (kernels/quant_head.py): given the int8-activation
// logits a [M, N] and per row m a margin 2B_m (B_m bounds |a - exact| for every column), the
// columns n with a[m, n] >= max_n a[m, n] - 2B_m for some m, ascending. Only these can hold a
// row's exact maximum, so the exact product is computed on them alone.
//
// Why a kernel: the same in torch (amax, compare, any, nonzero) is four passes over the logits
// with an allocation each, ~0.2 ms a step for Gemma-3's 262144-token vocabulary; here it is one
// vectorised max pass and one compare pass per row, the few hits marked in a byte map.
//
// The threshold is computed in double and rounded down to float, so no column the bound keeps
// is dropped by rounding. A row whose maximum or threshold is not finite (NaN or inf logits: no
// bound) makes every column a candidate, i.e. the caller computes the exact product in full.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

#define ZI_HEAD_AVX512 __attribute__((target("avx512f")))

ZI_HEAD_AVX512 float row_max(const float* a, int64_t n) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  bool nan = false;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(a + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
    m = _mm512_max_ps(m, v);
  }
  float best = _mm512_reduce_max_ps(m);
  for (; i < n; ++i) {
    nan |= std::isnan(a[i]);
    best = a[i] > best ? a[i] : best;
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : best;
}

// marks[n] = 1 where a[n] >= thr
ZI_HEAD_AVX512 void mark_at_least(const float* a, int64_t n, float thr, uint8_t* marks) {
  const __m512 t = _mm512_set1_ps(thr);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    uint32_t hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(a + i), t, _CMP_GE_OQ);
    while (hit) {
      marks[i + __builtin_ctz(hit)] = 1;
      hit &= hit - 1;
    }
  }
  for (; i < n; ++i)
    if (a[i] >= thr) marks[i] = 1;
}

at::Tensor quant_head_candidates(const at::Tensor& logits, const at::Tensor& margin) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.device().is_cpu(),
              "quant_head_candidates: logits must be a 2-D float32 CPU tensor, got ", logits.sizes(), " ",
              logits.scalar_type());
  TORCH_CHECK(margin.dim() == 1 && margin.size(0) == logits.size(0) && margin.scalar_type() == at::kDouble,
              "quant_head_candidates: margin must be float64 [", logits.size(0), "], got ", margin.sizes(), " ",
              margin.scalar_type());
  __builtin_cpu_init();
  TORCH_CHECK(__builtin_cpu_supports("avx512f"), "quant_head_candidates: this CPU lacks AVX-512");
  const at::Tensor a = logits.contiguous();
  const at::Tensor mg = margin.contiguous();
  const int64_t M = a.size(0), N = a.size(1);
  const float* ap = a.data_ptr<float>();
  const double* mp = mg.data_ptr<double>();
  std::vector<uint8_t> marks(N, 0);
  bool all = false;
  for (int64_t m = 0; m < M && !all; ++m) {
    const float top = row_max(ap + m * N, N);
    const double limit = static_cast<double>(top) - mp[m];
    if (!std::isfinite(top) || !std::isfinite(limit)) {
      all = true;
      break;
    }
    float thr = static_cast<float>(limit);
    if (static_cast<double>(thr) > limit) thr = std::nextafter(thr, -std::numeric_limits<float>::infinity());
    mark_at_least(ap + m * N, N, thr, marks.data());
  }
  if (all) return at::arange(N, logits.options().dtype(at::kLong));
  int64_t count = 0;
  for (int64_t n = 0; n < N; ++n) count += marks[n];
  at::Tensor cols = at::empty({count}, logits.options().dtype(at::kLong));
  int64_t* cp = cols.data_ptr<int64_t>();
  for (int64_t n = 0, j = 0; n < N; ++n)
    if (marks[n]) cp[j++] = n;
  return cols;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(zooinfer_cpu, m) {
  m.def("quant_head_candidates(Tensor logits, Tensor margin) -> Tensor");
  m.impl("quant_head_candidates", c10::DispatchKey::CPU, TORCH_FN(quant_head_candidates));
}
