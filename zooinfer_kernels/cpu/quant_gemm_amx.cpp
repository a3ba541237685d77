// The GEMM-ordered int8-activation product on AMX-INT8 tiles (quant_gemm_q8.cpp's op with `isa` 3,
// opt-in): the same formula, the same bits as the VNNI kernel.
//
// Not the default: measured slower than the VNNI kernel (Emerald Rapids KVM guest, 1 thread,
// SmolLM2's 120 body linears int4_asym, `python -m bench.quant_linears --rows 1,16,128,512
// --threads 1 --paths q8-gemm-amx,q8-gemm` (q8-gemm: VNNI): 128 rows 71-76 vs 62-68 ms, 512 rows 239-263 vs
// 218-227, 1 row 15.6 vs 10.5). With the scaling removed the tile side alone took as long (214 ms
// at 512 rows): each 32 k a tile product, a 1 KB C store and its reload, too little work per tile
// op. What would change that is the next step: more C tiles in flight per A / B load, or a C
// tile per 64+ k where the weights' group and x's block allow one scale (not the 32-blocks here).
//
// Why: on the VNNI kernel each 32 k of a 16-column tile cost a row of x 8 broadcasts and 8
// vpdpbusd, ~19 instructions with its scaling; a tile product (TDPBSUD: 16 rows x 16 columns x 32 k)
// does the integer part of 16 rows in one instruction, so what is left per row is the scaling the
// VNNI kernel does too: per unit of U k, cvt + mul by the row's dx + one FMA (3 instructions).
//
// Per 16-column tile (packed by quant_q8_tiles.h in the VNNI order, which is AMX's B layout: U / 4
// rows of 64 bytes) and 16 rows of x (xq natural order: A is 16 rows x U bytes at stride ldq): per
// unit, TDPBSUD (4-bit q, unsigned) or TDPBSSD (8-bit q as stored, signed) into a zeroed C tile,
// stored to a 1 KB buffer and folded into 16 fp32 accumulators in registers exactly as the VNNI
// kernel folds its integer lanes: acc = fma(cvt(isum), s_u * dx, acc), then per group
// fma(offset, xsum, acc). The integer sums are the same exact values (the VNNI kernel's 8-bit
// q + 128 and its -128 x sum(xq) cancel exactly in int32), every fp32 operation the same in the
// same order: each output is bit-identical to the VNNI kernel's (tests/test_quant_q8_gemm.py).
// Two C tiles alternate, so the tile product of unit u + 1 can run while unit u is scaled.
// Rows are computed 16 at a time (x padded with zero rows to a multiple of 16); the scaling runs on
// the stored rows only, rounded up to 4 (a template per count).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <immintrin.h>

#include "amx_perm.h"
#include "quant_q8_tiles.h"

namespace zi_quant {

bool q8_amx_ready() {
#if defined(__x86_64__)
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
           zooinfer_amx::ready(zooinfer_amx::kInt8);
  }();
  return ok;
#else
  return false;
#endif
}

}  // namespace zi_quant

