// What every bf16 screen of the greedy LM head shares (screened_argmax.cpp on AMX tiles,
// screened_lanes.cpp with VDPBF16PS or AVX2): the per-token error bound that makes the screen
// exact, and the fp32 decision among the vocab tiles the bound cannot rule out. Only the
// screen pass itself (the per-tile maxima of the bf16 logits) differs between instruction sets.
//
// The bound (derivation in screened_argmax.cpp's header): a bf16 logit (x and W rounded to bf16,
// products exact in fp32, fp32 sums in any order of at most `kterms` roundings, denormals
// possibly flushed) is within E of the fp32 logit, so the fp32 argmax lies in a 16-row vocab
// tile whose bf16 maximum is within 2E of the token's best bf16 logit.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "panels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace zooinfer_screen {

using namespace zooinfer_panels;

constexpr int64_t VT = 16;         // vocab rows per screen tile
// Candidate tiles per token before it takes linear_argmax: max(MAX_TILES, NT / 4). Deciding c
// tiles costs c * K vector FMAs for that token alone, a linear_argmax pass about NT * K for up
// to 16 tokens (its lanes) plus the head's bytes again, so a token with a quarter of the
// vocab still in play is decided directly (trained heads on random-token prompts, SmolLM2: up
// to ~90 of 3072 tiles; a fixed cap of 64 sent such tokens through a whole fp32 pass).
constexpr int64_t MAX_TILES = 64;

inline uint16_t to_bf16(float f) {   // round to nearest even (finite inputs; others fall back)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

inline float from_bf16(uint16_t b) {
  const uint32_t bits = uint32_t(b) << 16;
  float h;
  std::memcpy(&h, &bits, 4);
  return h;
}

// Per token m of x [M, K]: its bf16 rounding into xh[m * kpad + k] (zero past K, and all zero
// for a token that is not screened), 2E into e2[m] and screened[m] = 1 when the bound exists
// (x finite and its logits far from fp32's range). `kterms` >= the number of roundings of one
// screened sum (the padded K of the screen pass).
inline void token_bounds(const float* xp, int64_t M, int64_t K, int64_t kpad, int64_t kterms, double w_norm,
                         double wb_norm, double dw_norm, uint16_t* xh, float* e2, uint8_t* screened) {
  const double g32 = double(kterms) * std::ldexp(1.0, -24), gamma = g32 / (1 - g32);
  for (int64_t m = 0; m < M; ++m) {
    const float* row = xp + m * K;
    uint16_t* dst = xh + m * kpad;
    double xx = 0, xhh = 0, dx = 0;
    for (int64_t k = 0; k < K; ++k) {
      dst[k] = to_bf16(row[k]);
      const double h = from_bf16(dst[k]);
      xx += double(row[k]) * row[k];
      xhh += h * h;
      dx += (double(row[k]) - h) * (double(row[k]) - h);
    }
    std::fill(dst + K, dst + kpad, uint16_t(0));
    const double nx = std::sqrt(xx), nh = std::sqrt(xhh);
    screened[m] = 0;
    e2[m] = 0.f;
    if (!(nx * w_norm < 1e30 && nh * wb_norm < 1e30)) {   // NaN/inf x, or logits near fp32's range
      std::fill(dst, dst + kpad, uint16_t(0));
      continue;
    }
    const double err = nx * dw_norm + std::sqrt(dx) * wb_norm + 1.01 * gamma * (nx * w_norm + nh * wb_norm) +
                       double(kterms) * std::ldexp(1.0, -124) * (2 + nx + w_norm);
    e2[m] = static_cast<float>(2 * err * 1.01);   // 1%: the threshold max - 2E is itself rounded
    screened[m] = 1;
  }
}

// Bit j set where a[j] >= b[j] (false for NaN).
inline uint32_t ge_mask(vf16 a, vf16 b) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask(reinterpret_cast<__m512&>(a), reinterpret_cast<__m512&>(b), _CMP_GE_OQ);
#else
  const vi16 ge = a >= b;
  uint32_t bits = 0;
  for (int j = 0; j < 16; ++j) bits |= uint32_t(ge[j] & 1) << j;
  return bits;
#endif
}

inline at::Tensor linear_argmax_op(const at::Tensor& x, const at::Tensor& panels, int64_t n) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("zooinfer_cpu::linear_argmax", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>();
  return op.call(x, panels, n);
}

