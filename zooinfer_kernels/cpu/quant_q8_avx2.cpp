// Linears on quantized weights with int8 activations on AVX2 + FMA (no VNNI): what
// `quant_linear_q8` (decode rows) and `quant_linear_q8_gemm` (any rows) run on isa 1, i.e. on
// CPUs without AVX-512 VNNI (Zen 2 / Zen 3, most laptops) or when a test forces it.
//
// Why: without it those CPUs ran the exact fp32-activation kernels (quant_gemm.cpp), which widen
// every weight to fp32 (about eight instructions per 8 weights on AVX2). As llama.cpp does on
// AVX2 (its Q8_0 / Q8_1 activations), x is rounded to int8 per 32-block once per call and the
// dot products are integer: per 32 weights and row of x, one vpmaddubsw (32 unsigned x signed
// byte products summed in pairs to 16 int16) and one vpmaddwd by ones (8 int32 lanes), then cvt
// and one FMA by (weight scale x block scale of x).
//
// What it computes is quant_gemv_q8.cpp's formula, so its bound holds (tests/test_quant_q8.py):
// sum_k x_k w_k = sum_b s_b dx_b sum_{k in b} q_k xq_k + sum_g (min_g - zero s_g) xsum_g, the
// integer sums exact, xsum the exact fp32 group sums of x; |result - x @ dequantize(W)^T| <=
// sum_b |s| (dx_b / 2) sum_{k in b} |q_k| + fp32 rounding. Not bit-identical to the VNNI kernels
// (another fp32 order), but with fewer roundings per output: 8 lanes, one FMA per 32-block each.
//
// Nothing saturates in vpmaddubsw (it saturates the int16 pair sums), by the operand choice:
// - 4-bit q 0..15 is the unsigned operand as it is, xq (|xq| <= 127) the signed one:
//   |pair| <= 2 * 15 * 127 = 3810;
// - 8-bit q (int8 formats; 5 / 6 bits expanded to q - zero, quant_storage.h) is signed: |q| is
//   the unsigned operand (|-128| = 128 as a byte) and sign(xq, q) (xq negated where q < 0, zero
//   where q = 0) the signed one, so the product is q xq and |pair| <= 2 * 128 * 127 = 32512.
// The int32 lane sums (<= 4 * 128 * 127 per block) convert to fp32 exactly.
//
// Layout: x quantized in natural order (quant_xq.h `quantize_rows_avx2`). A 4-bit block is 16
// bytes, byte j = weight j low nibble | weight j + 16 high nibble; one 128-bit broadcast, a
// variable shift (0 in the low lane, 4 in the high lane) and a mask give its 32 weights in
// natural order. Groups: any multiple of 32, or of 16 for 8-bit weights (Q6_K): then the two
// 16-weight halves of a block (lanes 0-3 and 4-7) take their own scale.
//
// Two kernels, each for any row count:
// - row order (`tile`; the decode op, and the GEMM op on 8-bit weights): each weight row is
//   unpacked once per tile of up to 4 rows of x (16 ymm registers: 4 accumulators, the weights,
//   |q|, scales, constants, temporaries), x in blocks of 64 rows (L1 / L2) against each 64-row
//   tile of the weight (for_row_tiles); threads split the output columns. Per 32 weights and row:
//   vpmaddubsw, vpmaddwd, cvt, mul, FMA.
// - GEMM order (`micro4`; the GEMM op on 4-bit weights): the int32 lanes hold 8 output columns;
//   per block of 128 rows each 8-column tile is packed once (per 4 k, the 8 columns' 4 weights
//   side by side: one 32-byte vector), and per 4 k and row one vpmaddubsw with the row's 4 xq
//   broadcast, summed in int16 over the 32-block (at most 8 * 2 * 15 * 127 = 30480: 4-bit only;
//   8-bit pair sums reach 32512, two would saturate), so the float work (vpmaddwd, cvt, mul,
//   FMA) is once per block and 8 columns instead of per column: about half the instructions of
//   the row order per weight and row. Packing costs about as much as one row's products, so the
//   module takes it from Q8_GEMM_MIN_ROWS rows (zooinfer_kernels/quant_gemm.py), as on VNNI.
// In both each output is one fp32 chain over its blocks in k order whatever the register tile,
// block of rows or thread, so within an op a row's result does not depend on the batch size nor
// on the thread count; on 8-bit weights the two ops give the same values.
//
// Measured (AMD EPYC Zen 3, AVX2 + FMA, 1 thread, shared machine; `python -m bench.quant_linears
// --format F --rows 1,4,16,64,256 --paths exact,int8act --threads 1 --rounds 5`: SmolLM2-135M's
// 120 body linears, exact fp32-activation ms / int8-activation ms):
//   int4_asym (4-bit, fp32 scale + min per 32): 1 row 1.73x, 4 rows 1.23x, 16 rows 1.72x,
//                                               64 rows 1.20x, 256 rows 1.10x;
//   int8 (per-channel scale):                   1.34x, 1.06x, 1.19x, 0.82x, 0.76x
// (8-bit weights past ~32 rows: the row order's float work per 32 weights loses to the exact
// path's dequantize + MKL sgemm; the 4-bit GEMM order's int16 sums do not apply to them).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "quant_xq.h"

