// Linears on quantized weights with int8 activations for any number of rows (models/quant.py,
// `activations: int8`): prefill chunks and decode batches past the few rows where the decode
// kernel (quant_gemv_q8.cpp) is faster. out[M, N] = x[M, K] @ W^T, W in the layout of quant_layout.h.
//
// Why a second kernel: the decode kernel reads a weight row and dots it with up to 4 rows of x, so
// past a few rows it unpacks every weight once per 4 rows, and its integer lanes hold blocks of one
// output, reduced at the end. Here the lanes hold 16 output columns instead (the GEMM order):
// - x is quantized once per call (quant_xq.h, natural order; rows in parallel), with, per row, the
//   exact fp32 group sums (the min / zero term) and, for 8-bit weights, -128 x the sum of each
//   unit's xq (below);
// - threads split the columns (pairs of N tiles of 16); for each block of rows (as many as keep
//   their xq near 1 MB, so in L2: `row_block`), the weights of a tile are unpacked once into a
//   small buffer (16 K bytes: L1 / L2) in the VNNI order: for every 4 k, the 16 columns' 4 weights
//   side by side (one 64-byte vector), next to the tile's scales per unit and offsets per group;
// - a register tile of up to RT rows x two tiles (32 columns): per 4 k, two vector loads of
//   weights and, per row, that row's 4 xq broadcast once into two vpdpbusd (64 products each);
//   each unit of U k (32, or 16 where the group is not a multiple of 32, e.g. Q6_K) ends with cvt
//   + one FMA by scale x dx, each group with one FMA of its offset (min - zero * scale) by the
//   row's exact group sum. A last single tile (an odd count, or fewer than 16 columns) runs the
//   same register tile on one tile: the same ops per output, so the same bits.
// Why two tiles: 8 rows x one tile gave 8 integer chains of U / 4 dependent vpdpbusd, too few to
// cover its latency (5 cycles, 2 issued a cycle); 6 rows x two tiles (12 chains, a broadcast shared
// by two products) took one thread on an AMX Xeon from 250-290 to 300-380 GOP/s on SmolLM2's shapes
// at 32-2048 rows (a register-only loop issues ~815); 7 rows x two tiles spills.
// vpdpbusd multiplies unsigned by signed bytes: the broadcast (memory) operand is the signed one, so
// x stays signed and the weights are the unsigned operand: 4-bit q (0..15) as they are, 8-bit q
// (int8 formats, 5 / 6 bits expanded to q - zero) plus 128 (the sign bit flipped), the 128 x sum(xq)
// that adds removed by starting each unit's integer sum at -128 x sum(xq) (exact in int32).
//
// What it computes is the decode kernel's formula, so the same bound holds (tests/test_quant_q8.py):
// sum_k x_k w_k = sum_u s_u dx_u sum_{k in u} q_k xq_k + sum_g (min_g - zero s_g) xsum_g, the integer
// sums exact, each output one fp32 chain over units in k order; |result - x @ dequantize(W)^T| <=
// sum_b |s| (dx_b / 2) sum_{k in b} |q_k| + fp32 rounding. Not bit-identical to the decode kernel
// (other fp32 order). Needs AVX-512 F/BW/VL + VNNI, as the decode kernel (isa 2); on isa 1 (AVX2 +
// FMA: no VNNI, or forced by the `isa` argument) the op runs quant_q8_avx2.cpp's kernels instead
// (GEMM order for 4-bit weights; for 8-bit ones the decode op's row order).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "quant_panels.h"
#include "quant_xq.h"

