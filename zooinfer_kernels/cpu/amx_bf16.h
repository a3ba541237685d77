// The AMX-BF16 register tile the bf16 products share (head_amx.cpp: the quantized head's screen;
// quant_gemm_bf16.cpp: prefill-sized linears on quantized weights): 32 rows of x^ (two A tiles of
// 16 rows x 32 k, bf16 row-major) times a pair of B tiles (16 columns x 32 k each, in TDPBF16PS's
// VNNI pair order, `TILE` bf16 elements per k step) into four C tiles, summed over all k steps
// in increasing order before one store. Both callers include it only where the build has
// AMX-TILE, AMX-BF16 and AVX-512 (their `#if`), after `load_full_tiles` (amx_perm.h).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace zooinfer_amx {

constexpr int64_t TILE = 512;     // bf16 elements of one tile (16 rows x 32)

// C tiles 0/1: x rows a0 x B tiles b0/b1 (k step s at b + s * TILE); with TWO, C tiles 2/3: x rows
// a1. Each C tile is one fp32 sum per element over the KS steps, stored to cbuf[0..3].
template <bool TWO>
inline void pair_tiles(const uint16_t* a0, const uint16_t* a1, int64_t lda, const uint16_t* b0, const uint16_t* b1,
                       int64_t KS, float (*cbuf)[256]) {
  _tile_zero(0);
  _tile_zero(1);
  if (TWO) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t s = 0; s < KS; ++s) {
    _tile_loadd(4, a0 + s * 32, lda);
    _tile_loadd(6, b0 + s * TILE, 64);
    _tile_loadd(7, b1 + s * TILE, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (TWO) {
      _tile_loadd(5, a1 + s * 32, lda);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, cbuf[0], 64);
  _tile_stored(1, cbuf[1], 64);
  if (TWO) {
    _tile_stored(2, cbuf[2], 64);
    _tile_stored(3, cbuf[3], 64);
  }
}

// Rows [m0, m0 + rows) x columns [n0, n0 + cols) of out from one C tile, plus bias[n0 + j] where
// bias is given (one fp32 add after the whole sum).
inline void store_tile(const float* c, int64_t m0, int64_t rows, int64_t n0, int64_t cols, float* out, int64_t ldo,
                       const float* bias = nullptr) {
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 v = _mm512_load_ps(c + r * 16);
    _mm512_mask_storeu_ps(out + (m0 + r) * ldo + n0, mask, bias ? _mm512_add_ps(v, b) : v);
  }
}

}  // namespace zooinfer_amx
