// Decode linears on quantized weights with int8 activations (models/quant.py, `activations: int8`):
// out[M, N] = x[M, K] @ W^T for M <= DECODE_ROWS, W in the layout of quant_layout.h.
//
// Why: the exact decode kernels (quant_gemm.cpp) widen every weight to fp32 and spend about
// eight instructions per 32 weights; memory is not the limit at the sizes of the embedded models.
// As llama.cpp does (its Q8_0 / Q8_1 activations), x is quantized once per call to int8 in blocks
// of 32 (d = max|x| / 127, xq = round(x / d)), and the integer dot products run on VNNI
// (vpdpbusd: 64 unsigned x signed byte products into 16 int32 lanes per instruction), so one
// 64-byte load of 4-bit weights (128 weights) costs about a dozen instructions.
//
// What it computes (the bound tests/test_quant_q8.py checks): with xq_k the quantized x and dx_b
// its block scale, sum_k x_k w_k = sum_g s_g sum_{k in g} q_k x_k + sum_g (min_g - zero s_g) xsum_g
// where the first sum uses dx_b * xq_k for x_k and the second the exact fp32 group sums of x.
// So |result - x @ dequantize(W)^T| <= sum_b |s| (dx_b / 2) sum_{k in b} |q_k| + fp32 rounding:
// the error of rounding x to int8, on the integer part only.
//
// Layouts inside a call (built by quantize_x, quant_xq.h):
//   4-bit: a chunk of 64 weight bytes = 4 blocks of 32 weights; its low nibbles are weights 0..15
//   of the 4 blocks, its high nibbles weights 16..31. xq per row is stored in that order (128 bytes
//   per chunk: [A0-15 B0-15 C0-15 D0-15][A16-31 ... D16-31]), so lo/hi nibbles dot xq directly.
//   int32 lane i of the dot product then belongs to block i / 4.
//   8-bit: natural order, 64 weights per chunk, lane i = weights 4i..4i+3 (block i / 8). Signed
//   weights: |w| as the unsigned operand and x negated where w < 0 (vpdpbusd is unsigned x signed).
// This kernel needs AVX-512 F/BW/VL + VNNI (isa 2); elsewhere (isa 1: AVX2 + FMA, or forced by
// the `isa` argument) the op runs quant_q8_avx2.cpp's row-order kernel, the same formula and
// bound, whose results do not depend on the row count. `quant_q8_available`: either path; without AVX2 + FMA
// the Python side falls back to the exact kernels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "quant_xq.h"

namespace {

using namespace zi_quant;

// The weight scale of each of the `blocks` 32-weight blocks from block b0 on, into s[0..blocks).
inline void block_scales(const QW& w, int64_t row, int64_t b0, int blocks, float* s) {
  const float* sc = w.scale + row * (w.k / w.group);
  for (int j = 0; j < blocks; ++j) s[j] = sc[(b0 + j) * 32 / w.group];
}

// 4-bit rows n0..n1 against R rows of xq: acc lanes hold block i / 4 of each chunk.
template <int R>
ZI_VNNI void tile4(const QW& w, int64_t n, const XQ& xq, int64_t m0, const float* xsum, float* out, int64_t ldo) {
  const int64_t nb = w.k / 32, chunks = (nb + 3) / 4, ng = w.k / w.group;
  const uint8_t* r = w.qs + n * w.row_bytes();
  const float* sc = w.scale + n * ng;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const int blocks = static_cast<int>(std::min<int64_t>(4, nb - c * 4));
    const __mmask64 kb = blocks == 4 ? ~__mmask64(0) : (__mmask64(1) << (16 * blocks)) - 1;
    const __m512i v = _mm512_maskz_loadu_epi8(kb, r + c * 64);
    const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    const __mmask8 k4 = static_cast<__mmask8>((1u << blocks) - 1);
    __m128 sw;
    if (w.group == 32) {
      sw = _mm_maskz_loadu_ps(k4, sc + c * 4);
    } else {
      alignas(16) float s[4] = {0.f, 0.f, 0.f, 0.f};
      block_scales(w, n, c * 4, blocks, s);
      sw = _mm_load_ps(s);
    }
    for (int i = 0; i < R; ++i) {
      const int8_t* xr = xq.q.data() + (m0 + i) * xq.ldq + c * 128;
      __m512i dp = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xr));
      dp = _mm512_dpbusd_epi32(dp, hi, _mm512_loadu_si512(xr + 64));
      const __m128 s4 = _mm_mul_ps(sw, _mm_loadu_ps(xq.d.data() + (m0 + i) * xq.ldd + c * 4));
      const __m512 s = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(s4));
      acc[i][c & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), s, acc[i][c & 1]);
    }
  }
  for (int i = 0; i < R; ++i)
    out[(m0 + i) * ldo + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1])) +
                              (xsum ? offset_dot(Avx512{}, w, n, xsum + (m0 + i) * ng) : 0.f);
}

