// What the GEMM-ordered int8-activation products share (quant_gemm_q8.cpp: AVX-512 VNNI register
// tiles; quant_gemm_amx.cpp: AMX tiles): x quantized once per call with its group sums, the weights
// of 16 columns unpacked once per block of rows into the VNNI order (which is also AMX's B
// operand layout: 4 k x 16 columns per 64-byte row), and the loop that hands the packed tiles of
// a thread's columns to a kernel. quant_gemm_q8.cpp's header says why this order.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "quant_panels.h"
#include "quant_xq.h"

namespace zi_quant {

constexpr int64_t NT = 16;    // columns per tile: one int32 lane each
constexpr int64_t MB = 128;   // rows per block at least: the weights of a tile are unpacked once per block

// Rows per block: the xq of up to ~1 MB of x (L2) and at least MB rows, a multiple of `step` (the
// kernel's rows per register tile); each block unpacks every tile again (at 128-row blocks the
// unpacking took ~12% of the VNNI op).
inline int64_t row_block(int64_t K, int64_t step) {
  return std::max<int64_t>(MB, ((int64_t(1) << 20) / K) / step * step);
}

// Per call: x quantized, plus what the min / zero term and the 8-bit correction need.
struct Prep {
  XQ xq;                      // natural order, xq.ldq per row
  std::vector<float> xsum;    // [M, ng] exact fp32 group sums (weights with an offset only)
  std::vector<int32_t> corr;  // [M, K / U] -128 x sum of each unit's xq (8-bit weights only)
  int64_t ng = 0, nu = 0;
};

ZI_VNNI inline void prep_rows(const float* x, int64_t K, int64_t G, int64_t U, bool sums, bool eight, int64_t m0,
                       int64_t m1, Prep& p) {
  quantize_rows(x, K, m0, m1, K, false, p.xq);
  for (int64_t m = m0; m < m1; ++m) {
    const float* xr = x + m * K;
    for (int64_t g = 0; sums && g < p.ng; ++g) {     // 16 lanes summed in k order, then across lanes
      __m512 a = _mm512_setzero_ps();
      for (int64_t k = g * G; k < (g + 1) * G; k += 16) a = _mm512_add_ps(a, _mm512_loadu_ps(xr + k));
      p.xsum[m * p.ng + g] = _mm512_reduce_add_ps(a);
    }
    const int8_t* q = p.xq.q.data() + m * p.xq.ldq;
    for (int64_t u = 0; eight && u < p.nu; ++u) {
      __m512i s = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + u * U)));
      if (U == 32) s = _mm512_add_epi32(s, _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + u * U + 16))));
      p.corr[m * p.nu + u] = -128 * _mm512_reduce_add_epi32(s);
    }
  }
}

// Columns c0..c0 + nc of the tile `t` (bits 4 or 8, fp32 scales) in the VNNI order: wt[k / 4] is
// 64 bytes (16 columns x 4 weights), su[u] the 16 columns' scales of unit u, off[g] their offsets;
// columns past nc get zero weights, scales and offsets. 4-bit q as they are (0..15); 8-bit q with
// the sign bit flipped (q + 128, unsigned: vpdpbusd) when `flip`, else as stored (AMX's signed x
// signed product).
ZI_VNNI inline void pack_tile(const QW& t, int64_t c0, int64_t nc, int64_t U, const uint8_t* zeros, uint8_t* wt,
                              float* su, float* off, bool flip = true) {
  const int64_t K = t.k, ng = K / t.group, nu = K / U;
  const uint8_t* ptr[NT];
  for (int64_t c = 0; c < NT; ++c) ptr[c] = c < nc ? t.qs + (c0 + c) * t.row_bytes() : zeros;
  const __m512i low4 = _mm512_set1_epi8(0x0F), sign = _mm512_set1_epi8(static_cast<char>(flip ? 0x80 : 0));
  __m512i v[4];
  // the next tile's rows (the 16 rows after these, contiguous) prefetched meanwhile, a share per block:
  // this tile reads its rows 16 bytes at a time across 16 rows, which the hardware prefetchers follow poorly
  const int64_t region = NT * t.row_bytes(), share = region / (K / 32);
  const char* next = c0 + 2 * NT <= t.n ? reinterpret_cast<const char*>(t.qs + (c0 + NT) * t.row_bytes()) : nullptr;
  for (int64_t b = 0; b < K / 32; ++b) {
    for (int64_t o = b * share; next && o < (b + 1) * share; o += 64) __builtin_prefetch(next + o, 0, 0);
    __m512i* dst = reinterpret_cast<__m512i*>(wt + b * 8 * 64);
    if (t.bits == 4) {          // byte j: weight j low nibble, weight j + 16 high nibble
      transpose16(ptr, b * 16, v);
      for (int d = 0; d < 4; ++d) {
        _mm512_store_si512(dst + d, _mm512_and_si512(v[d], low4));
        _mm512_store_si512(dst + 4 + d, _mm512_and_si512(_mm512_srli_epi16(v[d], 4), low4));
      }
    } else {
      for (int h = 0; h < 2; ++h) {
        transpose16(ptr, b * 32 + h * 16, v);
        for (int d = 0; d < 4; ++d) _mm512_store_si512(dst + 4 * h + d, _mm512_xor_si512(v[d], sign));
      }
    }
  }
  const float z = static_cast<float>(t.zero);
  if (nc == NT) {                          // a full tile: the 16 columns' scales gathered per group
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(static_cast<int>(ng)));
    const float* sc = t.scale + c0 * ng;
    const float* mn = t.minv ? t.minv + c0 * ng : nullptr;
    const __m512 zv = _mm512_set1_ps(z);
    for (int64_t g = 0, u = 0; g < ng; ++g) {
      const __m512 s = _mm512_i32gather_ps(idx, sc + g, 4);
      for (const int64_t u1 = u + t.group / U; u < u1; ++u) _mm512_store_ps(su + u * NT, s);
      if (off) {
        const __m512 m = mn ? _mm512_i32gather_ps(idx, mn + g, 4) : _mm512_setzero_ps();
        _mm512_store_ps(off + g * NT, _mm512_fnmadd_ps(zv, s, m));   // QW::offset, fused as GCC contracts the scalar form
      }
    }
    return;
  }
  std::fill(su, su + nu * NT, 0.f);
  if (off) std::fill(off, off + ng * NT, 0.f);
  for (int64_t c = 0; c < nc; ++c) {       // no divisions in these loops: they run once per tile and block
    const float* sc = t.scale + (c0 + c) * ng;
    const float* mn = t.minv ? t.minv + (c0 + c) * ng : nullptr;
    for (int64_t g = 0, u = 0; g < ng; ++g) {
      for (const int64_t u1 = u + t.group / U; u < u1; ++u) su[u * NT + c] = sc[g];
      if (off) off[g * NT + c] = (mn ? mn[g] : 0.f) - z * sc[g];     // QW::offset
    }
  }
}