namespace {

using namespace zi_quant;

constexpr int64_t NT = 16;    // columns per tile: one int32 lane each
constexpr int RT = 6;         // rows per register tile: 2 x 6 int32 + 2 x 6 fp32 accumulators (7 spills)
constexpr int64_t MB = 128;   // rows per block at least: the weights of a tile are unpacked once per block

// Rows per block: the xq of up to ~1 MB of x (L2) and at least MB rows, a multiple of RT; each
// block unpacks every tile again (at 128-row blocks the unpacking took ~12% of the op).
inline int64_t row_block(int64_t K) { return std::max<int64_t>(MB, ((int64_t(1) << 20) / K) / RT * RT); }

// Per call: x quantized, plus what the min / zero term and the 8-bit correction need.
struct Prep {
  XQ xq;                      // natural order, xq.ldq per row
  std::vector<float> xsum;    // [M, ng] exact fp32 group sums (weights with an offset only)
  std::vector<int32_t> corr;  // [M, K / U] -128 x sum of each unit's xq (8-bit weights only)
  int64_t ng = 0, nu = 0;
};

ZI_VNNI void prep_rows(const float* x, int64_t K, int64_t G, int64_t U, bool sums, bool eight, int64_t m0,
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
// 64 bytes (16 columns x 4 weights, unsigned), su[u] the 16 columns' scales of unit u, off[g] their
// offsets; columns past nc get zero weights, scales and offsets.
ZI_VNNI void pack_tile(const QW& t, int64_t c0, int64_t nc, int64_t U, const uint8_t* zeros, uint8_t* wt, float* su,
                       float* off) {
  const int64_t K = t.k, ng = K / t.group, nu = K / U;
  const uint8_t* ptr[NT];
  for (int64_t c = 0; c < NT; ++c) ptr[c] = c < nc ? t.qs + (c0 + c) * t.row_bytes() : zeros;
  const __m512i low4 = _mm512_set1_epi8(0x0F), sign = _mm512_set1_epi8(static_cast<char>(0x80));
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

// out rows m..m + R x the 16 columns of `a` (`cols` of them stored) and, with TWO, the 16 after
// them of `b`: per 4 k, one weight vector per tile and one broadcast per row into one vpdpbusd per
// tile (see the header). Each output runs the same operations whether its tile is paired or not.
template <int R, bool EIGHT, int U, bool TWO>
ZI_VNNI void micro(Tile a, Tile b, int64_t K, int64_t G, const Prep& p, int64_t m, float* out, int64_t ldo,
                   __mmask16 cols) {
  constexpr int S = U / 4;     // 4-k steps per unit
  const int64_t nu = K / U, upg = G / U, ng = K / G, ldq = p.xq.ldq, ldd = p.xq.ldd;
  const int8_t* xq = p.xq.q.data() + m * ldq;
  const float* dx = p.xq.d.data() + m * ldd;
  const int32_t* corr = EIGHT ? p.corr.data() + m * nu : nullptr;
  const float* xsum = a.off ? p.xsum.data() + m * ng : nullptr;
  __m512 acc0[R], acc1[R];
  for (int i = 0; i < R; ++i) acc0[i] = _mm512_setzero_ps(), acc1[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    for (int64_t u = g * upg; u < (g + 1) * upg; ++u) {
      __m512i ia0[R], ia1[R];
      for (int i = 0; i < R; ++i) {
        ia0[i] = EIGHT ? _mm512_set1_epi32(corr[i * nu + u]) : _mm512_setzero_si512();
        if (TWO) ia1[i] = ia0[i];
      }
      const uint8_t* w0 = a.wt + u * S * 64;
      const uint8_t* w1 = TWO ? b.wt + u * S * 64 : nullptr;
      for (int s = 0; s < S; ++s) {
        const __m512i v0 = _mm512_load_si512(w0 + s * 64);
        const __m512i v1 = TWO ? _mm512_load_si512(w1 + s * 64) : v0;
        for (int i = 0; i < R; ++i) {
          int32_t x4;
          std::memcpy(&x4, xq + i * ldq + u * U + 4 * s, 4);
          const __m512i xb = _mm512_set1_epi32(x4);
          ia0[i] = _mm512_dpbusd_epi32(ia0[i], v0, xb);
          if (TWO) ia1[i] = _mm512_dpbusd_epi32(ia1[i], v1, xb);
        }
      }
      const __m512 s0 = _mm512_load_ps(a.su + u * NT), s1 = TWO ? _mm512_load_ps(b.su + u * NT) : s0;
      const int64_t blk = u * U / 32;
      for (int i = 0; i < R; ++i) {
        const __m512 d = _mm512_set1_ps(dx[i * ldd + blk]);
        acc0[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia0[i]), _mm512_mul_ps(s0, d), acc0[i]);
        if (TWO) acc1[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia1[i]), _mm512_mul_ps(s1, d), acc1[i]);
      }
    }
    if (a.off) {               // the group ends: its offsets times the rows' exact group sums
      const __m512 o0 = _mm512_load_ps(a.off + g * NT), o1 = TWO ? _mm512_load_ps(b.off + g * NT) : o0;
      for (int i = 0; i < R; ++i) {
        const __m512 xs = _mm512_set1_ps(xsum[i * ng + g]);
        acc0[i] = _mm512_fmadd_ps(o0, xs, acc0[i]);
        if (TWO) acc1[i] = _mm512_fmadd_ps(o1, xs, acc1[i]);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm512_mask_storeu_ps(out + (m + i) * ldo, cols, acc0[i]);
    if (TWO) _mm512_storeu_ps(out + (m + i) * ldo + NT, acc1[i]);
  }
}

template <bool EIGHT, int U, bool TWO>
ZI_VNNI void rows_block(Tile a, Tile b, int64_t K, int64_t G, const Prep& p, int64_t m0, int64_t m1, float* out,
                        int64_t ldo, __mmask16 cols) {
  for (int64_t m = m0; m < m1; m += RT) {
    switch (std::min<int64_t>(RT, m1 - m)) {
      case 1: micro<1, EIGHT, U, TWO>(a, b, K, G, p, m, out, ldo, cols); break;
      case 2: micro<2, EIGHT, U, TWO>(a, b, K, G, p, m, out, ldo, cols); break;
      case 3: micro<3, EIGHT, U, TWO>(a, b, K, G, p, m, out, ldo, cols); break;
      case 4: micro<4, EIGHT, U, TWO>(a, b, K, G, p, m, out, ldo, cols); break;
      case 5: micro<5, EIGHT, U, TWO>(a, b, K, G, p, m, out, ldo, cols); break;
      default: micro<6, EIGHT, U, TWO>(a, b, K, G, p, m, out, ldo, cols); break;
    }
  }
}

// Tiles a (and b, with TWO) over rows [m0, m1): the template for the weights' bits and unit.
template <bool TWO>
ZI_VNNI void run_tiles(int64_t bits, int64_t U, Tile a, Tile b, int64_t K, int64_t G, const Prep& p, int64_t m0,
                       int64_t m1, float* out, int64_t ldo, __mmask16 cols) {
  if (bits == 4) rows_block<false, 32, TWO>(a, b, K, G, p, m0, m1, out, ldo, cols);
  else if (U == 32) rows_block<true, 32, TWO>(a, b, K, G, p, m0, m1, out, ldo, cols);
  else rows_block<true, 16, TWO>(a, b, K, G, p, m0, m1, out, ldo, cols);
}

at::Tensor quant_linear_q8_gemm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                                const c10::optional<at::Tensor>& minv, int64_t bits, int64_t group, int64_t zero,
                                const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& qh,
                                const c10::optional<at::Tensor>& scale_d, const c10::optional<at::Tensor>& minv_d,
                                int64_t isa) {
  const int64_t path = q8_pick_isa(isa, "quant_linear_q8_gemm");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "quant_linear_q8_gemm: x must be a 2-D float32 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  const QW w = make_qw(qs, scale, minv, bits, group, zero, x.size(1), qh, scale_d, minv_d);
  const int64_t M = x.size(0), N = w.n, K = w.k, G = w.group;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M > 0 && N > 0 && path == 1) {
    const at::Tensor xc = x.contiguous();
    q8_linear_avx2(w, xc.data_ptr<float>(), M, out.data_ptr<float>(), N, true);   // quant_q8_avx2.cpp
  } else if (M > 0 && N > 0) {
    const at::Tensor xc = x.contiguous();
    const float* xp = xc.data_ptr<float>();
    const int64_t U = G % 32 == 0 ? 32 : 16;          // G is a multiple of 16 (make_qw)
    const bool eight = bits != 4, sums = w.has_min() || w.tile_zero();
    Prep p;
    p.ng = K / G;
    p.nu = K / U;
    p.xq = xq_alloc(M, K, false);
    if (sums) p.xsum.assign(M * p.ng, 0.f);
    if (eight) p.corr.assign(M * p.nu, 0);
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) { prep_rows(xp, K, G, U, sums, eight, m0, m1, p); });
    float* op = out.data_ptr<float>();
    const int64_t pairs = (N + 2 * NT - 1) / (2 * NT), mb = row_block(K);
    at::parallel_for(0, pairs, 1, [&](int64_t t0, int64_t t1) {
      // per thread: two tiles' unpacked weights (64-byte aligned), scales and offsets
      const int64_t wsz = NT * K + 64, ssz = p.nu * NT + 16, osz = sums ? p.ng * NT + 16 : 0;
      std::unique_ptr<uint8_t[]> wbuf(new uint8_t[2 * wsz]);
      std::vector<float> sbuf(2 * ssz), obuf(2 * osz);
      auto align = [](auto* q) { return reinterpret_cast<decltype(q)>((reinterpret_cast<uintptr_t>(q) + 63) & ~uintptr_t(63)); };
      uint8_t* wt[2] = {align(wbuf.get()), align(wbuf.get() + wsz)};
      float* su[2] = {align(sbuf.data()), align(sbuf.data() + ssz)};
      float* off[2] = {sums ? align(obuf.data()) : nullptr, sums ? align(obuf.data() + osz) : nullptr};
      const std::vector<uint8_t> zeros(static_cast<size_t>(std::max<int64_t>(w.row_bytes(), 64)), 0);
      for_row_tiles(w, 2, t0 * 2 * NT, std::min(N, t1 * 2 * NT), [&](const QW& t, int64_t r0, int64_t r1) {
        for (int64_t m0 = 0; m0 < M; m0 += mb) {
          const int64_t m1 = std::min(M, m0 + mb);
          for (int64_t c0 = 0; c0 < r1 - r0;) {
            float* o = op + r0 + c0;
            const Tile a{wt[0], su[0], off[0]}, b{wt[1], su[1], off[1]};
            if (c0 + 2 * NT <= r1 - r0) {          // two full tiles
              pack_tile(t, c0, NT, U, zeros.data(), wt[0], su[0], off[0]);
              pack_tile(t, c0 + NT, NT, U, zeros.data(), wt[1], su[1], off[1]);
              run_tiles<true>(t.bits, U, a, b, K, G, p, m0, m1, o, N, 0xFFFF);
              c0 += 2 * NT;
            } else {                               // the last one, of up to 16 columns
              const int64_t nc = std::min(NT, r1 - r0 - c0);
              pack_tile(t, c0, nc, U, zeros.data(), wt[0], su[0], off[0]);
              run_tiles<false>(t.bits, U, a, a, K, G, p, m0, m1, o, N, static_cast<__mmask16>((1u << nc) - 1));
              c0 += nc;
            }
          }
        }
      });
    });
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "quant_linear_q8_gemm: bias must have ", N, " elements, got ", bias->numel());
    out.add_(bias->to(at::kFloat).view({1, N}));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(zooinfer_cpu, m) {
  m.def("quant_linear_q8_gemm(Tensor x, Tensor qs, Tensor scale, Tensor? minv, int bits, int group, int zero, "
        "Tensor? bias, Tensor? qh=None, Tensor? scale_d=None, Tensor? minv_d=None, int isa=-1) -> Tensor");
  m.impl("quant_linear_q8_gemm", c10::DispatchKey::CPU, TORCH_FN(quant_linear_q8_gemm));
}