namespace {

using namespace zi_quant;

#define ZI_AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))

using zooinfer_amx::TileConfig;

// Tiles 0 / 1: A (x) for even / odd units; 2 / 3: B (weights); 4 / 5: C.
ZI_AMX void load_config(int64_t U) {
  TileConfig cfg;
  for (int t : {0, 1}) cfg.rows[t] = 16, cfg.colsb[t] = static_cast<uint16_t>(U);
  for (int t : {2, 3}) cfg.rows[t] = static_cast<uint8_t>(U / 4), cfg.colsb[t] = 64;
  for (int t : {4, 5}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  zooinfer_amx::load_config(cfg);
}

// The tile product of unit u into C tile 4 (even u) or 5 (odd), stored to cbuf[u & 1].
// Two spelled-out branches: GCC's tile intrinsics paste their tile number into the assembly text,
// so it cannot be a template parameter.
template <bool EIGHT, int U>
ZI_AMX ZI_INLINE void unit_product(const int8_t* xq, int64_t ldq, const uint8_t* wt, int64_t u,
                                   int32_t (*cbuf)[256]) {
  constexpr int S = U / 4;
  if (u & 1) {
    _tile_loadd(1, xq + u * U, ldq);
    _tile_loadd(3, wt + u * S * 64, 64);
    _tile_zero(5);
    if (EIGHT) _tile_dpbssd(5, 1, 3);
    else _tile_dpbsud(5, 1, 3);
    _tile_stored(5, cbuf[1], 64);
  } else {
    _tile_loadd(0, xq + u * U, ldq);
    _tile_loadd(2, wt + u * S * 64, 64);
    _tile_zero(4);
    if (EIGHT) _tile_dpbssd(4, 0, 2);
    else _tile_dpbsud(4, 0, 2);
    _tile_stored(4, cbuf[0], 64);
  }
}

// out rows m..m + R (rows past m1 computed, not stored) x the 16 columns of `a` (`cols` stored).
template <int R, bool EIGHT, int U>
ZI_AMX void rows16(Tile a, int64_t K, int64_t G, const Prep& p, int64_t m, int64_t m1, float* out, int64_t ldo,
                   __mmask16 cols) {
  const int64_t nu = K / U, upg = G / U, ng = K / G, ldq = p.xq.ldq, ldd = p.xq.ldd;
  const int8_t* xq = p.xq.q.data() + m * ldq;
  const float* dx = p.xq.d.data() + m * ldd;
  const float* xsum = a.off ? p.xsum.data() + m * ng : nullptr;
  alignas(64) int32_t cbuf[2][256];
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  unit_product<EIGHT, U>(xq, ldq, a.wt, 0, cbuf);
  for (int64_t g = 0; g < ng; ++g) {
    for (int64_t u = g * upg; u < (g + 1) * upg; ++u) {
      if (u + 1 < nu) unit_product<EIGHT, U>(xq, ldq, a.wt, u + 1, cbuf);   // runs while unit u is scaled
      const int32_t* c = cbuf[u & 1];
      const __m512 s0 = _mm512_load_ps(a.su + u * NT);
      const int64_t blk = u * U / 32;
      for (int i = 0; i < R; ++i) {
        const __m512 d = _mm512_set1_ps(dx[i * ldd + blk]);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + i * 16)), _mm512_mul_ps(s0, d), acc[i]);
      }
    }
    if (a.off) {               // the group ends: its offsets times the rows' exact group sums
      const __m512 o0 = _mm512_load_ps(a.off + g * NT);
      for (int i = 0; i < R; ++i) acc[i] = _mm512_fmadd_ps(o0, _mm512_set1_ps(xsum[i * ng + g]), acc[i]);
    }
  }
  for (int i = 0; i < R && m + i < m1; ++i) _mm512_mask_storeu_ps(out + (m + i) * ldo, cols, acc[i]);
}

template <bool EIGHT, int U>
ZI_AMX void tile_rows(Tile a, int64_t K, int64_t G, const Prep& p, int64_t m0, int64_t m1, float* out, int64_t ldo,
                      __mmask16 cols) {
  for (int64_t m = m0; m < m1; m += 16) {
    switch ((std::min<int64_t>(16, m1 - m) + 3) / 4) {
      case 1: rows16<4, EIGHT, U>(a, K, G, p, m, m1, out, ldo, cols); break;
      case 2: rows16<8, EIGHT, U>(a, K, G, p, m, m1, out, ldo, cols); break;
      case 3: rows16<12, EIGHT, U>(a, K, G, p, m, m1, out, ldo, cols); break;
      default: rows16<16, EIGHT, U>(a, K, G, p, m, m1, out, ldo, cols); break;
    }
  }
}

ZI_AMX void run_tile(int64_t bits, int64_t U, Tile a, int64_t K, int64_t G, const Prep& p, int64_t m0, int64_t m1,
                     float* out, int64_t ldo, __mmask16 cols) {
  if (bits == 4) tile_rows<false, 32>(a, K, G, p, m0, m1, out, ldo, cols);
  else if (U == 32) tile_rows<true, 32>(a, K, G, p, m0, m1, out, ldo, cols);
  else tile_rows<true, 16>(a, K, G, p, m0, m1, out, ldo, cols);
}

}  // namespace

namespace zi_quant {

ZI_AMX void q8_gemm_amx(const QW& w, const Prep& p, int64_t M, int64_t U, float* out) {
  const int64_t N = w.n, K = w.k, G = w.group, bits = w.bits == 4 ? 4 : 8;
  for_packed_tiles(w, p, M, U, row_block(K, 16), false,
                   [&](Tile a, Tile b, bool two, int64_t m0, int64_t m1, int64_t col, __mmask16 cols) {
                     load_config(U);           // per call: the tile state is per thread
                     run_tile(bits, U, a, K, G, p, m0, m1, out + col, N, cols);
                     if (two) run_tile(bits, U, b, K, G, p, m0, m1, out + col + NT, N, cols);
                     _tile_release();
                   });
}

}  // namespace zi_quant

namespace {

bool amx_int8_available() { return zi_quant::q8_amx_ready(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(zooinfer_cpu, m) {
  m.def("quant_q8_amx_available() -> bool", TORCH_FN(amx_int8_available));
}
