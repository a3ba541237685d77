// Small-M fp32 GEMM on pre-packed weight panels: out[M, N] = x[M, K] @ W^T (+ bias), for the
// decode-step linears of models/prepack.py (`PackedLinear`).
//
// Why a kernel: a decode step multiplies few rows (1-64, one per request) by every weight of
// the model; the weights do not fit the cache, so the step is a stream of all weight bytes from
// DRAM. MKL sgemm (plain or with a cblas-packed B) streamed them at 7-8 GB/s of the ~22 GB/s
// this machine reads with 2 threads. Here each weight byte is read from DRAM exactly once, in
// address order, with the next bytes prefetched while the FMA units work on the current ones.
//
// Layout: W [N, K] is packed once (in Python) into column panels P [ceil(N/32), K, 32]: panel p
// holds W[32p : 32p+32, :] transposed, zero-padded past N, so the 32 outputs of one k step are
// two contiguous 16-float vectors. For each panel: for each block of KB=64 k steps (8 KB of
// panel), for each register tile of up to MR rows of x (the tiles of balanced sizes) and 2
// vectors of columns (panels.h: the whole panel on AVX-512, MR = 12, 24 zmm accumulators; each
// half of it on AVX2, MR = 6, 12 ymm):
// per k two panel loads, MR broadcasts of x[m, k], 2*MR FMAs. The k blocking makes
// every row tile reuse the block from L1; while the T row tiles work on one block, each
// prefetches its 1/T share of the next block (the stream continues across panel ends: a
// thread's panels are contiguous), so DRAM reads are spread evenly over the compute instead of
// bunching in the first tile. Partial sums live in a per-thread [M, 32] scratch tile, so the
// N tail (last panel) and bias need no special case in the inner loop. Threads split the
// panels (at::parallel_for, contiguous ranges: each thread streams its own part of W).
//
// Measured (2 threads, 120 weights of SmolLM2-135M body shapes, 430 MB, streamed from DRAM;
// medians of 11 alternating rounds; the bench machine is shared, so ratios matter more):
//   rows      1        8        32       64
//   panel   24.7 ms  25.4 ms  35.0 ms  75.3 ms
//   MKL pk  26.4 ms  35.1 ms  47.3 ms  77.5 ms   (cblas packed B, the previous PackedLinear)
//   F.linear 24.7 ms 49.6 ms  59.7 ms  95.3 ms
// From ~96 rows on the product is compute-bound and MKL's kernels win (in cache they also win
// by 10-25% at 64 rows); models/prepack.py sends such products to F.linear.
//
// Vectors are GCC/Clang vector extensions of the build's native width (panels.h `vreg`: 16 floats
// with -march=native on AVX-512, 8 otherwise; the plain -O3 fallback build lowers 8 to SSE pairs).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "panels.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

using namespace zooinfer_panels;

constexpr int MR = VW == 16 ? 12 : 6;   // rows of x per register tile: 2 * MR accumulators
constexpr int64_t KB = 64;     // k steps per block: 8 KB of panel, reused from L1 by every row tile

// acc[R rows, TC] += x[R rows, k0:k1] @ panel[k0:k1, TC columns]; panel and acc rows are NR floats
// apart (both already offset to the tile's first column).
template <int R, bool PREFETCH>
inline void tile(const float* __restrict x, int64_t ldx, const float* __restrict panel, int64_t k0,
                 int64_t k1, float* __restrict acc, const float* pf, int64_t pf_step) {
  vreg c0[R], c1[R];
  for (int i = 0; i < R; ++i) {
    c0[i] = vload(acc + i * NR);
    c1[i] = vload(acc + i * NR + VW);
  }
  for (int64_t k = k0; k < k1; ++k) {
    const float* pk = panel + k * NR;
    if (PREFETCH) {
      const float* q = pf + (k - k0) * pf_step;
      __builtin_prefetch(q, 0, 3);
      __builtin_prefetch(q + 16, 0, 3);
    }
    const vreg b0 = vload(pk), b1 = vload(pk + VW);
    for (int i = 0; i < R; ++i) {
      const vreg a = vsplat(x[i * ldx + k]);
      c0[i] += a * b0;
      c1[i] += a * b1;
    }
  }
  for (int i = 0; i < R; ++i) {
    vstore(acc + i * NR, c0[i]);
    vstore(acc + i * NR + VW, c1[i]);
  }
}