namespace zi_quant {
namespace {

constexpr int RX = 4;          // rows of x per register tile
constexpr int64_t MBX = 64;    // rows of x per block against a weight tile
constexpr int64_t NG = 8;      // GEMM order: columns per tile (one int32 lane each)
constexpr int64_t MBG = 128;   // GEMM order: rows of x per block (a column tile is packed once per block)

struct Args {                  // one call's quantized x and what the formula needs per row
  const XQ* xq;
  const float* xsum;           // [M, ng] exact fp32 group sums, or null (no min / zero term)
  const int32_t* half_group;   // the group of each 16-weight half of K
  int64_t ng;
};

// Output columns n..n + NW (rows of the weight tile `t`) for rows m..m + R of x. NW = 2 where
// R <= 2 (decode): two independent chains per row of x, the same operations per output as NW = 1.
// Not inlined: inlined into the tile loops, GCC kept the accumulators on the stack (a
// store-forward in every chain).
template <int R, int NW, bool FOUR, bool G16>
ZI_AVX2 __attribute__((noinline)) void tile(const QW& t, int64_t n, const Args& a, int64_t m, float* out, int64_t ldo) {
  const int64_t nb = t.k / 32, ldq = a.xq->ldq, ldd = a.xq->ldd, rb = t.row_bytes();
  const uint8_t* r = t.qs + n * rb;
  const float* sc = t.scale + n * a.ng;
  const int32_t* hg = a.half_group;
  const int8_t* xq = a.xq->q.data() + m * ldq;
  const float* dx = a.xq->d.data() + m * ldd;
  const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F);
  const __m256i shift = _mm256_setr_epi64x(0, 0, 4, 4);
  __m256 acc[NW][R];
#pragma GCC unroll 8
  for (int i = 0; i < NW * R; ++i) acc[i / R][i % R] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i wv[NW], aw[NW];
    __m256 sw[NW];
#pragma GCC unroll 2
    for (int j = 0; j < NW; ++j) {
      if constexpr (FOUR) {   // 16 bytes -> weights 0..15 (low nibbles), 16..31 (high nibbles)
        const __m256i v = _mm256_broadcastsi128_si256(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + j * rb + b * 16)));
        wv[j] = _mm256_and_si256(_mm256_srlv_epi64(v, shift), low4);
        aw[j] = wv[j];
      } else {
        wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + j * rb + b * 32));
        aw[j] = _mm256_abs_epi8(wv[j]);
      }
      const float* sj = sc + j * a.ng;
      sw[j] = G16 ? _mm256_set_m128(_mm_set1_ps(sj[hg[2 * b + 1]]), _mm_set1_ps(sj[hg[2 * b]]))
                  : _mm256_set1_ps(sj[hg[2 * b]]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * ldq + b * 32));
      const __m256 dxi = _mm256_broadcast_ss(dx + i * ldd + b);
