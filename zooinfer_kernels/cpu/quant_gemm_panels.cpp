// The exact (fp32-activation) product on quantized weights past the decode rows: quant_gemm.cpp's
// `quant_linear` calls `quant_panel_gemm` for more than DECODE_ROWS rows on its AVX-512 path.
//
// Why: dequantizing ~4 MB fp32 tiles and calling at::mm wrote and re-read every weight in fp32
// and ran MKL's AVX2 code on AMD CPUs (32 rows took twice the fp32 panels' time). Here the weight
// is dequantized into exactly what the blocked fp32 GEMM reads (panel_gemm_blocked.cpp, 81% of
// the FMA peak on Zen 4): a panel of 32 columns x KC = 256 k steps (32 KB, in L1 / L2) at a time,
// consumed at once by its register kernel (`blocked::micro`) for every row tile of a chunk of
// rows packed as that GEMM packs them. Threads split the columns (whole panels), so each weight
// is dequantized by one thread only, once per chunk of RB * MR rows (224 with AVX-512).
//
// Dequantizing a panel: for 16 columns at a time, `transpose16` brings a 32-weight block's bytes
// of the 16 rows side by side (lane c = column c); each k is then a shift and mask of those lanes,
// a conversion and one FMA with the 16 columns' scale and offset for its group, kept transposed
// ([group][column]) per thread: w = scale * q + (min - zero * scale), the very operations of
// quant_gemm.cpp's `dequant_avx512` (so `quant_dequantize` gives the same floats).
//
// Exactness: each output is the blocked GEMM's one fp32 FMA chain over k in increasing order on
// those floats, then + bias, so the result equals panel_linear_blocked(x, panels of
// quant_dequantize(W)) bit for bit (tests/test_quant_panels.py), and x @ dequantize(W)^T to the fp32
// bound tests/test_quant.py states.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "panels_blocked.h"
#include "quant_panels.h"
#include "quant_storage.h"

namespace zi_quant {
namespace {

using zooinfer_panels::NR;
// Its own blocks (the fp32 GEMM's grew to 768 k steps for packed panels in memory): a dequantized
// panel of 256 k steps (32 KB) stays in L1 for every row tile of a chunk of 16 tiles (224 rows).
constexpr int64_t KC = 256;
constexpr int64_t RB = 16;
constexpr int BMR = zooinfer_panels::blocked::MR;   // rows per register tile (zi_quant::MR is the decode one)

// A thread's columns [n0, n1) as its panels are dequantized from: q as 4 or 8 bits (5 / 6-bit
// storage expanded to int8 q - zero), scale and offset in fp32 transposed to [group][column].
struct Cols {
  QW w;                          // rows n0..n1 (row 0 = n0), bits 4 or 8; its scale fields unused
  std::unique_ptr<int8_t[]> q;   // the expanded 5 / 6-bit values (w.qs points here), else empty
  std::vector<float> st, ot;     // [ng, ld] scale and offset (zero past the last column)
  int64_t ld = 0;                // columns, padded to whole panels
};

Cols expand_cols(const QW& w, int64_t n0, int64_t n1) {
  Cols c;
  const int64_t ng = w.k / w.group, nc = n1 - n0;
  c.ld = (nc + NR - 1) / NR * NR;
  c.st.assign(ng * c.ld, 0.f);
  c.ot.assign(ng * c.ld, 0.f);
  if (w.qh) c.q.reset(new int8_t[nc * w.k]);
  c.w = QW{w.qs + n0 * w.row_bytes(), nullptr, nullptr, nc, w.k, w.group, w.zero, w.bits};
  for_row_tiles(w, 2, n0, n1, [&](const QW& t, int64_t r0, int64_t r1) {
    for (int64_t r = 0; r < r1 - r0; ++r)
      for (int64_t g = 0; g < ng; ++g) {
        c.st[g * c.ld + r0 - n0 + r] = t.scale[r * ng + g];
        c.ot[g * c.ld + r0 - n0 + r] = t.offset(r, g);
      }
    if (w.qh) std::memcpy(c.q.get() + (r0 - n0) * w.k, t.qs, static_cast<size_t>((r1 - r0) * w.k));
    c.w.bits = t.bits;
    c.w.zero = t.zero;
  });
  if (w.qh) c.w.qs = reinterpret_cast<const uint8_t*>(c.q.get());
  return c;
}

// Panel `pl` of the thread's columns, k steps [k0, k0 + kc) (multiples of 32), as fp32 [kc, 32].
ZI_AVX512 void dequant_panel(const Cols& c, int64_t pl, int64_t k0, int64_t kc, const uint8_t* zeros, float* dst) {
  const QW& w = c.w;
  const __m512i low4 = _mm512_set1_epi32(15);
  __m512i v[4];
  for (int64_t h = 0; h < 2; ++h) {               // 16 columns at a time
    const int64_t col0 = pl * NR + h * 16;
    const uint8_t* ptr[16];
    for (int64_t j = 0; j < 16; ++j) ptr[j] = col0 + j < w.n ? w.qs + (col0 + j) * w.row_bytes() : zeros;
    float* d = dst + h * 16;
    for (int64_t k = k0; k < k0 + kc; k += 32) {
      // the same rows' bytes of the next k block prefetched, a line per row every 64 bytes read
      const int64_t ahead = (k + KC) * w.row_bytes() / w.k;
      if (k + KC < w.k && ahead % 64 < (w.bits == 4 ? 16 : 32))
        for (int64_t j = 0; j < 16; ++j) __builtin_prefetch(ptr[j] + ahead, 0, 0);
      if (w.bits == 4) {   // byte i of a block: weight i low nibble, weight i + 16 high nibble
        const int64_t g = k / w.group;
        const __m512 s = _mm512_loadu_ps(c.st.data() + g * c.ld + col0);
        const __m512 o = _mm512_loadu_ps(c.ot.data() + g * c.ld + col0);
        transpose16(ptr, k / 2, v);
        for (int q = 0; q < 4; ++q)
          for (int b = 0; b < 4; ++b) {
            const int64_t i = k - k0 + 4 * q + b;
            const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(v[q], 8 * b), low4);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(v[q], 8 * b + 4), low4);
            _mm512_storeu_ps(d + i * NR, _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), s, o));
            _mm512_storeu_ps(d + (i + 16) * NR, _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), s, o));
          }
        continue;
      }
      for (int64_t half = k; half < k + 32; half += 16) {   // int8: 16 weights a step (groups of 16)
        const int64_t g = half / w.group;
        const __m512 s = _mm512_loadu_ps(c.st.data() + g * c.ld + col0);
        const __m512 o = _mm512_loadu_ps(c.ot.data() + g * c.ld + col0);
        transpose16(ptr, half, v);
        for (int q = 0; q < 4; ++q)
          for (int b = 0; b < 4; ++b) {     // signed byte b of each lane
            const __m512i qv = _mm512_srai_epi32(_mm512_slli_epi32(v[q], 24 - 8 * b), 24);
            _mm512_storeu_ps(d + (half - k0 + 4 * q + b) * NR, _mm512_fmadd_ps(_mm512_cvtepi32_ps(qv), s, o));
          }
      }
    }
  }
}

}  // namespace

