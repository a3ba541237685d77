// Prefill-sized linears on quantized weights on AMX-BF16 tiles (`quantization.activations:
// int8_bf16`, models/quant.py): out = x^ W^T + bias, with x^ = x rounded to bf16 and W^ = the
// dequantized weight (`quant_dequantize`'s floats) rounded to bf16, the products exact and summed
// in fp32 by TDPBF16PS over k in increasing order (amx_bf16.h's register tile).
//
// Why: at prefill the int8-activation GEMM (quant_gemm_q8.cpp) is compute-bound at ~300-380 GOP/s
// a thread (each 32-block of k carries its own scales, so its integer sums are scaled every 32 k;
// AMX-INT8 tiles could not hide that, quant_gemm_amx.cpp). bf16 needs no per-block scaling: the
// weight is dequantized once per call into B tiles and a C tile sums all of k in the tiles, ~1-2
// TFLOP/s on 2 threads for Gemma-3's shapes (Emerald Rapids). This is OpenVINO's CPU scheme too
// (bf16 inference on AMX for prefill, int8 dynamic activations for decode).
//
// Order: threads split the columns (pairs of 16-column B tiles); each dequantizes a chunk of its
// pairs over all of k (`CHUNK_BYTES` of bf16 tiles, kept in L2) through `dequant_panel`'s fp32
// panels, then runs every 32-row block of x^ against every pair of the chunk. Each weight is so
// dequantized once per call, by one thread.
//
// Exactness: each output equals `head_logits_bf16_amx(x^, pack_pair_tiles(W^))` (head_amx.cpp's
// tile, the same sums in the same order) + bias in one fp32 add: tests/test_quant_bf16.py checks it
// bit for bit, and the bound |out - x W^T| <= (2^-8 (2 + 2^-8) + K 2^-21) sum_k |x_k W_k| + flushed
// denormals (x^ and W^ each within 2^-8 relative of x and W, the tiles' fp32 sums).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "quant_storage.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include "amx_bf16.h"
#include "amx_perm.h"
#include "quant_panels.h"
#define ZOOINFER_AMX_QUANT_BF16 1
#endif

namespace zi_quant {
namespace {

#ifdef ZOOINFER_AMX_QUANT_BF16
using zooinfer_amx::TILE;
constexpr int64_t KC = 256;                    // k steps per fp32 panel (dequant_panel's block)
constexpr int64_t CHUNK_BYTES = 256 << 10;     // a thread's dequantized B tiles at a time (L2)

// The fp32 panel p [kc, 32] (k-major) as the B tiles of its two 16-column halves, k steps s of
// 32: row r holds for each column j the bf16 pair (k = 32 s + 2 r, k + 1), rounded to nearest even.
inline void to_pair_tiles(const float* p, int64_t kc, uint16_t* b0, uint16_t* b1) {
  for (int64_t s = 0; s < kc / 32; ++s)
    for (int64_t r = 0; r < 16; ++r) {
      const float* e = p + (32 * s + 2 * r) * 32;
      for (int h = 0; h < 2; ++h) {
        const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(e + 16 * h)));
        const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(e + 32 + 16 * h)));
        _mm512_storeu_si512((h ? b1 : b0) + s * TILE + r * 32, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
}

// Columns [32 p0, 32 p1) of out (clipped to N) for all M rows of xb [Mp, K].
void run_cols(const QW& w, const uint16_t* xb, int64_t M, int64_t Mp, const float* bias, float* out, int64_t p0,
              int64_t p1) {
  const int64_t N = w.n, K = w.k, KS = K / 32, pair_elems = 2 * KS * TILE;
  const int64_t chunk = std::max<int64_t>(1, CHUNK_BYTES / (2 * pair_elems));
  const Cols c = expand_cols(w, p0 * 32, std::min(N, p1 * 32));
  const std::vector<uint8_t> zeros(static_cast<size_t>(std::max<int64_t>(w.row_bytes(), 64)), 0);
  std::vector<float> pbuf(static_cast<size_t>(KC * 32) + 16);
  std::vector<uint16_t> bbuf(static_cast<size_t>(std::min(chunk, p1 - p0) * pair_elems) + 32);
  float* pf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(pbuf.data()) + 63) & ~uintptr_t(63));
  uint16_t* bt = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(bbuf.data()) + 63) & ~uintptr_t(63));
  alignas(64) float cbuf[4][256];
  zooinfer_amx::load_full_tiles();
  for (int64_t q0 = p0; q0 < p1; q0 += chunk) {
    const int64_t q1 = std::min(p1, q0 + chunk);
    for (int64_t p = q0; p < q1; ++p)
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = std::min(KC, K - k0);
        dequant_panel(c, p - p0, k0, kc, zeros.data(), pf);
        uint16_t* b0 = bt + (p - q0) * pair_elems + (k0 / 32) * TILE;
        to_pair_tiles(pf, kc, b0, b0 + KS * TILE);
      }
    for (int64_t m = 0; m < Mp; m += 32) {
      const uint16_t* a0 = xb + m * K;
      const bool two = m + 16 < Mp;
      const int64_t r0 = std::clamp<int64_t>(M - m, 0, 16), r1 = std::clamp<int64_t>(M - m - 16, 0, 16);
      for (int64_t p = q0; p < q1; ++p) {
        const uint16_t* b0 = bt + (p - q0) * pair_elems;
        if (two) zooinfer_amx::pair_tiles<true>(a0, a0 + 16 * K, 2 * K, b0, b0 + KS * TILE, KS, cbuf);
        else zooinfer_amx::pair_tiles<false>(a0, nullptr, 2 * K, b0, b0 + KS * TILE, KS, cbuf);
        const int64_t n0 = 32 * p;
        const int64_t c0 = std::clamp<int64_t>(N - n0, 0, 16), c1 = std::clamp<int64_t>(N - n0 - 16, 0, 16);
        if (c0) zooinfer_amx::store_tile(cbuf[0], m, r0, n0, c0, out, N, bias);
        if (c1) zooinfer_amx::store_tile(cbuf[1], m, r0, n0 + 16, c1, out, N, bias);
        if (two && c0) zooinfer_amx::store_tile(cbuf[2], m + 16, r1, n0, c0, out, N, bias);
        if (two && c1) zooinfer_amx::store_tile(cbuf[3], m + 16, r1, n0 + 16, c1, out, N, bias);
      }
    }
  }
  _tile_release();
}
#endif