// 8-bit rows: lane i of a 64-weight chunk covers weights 4i..4i+3 (block i / 8, 16-group i / 4).
template <int R>
ZI_VNNI void tile8(const QW& w, int64_t n, const XQ& xq, int64_t m0, const float* xsum, float* out, int64_t ldo) {
  const int64_t chunks = (w.k + 63) / 64, ng = w.k / w.group;
  const uint8_t* r = w.qs + n * w.row_bytes();
  const float* sc = w.scale + n * ng;
  const __m512i by8 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i by4 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i zero = _mm512_setzero_si512();
  __m512 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t k0 = c * 64, len = std::min<int64_t>(64, w.k - k0);   // 64 or a 32-weight tail
    const __mmask64 kb = len == 64 ? ~__mmask64(0) : (__mmask64(1) << len) - 1;
    const __m512i v = _mm512_maskz_loadu_epi8(kb, r + k0);
    const __m512i aw = _mm512_abs_epi8(v);
    const __mmask64 neg = _mm512_movepi8_mask(v);
    __m512 sw;    // the weight scale of each lane
    if (w.group == 16) {
      sw = _mm512_permutexvar_ps(by4, _mm512_castps128_ps512(_mm_maskz_loadu_ps(len == 64 ? 0xF : 0x3, sc + k0 / 16)));
    } else if (w.group == 32) {
      sw = _mm512_permutexvar_ps(by8, _mm512_castps256_ps512(_mm256_maskz_loadu_ps(len == 64 ? 0x3 : 0x1, sc + k0 / 32)));
    } else if (k0 / w.group == (k0 + len - 1) / w.group) {
      sw = _mm512_set1_ps(sc[k0 / w.group]);
    } else {      // a chunk across two groups of a G that is not a multiple of 64 (e.g. 96)
      alignas(64) float s[16];
      for (int j = 0; j < 16; ++j) s[j] = k0 + 4 * j < w.k ? sc[(k0 + 4 * j) / w.group] : 0.f;
      sw = _mm512_load_ps(s);
    }
    for (int i = 0; i < R; ++i) {
      const __m512i xv = _mm512_loadu_si512(xq.q.data() + (m0 + i) * xq.ldq + k0);
      const __m512i dp = _mm512_dpbusd_epi32(zero, aw, _mm512_mask_sub_epi8(xv, neg, zero, xv));
      const __m512 dx = _mm512_permutexvar_ps(by8, _mm512_castps256_ps512(
          _mm256_maskz_loadu_ps(0x3, xq.d.data() + (m0 + i) * xq.ldd + c * 2)));
      acc[i][c & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), _mm512_mul_ps(sw, dx), acc[i][c & 1]);
    }
  }
  for (int i = 0; i < R; ++i)
    out[(m0 + i) * ldo + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1])) +
                              (xsum ? offset_dot(Avx512{}, w, n, xsum + (m0 + i) * ng) : 0.f);
}

template <int R>
ZI_VNNI void tile(const QW& w, int64_t n, const XQ& xq, int64_t m0, const float* xsum, float* out, int64_t ldo) {
  if (w.bits == 4) tile4<R>(w, n, xq, m0, xsum, out, ldo);
  else tile8<R>(w, n, xq, m0, xsum, out, ldo);
}

