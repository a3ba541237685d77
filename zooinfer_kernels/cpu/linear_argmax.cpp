// Greedy tokens straight from the LM head: out[m] = argmax_n (x[m] . W[n]) for fp32 x [M, K]
// and the LM head weight W [N, K] in the column panels of panel_gemm.cpp (P [ceil(N/32), K, 32],
// zero-padded past N), without writing logits. Ties and NaN follow
// `torch.argmax(x @ W.T, -1)`: the first index of the maximum, a NaN counting as the maximum
// (the first NaN wins).
//
// Why: in a greedy decode step of 64 requests on the tiny Llama (vocab 32000, hidden 256) the
// LM head plus argmax took ~5.5 ms: MKL's packed sgemm ran at ~190 GFLOP/s for 64 rows, then
// wrote 8 MB of logits that the argmax read back from L3/DRAM. Here the product is computed
// transposed, vocab rows by tokens, so the tokens are the vector lanes: a register tile holds
// R vocab rows x 16*MV tokens, and the argmax is a per-lane compare-and-select on the finished
// tile (no horizontal reduction, nothing written).
//
// Blocking: x is transposed once per call into xT [K, 16*MV] (64 tokens: 64 KB, L2). For each
// block of KB k steps of a panel (8 KB, contiguous), the panel's 32/R row tiles reuse that
// 16 KB block of xT from L1, keeping partial sums in a per-panel scratch between blocks
// (without the k blocking every tile re-reads all of xT from L2). The panels are read once, in
// address order, and each block prefetches the next one, R/16 lines per k step, so the weight
// streams from DRAM at full rate while the FMA units work (row-major W, read a few rows at a
// time, lost ~1 ms of a step to DRAM stalls in the engine). Threads split the panels into
// contiguous ranges; their per-lane winners are merged in vocab order, so the first index wins.
//
// More rows go in equal blocks of at most 16 * MAX_MV, each a pass over W: 64 with AVX-512; 16 with
// AVX2, where 32 / 64 tokens at once ran at 33-36 GFLOP/s against 39-44 for 16 (Zen 3, one
// thread; the sums of wider tiles do not fit its 16 registers).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "panels.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using namespace zooinfer_panels;

constexpr int64_t KB = 64;   // k steps per block: 8 KB of panel, 16 KB of xT for 64 tokens
constexpr int MAX_MV = VW == 16 ? 4 : 1;    // 64 / 16 tokens per pass
// Token lanes are native vectors (panels.h `vreg`): 16 * MV tokens are L = 16 * MV / VW of them.
// (16-float GCC vectors in 2-D arrays were lowered without AVX-512 to stack traffic and scalar
// inserts on every k step: 3-8 GFLOP/s on Zen 3.)
template <int MV>
constexpr int lanes_vectors() { return static_cast<int>(16 * MV / VW); }
constexpr int MAX_L = 16 * MAX_MV / VW;

// The running winner of each token lane: value and vocab index.
struct Best {
  vreg val[MAX_L];
  vireg idx[MAX_L];
};

// Fold vocab row n's values v (L vectors of tokens) into the winners: replace on a
// strictly larger value, or on the first NaN (a NaN winner is never replaced).
template <int L>
inline void fold(Best& b, const vreg* v, int32_t n) {
  const vireg nv = n - vireg{};
  for (int j = 0; j < L; ++j) {
    const vireg upd = (v[j] > b.val[j]) | ((v[j] != v[j]) & (b.val[j] == b.val[j]));
    b.val[j] = upd ? v[j] : b.val[j];
    b.idx[j] = upd ? nv : b.idx[j];
  }
}

// Rows [c, c+R) of a panel (`p` points at its column c) over k steps [k0, k1). FIRST: start
// from zero, else from `scratch`; LAST: fold the first `valid` rows into the winners, else
// store the partial sums to `scratch`. `pf` walks the next block: R/16 lines per k step.
template <int MV, int R, bool FIRST, bool LAST>
inline void tile(const float* __restrict p, const float* __restrict xt, int64_t k0, int64_t k1, int32_t n0,
                 int valid, vreg* __restrict scratch, Best& best, const char*& pf, const char* pf_end) {
  constexpr int L = lanes_vectors<MV>();
  vreg acc[R][L];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < L; ++j) acc[r][j] = FIRST ? vreg{} : scratch[r * L + j];
  for (int64_t k = k0; k < k1; ++k) {
    const int lines = static_cast<int>(((k + 1) * R) / 16 - (k * R) / 16);
    for (int i = 0; i < lines && pf < pf_end; ++i, pf += 64) __builtin_prefetch(pf, 0, 3);
    vreg xv[L];
    for (int j = 0; j < L; ++j) xv[j] = vload(xt + k * 16 * MV + VW * j);
    for (int r = 0; r < R; ++r) {
      const vreg a = vsplat(p[k * NR + r]);
      for (int j = 0; j < L; ++j) acc[r][j] += a * xv[j];
    }
  }
  if (!LAST) {
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < L; ++j) scratch[r * L + j] = acc[r][j];
    return;
  }
  for (int r = 0; r < R && r < valid; ++r) fold<L>(best, acc[r], n0 + r);
}