#pragma GCC unroll 2
      for (int j = 0; j < NW; ++j) {
        const __m256i p16 = _mm256_maddubs_epi16(aw[j], FOUR ? xv : _mm256_sign_epi8(xv, wv[j]));
        const __m256 dp = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
        acc[j][i] = _mm256_fmadd_ps(dp, _mm256_mul_ps(sw[j], dxi), acc[j][i]);
      }
    }
  }
  float res[NW][R];
#pragma GCC unroll 8
  for (int i = 0; i < NW * R; ++i) res[i / R][i % R] = Avx2::sum(acc[i / R][i % R]);
  for (int j = 0; j < NW; ++j)
    for (int i = 0; i < R; ++i)
      out[(m + i) * ldo + n + j] =
          res[j][i] + (a.xsum ? offset_dot(Avx2{}, t, n + j, a.xsum + (m + i) * a.ng) : 0.f);
}

// Every column of the weight tile `t` for rows [0, M) of x (out: the tile's column 0).
template <bool FOUR, bool G16>
ZI_AVX2 void tile_rows(const QW& t, const Args& a, int64_t M, float* out, int64_t ldo) {
  const int64_t rb = t.row_bytes();
  auto prefetch = [&](int64_t row) {   // the first pass streams the tile from memory: the next rows meanwhile
    const char* p = reinterpret_cast<const char*>(t.qs + row * rb);
    for (int64_t o = 0; row < t.n && o < rb; o += 64) __builtin_prefetch(p + o, 0, 0);
  };
  if (M <= 2) {                        // decode: two weight rows per pass (two chains per row of x)
    int64_t n = 0;
    for (; n + 2 <= t.n; n += 2) {
      prefetch(n + 2);
      prefetch(n + 3);
      if (M == 1) tile<1, 2, FOUR, G16>(t, n, a, 0, out, ldo);
      else tile<2, 2, FOUR, G16>(t, n, a, 0, out, ldo);
    }
    if (n < t.n) {
      if (M == 1) tile<1, 1, FOUR, G16>(t, n, a, 0, out, ldo);
      else tile<2, 1, FOUR, G16>(t, n, a, 0, out, ldo);
    }
    return;
  }
  for (int64_t m0 = 0; m0 < M; m0 += MBX) {
    const int64_t m1 = std::min(M, m0 + MBX);
    for (int64_t n = 0; n < t.n; ++n) {
      if (m0 == 0) prefetch(n + 1);
      for (int64_t m = m0; m < m1; m += RX) {
        switch (std::min<int64_t>(RX, m1 - m)) {
          case 1: tile<1, 1, FOUR, G16>(t, n, a, m, out, ldo); break;
          case 2: tile<2, 1, FOUR, G16>(t, n, a, m, out, ldo); break;
          case 3: tile<3, 1, FOUR, G16>(t, n, a, m, out, ldo); break;
          default: tile<4, 1, FOUR, G16>(t, n, a, m, out, ldo); break;
        }
      }
    }
  }
}

// The exact fp32 group sums of rows [m0, m1) of x: 8 lanes in k order, then across the lanes.
ZI_AVX2 void group_sums_avx2(const float* x, int64_t K, int64_t G, int64_t m0, int64_t m1, float* xsum) {
  const int64_t ng = K / G;     // G is a multiple of 16 (make_qw)
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t g = 0; g < ng; ++g) {
      __m256 s = _mm256_setzero_ps();
      for (int64_t k = g * G; k < (g + 1) * G; k += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(x + m * K + k));
      xsum[m * ng + g] = Avx2::sum(s);
    }
}

