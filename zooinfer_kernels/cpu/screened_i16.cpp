// Greedy tokens screened in 16-bit integers on AVX2: out[m] is the index `linear_argmax` returns
// for x [M, K] and the head W [N, K] (the first maximum of the fp32 logits), like the bf16 screens
// (screened_argmax.cpp, screened_lanes.cpp), with the screen pass in VPMADDWD.
//
// Why: AVX2 has no bf16 arithmetic. A bf16 screen there widens each bf16 pair to fp32 and runs
// fp32 FMAs: it reads half the head's bytes but computes at the fp32 rate, so from ~24 rows,
// where the head product is compute-bound (tiny Llama's 32000 x 256 head at 64 rows is 1 GFLOP),
// it lost to the plain panel product + argmax. VPMADDWD multiplies 16 int16 pairs per
// instruction into 8 int32 sums, and Zen 3 issues two a cycle beside two VPADDD: 32 multiply-adds
// a cycle against fp32 FMA's 16, from the same 2 bytes per weight.
//
// The integer screen: W is rounded with one scale for the whole head, W^ = s_w q (|q| <= Qw),
// and each token's x with a scale of its own, x^ = s_x r (|r| <= Qx). The integer sums
// S_n = sum_k q_nk r_k are exact in int32: |S_n| <= 2 KP Qw Qx < 2^31 (KP k pairs; Qx is derived
// from KP and the head's largest |q| per call). The screen logit is a_n = fl32(S_n * (s_w s_x)),
// the product in double (s_w s_x is exact there), one rounding to fp32: |a_n - s_w s_x S_n| <=
// 2^-24 |W^_n| |x^| + 2^-149. Against the fp32 logit L_n that linear_argmax and the decision
// compute (K fused multiply-adds in k order):
//     W^_n . x^ - W_n . x = (W^_n - W_n) . x^ + W_n . (x^ - x)
//     |L_n - W_n . x| <= gamma_K |W_n| |x| + K 2^-148         (gamma_K = K u / (1 - K u), u = 2^-24)
// so by Cauchy-Schwarz, with the head's largest row norms |W|, |W^|, |W - W^| (measured when
// packing: lm_head.make_screen),
//     E = |W - W^| |x^| + |W| |x - x^| + 2^-24 |W^| |x^| + gamma_K |W| |x| + (K + 2) 2^-148
// bounds |a_n - L_n|, and the fp32 argmax lies in a 16-row vocab tile whose screen maximum is
// within 2E of the token's best (screen_common.h `decide` recomputes those tiles in fp32; the
// threshold's own rounding is covered by its 1% and by fl's monotonicity).
//
// Precision: Qw and Qx share the int32 budget 2^31 / (2 KP); x gets about 4x Qw's levels because
// hidden states have outlier features that set s_x, where one global s_w is set by the head's
// largest weight (lm_head.i16_levels). At K = 576 that is Qw = 965, Qx = 3864: a bound of the
// same size as bf16's 8-bit mantissa on random and trained heads.
//
// Layouts: q as [NT, KP, 32] int16 (lm_head.pack_i16_pairs): tile t, k pair p holds
// (q[16t + r, 2p], q[16t + r, 2p + 1]) for r = 0..15, zero past N and K, NT a multiple of RV; the
// two 256-bit halves are rows 0-7 and 8-15. r is one 32-bit pair per (token, k pair), broadcast.
// A register block is one vocab tile x T <= 4 tokens: 8 accumulators, the weights as memory
// operands, T broadcasts (GCC hoists every broadcast of a k pair, and 6 tokens' 12 accumulators
// then spilled to the stack: 1.1x the panel product at 32-64 rows, against ~1.5x with 4); the
// tile's maximum per token is an integer max over its valid rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "screen_common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) && (defined(__clang__) || __GNUC__ >= 10)
#include <immintrin.h>
#define ZOOINFER_I16 1
#define TARGET_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace {

using namespace zooinfer_panels;
using namespace zooinfer_screen;

constexpr int64_t RV = 4;    // the pair layout pads NT to a multiple of this (shared with screened_lanes.cpp)
constexpr int MAX_T = 4;     // tokens per register block: 2 halves x 4 = 8 ymm accumulators
constexpr int64_t INT32_BUDGET = 2147483647;

