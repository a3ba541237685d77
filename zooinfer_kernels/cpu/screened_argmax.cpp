// Greedy tokens from the LM head, screened in bf16 on AMX and decided in fp32: out[m] is the
// same index `linear_argmax` (linear_argmax.cpp) returns for x [M, K] and the head W [N, K],
// i.e. the first maximum of the fp32 logits x[m] . W[n] summed in k order.
//
// Why: the LM head is the largest product of a decode step (tiny Llama, 64 requests: 3.5 ms of
// a 15 ms step in fp32). AMX multiplies bf16 tiles at several times the fp32 FMA rate and reads
// half the bytes; but bf16 logits are not the fp32 logits, so their argmax alone could pick
// another token. The screen makes the result exact instead of close:
//
// - the bf16 logit a_n (x and W rounded to bf16: x^, W^; products exact in fp32, fp32 sums)
//   differs from the fp32 logit L_n by at most E_m: x.W_n - x^.W^_n = x.(W_n - W^_n) +
//   (x - x^).W^_n, so by Cauchy-Schwarz |x| max|W - W^| + |x - x^| max|W^| (row norms of the
//   actual rounding, measured when packing: models/prepack.py `make_screen`), plus each fp32
//   sum's rounding (K 2^-24 times its sum of |terms|) and flushed denormals, and 1% for
//   computing the threshold itself in fp32;
// - so the fp32 argmax n* has a_n* >= L_n* - E >= L_best - E >= max_n a_n - 2E;
// - each 16-row vocab tile keeps, per token, only the maximum of its a_n. After the pass, the
//   tiles whose maximum is within 2E of the token's best are candidates (n*'s tile is one),
//   and all their rows are recomputed in fp32 from the head's panels exactly as linear_argmax
//   sums them (k order, one fused multiply-add per step); the first maximum among them is n*
//   (any row before n* with the same logit would itself be the first maximum).
//
// With random or trained heads 2E is a fraction of the logits' spread: SmolLM2-135M's real
// hidden states leave 1 candidate row for most tokens and at most a few tiles. A token whose x
// is not finite, whose bound could overflow fp32, or that has more than max(64, NT / 4)
// candidate tiles (x = 0 ties everything) takes linear_argmax instead, as does everything
// without AMX.
//
// The bound and the decision are shared with the AVX-512 BF16 / AVX2 screens
// (screened_lanes.cpp) in screen_common.h; this file holds the AMX screen pass.
//
// Layouts: W^ as tiles [NT, KS, 16, 32] (prepack `pack_bf16_tiles`: vocab tile t, k step s
// holds W[16t : 16t+16, 32s : 32s+32], zero-padded; NT even), the A operand of TDPBF16PS; x^ is
// built per call as B operands [G, KS, 16, 16, 2] (k pairs x 16 tokens, the VNNI order), so a
// C tile is 16 vocab rows x 16 tokens and every reduction is per lane.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "screen_common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__linux__)
#include <immintrin.h>
#include "amx_perm.h"
#define ZOOINFER_AMX 1
#endif

