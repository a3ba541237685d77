// Greedy tokens screened in bf16 without AMX: out[m] is the index `linear_argmax` returns for
// x [M, K] and the head W [N, K] (the first maximum of the fp32 logits), like
// screened_argmax.cpp, with the screen pass on AVX-512 BF16 (VDPBF16PS).
//
// Why: on CPUs without AMX (AMD Zen 4, Ice Lake, laptops) the greedy head ran the fp32
// product: SmolLM2's head is 49152 x 576 fp32 = 113 MB streamed from DRAM every decode step.
// A bf16 copy halves those bytes, and VDPBF16PS multiplies two bf16 pairs per lane per
// instruction, twice the fp32 FMA rate. (AVX2 without bf16 arithmetic screens in int16
// instead: screened_i16.cpp.)
//
// Exactness: the pass sums exact products of bf16 x^ and W^ in fp32 with at most 2 * KP
// roundings (two per pair, FTZ/DAZ), so the bound of screen_common.h holds with
// kterms = 2 * KP, and `decide` recomputes the candidates in fp32.
//
// Layouts: vocab rows are the vector lanes. W^ as wv [NT, KP, 32] bf16 (`pack_bf16_pairs`):
// tile t, k pair p holds (W^[16t + r, 2p], W^[16t + r, 2p + 1]) for r = 0..15, zero-padded past
// N and K, NT a multiple of RV. x^ is one 32-bit pair per (token, k pair), broadcast to all
// lanes: a register block is RV vocab tiles x T tokens of accumulators, each vocab vector
// loaded once per k pair for all T tokens. A tile's maximum per token is one masked horizontal
// max at the end of the k loop (rows past N masked out).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "screen_common.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__x86_64__) && (defined(__clang__) || __GNUC__ >= 10)
#include <immintrin.h>
#define ZOOINFER_LANES 1
#define TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))
#endif

namespace {

using namespace zooinfer_panels;
using namespace zooinfer_screen;

constexpr int64_t RV = 4;   // vocab tiles per register block; NT is a multiple of it
constexpr int MAX_T = 6;    // tokens per register block: RV * MAX_T = 24 zmm accumulators

bool has_bf16() {
#ifdef ZOOINFER_LANES
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512bf16");
  return ok;
#else
  return false;
#endif
}

// Rows of tile t below N: a 16-bit lane mask.
inline uint32_t valid_rows(int64_t t, int64_t N) {
  const int64_t v = std::clamp<int64_t>(N - t * VT, 0, VT);
  return v == VT ? 0xFFFFu : (1u << v) - 1;
}

inline void put(float v, int64_t t, int64_t m, int64_t ld, float* tmax, float* rm) {
  tmax[t * ld + m] = v;
  rm[m] = std::max(rm[m], v);
}

#ifdef ZOOINFER_LANES
// Tiles [t0, t0 + RV) x tokens [m0, m0 + T) on VDPBF16PS: maxima into tmax, running max into rm.
template <int T>
TARGET_BF16 void bf16_block(const uint16_t* wv, const uint32_t* xq, int64_t KP, int64_t N, int64_t t0, int64_t m0,
                            int64_t ld, float* tmax, float* rm) {
  __m512 acc[RV][T];
  for (int v = 0; v < RV; ++v)
    for (int j = 0; j < T; ++j) acc[v][j] = _mm512_setzero_ps();
  const uint16_t* w = wv + t0 * KP * 32;
  const uint32_t* x = xq + m0 * KP;
  for (int64_t p = 0; p < KP; ++p) {
    __m512bh a[RV];
    for (int v = 0; v < RV; ++v) a[v] = (__m512bh)_mm512_loadu_si512(w + (v * KP + p) * 32);
    for (int j = 0; j < T; ++j) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[j * KP + p]));
      for (int v = 0; v < RV; ++v) acc[v][j] = _mm512_dpbf16_ps(acc[v][j], a[v], b);
    }
  }
  for (int v = 0; v < RV; ++v) {
    const __mmask16 mask = static_cast<__mmask16>(valid_rows(t0 + v, N));
    for (int j = 0; j < T; ++j)
      put(mask ? _mm512_mask_reduce_max_ps(mask, acc[v][j]) : -std::numeric_limits<float>::infinity(), t0 + v,
          m0 + j, ld, tmax, rm);
  }
}