// A packed tile (pack_tile's wt, su, off).
struct Tile {
  const uint8_t* wt;
  const float* su;
  const float* off;
};

// run(a, b, two, m0, m1, col, cols) for every packed tile (pair) of w's columns and block of `mb`
// rows: threads split the columns in pairs of tiles; `a` holds columns col..col + 16 (`cols` the
// mask of those stored: a last tile has fewer), `b` (two: true) the 16 after them.
template <class F>
void for_packed_tiles(const QW& w, const Prep& p, int64_t M, int64_t U, int64_t mb, bool flip, F&& run) {
  const int64_t N = w.n, K = w.k, pairs = (N + 2 * NT - 1) / (2 * NT);
  const bool sums = w.has_min() || w.tile_zero();
  at::parallel_for(0, pairs, 1, [&](int64_t t0, int64_t t1) {
    // per thread: two tiles' unpacked weights (64-byte aligned), scales and offsets
    const int64_t wsz = NT * K + 64, ssz = p.nu * NT + 16, osz = sums ? p.ng * NT + 16 : 0;
    std::unique_ptr<uint8_t[]> wbuf(new uint8_t[2 * wsz]);
    std::vector<float> sbuf(2 * ssz), obuf(2 * osz);
    auto align = [](auto* q) { return reinterpret_cast<decltype(q)>((reinterpret_cast<uintptr_t>(q) + 63) & ~uintptr_t(63)); };
    const Tile a{align(wbuf.get()), align(sbuf.data()), sums ? align(obuf.data()) : nullptr};
    const Tile b{align(wbuf.get() + wsz), align(sbuf.data() + ssz), sums ? align(obuf.data() + osz) : nullptr};
    const std::vector<uint8_t> zeros(static_cast<size_t>(std::max<int64_t>(w.row_bytes(), 64)), 0);
    auto pack = [&](const QW& t, int64_t c0, int64_t nc, const Tile& d) {
      pack_tile(t, c0, nc, U, zeros.data(), const_cast<uint8_t*>(d.wt), const_cast<float*>(d.su),
                const_cast<float*>(d.off), flip);
    };
    for_row_tiles(w, 2, t0 * 2 * NT, std::min(N, t1 * 2 * NT), [&](const QW& t, int64_t r0, int64_t r1) {
      for (int64_t m0 = 0; m0 < M; m0 += mb) {
        const int64_t m1 = std::min(M, m0 + mb);
        for (int64_t c0 = 0; c0 < r1 - r0;) {
          if (c0 + 2 * NT <= r1 - r0) {          // two full tiles
            pack(t, c0, NT, a);
            pack(t, c0 + NT, NT, b);
            run(a, b, true, m0, m1, r0 + c0, __mmask16(0xFFFF));
            c0 += 2 * NT;
          } else {                               // the last one, of up to 16 columns
            const int64_t nc = std::min(NT, r1 - r0 - c0);
            pack(t, c0, nc, a);
            run(a, a, false, m0, m1, r0 + c0, static_cast<__mmask16>((1u << nc) - 1));
            c0 += nc;
          }
        }
      }
    });
  });
}

// The AMX-INT8 product (quant_gemm_amx.cpp): out [M, w.n] for Prep p of x's M rows (xq allocated
// for M rounded up to 16 rows, zero past M; no 8-bit correction: AMX multiplies signed by signed).
// The same bits as the VNNI kernel. Needs q8_amx_ready().
void q8_gemm_amx(const QW& w, const Prep& p, int64_t M, int64_t U, float* out);

// Whether this CPU and OS run AMX-INT8 tiles (the tile data permission granted to the process).
bool q8_amx_ready();

}  // namespace zi_quant