namespace {

using namespace zooinfer_panels;
using namespace zooinfer_screen;

constexpr int64_t KT = 32;        // k per tile step (bf16 pairs x 16)
constexpr int64_t TILE = 512;     // bf16 elements per tile (1 KB)
constexpr int64_t PF_PAIRS = 2;   // prefetch the vocab tile pair this far ahead

bool amx_ready() {
#ifdef ZOOINFER_AMX
  return zooinfer_amx::bf16_ready();
#else
  return false;
#endif
}

#ifdef ZOOINFER_AMX
// C tiles 0/1: vocab tiles a0/a1 x token group b0; with TWO, C tiles 2/3: the same x group b1.
template <bool TWO>
inline void pair_groups(const uint16_t* a0, const uint16_t* a1, const uint16_t* b0, const uint16_t* b1, int64_t KS,
                        float (*cbuf)[256]) {
  _tile_zero(0);
  _tile_zero(1);
  if (TWO) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t s = 0; s < KS; ++s) {
    _tile_loadd(4, a0 + s * TILE, 64);
    _tile_loadd(5, a1 + s * TILE, 64);
    _tile_loadd(6, b0 + s * TILE, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    if (TWO) {
      _tile_loadd(7, b1 + s * TILE, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, cbuf[0], 64);
  _tile_stored(1, cbuf[1], 64);
  if (TWO) {
    _tile_stored(2, cbuf[2], 64);
    _tile_stored(3, cbuf[3], 64);
  }
}

// The per-token maximum of a C tile's first `valid` rows into `dst` and the running maximum.
inline void tile_max(const float* buf, int valid, float* dst, __m512& rm) {
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int r = 0; r < valid; ++r) mx = _mm512_max_ps(_mm512_load_ps(buf + r * 16), mx);
  _mm512_storeu_ps(dst, mx);
  rm = _mm512_max_ps(mx, rm);
}

// Vocab tile pairs [pb, pe) against every token group: tile maxima into tmax [NT, G * 16],
// the running maximum of each token lane into rm_out [G * 16].
void screen_chunk(const uint16_t* wb, const uint16_t* xb, int64_t N, int64_t KS, int64_t G, int64_t pb, int64_t pe,
                  float* tmax, float* rm_out) {
  zooinfer_amx::load_full_tiles();
  alignas(64) float cbuf[4][256];
  std::vector<__m512> rm(G, _mm512_set1_ps(-std::numeric_limits<float>::infinity()));
  const int64_t ld = G * 16;
  for (int64_t p = pb; p < pe; ++p) {
    const uint16_t* a0 = wb + 2 * p * KS * TILE;
    const uint16_t* a1 = a0 + KS * TILE;
    if (p + PF_PAIRS < pe) {   // in the engine the head streams from DRAM: 6-10% faster (tiny Llama)
      const char* q = reinterpret_cast<const char*>(a0 + 2 * PF_PAIRS * KS * TILE);
      for (int64_t i = 0; i < 2 * KS * TILE * 2; i += 64) _mm_prefetch(q + i, _MM_HINT_T0);
    }
    const int64_t n0 = 2 * p * VT;
    const int v0 = static_cast<int>(std::clamp<int64_t>(N - n0, 0, VT));
    const int v1 = static_cast<int>(std::clamp<int64_t>(N - n0 - VT, 0, VT));
    float* t0 = tmax + 2 * p * ld;
    float* t1 = t0 + ld;
    for (int64_t g = 0; g < G; g += 2) {
      const uint16_t* b0 = xb + g * KS * TILE;
      if (g + 1 < G) {
        pair_groups<true>(a0, a1, b0, b0 + KS * TILE, KS, cbuf);
        tile_max(cbuf[2], v0, t0 + (g + 1) * 16, rm[g + 1]);
        tile_max(cbuf[3], v1, t1 + (g + 1) * 16, rm[g + 1]);
      } else {
        pair_groups<false>(a0, a1, b0, nullptr, KS, cbuf);
      }
      tile_max(cbuf[0], v0, t0 + g * 16, rm[g]);
      tile_max(cbuf[1], v1, t1 + g * 16, rm[g]);
    }
  }
  _tile_release();
  for (int64_t g = 0; g < G; ++g) _mm512_storeu_ps(rm_out + g * 16, rm[g]);
}
#endif

at::Tensor screened_argmax(const at::Tensor& x, const at::Tensor& wb, const at::Tensor& panels, int64_t n,
                           double w_norm, double wb_norm, double dw_norm) {
  check_inputs("screened_argmax", x, panels, n);
  const int64_t M = x.size(0), K = x.size(1), KS = (K + KT - 1) / KT;
  const int64_t NT = 2 * ((n + 2 * VT - 1) / (2 * VT));
  TORCH_CHECK(wb.dim() == 4 && wb.scalar_type() == at::kBFloat16 && wb.is_contiguous() && wb.size(0) == NT &&
                  wb.size(1) == KS && wb.size(2) == VT && wb.size(3) == KT,
              "screened_argmax: wb must be contiguous bfloat16 tiles [", NT, ", ", KS, ", 16, 32], got ", wb.sizes(),
              " ", wb.scalar_type());
  if (M == 0 || !amx_ready() || !std::isfinite(w_norm + wb_norm + dw_norm)) return linear_argmax_op(x, panels, n);
#ifdef ZOOINFER_AMX
  const at::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const int64_t G = (M + 15) / 16, ld = G * 16;
  // Per token: 2E (the candidate window) and its bf16 B-operand lanes (zero for padding lanes
  // and tokens that fall back: never screened).
  std::vector<float> e2(ld, 0.f);
  std::vector<uint8_t> screened(M, 0);
  std::vector<uint16_t> xh(static_cast<size_t>(M * KS * KT));
  token_bounds(xp, M, K, KS * KT, KS * KT, w_norm, wb_norm, dw_norm, xh.data(), e2.data(), screened.data());
  std::vector<uint16_t> xb(static_cast<size_t>(G * KS * TILE), 0);
  for (int64_t m = 0; m < M; ++m) {
    uint16_t* dst = xb.data() + (m / 16) * KS * TILE + (m % 16) * 2;
    for (int64_t k = 0; k < K; ++k) dst[(k / KT) * TILE + ((k % KT) / 2) * 32 + (k % 2)] = xh[m * KS * KT + k];
  }
  // The screen: per vocab tile and token, the tile's largest bf16 logit, over tile pairs; then
  // the decision, per token: every row of the tiles within 2E of its best, in fp32.
  const auto* wp = reinterpret_cast<const uint16_t*>(wb.data_ptr<at::BFloat16>());
  return screen_then_decide(xc, panels, n, NT, ld, NT / 2, e2.data(), screened.data(),
                            [&](int64_t p0, int64_t p1, float* tmax, float* rm) {
                              screen_chunk(wp, xb.data(), n, KS, G, p0, p1, tmax, rm);
                            });
#else
  return linear_argmax_op(x, panels, n);
#endif
}

bool amx_screen_available() { return amx_ready(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(zooinfer_cpu, m) {
  m.def("screened_argmax(Tensor x, Tensor wb, Tensor panels, int n, float w_norm, float wb_norm, float dw_norm) "
        "-> Tensor");
  m.impl("screened_argmax", c10::DispatchKey::CPU, TORCH_FN(screened_argmax));
  m.def("amx_available() -> bool", TORCH_FN(amx_screen_available));
}
