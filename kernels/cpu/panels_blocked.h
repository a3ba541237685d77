// The blocked fp32 GEMM's register kernel and x packing (panel_gemm_blocked.cpp: prefill chunks on
// fp32 panels; quant_gemm_panels.cpp: the same kernel on panels dequantized from quantized weights).
// panel_gemm_blocked.cpp's header describes the layout and the loop order around them.
#pragma once

#include "panels.h"

#include <algorithm>
#include <cstring>

namespace zooinfer_panels {
namespace blocked {

constexpr int MR = 14;          // rows per register tile: 28 accumulators + 2 panel vectors + 1 broadcast
constexpr int64_t KC = 256;     // k steps per block: 32 KB of panel, reused by every row tile
constexpr int64_t RB = 16;      // row tiles per packed chunk: 16 * 12 rows * 256 k * 4 B = 192 KB (L2)

// c[MR, 32] (row stride ldc) = (ACCUM ? c : 0) + a_tile[kc, MR] @ panel[kc, 32] (+ add, 32 floats,
// when not null: the bias, after the last k block); `rows` of the tile's MR are stored (the rest
// are the zero rows past M).
template <bool ACCUM>
inline void micro(const float* __restrict a, const float* __restrict b, int64_t kc, float* __restrict c,
                  int64_t ldc, const float* __restrict add, int rows) {
  vf16 c0[MR], c1[MR];
  if (ACCUM) {
    for (int i = 0; i < MR; ++i) {
      if (i < rows) {
        c0[i] = load(c + i * ldc);
        c1[i] = load(c + i * ldc + 16);
      } else {
        c0[i] = c1[i] = splat(0.f);
      }
    }
  } else {
    for (int i = 0; i < MR; ++i) c0[i] = c1[i] = splat(0.f);
  }
  for (int64_t k = 0; k < kc; ++k) {
    const vf16 b0 = load(b + k * NR), b1 = load(b + k * NR + 16);
    const float* ak = a + k * MR;
    for (int i = 0; i < MR; ++i) {
      const vf16 s = splat(ak[i]);
      c0[i] += s * b0;
      c1[i] += s * b1;
    }
  }
  if (add) {
    const vf16 a0 = load(add), a1 = load(add + 16);
    for (int i = 0; i < MR; ++i) {
      c0[i] += a0;
      c1[i] += a1;
    }
  }
  for (int i = 0; i < MR; ++i) {
    if (i < rows) {
      store(c + i * ldc, c0[i]);
      store(c + i * ldc + 16, c1[i]);
    }
  }
}

// Pack rows [m0, m0 + 12 * tiles) of x, k steps [k0, k0 + kc), as `tiles` row tiles [kc, MR].
inline void pack_rows(const float* x, int64_t ldx, int64_t M, int64_t m0, int64_t tiles, int64_t k0, int64_t kc,
               float* dst) {
  for (int64_t t = 0; t < tiles; ++t) {
    float* d = dst + t * kc * MR;
    for (int i = 0; i < MR; ++i) {
      const int64_t m = m0 + t * MR + i;
      if (m < M) {
        const float* src = x + m * ldx + k0;
        for (int64_t k = 0; k < kc; ++k) d[k * MR + i] = src[k];
      } else {
        for (int64_t k = 0; k < kc; ++k) d[k * MR + i] = 0.f;
      }
    }
  }
}

// One KC block of one panel for `ct` packed row tiles (ap, from row m0 on): out[m, col : col + w]
// = (first ? 0 : out) + tiles @ panel (+ add + col after the last block, when `add` is not null),
// for the w = min(NR, n - col) real columns; a panel past N goes through the stack tile `tail`.
inline void panel_block(const float* ap, int64_t ct, int64_t m0, int64_t M, int64_t kc, const float* panel,
                        float* out, int64_t n, int64_t col, bool first, const float* add, float* tail) {
  const int64_t w = std::min(NR, n - col);
  for (int64_t t = 0; t < ct; ++t) {
    const int64_t m = m0 + t * MR;
    const int rows = static_cast<int>(std::min<int64_t>(MR, M - m));
    const float* a = ap + t * kc * MR;
    float* c = w == NR ? out + m * n + col : tail;
    const int64_t ldc = w == NR ? n : NR;
    if (w != NR && !first)
      for (int i = 0; i < rows; ++i) std::memcpy(tail + i * NR, out + (m + i) * n + col, sizeof(float) * w);
    if (first) micro<false>(a, panel, kc, c, ldc, add ? add + col : nullptr, rows);
    else micro<true>(a, panel, kc, c, ldc, add ? add + col : nullptr, rows);
    if (w != NR)
      for (int i = 0; i < rows; ++i) std::memcpy(out + (m + i) * n + col, tail + i * NR, sizeof(float) * w);
  }
}

}  // namespace blocked
}  // namespace zooinfer_panels