template <bool PREFETCH>
inline void tile_rows(int rows, const float* x, int64_t ldx, const float* panel, int64_t k0, int64_t k1,
                      float* acc, const float* pf, int64_t pf_step) {
  switch (rows) {
#define ZI_CASE(r) \
  case r: if constexpr (r <= MR) tile<r, PREFETCH>(x, ldx, panel, k0, k1, acc, pf, pf_step); break;
    ZI_CASE(1) ZI_CASE(2) ZI_CASE(3) ZI_CASE(4) ZI_CASE(5) ZI_CASE(6)
    ZI_CASE(7) ZI_CASE(8) ZI_CASE(9) ZI_CASE(10) ZI_CASE(11) ZI_CASE(12)
#undef ZI_CASE
    default: break;
  }
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                        const c10::optional<at::Tensor>& bias) {
  check_inputs("panel_linear", x, panels, n);
  const int64_t M = x.size(0), K = x.size(1), np_ = panels.size(0);
  const float* b = nullptr;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kFloat && bc.numel() == n, "panel_linear: bias must be float32 [", n,
                "], got ", bc.sizes());
    b = bc.data_ptr<float>();
  }
  at::Tensor out = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return out;
  at::Tensor xc = x.stride(1) == 1 && x.stride(0) >= K ? x : x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const int64_t ldx = M > 1 ? xc.stride(0) : K;
  const float* pp = panels.data_ptr<float>();
  float* op = out.data_ptr<float>();

  // Row tiles of balanced sizes when every tile then keeps at least 5 rows (15 rows on AVX2: 5 5 5,
  // not 6 6 3; 32: 6 6 5 5 5 5, not 6 6 6 6 6 2), else MR-row tiles and the rest (8 rows: 6 2).
  // A tile of R rows runs 2R independent FMA chains, and two FMA units of latency 4 need 8 of
  // them; on Zen 3 (one thread, bench/prefill_gemm's SmolLM2 shapes) 5 5 5 ran 1.03-1.6x faster
  // than 6 6 3, while 4 4 ran 0.8x the speed of 6 2.
  const int64_t row_tiles = (M + MR - 1) / MR;
  const bool balanced = M / row_tiles >= 5;
  const int64_t base_rows = balanced ? M / row_tiles : MR, extra_rows = balanced ? M % row_tiles : 0;
  at::parallel_for(0, np_, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> scratch(static_cast<size_t>(M) * NR + 16);
    float* acc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t(63));
    for (int64_t p = p0; p < p1; ++p) {
      const float* panel = pp + p * K * NR;
      std::memset(acc, 0, sizeof(float) * M * NR);
      // tile t of T prefetches floats [k1 * NR + t * (k1 - k0) * NR / T, ...) of the stream, one
      // ceil(NR / T)-float step per k: together the tiles cover the next block once
      const int64_t T = COL_TILES * row_tiles;
      const int64_t step = (NR + T - 1) / T;
      for (int64_t k0 = 0; k0 < K; k0 += KB) {
        const int64_t k1 = std::min(K, k0 + KB);
        int64_t t = 0;
        for (int64_t j = 0; j < NR; j += TC)
          for (int64_t r = 0; r < row_tiles; ++r, ++t) {
            const int64_t m = r * base_rows + std::min(r, extra_rows);   // the first extra_rows tiles hold one more
            const int rows = static_cast<int>(std::min(base_rows + (r < extra_rows), M - m));
            const float* pf = panel + k1 * NR + (t * (k1 - k0) * NR) / T;
            if (p + 1 < np_ || k1 < K)   // nothing to prefetch past the last block of W
              tile_rows<true>(rows, xp + m * ldx, ldx, panel + j, k0, k1, acc + m * NR + j, pf, step);
            else
              tile_rows<false>(rows, xp + m * ldx, ldx, panel + j, k0, k1, acc + m * NR + j, pf, step);
          }
      }
      const int64_t c0 = p * NR, w = std::min(NR, n - c0);
      for (int64_t m = 0; m < M; ++m) {
        float* o = op + m * n + c0;
        const float* a = acc + m * NR;
        if (w == NR) {
          vf16 v0 = load(a), v1 = load(a + 16);
          if (b) {
            v0 += load(b + c0);
            v1 += load(b + c0 + 16);
          }
          store(o, v0);
          store(o + 16, v1);
        } else {
          for (int64_t j = 0; j < w; ++j) o[j] = a[j] + (b ? b[c0 + j] : 0.f);
        }
      }
    }
  });
  return out;
}

int64_t panel_vector_width() { return VW; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(zooinfer_cpu, m) {
  m.def("panel_vector_width() -> int");   // floats per register of the panel kernels' tiles (panels.h)
  m.impl("panel_vector_width", c10::DispatchKey::CatchAll, TORCH_FN(panel_vector_width));
  m.def("panel_linear(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
  m.impl("panel_linear", c10::DispatchKey::CPU, TORCH_FN(panel_linear));
}
