// Linears on quantized weights with int8 activations for any number of rows (models/quant.py,
// `activations: int8`): prefill chunks and decode batches past the few rows where the decode
// kernel (quant_gemv_q8.cpp) is faster. out[M, N] = x[M, K] @ W^T, W in the layout of quant_layout.h.
//
// Why a second kernel: the decode kernel reads a weight row and dots it with up to 4 rows of x, so
// past a few rows it unpacks every weight once per 4 rows, and its integer lanes hold blocks of one
// output, reduced at the end. Here the lanes hold 16 output columns instead (the GEMM order):
// - x is quantized once per call (quant_xq.h, natural order; rows in parallel), with, per row, the
//   exact fp32 group sums (the min / zero term) and, for 8-bit weights, -128 x the sum of each
//   unit's xq (below);
// - threads split the columns (pairs of N tiles of 16); for each block of rows (as many as keep
//   their xq near 1 MB, so in L2: `row_block`), the weights of a tile are unpacked once into a
//   small buffer (16 K bytes: L1 / L2) in the VNNI order: for every 4 k, the 16 columns' 4 weights
//   side by side (one 64-byte vector), next to the tile's scales per unit and offsets per group;
// - a register tile of up to RT rows x two tiles (32 columns): per 4 k, two vector loads of
//   weights and, per row, that row's 4 xq broadcast once into two vpdpbusd (64 products each);
//   each unit of U k (32, or 16 where the group is not a multiple of 32, e.g. Q6_K) ends with cvt
//   + one FMA by scale x dx, each group with one FMA of its offset (min - zero * scale) by the
//   row's exact group sum. A last single tile (an odd count, or fewer than 16 columns) runs the
//   same register tile on one tile: the same ops per output, so the same bits.
// Why two tiles: 8 rows x one tile gave 8 integer chains of U / 4 dependent vpdpbusd, too few to
// cover its latency (5 cycles, 2 issued a cycle); 6 rows x two tiles (12 chains, a broadcast shared
// by two products) took one thread on an AMX Xeon from 250-290 to 300-380 GOP/s on SmolLM2's shapes
// at 32-2048 rows (a register-only loop issues ~815); 7 rows x two tiles spills.
// vpdpbusd multiplies unsigned by signed bytes: the broadcast (memory) operand is the signed one, so
// x stays signed and the weights are the unsigned operand: 4-bit q (0..15) as they are, 8-bit q
// (int8 formats, 5 / 6 bits expanded to q - zero) plus 128 (the sign bit flipped), the 128 x sum(xq)
// that adds removed by starting each unit's integer sum at -128 x sum(xq) (exact in int32).
//
// What it computes is the decode kernel's formula, so the same bound holds (tests/test_quant_q8.py):
// sum_k x_k w_k = sum_u s_u dx_u sum_{k in u} q_k xq_k + sum_g (min_g - zero s_g) xsum_g, the integer
// sums exact, each output one fp32 chain over units in k order; |result - x @ dequantize(W)^T| <=
// sum_b |s| (dx_b / 2) sum_{k in b} |q_k| + fp32 rounding. Not bit-identical to the decode kernel
// (other fp32 order). Needs AVX-512 F/BW/VL + VNNI, as the decode kernel (isa 2); on isa 1 (AVX2 +
// FMA: no VNNI, or forced by the `isa` argument) the op runs quant_q8_avx2.cpp's kernels instead
// (GEMM order for 4-bit weights; for 8-bit ones the decode op's row order). `isa` 3 runs the same
// product on AMX-INT8 tiles (quant_gemm_amx.cpp: the same bits; opt-in, slower so far).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "quant_q8_tiles.h"

