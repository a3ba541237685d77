// Screen logits of a quantized LM head on AMX bf16 tiles, for batched greedy steps
// (zooinfer_kernels/head_amx.py `amx_argmax`): out[m, n] = sum_k x^[m, k] W^[n, k], x and the head
// rounded to bf16, the products exact and summed in fp32 by TDPBF16PS.
//
// Why: past 16 rows a greedy step's head is the int8-activation GEMM (quant_gemm_q8.cpp), which on
// a Q8_0 head is compute-bound on its per-32-block scales (Gemma-3's 262144 x 640 head: 23.8 ms of
// a 32-request decode step at 2 threads). A bf16 copy needs no scales at all, and AMX multiplies it
// at the weight stream's speed. Rounding the weights to one int8 scale per row instead (half the
// bytes) was tried first: its rigorous error bound came out at 7-50 logits on Gemma-3's real hidden
// states (the rows' int8 rounding is ~5% of their norm), so every column stayed a candidate;
// bf16's ~0.1% leaves a bound of a fraction of a logit.
//
// Layouts: x^ [Mp, Kp] bf16 row-major, Mp a multiple of 16, Kp of 32 (zero padding), the A operand
// (16 rows x 32 k); the head as B tiles [NT, KS, 16, 32] (`pack_bf16_pairs_tiles`: vocab tile t,
// k step s, row r holds, for the 16 vocab rows j, W^[16t + j, 32s + 2r], W^[16t + j, 32s + 2r + 1]:
// the VNNI pair order), NT even.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__linux__)
#include <immintrin.h>
#include "amx_bf16.h"
#include "amx_perm.h"
#define ZOOINFER_AMX_HEAD 1
#endif

namespace {

constexpr int64_t PF_PAIRS = 2;   // prefetch the vocab tile pair this far ahead (the head streams from DRAM)

bool bf16_ready() {
#ifdef ZOOINFER_AMX_HEAD
  return zooinfer_amx::bf16_ready();
#else
  return false;
#endif
}

#ifdef ZOOINFER_AMX_HEAD
using zooinfer_amx::pair_tiles;
using zooinfer_amx::store_tile;
using zooinfer_amx::TILE;

void run_pairs(const uint16_t* xb, const uint16_t* wt, int64_t M, int64_t Mp, int64_t Kp, int64_t N, int64_t pb,
               int64_t pe, float* out) {
  const int64_t KS = Kp / 32;
  zooinfer_amx::load_full_tiles();
  alignas(64) float cbuf[4][256];
  for (int64_t p = pb; p < pe; ++p) {
    const uint16_t* b0 = wt + 2 * p * KS * TILE;
    const uint16_t* b1 = b0 + KS * TILE;
    if (p + PF_PAIRS < pe) {
      const char* q = reinterpret_cast<const char*>(b0 + 2 * PF_PAIRS * KS * TILE);
      for (int64_t i = 0; i < 2 * KS * TILE * 2; i += 64) _mm_prefetch(q + i, _MM_HINT_T0);
    }
    const int64_t n0 = 2 * p * 16;
    const int64_t c0 = std::clamp<int64_t>(N - n0, 0, 16), c1 = std::clamp<int64_t>(N - n0 - 16, 0, 16);
    for (int64_t m = 0; m < Mp; m += 32) {
      const uint16_t* a0 = xb + m * Kp;
      const bool two = m + 16 < Mp;
      if (two) pair_tiles<true>(a0, a0 + 16 * Kp, 2 * Kp, b0, b1, KS, cbuf);
      else pair_tiles<false>(a0, nullptr, 2 * Kp, b0, b1, KS, cbuf);
      const int64_t r0 = std::clamp<int64_t>(M - m, 0, 16), r1 = std::clamp<int64_t>(M - m - 16, 0, 16);
      if (c0) store_tile(cbuf[0], m, r0, n0, c0, out, N);
      if (c1) store_tile(cbuf[1], m, r0, n0 + 16, c1, out, N);
      if (two && c0) store_tile(cbuf[2], m + 16, r1, n0, c0, out, N);
      if (two && c1) store_tile(cbuf[3], m + 16, r1, n0 + 16, c1, out, N);
    }
  }
  _tile_release();
}
#endif

// out [M, N] float32: the screen logits of the first M rows of xb (see the header).
void head_logits_bf16_amx(const at::Tensor& xb, const at::Tensor& wt, int64_t n, const at::Tensor& out) {
  TORCH_CHECK(bf16_ready(), "head_logits_bf16_amx: this CPU or build has no usable AMX-BF16");
  TORCH_CHECK(xb.dim() == 2 && xb.scalar_type() == at::kBFloat16 && xb.is_contiguous() && xb.size(0) % 16 == 0 &&
                  xb.size(1) % 32 == 0 && xb.size(1) > 0,
              "head_logits_bf16_amx: x must be contiguous bf16 [Mp, Kp], Mp a multiple of 16, Kp of 32, got ",
              xb.sizes());
  const int64_t Mp = xb.size(0), Kp = xb.size(1), KS = Kp / 32;
  TORCH_CHECK(wt.dim() == 4 && wt.scalar_type() == at::kBFloat16 && wt.is_contiguous() && wt.size(0) % 2 == 0 &&
                  wt.size(1) == KS && wt.size(2) == 16 && wt.size(3) == 32 && n > 0 && n <= wt.size(0) * 16,
              "head_logits_bf16_amx: wt must be contiguous bf16 [NT (even), ", KS, ", 16, 32] covering ", n,
              " rows, got ", wt.sizes());
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(1) == n &&
                  out.size(0) <= Mp,
              "head_logits_bf16_amx: out must be contiguous float32 [M <= ", Mp, ", ", n, "]");
#ifdef ZOOINFER_AMX_HEAD
  const int64_t M = out.size(0), pairs = (n + 31) / 32;
  const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(wt.data_ptr());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, pairs, 64, [&](int64_t pb, int64_t pe) { run_pairs(xp, wp, M, Mp, Kp, n, pb, pe, op); });
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(zooinfer_cpu, m) {
  m.def("head_logits_bf16_amx(Tensor xb, Tensor wt, int n, Tensor(a!) out) -> ()");
  m.impl("head_logits_bf16_amx", c10::DispatchKey::CPU, TORCH_FN(head_logits_bf16_amx));
}
