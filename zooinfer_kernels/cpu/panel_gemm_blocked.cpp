// Large-M fp32 GEMM on the same pre-packed weight panels as panel_gemm.cpp: out[M, N] = x[M, K] @ W^T
// (+ bias), for prefill chunks (hundreds to thousands of rows), where the product is compute-bound.
//
// Why a second kernel: panel_linear (panel_gemm.cpp) is built to stream W from DRAM for few rows: it
// keeps partial sums in a memory scratch tile that every 64-step k block reloads and stores, and
// broadcasts x from MR separate rows. For a prefill chunk that costs 15-30% against MKL sgemm, and
// the models sent such products to F.linear, which on AMD CPUs is MKL's AVX2 code (MKL does not run
// its AVX-512 kernels there). This kernel is laid out for compute instead (GotoBLAS / BLIS order):
// - x is packed per thread, one k block at a time (panels_blocked.h `k_step`: K split evenly into
//   blocks of at most 768), into row tiles of MR rows: tile t
//   holds, for every k, the MR values x[MR t .. MR t + MR, k] side by side, so the micro-kernel
//   broadcasts from one contiguous stream (zero rows past M);
// - the micro-kernel keeps an MR x 32 block of out in 2 * MR vector registers over the whole k
//   block (no scratch round trip), two panel loads and MR broadcast-FMA pairs per k;
// - for each k block, with AVX-512: for each group of PG full panels: for each row tile of the
//   thread's chunk: the tile over the group's panels (its packed x read from L1 / L2 once a group,
//   the panels from L2); with AVX2: for each panel: each 16-column half over all row tiles (the half
//   panel streaming from L2). The packed x chunk (RB tiles) stays in L2. On an AVX-512 Xeon (one
//   thread, 2048 rows, a standalone copy of the loop) the grouped order with 768-step blocks took
//   qkv / gate_up / down from 107 / 92 / 115 to 133 / 126 / 130 GFLOP/s (256-step blocks, panel
//   outer, as before);
// - threads split the rows (contiguous ranges of row tiles, at::parallel_for), so each packs only its
//   own x and no thread waits for another; every thread reads all of W (from the last-level cache).
// The first k block writes out (its sum from zero), later ones add to it, the last adds the bias;
// the last panel's columns past N go through a small stack tile. Each output is one fp32 FMA chain
// over k in increasing order, then + bias: the same operations as panel_linear, so the two kernels
// agree bit for bit (a row's result does not depend on how many rows its product has, nor on the
// 64-row switch between them); against F.linear they agree to fp32 rounding.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "act.h"
#include "panels_blocked.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

