// Greedy tokens screened in bf16 without AMX: out[m] is the index `linear_argmax` returns for
// x [M, K] and the head W [N, K] (the first maximum of the fp32 logits), like
// screened_argmax.cpp, with the screen pass on AVX-512 BF16 (VDPBF16PS) or on AVX2 + FMA.
//
// Why: on CPUs without AMX (AMD Zen 4, Ice Lake, laptops) the greedy head ran the fp32
// product: SmolLM2's head is 49152 x 576 fp32 = 113 MB streamed from DRAM every decode step.
// A bf16 copy halves those bytes, and VDPBF16PS multiplies two bf16 pairs per lane per
// instruction, twice the fp32 FMA rate. The AVX2 path has no bf16 arithmetic: it widens each
// bf16 pair to fp32 with a shift and a mask (exact) and uses fp32 FMA, so it wins by reading
// half the bytes where the head streams from memory (few rows), not by computing faster.
//
// Exactness: both passes sum exact products of bf16 x^ and W^ in fp32 with at most 2 * KP
// roundings (VDPBF16PS: two per pair, FTZ/DAZ; AVX2: one FMA per term), so the bound of
// screen_common.h holds with kterms = 2 * KP, and `decide` recomputes the candidates in fp32.
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
#define TARGET_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace {

using namespace zooinfer_panels;
using namespace zooinfer_screen;

constexpr int64_t RV = 4;   // vocab tiles per register block; NT is a multiple of it
constexpr int MAX_T = 6;    // tokens per register block: RV * MAX_T = 24 zmm accumulators
constexpr int MAX_T2 = 4;   // AVX2: 2 halves x 4 tokens = 8 ymm accumulators, 4 for the widened pairs

bool has_bf16() {
#ifdef ZOOINFER_LANES
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512bf16");
  return ok;
#else
  return false;
#endif
}

bool has_avx2() {
#ifdef ZOOINFER_LANES
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
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

// Tile t x tokens [m0, m0 + T) on AVX2: the bf16 pairs widened to fp32 (low half << 16: the
// even k; high half masked: the odd k), fp32 FMA with x^ in fp32 (xf [M, 2 KP]).
template <int T>
TARGET_AVX2 void avx2_block(const uint16_t* wv, const float* xf, int64_t KP, int64_t N, int64_t t, int64_t m0,
                            int64_t ld, float* tmax, float* rm) {
  __m256 acc[2][T];
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < T; ++j) acc[h][j] = _mm256_setzero_ps();
  const uint16_t* w = wv + t * KP * 32;
  const float* x = xf + m0 * 2 * KP;
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = 0; p < KP; ++p) {
    __m256 even[2], odd[2];
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32 + h * 16));
      even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      odd[h] = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
    }
    for (int j = 0; j < T; ++j) {
      const __m256 xe = _mm256_broadcast_ss(x + j * 2 * KP + 2 * p);
      const __m256 xo = _mm256_broadcast_ss(x + j * 2 * KP + 2 * p + 1);
      for (int h = 0; h < 2; ++h) acc[h][j] = _mm256_fmadd_ps(odd[h], xo, _mm256_fmadd_ps(even[h], xe, acc[h][j]));
    }
  }
  const int valid = __builtin_popcount(valid_rows(t, N));
  for (int j = 0; j < T; ++j) {
    alignas(32) float row[16];
    _mm256_store_ps(row, acc[0][j]);
    _mm256_store_ps(row + 8, acc[1][j]);
    float mx = -std::numeric_limits<float>::infinity();
    for (int r = 0; r < valid; ++r) mx = std::max(mx, row[r]);
    put(mx, t, m0 + j, ld, tmax, rm);
  }
}

template <int T>
void block(bool bf16, const uint16_t* wv, const uint16_t* xh, const float* xf, int64_t KP, int64_t N, int64_t t0,
           int64_t m0, int64_t ld, float* tmax, float* rm) {
  if (bf16) {
    bf16_block<T>(wv, reinterpret_cast<const uint32_t*>(xh), KP, N, t0, m0, ld, tmax, rm);
  } else if constexpr (T <= MAX_T2) {
    for (int64_t t = t0; t < t0 + RV; ++t) avx2_block<T>(wv, xf, KP, N, t, m0, ld, tmax, rm);
  }
}