bool has_avx2() {
#ifdef ZOOINFER_I16
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
#else
  return false;
#endif
}

// Levels of x for a head whose |q| <= qw_max over KP k pairs: 2 KP qw_max Qx <= 2^31 - 1.
int64_t x_levels(int64_t KP, int64_t qw_max) {
  return std::min<int64_t>(32767, INT32_BUDGET / (2 * KP * std::max<int64_t>(qw_max, 1)));
}

// Per token m: its rounding r into xq[m * KP + p] (pairs, zero past K; all zero when not
// screened), the scale c[m] = s_w s_x, 2E into e2[m] and screened[m] = 1 where the bound
// exists (x finite, not all zero, logits far from fp32's range).
void token_bounds_i16(const float* xp, int64_t M, int64_t K, int64_t KP, int64_t qx, double s_w, double w_norm,
                      double wq_norm, double dw_norm, uint32_t* xq, double* c, float* e2, uint8_t* screened) {
  const double u = std::ldexp(1.0, -24), g = double(2 * KP) * u, gamma = g / (1 - g);
  std::vector<int16_t> r(static_cast<size_t>(2 * KP));
  for (int64_t m = 0; m < M; ++m) {
    const float* row = xp + m * K;
    screened[m] = 0;
    e2[m] = 0.f;
    c[m] = 0;
    std::fill(xq + m * KP, xq + (m + 1) * KP, 0u);
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));   // NaN: max keeps amax
    double xx = 0;
    for (int64_t k = 0; k < K; ++k) xx += double(row[k]) * row[k];
    const double nx = std::sqrt(xx);
    if (!(amax > 0.f) || !std::isfinite(nx) || !(nx * w_norm < 1e30)) continue;   // zero, NaN/inf, huge
    const float s_x = amax / static_cast<float>(qx);
    if (!(s_x >= std::numeric_limits<float>::min())) continue;   // x so small its scale would be denormal
    double xh = 0, dx = 0;
    std::fill(r.begin(), r.end(), int16_t(0));
    for (int64_t k = 0; k < K; ++k) {
      const float q = std::clamp(std::nearbyint(row[k] / s_x), -float(qx), float(qx));
      r[k] = static_cast<int16_t>(q);
      const double h = double(s_x) * q;   // exact: 24-bit s_x times a 16-bit integer
      xh += h * h;
      dx += (double(row[k]) - h) * (double(row[k]) - h);
    }
    for (int64_t p = 0; p < KP; ++p)
      xq[m * KP + p] = uint32_t(uint16_t(r[2 * p])) | (uint32_t(uint16_t(r[2 * p + 1])) << 16);
    const double nh = std::sqrt(xh);
    const double err = dw_norm * nh + w_norm * std::sqrt(dx) + u * wq_norm * nh + gamma * w_norm * nx +
                       double(K + 2) * std::ldexp(1.0, -148);
    c[m] = s_w * double(s_x);
    e2[m] = static_cast<float>(2 * err * 1.01);   // 1%: the norms' own rounding, and the threshold's
    screened[m] = 1;
  }
}

#ifdef ZOOINFER_I16
// Tile t x tokens [m0, m0 + T): the tile's screen maximum per token into tmax, running max into rm.
template <int T>
TARGET_AVX2 void i16_block(const int16_t* wq, const uint32_t* xq, int64_t KP, int64_t N, int64_t t, int64_t m0,
                           const double* c, int64_t ld, float* tmax, float* rm) {
  __m256i acc[2][T];
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < T; ++j) acc[h][j] = _mm256_setzero_si256();
  const int16_t* w = wq + t * KP * 32;
  const uint32_t* x = xq + m0 * KP;
  for (int64_t p = 0; p < KP; ++p) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32 + 16));
    for (int j = 0; j < T; ++j) {
      const __m256i b = _mm256_set1_epi32(static_cast<int>(x[j * KP + p]));
      acc[0][j] = _mm256_add_epi32(_mm256_madd_epi16(b, w0), acc[0][j]);
      acc[1][j] = _mm256_add_epi32(_mm256_madd_epi16(b, w1), acc[1][j]);
    }
  }
  const int64_t valid = std::clamp<int64_t>(N - t * VT, 0, VT);
  for (int j = 0; j < T; ++j) {
    float best = -std::numeric_limits<float>::infinity();
    if (valid > 0) {
      alignas(32) int32_t s[16];
      _mm256_store_si256(reinterpret_cast<__m256i*>(s), acc[0][j]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(s + 8), acc[1][j]);
      const int32_t mx = *std::max_element(s, s + valid);
      best = static_cast<float>(double(mx) * c[m0 + j]);   // monotone: the max of the rounded logits
    }
    tmax[t * ld + m0 + j] = best;
    rm[m0 + j] = std::max(rm[m0 + j], best);
  }
}