namespace {

using namespace zooinfer_panels;
using namespace zooinfer_panels::blocked;

// out = x @ W^T (+ bias), or with act >= 0 (0 silu, 1 gelu_tanh: act.h) for W = [gate; up] of
// n = 2I rows, out [M, I] = act(gate) * up, the values act_mul would give on the unfused product.
// Fused, each thread's chunk of rows (RB row tiles, 112 x 2I floats with AVX-512: 1.4 MB at I = 1536)
// runs into a per-thread scratch that stays in L2, and the epilogue writes only the [M, I] result: the
// [M, 2I] product never goes to memory and back (act_mul on SmolLM2's 2048-row chunks streamed 37 MB
// a layer, 5% of a prefill).
at::Tensor blocked_product(const char* op_name, const at::Tensor& x, const at::Tensor& panels, int64_t n,
                           const c10::optional<at::Tensor>& bias, int64_t act) {
  check_inputs(op_name, x, panels, n);
  TORCH_CHECK(act < 0 || n % 2 == 0, op_name, ": gate_up needs an even n, got ", n);
  const int64_t M = x.size(0), K = x.size(1), np_ = panels.size(0), I = n / 2;
  at::Tensor bc;
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kFloat && bc.numel() == n, op_name, ": bias must be float32 [", n, "], got ",
                bc.sizes());
    b = bc.data_ptr<float>();
  }
  if (act >= 0 && (M == 0 || K == 0)) {   // act(bias or 0) * (bias or 0), through act_mul's own row code
    at::Tensor gu = at::zeros({M, n}, x.options());
    if (b) gu.copy_(bc.expand({M, n}));
    at::Tensor out = at::empty({M, I}, x.options());
    for (int64_t m = 0; m < M; ++m)
      zooinfer_act::act_row(gu.data_ptr<float>() + m * n, gu.data_ptr<float>() + m * n + I, out.data_ptr<float>() + m * I,
                            I, static_cast<int>(act));
    return out;
  }
  at::Tensor out = at::empty({M, act >= 0 ? I : n}, x.options());
  if (M == 0 || n == 0) return out;
  if (K == 0) return b ? out.copy_(bc.expand({M, n})) : out.zero_();
  at::Tensor xc = x.stride(1) == 1 && x.stride(0) >= K ? x : x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const int64_t ldx = M > 1 ? xc.stride(0) : K;
  const float* pp = panels.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // The bias padded to whole panels, so adding it is two plain loads per row.
  std::vector<float> bias_pad(b ? static_cast<size_t>(np_ * NR) : 0, 0.f);
  if (b) std::memcpy(bias_pad.data(), b, sizeof(float) * n);
  const float* add = b ? bias_pad.data() : nullptr;
  const int64_t tiles = (M + MR - 1) / MR, ks = k_step(K);
  const int64_t grouped = PG > 1 ? n / NR : 0;   // full panels, run in groups of PG (AVX-512)

  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> apack(static_cast<size_t>(RB * KC * MR) + 16);
    float* ap = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(apack.data()) + 63) & ~uintptr_t(63));
    std::unique_ptr<float[]> scratch(act >= 0 ? new float[RB * MR * n] : nullptr);   // uninitialised: written first
    alignas(64) float tail[MR * NR];
    for (int64_t c0 = t0; c0 < t1; c0 += RB) {
      const int64_t ct = std::min(RB, t1 - c0);
      // unfused: the chunk's rows of out; fused: the scratch, its row 0 = the chunk's first row
      float* dst = act >= 0 ? scratch.get() : op;
      const int64_t m0 = act >= 0 ? 0 : c0 * MR, rows = act >= 0 ? M - c0 * MR : M;
      for (int64_t k0 = 0; k0 < K; k0 += ks) {
        const int64_t kc = std::min(ks, K - k0);
        const bool last = k0 + kc == K && b;   // the bias joins after the whole sum, as in panel_linear
        pack_rows(xp, ldx, M, c0 * MR, ct, k0, kc, ap);
        for (int64_t p = 0; p < grouped; p += PG)
          group_block(ap, ct, m0, rows, kc, pp + k0 * NR, K, p, std::min(grouped, p + PG), dst, n, k0 == 0,
                      last ? add : nullptr);
        for (int64_t p = grouped; p < np_; ++p)
          panel_block(ap, ct, m0, rows, kc, pp + (p * K + k0) * NR, dst, n, p * NR, k0 == 0, last ? add : nullptr,
                      tail);
      }
      if (act >= 0) {
        const int64_t live = std::min(ct * MR, M - c0 * MR);
        for (int64_t r = 0; r < live; ++r)
          zooinfer_act::act_row(dst + r * n, dst + r * n + I, op + (c0 * MR + r) * I, I, static_cast<int>(act));
      }
    }
  });
  return out;
}

at::Tensor panel_linear_blocked(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                                const c10::optional<at::Tensor>& bias) {
  return blocked_product("panel_linear_blocked", x, panels, n, bias, -1);
}

at::Tensor panel_linear_blocked_act(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                                    const c10::optional<at::Tensor>& bias, int64_t act) {
  TORCH_CHECK(act == 0 || act == 1, "panel_linear_blocked_act: act must be 0 (silu) or 1 (gelu_tanh), got ", act);
  return blocked_product("panel_linear_blocked_act", x, panels, n, bias, act);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(zooinfer_cpu, m) {
  m.def("panel_linear_blocked(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
  m.impl("panel_linear_blocked", c10::DispatchKey::CPU, TORCH_FN(panel_linear_blocked));
  m.def("panel_linear_blocked_act(Tensor x, Tensor panels, int n, Tensor? bias, int act) -> Tensor");
  m.impl("panel_linear_blocked_act", c10::DispatchKey::CPU, TORCH_FN(panel_linear_blocked_act));
}