void quant_panel_gemm(const QW& w, const float* x, int64_t ldx, int64_t M, float* out, const float* bias) {
  const int64_t N = w.n, K = w.k, np = (N + NR - 1) / NR, tiles = (M + BMR - 1) / BMR;
  std::vector<float> bias_pad(bias ? static_cast<size_t>(np * NR) : 0, 0.f);   // whole panels: plain loads
  if (bias) std::memcpy(bias_pad.data(), bias, sizeof(float) * N);
  const float* add = bias ? bias_pad.data() : nullptr;
  at::parallel_for(0, np, 1, [&](int64_t p0, int64_t p1) {
    const Cols c = expand_cols(w, p0 * NR, std::min(N, p1 * NR));
    const std::vector<uint8_t> zeros(static_cast<size_t>(std::max<int64_t>(w.row_bytes(), 64)), 0);
    std::vector<float> abuf(static_cast<size_t>(RB * KC * BMR) + 16), pbuf(static_cast<size_t>(KC * NR) + 16);
    float* ap = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(abuf.data()) + 63) & ~uintptr_t(63));
    float* pb = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(pbuf.data()) + 63) & ~uintptr_t(63));
    alignas(64) float tail[BMR * NR];
    for (int64_t c0 = 0; c0 < tiles; c0 += RB) {
      const int64_t ct = std::min(RB, tiles - c0);
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = std::min(KC, K - k0);
        const bool last = k0 + kc == K && add;    // the bias joins after the whole sum, as in the blocked GEMM
        zooinfer_panels::blocked::pack_rows(x, ldx, M, c0 * BMR, ct, k0, kc, ap);
        for (int64_t p = p0; p < p1; ++p) {
          dequant_panel(c, p - p0, k0, kc, zeros.data(), pb);
          zooinfer_panels::blocked::panel_block(ap, ct, c0 * BMR, M, kc, pb, out, N, p * NR, k0 == 0,
                                                last ? add : nullptr, tail);
        }
      }
    }
  });
}

}  // namespace zi_quant