// ------------------------------------------------------------------ GEMM order, 4-bit weights
// Columns c0..c0 + nc of the 4-bit tile `t` packed for `micro4`: wt[b * 8 + s] (32 bytes) holds, in
// bytes 4c..4c + 3, column c's weights 32b + 4s..32b + 4s + 3 (unsigned 0..15); su[b * 8 + c] the
// scale of column c's block b, off[g * 8 + c] its group offset (min - zero * scale). Columns past
// nc: zero weights, scales and offsets.
ZI_AVX2 void pack4(const QW& t, int64_t c0, int64_t nc, const int32_t* hg, uint8_t* wt, float* su, float* off) {
  const int64_t nb = t.k / 32, ng = t.k / t.group;
  const __m256i low4 = _mm256_set1_epi8(0x0F), shift = _mm256_setr_epi64x(0, 0, 4, 4);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i v[8], u[8];
    for (int64_t c = 0; c < NG; ++c)
      v[c] = c < nc ? _mm256_and_si256(_mm256_srlv_epi64(_mm256_broadcastsi128_si256(_mm_loadu_si128(
                          reinterpret_cast<const __m128i*>(t.qs + (c0 + c) * t.row_bytes() + b * 16))), shift), low4)
                    : _mm256_setzero_si256();
    for (int j = 0; j < 8; j += 2) {   // 8 x 8 dwords transposed: v[c] dword s -> u[s] dword c
      u[j] = _mm256_unpacklo_epi32(v[j], v[j + 1]);
      u[j + 1] = _mm256_unpackhi_epi32(v[j], v[j + 1]);
    }
    for (int j = 0; j < 8; j += 4) {
      v[j] = _mm256_unpacklo_epi64(u[j], u[j + 2]);
      v[j + 1] = _mm256_unpackhi_epi64(u[j], u[j + 2]);
      v[j + 2] = _mm256_unpacklo_epi64(u[j + 1], u[j + 3]);
      v[j + 3] = _mm256_unpackhi_epi64(u[j + 1], u[j + 3]);
    }
    __m256i* dst = reinterpret_cast<__m256i*>(wt + b * 256);
    for (int j = 0; j < 4; ++j) {
      _mm256_store_si256(dst + j, _mm256_permute2x128_si256(v[j], v[j + 4], 0x20));
      _mm256_store_si256(dst + 4 + j, _mm256_permute2x128_si256(v[j], v[j + 4], 0x31));
    }
  }
  std::fill(su, su + nb * NG, 0.f);
  if (off) std::fill(off, off + ng * NG, 0.f);
  for (int64_t c = 0; c < nc; ++c) {
    const float* sc = t.scale + (c0 + c) * ng;
    for (int64_t b = 0; b < nb; ++b) su[b * NG + c] = sc[hg[2 * b]];
    for (int64_t g = 0; off && g < ng; ++g) off[g * NG + c] = t.offset(c0 + c, g);
  }
}

// Rows m..m + R of x against the 8 packed columns (`cols` of them stored). Per block and row: for
// each 4 k, one vpmaddubsw of the 8 columns' 4 weights with the row's 4 xq broadcast, summed in
// int16 over the block (8 pair sums of at most 2 * 15 * 127: <= 30480, no saturation), then one
// vpmaddwd by ones (8 int32 lanes: the block's dot per column), cvt and one FMA by scale x dx.
template <int R>
ZI_AVX2 __attribute__((noinline)) void micro4(const uint8_t* wt, const float* su, const float* off, int64_t nb,
                                              int64_t bpg, const Args& a, int64_t m, float* out, int64_t ldo,
                                              int64_t cols) {
  const int64_t ldq = a.xq->ldq, ldd = a.xq->ldd, ng = a.ng;
  const int8_t* xq = a.xq->q.data() + m * ldq;
  const float* dx = a.xq->d.data() + m * ldd;
  const float* xsum = off ? a.xsum + m * ng : nullptr;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0, b = 0; g < ng; ++g) {
    for (const int64_t b1 = b + bpg; b < b1; ++b) {
      const __m256i* wb = reinterpret_cast<const __m256i*>(wt + b * 256);
      __m256i s16[R];
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) s16[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int s = 0; s < 8; ++s) {
        const __m256i wv = _mm256_load_si256(wb + s);
#pragma GCC unroll 4
        for (int i = 0; i < R; ++i) {
          int32_t x4;
          std::memcpy(&x4, xq + i * ldq + b * 32 + 4 * s, 4);
          s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(wv, _mm256_set1_epi32(x4)));
        }
      }
      const __m256 sv = _mm256_load_ps(su + b * NG);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i)
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s16[i], ones)),
                                 _mm256_mul_ps(sv, _mm256_broadcast_ss(dx + i * ldd + b)), acc[i]);
    }
    if (off) {                 // the group ends: its offsets times the rows' exact group sums
      const __m256 ov = _mm256_load_ps(off + g * NG);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) acc[i] = _mm256_fmadd_ps(ov, _mm256_broadcast_ss(xsum + i * ng + g), acc[i]);
    }
  }
  const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cols)),
                                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (int i = 0; i < R; ++i) _mm256_maskstore_ps(out + (m + i) * ldo, lanes, acc[i]);
}