// Vocab blocks [b0, b1) (RV tiles each) against every token: each block's weights stay in
// cache while all token blocks pass over them.
void screen_chunk(bool bf16, const uint16_t* wv, const uint16_t* xh, const float* xf, int64_t M, int64_t KP,
                  int64_t N, int64_t b0, int64_t b1, int64_t ld, float* tmax, float* rm) {
  const int step = bf16 ? MAX_T : MAX_T2;
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t m0 = 0; m0 < M; m0 += step) {
      const int64_t t0 = b * RV;
      switch (std::min<int64_t>(step, M - m0)) {
        case 1: block<1>(bf16, wv, xh, xf, KP, N, t0, m0, ld, tmax, rm); break;
        case 2: block<2>(bf16, wv, xh, xf, KP, N, t0, m0, ld, tmax, rm); break;
        case 3: block<3>(bf16, wv, xh, xf, KP, N, t0, m0, ld, tmax, rm); break;
        case 4: block<4>(bf16, wv, xh, xf, KP, N, t0, m0, ld, tmax, rm); break;
        case 5: block<5>(bf16, wv, xh, xf, KP, N, t0, m0, ld, tmax, rm); break;
        default: block<6>(bf16, wv, xh, xf, KP, N, t0, m0, ld, tmax, rm); break;
      }
    }
  }
}
#endif

std::vector<std::string> lane_screen_isas() {
  std::vector<std::string> out;
  if (has_bf16()) out.emplace_back("avx512_bf16");
  if (has_avx2()) out.emplace_back("avx2");
  return out;
}

at::Tensor screened_argmax_lanes(const at::Tensor& x, const at::Tensor& wv, const at::Tensor& panels, int64_t n,
                                 double w_norm, double wb_norm, double dw_norm, c10::string_view isa) {
  check_inputs("screened_argmax_lanes", x, panels, n);
  const int64_t M = x.size(0), K = x.size(1), KP = (K + 1) / 2;
  const int64_t NT = RV * ((n + RV * VT - 1) / (RV * VT));
  TORCH_CHECK(wv.dim() == 3 && wv.scalar_type() == at::kBFloat16 && wv.is_contiguous() && wv.size(0) == NT &&
                  wv.size(1) == KP && wv.size(2) == 32,
              "screened_argmax_lanes: wv must be contiguous bfloat16 pairs [", NT, ", ", KP, ", 32], got ", wv.sizes(),
              " ", wv.scalar_type());
  const bool bf16 = isa == "avx512_bf16";
  TORCH_CHECK(bf16 || isa == "avx2", "screened_argmax_lanes: isa must be 'avx512_bf16' or 'avx2', got '",
              std::string(isa), "'");
  TORCH_CHECK(bf16 ? has_bf16() : has_avx2(), "screened_argmax_lanes: isa '", std::string(isa),
              "' is not available on this CPU");
  if (M == 0 || !std::isfinite(w_norm + wb_norm + dw_norm)) return linear_argmax_op(x, panels, n);
#ifdef ZOOINFER_LANES
  const at::Tensor xc = x.contiguous();
  const int64_t ld = 16 * ((M + 15) / 16);
  std::vector<float> e2(ld, 0.f);
  std::vector<uint8_t> screened(M, 0);
  std::vector<uint16_t> xh(static_cast<size_t>(M * 2 * KP));
  token_bounds(xc.data_ptr<float>(), M, K, 2 * KP, 2 * KP, w_norm, wb_norm, dw_norm, xh.data(), e2.data(),
               screened.data());
  std::vector<float> xf;
  if (!bf16) {
    xf.resize(xh.size());
    for (size_t i = 0; i < xh.size(); ++i) xf[i] = from_bf16(xh[i]);
  }
  // The screen: per vocab tile and token, the tile's largest bf16 logit; threads take
  // contiguous ranges of vocab blocks, each with its own running maxima.
  const int64_t blocks = NT / RV;
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks));
  std::vector<float> tmax(static_cast<size_t>(NT * ld), -std::numeric_limits<float>::infinity());
  std::vector<float> rm(static_cast<size_t>(chunks * ld), -std::numeric_limits<float>::infinity());
  const auto* wp = reinterpret_cast<const uint16_t*>(wv.data_ptr<at::BFloat16>());
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t ch = c0; ch < c1; ++ch)
      screen_chunk(bf16, wp, xh.data(), xf.data(), M, KP, n, blocks * ch / chunks, blocks * (ch + 1) / chunks, ld,
                   tmax.data(), rm.data() + ch * ld);
  });
  return decide(xc, panels, n, NT, tmax.data(), ld, rm.data(), chunks, e2.data(), screened.data());
#else
  return linear_argmax_op(x, panels, n);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(zooinfer_cpu, m) {
  m.def("screened_argmax_lanes(Tensor x, Tensor wv, Tensor panels, int n, float w_norm, float wb_norm, "
        "float dw_norm, str isa) -> Tensor");
  m.impl("screened_argmax_lanes", c10::DispatchKey::CPU, TORCH_FN(screened_argmax_lanes));
  m.def("lane_screen_isas() -> str[]", TORCH_FN(lane_screen_isas));
}