namespace {

using namespace zi_quant;

constexpr int RT = 6;         // rows per register tile: 2 x 6 int32 + 2 x 6 fp32 accumulators (7 spills)

// out rows m..m + R x the 16 columns of `a` (`cols` of them stored) and, with TWO, the 16 after
// them of `b`: per 4 k, one weight vector per tile and one broadcast per row into one vpdpbusd per
// tile (see the header). Each output runs the same operations whether its tile is paired or not.
template <int R, bool EIGHT, int U, bool TWO>
ZI_VNNI void micro(Tile a, Tile b, int64_t K, int64_t G, const Prep& p, int64_t m, float* out, int64_t ldo,
                   __mmask16 cols) {
  constexpr int S = U / 4;     // 4-k steps per unit
  const int64_t nu = K / U, upg = G / U, ng = K / G, ldq = p.xq.ldq, ldd = p.xq.ldd;
  const int8_t* xq = p.xq.q.data() + m * ldq;
  const float* dx = p.xq.d.data() + m * ldd;
  const int32_t* corr = EIGHT ? p.corr.data() + m * nu : nullptr;
  const float* xsum = a.off ? p.xsum.data() + m * ng : nullptr;
  __m512 acc0[R], acc1[R];
  for (int i = 0; i < R; ++i) acc0[i] = _mm512_setzero_ps(), acc1[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    for (int64_t u = g * upg; u < (g + 1) * upg; ++u) {
      __m512i ia0[R], ia1[R];
      for (int i = 0; i < R; ++i) {
        ia0[i] = EIGHT ? _mm512_set1_epi32(corr[i * nu + u]) : _mm512_setzero_si512();
        if (TWO) ia1[i] = ia0[i];
      }
      const uint8_t* w0 = a.wt + u * S * 64;
      const uint8_t* w1 = TWO ? b.wt + u * S * 64 : nullptr;
      for (int s = 0; s < S; ++s) {
        const __m512i v0 = _mm512_load_si512(w0 + s * 64);
        const __m512i v1 = TWO ? _mm512_load_si512(w1 + s * 64) : v0;
        for (int i = 0; i < R; ++i) {
          int32_t x4;
          std::memcpy(&x4, xq + i * ldq + u * U + 4 * s, 4);
          const __m512i xb = _mm512_set1_epi32(x4);
          ia0[i] = _mm512_dpbusd_epi32(ia0[i], v0, xb);
          if (TWO) ia1[i] = _mm512_dpbusd_epi32(ia1[i], v1, xb);
        }
      }
      const __m512 s0 = _mm512_load_ps(a.su + u * NT), s1 = TWO ? _mm512_load_ps(b.su + u * NT) : s0;
      const int64_t blk = u * U / 32;
      for (int i = 0; i < R; ++i) {
        const __m512 d = _mm512_set1_ps(dx[i * ldd + blk]);
        acc0[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia0[i]), _mm512_mul_ps(s0, d), acc0[i]);
        if (TWO) acc1[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia1[i]), _mm512_mul_ps(s1, d), acc1[i]);
      }
    }
    if (a.off) {               // the group ends: its offsets times the rows' exact group sums
      const __m512 o0 = _mm512_load_ps(a.off + g * NT), o1 = TWO ? _mm512_load_ps(b.off + g * NT) : o0;
      for (int i = 0; i < R; ++i) {
        const __m512 xs = _mm512_set1_ps(xsum[i * ng + g]);
        acc0[i] = _mm512_fmadd_ps(o0, xs, acc0[i]);
        if (TWO) acc1[i] = _mm512_fmadd_ps(o1, xs, acc1[i]);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm512_mask_storeu_ps(out + (m + i) * ldo, cols, acc0[i]);
    if (TWO) _mm512_storeu_ps(out + (m + i) * ldo + NT, acc1[i]);
  }
}

template <bool EIGHT, int U, bool TWO>
ZI_VNNI void rows_block(Tile a, Tile b, int64_t K, int64_t G, const Prep& p, int64_t m0, int64_t m1, float* out,
                        int64_t ldo, __mmask16 cols) {
  for (int64_t m = m0; m < m1; m += RT) {
    switch (std::min<int64_t>(RT, m1 - m)) {
      case 1: micro<1, EIGHT, U, TWO>(a, b, K, G, p, m, out, ldo, cols); break;
      case 2: micro<2, EIGHT, U, TWO>(a, b, K, G, p, m, out, ldo, cols); break;
      case 3: micro<3, EIGHT, U, TWO>(a, b, K, G, p, m, out, ldo, cols); break;
      case 4: micro<4, EIGHT, U, TWO>(a, b, K, G, p, m, out, ldo, cols); break;
      case 5: micro<5, EIGHT, U, TWO>(a, b, K, G, p, m, out, ldo, cols); break;
      default: micro<6, EIGHT, U, TWO>(a, b, K, G, p, m, out, ldo, cols); break;
    }
  }
}

// Tiles a (and b, with TWO) over rows [m0, m1): the template for the weights' bits and unit.
template <bool TWO>
ZI_VNNI void run_tiles(int64_t bits, int64_t U, Tile a, Tile b, int64_t K, int64_t G, const Prep& p, int64_t m0,
                       int64_t m1, float* out, int64_t ldo, __mmask16 cols) {
  if (bits == 4) rows_block<false, 32, TWO>(a, b, K, G, p, m0, m1, out, ldo, cols);
  else if (U == 32) rows_block<true, 32, TWO>(a, b, K, G, p, m0, m1, out, ldo, cols);
  else rows_block<true, 16, TWO>(a, b, K, G, p, m0, m1, out, ldo, cols);
}

at::Tensor quant_linear_q8_gemm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                                const c10::optional<at::Tensor>& minv, int64_t bits, int64_t group, int64_t zero,
                                const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& qh,
                                const c10::optional<at::Tensor>& scale_d, const c10::optional<at::Tensor>& minv_d,
                                int64_t isa) {
  TORCH_CHECK(isa >= -1 && isa <= 3 && isa != 0, "quant_linear_q8_gemm: isa must be -1 (best), 1 (AVX2), "
              "2 (AVX-512 VNNI) or 3 (AMX-INT8), got ", isa);
  TORCH_CHECK(isa != 3 || q8_amx_ready(), "quant_linear_q8_gemm: isa 3 needs AMX-INT8 tiles, which this CPU or OS lacks");
  const int64_t path = isa == 3 ? 3 : q8_pick_isa(isa, "quant_linear_q8_gemm");   // AMX opt-in: quant_gemm_amx.cpp
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "quant_linear_q8_gemm: x must be a 2-D float32 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  const QW w = make_qw(qs, scale, minv, bits, group, zero, x.size(1), qh, scale_d, minv_d);
  const int64_t M = x.size(0), N = w.n, K = w.k, G = w.group;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M > 0 && N > 0 && path == 1) {
    const at::Tensor xc = x.contiguous();
    q8_linear_avx2(w, xc.data_ptr<float>(), M, out.data_ptr<float>(), N, true);   // quant_q8_avx2.cpp
  } else if (M > 0 && N > 0) {
    const at::Tensor xc = x.contiguous();
    const float* xp = xc.data_ptr<float>();
    const int64_t U = G % 32 == 0 ? 32 : 16;          // G is a multiple of 16 (make_qw)
    const bool amx = path == 3, eight = bits != 4 && !amx, sums = w.has_min() || w.tile_zero();
    const int64_t Mp = amx ? (M + 15) / 16 * 16 : M;  // AMX loads x 16 rows a tile: zero rows past M
    Prep p;
    p.ng = K / G;
    p.nu = K / U;
    p.xq = xq_alloc(Mp, K, false);
    if (sums) p.xsum.assign(Mp * p.ng, 0.f);
    if (eight) p.corr.assign(Mp * p.nu, 0);
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) { prep_rows(xp, K, G, U, sums, eight, m0, m1, p); });
    float* op = out.data_ptr<float>();
    if (amx) {
      q8_gemm_amx(w, p, M, U, op);                    // quant_gemm_amx.cpp
    } else {
      for_packed_tiles(w, p, M, U, row_block(K, RT), true,
                       [&](Tile a, Tile b, bool two, int64_t m0, int64_t m1, int64_t col, __mmask16 cols) {
                         if (two) run_tiles<true>(w.bits == 4 ? 4 : 8, U, a, b, K, G, p, m0, m1, op + col, N, cols);
                         else run_tiles<false>(w.bits == 4 ? 4 : 8, U, a, a, K, G, p, m0, m1, op + col, N, cols);
                       });
    }
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "quant_linear_q8_gemm: bias must have ", N, " elements, got ", bias->numel());
    out.add_(bias->to(at::kFloat).view({1, N}));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(zooinfer_cpu, m) {
  m.def("quant_linear_q8_gemm(Tensor x, Tensor qs, Tensor scale, Tensor? minv, int bits, int group, int zero, "
        "Tensor? bias, Tensor? qh=None, Tensor? scale_d=None, Tensor? minv_d=None, int isa=-1) -> Tensor");
  m.impl("quant_linear_q8_gemm", c10::DispatchKey::CPU, TORCH_FN(quant_linear_q8_gemm));
}