// Vocab blocks [b0, b1) (RV tiles each) against every token: each block's weights stay in
// cache while all token blocks pass over them.
void screen_chunk(const uint16_t* wv, const uint32_t* xq, int64_t M, int64_t KP, int64_t N, int64_t b0, int64_t b1,
                  int64_t ld, float* tmax, float* rm) {
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t m0 = 0; m0 < M; m0 += MAX_T) {
      const int64_t t0 = b * RV;
      switch (std::min<int64_t>(MAX_T, M - m0)) {
        case 1: bf16_block<1>(wv, xq, KP, N, t0, m0, ld, tmax, rm); break;
        case 2: bf16_block<2>(wv, xq, KP, N, t0, m0, ld, tmax, rm); break;
        case 3: bf16_block<3>(wv, xq, KP, N, t0, m0, ld, tmax, rm); break;
        case 4: bf16_block<4>(wv, xq, KP, N, t0, m0, ld, tmax, rm); break;
        case 5: bf16_block<5>(wv, xq, KP, N, t0, m0, ld, tmax, rm); break;
        default: bf16_block<6>(wv, xq, KP, N, t0, m0, ld, tmax, rm); break;
      }
    }
  }
}
#endif

bool bf16_screen_available() { return has_bf16(); }

at::Tensor screened_argmax_lanes(const at::Tensor& x, const at::Tensor& wv, const at::Tensor& panels, int64_t n,
                                 double w_norm, double wb_norm, double dw_norm) {
  check_inputs("screened_argmax_lanes", x, panels, n);
  const int64_t M = x.size(0), K = x.size(1), KP = (K + 1) / 2;
  const int64_t NT = RV * ((n + RV * VT - 1) / (RV * VT));
  TORCH_CHECK(wv.dim() == 3 && wv.scalar_type() == at::kBFloat16 && wv.is_contiguous() && wv.size(0) == NT &&
                  wv.size(1) == KP && wv.size(2) == 32,
              "screened_argmax_lanes: wv must be contiguous bfloat16 pairs [", NT, ", ", KP, ", 32], got ", wv.sizes(),
              " ", wv.scalar_type());
  TORCH_CHECK(has_bf16(), "screened_argmax_lanes: this CPU has no avx512_bf16");
  if (M == 0 || !std::isfinite(w_norm + wb_norm + dw_norm)) return linear_argmax_op(x, panels, n);
#ifdef ZOOINFER_LANES
  const at::Tensor xc = x.contiguous();
  const int64_t ld = 16 * ((M + 15) / 16);
  std::vector<float> e2(ld, 0.f);
  std::vector<uint8_t> screened(M, 0);
  std::vector<uint16_t> xh(static_cast<size_t>(M * 2 * KP));
  token_bounds(xc.data_ptr<float>(), M, K, 2 * KP, 2 * KP, w_norm, wb_norm, dw_norm, xh.data(), e2.data(),
               screened.data());
  // The screen: per vocab tile and token, the tile's largest bf16 logit, over blocks of RV tiles.
  const auto* wp = reinterpret_cast<const uint16_t*>(wv.data_ptr<at::BFloat16>());
  const auto* xq = reinterpret_cast<const uint32_t*>(xh.data());
  return screen_then_decide(xc, panels, n, NT, ld, NT / RV, e2.data(), screened.data(),
                            [&](int64_t b0, int64_t b1, float* tmax, float* rm) {
                              screen_chunk(wp, xq, M, KP, n, b0, b1, ld, tmax, rm);
                            });
#else
  return linear_argmax_op(x, panels, n);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(zooinfer_cpu, m) {
  m.def("screened_argmax_lanes(Tensor x, Tensor wv, Tensor panels, int n, float w_norm, float wb_norm, "
        "float dw_norm) -> Tensor");
  m.impl("screened_argmax_lanes", c10::DispatchKey::CPU, TORCH_FN(screened_argmax_lanes));
  m.def("bf16_screen_available() -> bool", TORCH_FN(bf16_screen_available));
}