// Panels [pb, pe) into `best`; N is the true row count (the last panel may be padded).
template <int MV, int R>
void run(const float* panels, int64_t N, int64_t K, const float* xt, int64_t pb, int64_t pe, Best& best) {
  vreg scratch[NR * lanes_vectors<MV>()];
  const char* pf = reinterpret_cast<const char*>(panels + pb * K * NR);
  const char* pf_end = reinterpret_cast<const char*>(panels + pe * K * NR);
  pf += std::min<int64_t>(KB * NR * sizeof(float), pf_end - pf);   // block 0 is read first; prefetch from block 1
  for (int64_t q = pb; q < pe; ++q) {
    const float* panel = panels + q * K * NR;
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
      const int64_t k1 = std::min(K, k0 + KB);
      const bool first = k0 == 0, last = k1 == K;
      for (int64_t c = 0; c < NR; c += R) {
        vreg* s = scratch + c * lanes_vectors<MV>();
        const auto n0 = static_cast<int32_t>(q * NR + c);
        const int valid = static_cast<int>(std::min<int64_t>(R, N - n0));
        if (valid <= 0) break;   // padding past N
        const float* p = panel + c;
        if (first && last) tile<MV, R, true, true>(p, xt, k0, k1, n0, valid, s, best, pf, pf_end);
        else if (first) tile<MV, R, true, false>(p, xt, k0, k1, n0, valid, s, best, pf, pf_end);
        else if (last) tile<MV, R, false, true>(p, xt, k0, k1, n0, valid, s, best, pf, pf_end);
        else tile<MV, R, false, false>(p, xt, k0, k1, n0, valid, s, best, pf, pf_end);
      }
    }
  }
}

// Rows per tile for MV 16-token vectors (R divides the panel width; R * L accumulators).
// AVX-512: 4 rows at 64 tokens: 8 rows would need all 32 zmm registers for the sums alone.
// AVX2 (16 ymm, L = 2 * MV): measured on Zen 3 (one thread, SmolLM2's 49152 x 576 head), R = 8 / 4
// / 2 for 16 / 32 / 64 tokens ran at 39-44 / 34-36 / 37-40 GFLOP/s, fewer rows 10-25% slower at
// 16 tokens; more rows spill some sums but the broadcasts of the panel amortise better.
constexpr int rows_per_tile(int mv) {
  return VW == 16 ? (mv == 1 ? 16 : mv == 4 ? 4 : 8) : (mv == 1 ? 8 : mv == 2 ? 4 : 2);
}

template <int MV>
void block(const float* panels, int64_t N, int64_t K, const float* xt, int64_t rows, int64_t* out) {
  constexpr int R = rows_per_tile(MV);
  const int64_t np_ = (N + NR - 1) / NR;
  // One contiguous panel range per chunk, chunk c before chunk c + 1 in the vocab, so merging
  // the chunks' winners in chunk order keeps the first index among ties (whichever thread ran
  // which chunk).
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), np_));
  std::vector<Best> bests(chunks);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t b = np_ * c / chunks, e = np_ * (c + 1) / chunks;
      Best& best = bests[c];
      for (int j = 0; j < lanes_vectors<MV>(); ++j) {
        best.val[j] = vsplat(-std::numeric_limits<float>::infinity());
        best.idx[j] = static_cast<int32_t>(b * NR) - vireg{};   // all -inf: the range's first row wins
      }
      run<MV, R>(panels, N, K, xt, b, e, best);
    }
  });
  for (int64_t m = 0; m < rows; ++m) {
    float bv = bests[0].val[m / VW][m % VW];
    int64_t bi = bests[0].idx[m / VW][m % VW];
    for (int64_t c = 1; c < chunks; ++c) {
      const float v = bests[c].val[m / VW][m % VW];
      if (v > bv || (v != v && bv == bv)) {
        bv = v;
        bi = bests[c].idx[m / VW][m % VW];
      }
    }
    out[m] = bi;
  }
}

// block<MV> where MV <= MAX_MV (only such MV occur); wider ones are never instantiated.
template <int MV>
void block_upto(const float* panels, int64_t N, int64_t K, const float* xt, int64_t rows, int64_t* out) {
  if constexpr (MV <= MAX_MV) block<MV>(panels, N, K, xt, rows, out);
}

at::Tensor linear_argmax(const at::Tensor& x, const at::Tensor& panels, int64_t n) {
  check_inputs("linear_argmax", x, panels, n);
  TORCH_CHECK(n > 0, "linear_argmax: the weight has no rows");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  if (M == 0) return out;
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const int64_t ldx = xc.stride(0);
  const float* pp = panels.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  std::vector<float> xt_buf(static_cast<size_t>(K) * 16 * MAX_MV + 16);
  float* xt = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(xt_buf.data()) + 63) & ~uintptr_t(63));
  // Blocks of at most 16 * MAX_MV rows, of equal size (65 rows: 33 + 32, not 64 + 1).
  const int64_t nblocks = (M + 16 * MAX_MV - 1) / (16 * MAX_MV);
  const int64_t per_block = (M + nblocks - 1) / nblocks;
  for (int64_t m0 = 0; m0 < M; m0 += per_block) {
    const int64_t rows = std::min<int64_t>(per_block, M - m0);
    const int mv = static_cast<int>((rows + 15) / 16);
    const int64_t lanes = 16 * mv;
    for (int64_t k = 0; k < K; ++k) {   // xT [K, lanes], zero past the block's rows
      float* dst = xt + k * lanes;
      for (int64_t m = 0; m < rows; ++m) dst[m] = xp[(m0 + m) * ldx + k];
      for (int64_t m = rows; m < lanes; ++m) dst[m] = 0.f;
    }
    switch (mv) {
      case 1: block_upto<1>(pp, n, K, xt, rows, op + m0); break;
      case 2: block_upto<2>(pp, n, K, xt, rows, op + m0); break;
      case 3: block_upto<3>(pp, n, K, xt, rows, op + m0); break;
      default: block_upto<4>(pp, n, K, xt, rows, op + m0); break;
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(zooinfer_cpu, m) {
  m.def("linear_argmax(Tensor x, Tensor panels, int n) -> Tensor");
  m.impl("linear_argmax", c10::DispatchKey::CPU, TORCH_FN(linear_argmax));
}