// Vocab tiles [t0, t1) against every token: each tile's 2 KP * 32 bytes stay in L1 while all
// token blocks pass over them.
void screen_tiles(const int16_t* wq, const uint32_t* xq, int64_t M, int64_t KP, int64_t N, int64_t t0, int64_t t1,
                  const double* c, int64_t ld, float* tmax, float* rm) {
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t m0 = 0; m0 < M; m0 += MAX_T) {
      switch (std::min<int64_t>(MAX_T, M - m0)) {
        case 1: i16_block<1>(wq, xq, KP, N, t, m0, c, ld, tmax, rm); break;
        case 2: i16_block<2>(wq, xq, KP, N, t, m0, c, ld, tmax, rm); break;
        case 3: i16_block<3>(wq, xq, KP, N, t, m0, c, ld, tmax, rm); break;
        default: i16_block<4>(wq, xq, KP, N, t, m0, c, ld, tmax, rm); break;
      }
    }
  }
}
#endif

bool i16_screen_available() { return has_avx2(); }

at::Tensor screened_argmax_i16(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& panels, int64_t n,
                               double w_scale, int64_t qw_max, double w_norm, double wq_norm, double dw_norm) {
  check_inputs("screened_argmax_i16", x, panels, n);
  const int64_t M = x.size(0), K = x.size(1), KP = (K + 1) / 2;
  const int64_t NT = RV * ((n + RV * VT - 1) / (RV * VT));
  TORCH_CHECK(wq.dim() == 3 && wq.scalar_type() == at::kShort && wq.is_contiguous() && wq.size(0) == NT &&
                  wq.size(1) == KP && wq.size(2) == 32,
              "screened_argmax_i16: wq must be contiguous int16 pairs [", NT, ", ", KP, ", 32], got ", wq.sizes(), " ",
              wq.scalar_type());
  TORCH_CHECK(qw_max >= 0 && qw_max <= 32767 && x_levels(KP, qw_max) >= 1, "screened_argmax_i16: qw_max=", qw_max,
              " leaves no int32 room for K=", K);
  TORCH_CHECK(has_avx2(), "screened_argmax_i16: this CPU has no AVX2 + FMA");
  if (M == 0 || !(w_scale > 0) || !std::isfinite(w_scale + w_norm + wq_norm + dw_norm))
    return linear_argmax_op(x, panels, n);
#ifdef ZOOINFER_I16
  const at::Tensor xc = x.contiguous();
  const int64_t ld = 16 * ((M + 15) / 16);
  std::vector<float> e2(ld, 0.f);
  std::vector<double> c(M, 0.0);
  std::vector<uint8_t> screened(M, 0);
  std::vector<uint32_t> xq(static_cast<size_t>(M * KP));
  token_bounds_i16(xc.data_ptr<float>(), M, K, KP, x_levels(KP, qw_max), w_scale, w_norm, wq_norm, dw_norm,
                   xq.data(), c.data(), e2.data(), screened.data());
  const int16_t* wp = wq.data_ptr<int16_t>();
  return screen_then_decide(xc, panels, n, NT, ld, NT, e2.data(), screened.data(),
                            [&](int64_t t0, int64_t t1, float* tmax, float* rm) {
                              screen_tiles(wp, xq.data(), M, KP, n, t0, t1, c.data(), ld, tmax, rm);
                            });
#else
  return linear_argmax_op(x, panels, n);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(zooinfer_cpu, m) {
  m.def("screened_argmax_i16(Tensor x, Tensor wq, Tensor panels, int n, float w_scale, int qw_max, float w_norm, "
        "float wq_norm, float dw_norm) -> Tensor");
  m.impl("screened_argmax_i16", c10::DispatchKey::CPU, TORCH_FN(screened_argmax_i16));
  m.def("i16_screen_available() -> bool", TORCH_FN(i16_screen_available));
}