// The decision after a screen pass. tmax [NT, ld] holds each 16-row vocab tile's largest bf16
// logit per token (ld = 16 * ceil(M / 16) token lanes), rm [chunks, ld] each screen chunk's
// running maximum per token. Every row of the tiles within 2E of a token's best is recomputed
// in fp32 from the panels exactly as linear_argmax sums them (k order, one fused multiply-add
// per step); the first maximum among them is the fp32 argmax (any row before it with the same
// logit would itself be the first maximum). Tokens not screened, or with more than
// max(MAX_TILES, NT / 4) candidate tiles (x = 0 ties everything), take linear_argmax.
// xc: contiguous x [M, K].
inline at::Tensor decide(const at::Tensor& xc, const at::Tensor& panels, int64_t n, int64_t NT, const float* tmax,
                         int64_t ld, const float* rm, int64_t chunks, const float* e2, const uint8_t* screened) {
  const int64_t M = xc.size(0), K = xc.size(1), G = ld / 16;
  const float* xp = xc.data_ptr<float>();
  at::Tensor out = at::empty({M}, xc.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const float* pp = panels.data_ptr<float>();
  const int64_t cap = std::max<int64_t>(MAX_TILES, NT / 4);
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    std::vector<int32_t> tiles[16];
    for (int64_t g = g0; g < g1; ++g) {
      vf16 thr;
      for (int j = 0; j < 16; ++j) {
        const int64_t m = g * 16 + j;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t ch = 0; ch < chunks; ++ch) top = std::max(top, rm[ch * ld + m]);
        thr[j] = m < M && screened[m] ? top - e2[m] : std::numeric_limits<float>::infinity();
        tiles[j].clear();
      }
      for (int64_t t = 0; t < NT; ++t) {   // tiles picked 16 tokens (one group) per vector compare
        for (uint32_t k = ge_mask(load(tmax + t * ld + g * 16), thr); k; k &= k - 1) {
          auto& list = tiles[__builtin_ctz(k)];
          if (static_cast<int64_t>(list.size()) <= cap) list.push_back(static_cast<int32_t>(t));
        }
      }
      for (int j = 0; j < 16 && g * 16 + j < M; ++j) {
        const int64_t m = g * 16 + j;
        op[m] = -1;
        if (!screened[m] || static_cast<int64_t>(tiles[j].size()) > cap) continue;
        const float* xr = xp + m * K;
        float best = 0.f;
        int64_t best_n = -1;
        for (const int32_t t : tiles[j]) {   // ascending: the first maximum wins
          const float* p = pp + (t / 2) * K * NR + (t % 2) * VT;
          vf16 acc = splat(0.f);
          for (int64_t k = 0; k < K; ++k) acc += load(p + k * NR) * splat(xr[k]);
          const int64_t valid = std::min<int64_t>(VT, n - int64_t(t) * VT);
          for (int64_t r = 0; r < valid; ++r)
            if (best_n < 0 || acc[r] > best) best = acc[r], best_n = int64_t(t) * VT + r;
        }
        op[m] = best_n;
      }
    }
  });
  std::vector<int64_t> rest;
  for (int64_t m = 0; m < M; ++m)
    if (op[m] < 0) rest.push_back(m);
  if (!rest.empty()) {
    const at::Tensor idx = at::tensor(rest, out.options());
    out.index_put_({idx}, linear_argmax_op(xc.index_select(0, idx), panels, n));
  }
  return out;
}

// The screen pass over threads, then the decision. The vocab is `units` work units (tiles,
// tile pairs or tile blocks: whatever the screen's inner loop walks); each thread takes a
// contiguous range of them with its own running maxima, so no two threads write one rm row.
// screen(u0, u1, tmax, rm) fills tmax for its units' tiles and folds their maxima into rm [ld].
template <class Screen>
inline at::Tensor screen_then_decide(const at::Tensor& xc, const at::Tensor& panels, int64_t n, int64_t NT,
                                     int64_t ld, int64_t units, const float* e2, const uint8_t* screened,
                                     const Screen& screen) {
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units));
  std::vector<float> tmax(static_cast<size_t>(NT * ld), -std::numeric_limits<float>::infinity());
  std::vector<float> rm(static_cast<size_t>(chunks * ld), -std::numeric_limits<float>::infinity());
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t ch = c0; ch < c1; ++ch)
      screen(units * ch / chunks, units * (ch + 1) / chunks, tmax.data(), rm.data() + ch * ld);
  });
  return decide(xc, panels, n, NT, tmax.data(), ld, rm.data(), chunks, e2, screened);
}

}  // namespace zooinfer_screen