ZI_VNNI void rows_q8(const QW& w, const XQ& xq, int64_t M, const float* xsum, float* out, int64_t ldo, int64_t n0,
                     int64_t n1) {
  for_each_tile(w, M, n0, n1, [&](auto r, int64_t n, int64_t m0) { tile<decltype(r)::value>(w, n, xq, m0, xsum, out, ldo); });
}

at::Tensor quant_linear_q8(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                           const c10::optional<at::Tensor>& minv, int64_t bits, int64_t group, int64_t zero,
                           const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& qh,
                           const c10::optional<at::Tensor>& scale_d, const c10::optional<at::Tensor>& minv_d,
                           int64_t isa) {
  const int64_t path = q8_pick_isa(isa, "quant_linear_q8");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "quant_linear_q8: x must be a 2-D float32 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(x.size(0) <= DECODE_ROWS, "quant_linear_q8: at most ", DECODE_ROWS, " rows (decode), got ", x.size(0));
  const QW w = make_qw(qs, scale, minv, bits, group, zero, x.size(1), qh, scale_d, minv_d);
  const int64_t M = x.size(0), N = w.n;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M > 0 && N > 0) {
    const at::Tensor xc = x.contiguous();
    const float* xp = xc.data_ptr<float>();
    float* op = out.data_ptr<float>();
    if (path == 1) {
      q8_linear_avx2(w, xp, M, op, N, false);     // quant_q8_avx2.cpp, row order
    } else {
      const XQ xq = quantize_x(xp, w.k, M, w.k, bits == 4);
      const std::vector<float> xsum = group_sums(w, xp, w.k, M);
      const float* xs = xsum.empty() ? nullptr : xsum.data();
      at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        for_row_tiles(w, 2, n0, n1, [&](const QW& t, int64_t r0, int64_t r1) { rows_q8(t, xq, M, xs, op + r0, N, 0, r1 - r0); });
      });
    }
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "quant_linear_q8: bias must have ", N, " elements, got ", bias->numel());
    out.add_(bias->to(at::kFloat).view({1, N}));
  }
  return out;
}

// xq and its block scales as the kernel computes them (for the tests' exact emulation): int8 [M, K]
// in natural order and float32 [M, K / 32].
std::vector<at::Tensor> quantize_activations_q8(const at::Tensor& x, int64_t isa) {
  const int64_t path = q8_pick_isa(isa, "quantize_activations_q8");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % 32 == 0,
              "quantize_activations_q8: x must be float32 [M, K] with K a multiple of 32, got ", x.sizes());
  const at::Tensor xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const XQ xq = quantize_x(xc.data_ptr<float>(), K, M, K, false, path);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar)), d = at::empty({M, K / 32}, x.options());
  for (int64_t m = 0; m < M; ++m) {
    std::copy_n(xq.q.data() + m * xq.ldq, K, q.data_ptr<int8_t>() + m * K);
    std::copy_n(xq.d.data() + m * xq.ldd, K / 32, d.data_ptr<float>() + m * (K / 32));
  }
  return {q, d};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(zooinfer_cpu, m) {
  m.def("quant_linear_q8(Tensor x, Tensor qs, Tensor scale, Tensor? minv, int bits, int group, int zero, "
        "Tensor? bias, Tensor? qh=None, Tensor? scale_d=None, Tensor? minv_d=None, int isa=-1) -> Tensor");
  m.impl("quant_linear_q8", c10::DispatchKey::CPU, TORCH_FN(quant_linear_q8));
  m.def("quantize_activations_q8(Tensor x, int isa=-1) -> Tensor[]");
  m.impl("quantize_activations_q8", c10::DispatchKey::CPU, TORCH_FN(quantize_activations_q8));
  m.def("quant_q8_available() -> bool", TORCH_FN(q8_available));
  m.def("quant_q8_best_isa() -> int", TORCH_FN(q8_best_isa));
}