// Every row of x against the 4-bit weight `w` in GEMM order (see the header); threads split the
// column tiles of 8.
void gemm4(const QW& w, const Args& a, int64_t M, float* out, int64_t ldo) {
  const int64_t nb = w.k / 32, ng = a.ng, bpg = w.group / 32, tiles = (w.n + NG - 1) / NG;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::unique_ptr<uint8_t[]> wbuf(new uint8_t[nb * 256 + 32]);
    uint8_t* wt = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(wbuf.get()) + 31) & ~uintptr_t(31));
    std::vector<float> sbuf(nb * NG + 8), obuf(a.xsum ? ng * NG + 8 : 0);
    float* su = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(sbuf.data()) + 31) & ~uintptr_t(31));
    float* off = a.xsum ? reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(obuf.data()) + 31) & ~uintptr_t(31))
                        : nullptr;
    for_row_tiles(w, 1, t0 * NG, std::min(w.n, t1 * NG), [&](const QW& t, int64_t r0, int64_t r1) {
      for (int64_t m0 = 0; m0 < M; m0 += MBG) {
        const int64_t m1 = std::min(M, m0 + MBG);
        for (int64_t c0 = 0; c0 < r1 - r0; c0 += NG) {
          const int64_t nc = std::min(NG, r1 - r0 - c0);
          pack4(t, c0, nc, a.half_group, wt, su, off);
          float* o = out + r0 + c0;
          for (int64_t m = m0; m < m1; m += RX) {
            switch (std::min<int64_t>(RX, m1 - m)) {
              case 1: micro4<1>(wt, su, off, nb, bpg, a, m, o, ldo, nc); break;
              case 2: micro4<2>(wt, su, off, nb, bpg, a, m, o, ldo, nc); break;
              case 3: micro4<3>(wt, su, off, nb, bpg, a, m, o, ldo, nc); break;
              default: micro4<4>(wt, su, off, nb, bpg, a, m, o, ldo, nc); break;
            }
          }
        }
      }
    });
  });
}

}  // namespace

void q8_linear_avx2(const QW& w, const float* x, int64_t M, float* out, int64_t ldo, bool gemm_order) {
  const int64_t K = w.k, G = w.group, ng = K / G;
  const bool sums = w.has_min() || w.tile_zero();
  XQ xq = xq_alloc(M, K, false);
  std::vector<float> xsum(sums ? M * ng : 0);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    quantize_rows_avx2(x, K, m0, m1, K, false, xq);
    if (sums) group_sums_avx2(x, K, G, m0, m1, xsum.data());
  });
  std::vector<int32_t> half_group(K / 16);
  for (int64_t h = 0; h < K / 16; ++h) half_group[h] = static_cast<int32_t>(h * 16 / G);
  const Args a{&xq, sums ? xsum.data() : nullptr, half_group.data(), ng};
  const bool g16 = G % 32 != 0;   // 8-bit only (make_qw: 4-bit groups are multiples of 32)
  if (gemm_order && w.bits == 4) return gemm4(w, a, M, out, ldo);
  at::parallel_for(0, w.n, 16, [&](int64_t n0, int64_t n1) {
    for_row_tiles(w, 1, n0, n1, [&](const QW& t, int64_t r0, int64_t) {
      if (t.bits == 4) tile_rows<true, false>(t, a, M, out + r0, ldo);
      else if (g16) tile_rows<false, true>(t, a, M, out + r0, ldo);
      else tile_rows<false, false>(t, a, M, out + r0, ldo);
    });
  });
}

}  // namespace zi_quant