bool bf16_gemm_ready() {
#ifdef ZOOINFER_AMX_QUANT_BF16
  return zooinfer_amx::bf16_ready();
#else
  return false;
#endif
}

at::Tensor quant_linear_bf16_amx(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                                 const c10::optional<at::Tensor>& minv, int64_t bits, int64_t group, int64_t zero,
                                 const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& qh,
                                 const c10::optional<at::Tensor>& scale_d, const c10::optional<at::Tensor>& minv_d) {
  TORCH_CHECK(bf16_gemm_ready(), "quant_linear_bf16_amx: this CPU or build has no usable AMX-BF16 and AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "quant_linear_bf16_amx: x must be a 2-D float32 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  const QW w = make_qw(qs, scale, minv, bits, group, zero, x.size(1), qh, scale_d, minv_d);
  const int64_t M = x.size(0), N = w.n, K = w.k;
  at::Tensor out = at::empty({M, N}, x.options());
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "quant_linear_bf16_amx: bias must have ", N, " elements, got ", bias->numel());
    bf = bias->to(at::kFloat).contiguous();
  }
  if (M == 0 || N == 0) return out;
#ifdef ZOOINFER_AMX_QUANT_BF16
  const int64_t Mp = (M + 15) / 16 * 16;
  at::Tensor xb = at::empty({Mp, K}, x.options().dtype(at::kBFloat16));
  xb.narrow(0, 0, M).copy_(x);
  if (Mp > M) xb.narrow(0, M, Mp - M).zero_();
  const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (N + 31) / 32, 1, [&](int64_t p0, int64_t p1) { run_cols(w, xp, M, Mp, bp, op, p0, p1); });
#endif
  return out;
}

}  // namespace
}  // namespace zi_quant

TORCH_LIBRARY_FRAGMENT(zooinfer_cpu, m) {
  m.def("quant_linear_bf16_amx(Tensor x, Tensor qs, Tensor scale, Tensor? minv, int bits, int group, int zero, "
        "Tensor? bias, Tensor? qh, Tensor? scale_d, Tensor? min_d) -> Tensor");
  m.impl("quant_linear_bf16_amx", c10::DispatchKey::CPU, TORCH_FN(zi_quant::quant_linear_bf16_amx));
  m.def("quant_bf16_amx_available() -> bool", TORCH_FN(zi_quant::bf16_gemm_ready));
}
