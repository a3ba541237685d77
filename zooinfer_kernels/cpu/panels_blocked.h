// The blocked fp32 GEMM's register kernel and x packing (panel_gemm_blocked.cpp: prefill chunks on
// fp32 panels; quant_gemm_panels.cpp: the same kernel on panels dequantized from quantized weights).
// panel_gemm_blocked.cpp's header describes the layout and the loop order around them.
#pragma once

#include "panels.h"

#include <unistd.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstring>

namespace zooinfer_panels {
namespace blocked {

// Rows per register tile: 2 * MR accumulators + 2 panel vectors + 1 broadcast (panels.h: AVX-512's 32
// zmm hold 14 rows of a whole panel; AVX2's 16 ymm hold 6 rows of half a panel, run once per half).
constexpr int MR = VW == 16 ? 14 : 6;
// k steps per block, at most (K split evenly into the fewest blocks of at most KC, no short tail
// block): each k block costs every register tile a load and store of its accumulators, so fewer,
// longer blocks win. On Zen 3 (AVX2, one thread, 2048 rows, bench/prefill_gemm's shapes) K = 576 in
// one block instead of 256 + 256 + 64 took gate_up from 77 to 86 GFLOP/s and K = 1536 in two blocks
// from 85 to 87 (L1 peak: 99). On AVX-512 the same blocks need the row-tile-outer order below.
constexpr int64_t KC = 768;
// Row tiles per packed chunk: 112 rows x 768 k (344 KB, L2) with AVX-512; 192 rows with AVX2 (576 KB,
// past Zen 3's 512 KB L2, yet 16 tiles measured no faster there).
constexpr int64_t RB = VW == 16 ? 8 : 32;
// Full panels per group on AVX-512 (`group_block`): a row tile runs over PG panels before the next
// tile, so its packed x (kc x 14 floats, 43 KB at kc = 768) is read from L1 / L2 once per group
// while the group's panels (PG x 96 KB) stream from L2 for every tile of the chunk. With AVX2 the
// panel-outer order of `panel_block` stays (1: no groups).
constexpr int64_t PG = VW == 16 ? 4 : 1;

// With AVX-512 the micro-kernel prefetches the panel row this many k steps ahead: in the grouped
// order a panel streams from L2 through each tile's pass, and on an AVX-512 Xeon (one thread, a
// standalone copy of the loop, 2048 rows) that took qkv / gate_up / down from 132 / 129 / 121 to
// 142 / 144 / 131 GFLOP/s (8 to 64 steps ahead all within 2%; prefetching the packed x as well
// lost 5-8%). A prefetch past the panel's end is only a hint: it never faults.
constexpr int64_t PF_K = 16;

// The most k steps of a block here: KC, and on AVX-512 at most what keeps a packed x tile (k x MR
// floats, re-read for each panel of a group) within 7/8 of this CPU's L1 data cache (48 KB: 768;
// 32 KB, as on AMD Zen 4 / 5: 512, unmeasured there).
inline int64_t k_block_max() {
  if constexpr (VW != 16) return KC;
  static const int64_t cap = [] {
    const long l1 = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    if (l1 <= 0) return KC;
    return std::clamp<int64_t>(l1 * 7 / 8 / (MR * 4) / 64 * 64, 256, KC);
  }();
  return cap;
}

// The k steps of each block for a K-deep product: K split evenly into the fewest blocks of at most
// k_block_max(); the callers' min(step, K - k0) ends each product.
inline int64_t k_step(int64_t K) {
  const int64_t most = k_block_max();
  if (K <= most) return most;
  const int64_t blocks = (K + most - 1) / most;
  return (K + blocks - 1) / blocks;
}

// c[MR, TC] (row stride ldc) = (ACCUM ? c : 0) + a_tile[kc, MR] @ b[kc, TC] (b's rows NR floats apart;
// + add, TC floats, when not null: the bias, after the last k block); `rows` of the tile's MR are
// stored (the rest are the zero rows past M). b, c and add are offset to the tile's first column.
template <bool ACCUM>
inline void micro(const float* __restrict a, const float* __restrict b, int64_t kc, float* __restrict c,
                  int64_t ldc, const float* __restrict add, int rows) {
  vreg c0[MR], c1[MR];
  if (ACCUM) {
    for (int i = 0; i < MR; ++i) {
      if (i < rows) {
        c0[i] = vload(c + i * ldc);
        c1[i] = vload(c + i * ldc + VW);
      } else {
        c0[i] = c1[i] = vreg{};
      }
    }
  } else {
    for (int i = 0; i < MR; ++i) c0[i] = c1[i] = vreg{};
  }
  for (int64_t k = 0; k < kc; ++k) {
    if constexpr (VW == 16) {   // the panel row PF_K steps ahead (both its lines): see PF_K
      __builtin_prefetch(b + (k + PF_K) * NR, 0, 3);
      __builtin_prefetch(b + (k + PF_K) * NR + 16, 0, 3);
    }
    const vreg b0 = vload(b + k * NR), b1 = vload(b + k * NR + VW);
    const float* ak = a + k * MR;
    for (int i = 0; i < MR; ++i) {
      const vreg s = vsplat(ak[i]);
      c0[i] += s * b0;
      c1[i] += s * b1;
    }
  }
  if (add) {
    const vreg a0 = vload(add), a1 = vload(add + VW);
    for (int i = 0; i < MR; ++i) {
      c0[i] += a0;
      c1[i] += a1;
    }
  }
  for (int i = 0; i < MR; ++i) {
    if (i < rows) {
      vstore(c + i * ldc, c0[i]);
      vstore(c + i * ldc + VW, c1[i]);
    }
  }
}

#if defined(__AVX512F__)
// r[j] lane i <- r[i] lane j for 16 vectors of 16 floats: pairs, then quads within 128-bit lanes,
// then the lanes themselves (64 shuffles for 256 values).
inline void transpose16x16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  __m512 u[16];   // u[4b + c], 128-bit lane L: rows 4b .. 4b + 3 at column 4L + c
  for (int b = 0; b < 16; b += 4) {
    const __m512d t0 = _mm512_castps_pd(t[b]), t1 = _mm512_castps_pd(t[b + 1]);
    const __m512d t2 = _mm512_castps_pd(t[b + 2]), t3 = _mm512_castps_pd(t[b + 3]);
    u[b] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
    u[b + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
    u[b + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
    u[b + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 p0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44), p1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
    const __m512 q0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
    const __m512 q1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_f32x4(p0, q0, 0x88);
    r[4 + c] = _mm512_shuffle_f32x4(p0, q0, 0xDD);
    r[8 + c] = _mm512_shuffle_f32x4(p1, q1, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(p1, q1, 0xDD);
  }
}
#endif

// Pack rows [m0, m0 + MR * tiles) of x, k steps [k0, k0 + kc), as `tiles` row tiles [kc, MR] (zero
// rows past M). With AVX-512, 16 k steps of a tile's rows at a time: 14 row loads, one 16 x 16
// transpose, 16 stores of 14 floats. Why: the scalar copy (a 4-byte store per value) took 8-16% of
// a prefill product whose N is small next to its K (SmolLM2's o and down: 2048 x 576 x 576 and
// 2048 x 1536 x 576, one thread on an AVX-512 Xeon); the same values either way.
inline void pack_rows(const float* x, int64_t ldx, int64_t M, int64_t m0, int64_t tiles, int64_t k0, int64_t kc,
               float* dst) {
  for (int64_t t = 0; t < tiles; ++t) {
    float* d = dst + t * kc * MR;
    int64_t k = 0;
#if defined(__AVX512F__)
    static_assert(MR <= 16, "a row tile is at most one 16 x 16 transpose wide");
    {
      const int64_t live = std::clamp<int64_t>(M - (m0 + t * MR), 0, MR);
      const float* src = x + (m0 + t * MR) * ldx + k0;
      const __mmask16 keep = static_cast<__mmask16>((1u << MR) - 1);
      for (; k + 16 <= kc; k += 16) {
        __m512 r[16];
        for (int i = 0; i < 16; ++i) r[i] = i < live ? _mm512_loadu_ps(src + i * ldx + k) : _mm512_setzero_ps();
        transpose16x16(r);
        for (int j = 0; j < 16; ++j) _mm512_mask_storeu_ps(d + (k + j) * MR, keep, r[j]);
      }
    }
#endif
    for (int i = 0; i < MR; ++i) {
      const int64_t m = m0 + t * MR + i;
      if (m < M) {
        const float* src = x + m * ldx + k0;
        for (int64_t kk = k; kk < kc; ++kk) d[kk * MR + i] = src[kk];
      } else {
        for (int64_t kk = k; kk < kc; ++kk) d[kk * MR + i] = 0.f;
      }
    }
  }
}

// micro() on one register tile, the first k block (write) or a later one (accumulate)
inline void tile_product(bool first, const float* a, const float* b, int64_t kc, float* c, int64_t ldc,
                         const float* add, int rows) {
  if (first) micro<false>(a, b, kc, c, ldc, add, rows);
  else micro<true>(a, b, kc, c, ldc, add, rows);
}

// One KC block of one panel for `ct` packed row tiles (ap, from row m0 on): out[m, col : col + w]
// = (first ? 0 : out) + tiles @ panel (+ add + col after the last block, when `add` is not null),
// for the w = min(NR, n - col) real columns; a panel past N goes through the stack tile `tail`.
inline void panel_block(const float* ap, int64_t ct, int64_t m0, int64_t M, int64_t kc, const float* panel,
                        float* out, int64_t n, int64_t col, bool first, const float* add, float* tail) {
  const int64_t w = std::min(NR, n - col);
  if (w == NR) {
    // Column tile outer, row tiles inner: on AVX2 (two 16-column tiles a panel) each row tile then
    // reads one half panel (kc x 16 floats) that the previous tile just read, where the whole panel
    // plus the tile overflowed Zen 3's 32 KB L1 even at kc = 256. Same FMAs per output.
    for (int64_t j = 0; j < NR; j += TC) {
      for (int64_t t = 0; t < ct; ++t) {
        const int64_t m = m0 + t * MR;
        const int rows = static_cast<int>(std::min<int64_t>(MR, M - m));
        const float* a = ap + t * kc * MR;
        tile_product(first, a, panel + j, kc, out + m * n + col + j, n, add ? add + col + j : nullptr, rows);
      }
    }
    return;
  }
  for (int64_t t = 0; t < ct; ++t) {   // the last panel, past N: through `tail`
    const int64_t m = m0 + t * MR;
    const int rows = static_cast<int>(std::min<int64_t>(MR, M - m));
    const float* a = ap + t * kc * MR;
    if (!first)
      for (int i = 0; i < rows; ++i) std::memcpy(tail + i * NR, out + (m + i) * n + col, sizeof(float) * w);
    for (int64_t j = 0; j < NR; j += TC)
      tile_product(first, a, panel + j, kc, tail + j, NR, add ? add + col + j : nullptr, rows);
    for (int i = 0; i < rows; ++i) std::memcpy(out + (m + i) * n + col, tail + i * NR, sizeof(float) * w);
  }
}

// One KC block of the full panels [p0, p1) (all NR columns real; `pk` is the first panel's block,
// panels K * NR floats apart) for `ct` packed row tiles: row tile outer, panels inner (see PG).
// Same micro-kernel calls as panel_block, in another order: the same sums.
inline void group_block(const float* ap, int64_t ct, int64_t m0, int64_t M, int64_t kc, const float* pk, int64_t K,
                        int64_t p0, int64_t p1, float* out, int64_t n, bool first, const float* add) {
  for (int64_t t = 0; t < ct; ++t) {
    const int64_t m = m0 + t * MR;
    const int rows = static_cast<int>(std::min<int64_t>(MR, M - m));
    const float* a = ap + t * kc * MR;
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < NR; j += TC)
        tile_product(first, a, pk + p * K * NR + j, kc, out + m * n + p * NR + j, n, add ? add + p * NR + j : nullptr,
                     rows);
  }
}

}  // namespace blocked
}  // namespace zooinfer_panels
