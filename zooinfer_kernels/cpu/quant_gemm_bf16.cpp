// Prefill-sized linears on quantized weights on AMX-BF16 tiles (`quantization.activations:
// int8_bf16`, models/quant.py): out = x^ W^T + bias, with x^ = x rounded to bf16 and W^ = the
// dequantized weight (`quant_dequantize`'s floats) rounded to bf16, the products exact and summed
// in fp32 by TDPBF16PS over k in increasing order (amx_bf16.h's register tile).
//
// Why: at prefill the int8-activation GEMM (quant_gemm_q8.cpp) is compute-bound at ~300-380 GOP/s
// a thread (each 32-block of k carries its own scales, so its integer sums are scaled every 32 k;
// AMX-INT8 tiles could not hide that, quant_gemm_amx.cpp). bf16 needs no per-block scaling: the
// weight is dequantized once per call into B tiles and a C tile sums all of k in the tiles, ~1-2
// TFLOP/s on 2 threads for Gemma-3's shapes (Emerald Rapids). OpenVINO's CPU defaults are of the
// same kind (bf16 inference precision on AMX, dynamic int8 activations for compressed weights).
//
// Order: threads split the columns (pairs of 16-column B tiles); each dequantizes a chunk of its
// pairs over all of k (`CHUNK_BYTES` of bf16 tiles, kept in L2), then runs every 32-row block of x^
// against every pair of the chunk. Each weight is so dequantized once per call, by one thread:
// 16 weight rows x 32 k at a time, each row's 32 weights one FMA pair and one bf16 conversion in
// row order (`row_pairs`), then a 16 x 16 dword transpose makes the B tile's pair order. ~0.45
// cycles a weight on Emerald Rapids; the integer division of a group index per row had doubled it,
// and broadcasting the scales from registers (the shuffle port, shared with the transpose) cost
// another ~10%. That cost sets `quant_gemm.BF16_MIN_ROWS`.
//
// Exactness: each output equals `head_logits_bf16_amx(x^, pack_pair_tiles(W^))` (head_amx.cpp's
// tile, the same sums in the same order) + bias in one fp32 add: tests/test_quant_bf16.py checks it
// bit for bit, and the bound |out - x W^T| <= (2^-8 (2 + 2^-8) + K 2^-21) sum_k |x_k W_k| + flushed
// denormals (x^ and W^ each within 2^-8 relative of x and W, the tiles' fp32 sums).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "quant_storage.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include "amx_bf16.h"
#include "amx_perm.h"
#define ZOOINFER_AMX_QUANT_BF16 1
#endif

namespace zi_quant {
namespace {

#ifdef ZOOINFER_AMX_QUANT_BF16
using zooinfer_amx::TILE;
constexpr int64_t CHUNK_BYTES = 256 << 10;     // a thread's dequantized B tiles at a time (L2)

// 32 weights k0..k0 + 31 of row r of an expanded tile (bits 4 or 8) as 16 bf16 pairs: each weight
// `scale * q + offset` in fp32 (quant_gemm_panels.cpp's operations, so the floats of
// `quant_dequantize`), rounded to nearest even; dword d = (w[k0 + 2d], w[k0 + 2d + 1]). s0 / o0
// and s1 / o1: the scale and offset of the two 16-weight halves' groups (the same group but for
// 8-bit groups of 16), read from memory so their broadcasts take no shuffle port.
inline __m512i row_pairs(const QW& t, int64_t r, int64_t k0, const float* s0, const float* o0, const float* s1,
                         const float* o1) {
  __m512i lo, hi;
  if (t.bits == 4) {   // byte i of a block: weight i low nibble, weight i + 16 high nibble
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t.qs + r * (t.k / 2) + k0 / 2)));
    lo = _mm512_and_si512(b, _mm512_set1_epi32(15));
    hi = _mm512_srli_epi32(b, 4);
  } else {
    const auto* q = reinterpret_cast<const __m128i*>(t.qs + r * t.k + k0);
    lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(q));
    hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1));
  }
  const __m512 f0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_set1_ps(*s0), _mm512_set1_ps(*o0));
  const __m512 f1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(*s1), _mm512_set1_ps(*o1));
  return (__m512i)_mm512_cvtne2ps_pbh(f1, f0);
}

// v[i] dword j -> v[j] dword i (16 x 16).
inline void transpose16(__m512i v[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // now v[4a + b] holds, in 128-bit lane L, dwords b of rows 4L'.. : regroup the 128-bit lanes
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(v[i], v[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(v[i], v[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(v[i + 8], v[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(v[i + 8], v[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    v[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    v[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    v[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// Rows [r0, r0 + rows) (rows <= 16, the rest zero) of the expanded tile `t` as one B tile per k
// step s of 32: tile row d holds, for column j, the pair of weight row j at k 32 s + 2 d. The rows'
// offsets (QW::offset's operations) are computed once into `off` first.
// `off`: room for 16 rows' offsets (16 * K / group floats).
inline void rows_to_tiles(const QW& t, int64_t r0, int64_t rows, uint16_t* b, float* off) {
  const int64_t ng = t.k / t.group;
  const float* sc = t.scale + r0 * ng;
  for (int64_t i = 0; i < rows * ng; ++i) off[i] = (t.minv ? t.minv[r0 * ng + i] : 0.f) - static_cast<float>(t.tile_zero()) * sc[i];
  for (int64_t k0 = 0; k0 < t.k; k0 += 32) {
    const int64_t g0 = k0 / t.group, g1 = (k0 + 16) / t.group;   // 8-bit groups of 16: two per block
    __m512i v[16];
    for (int64_t j = 0; j < 16; ++j)
      v[j] = j < rows ? row_pairs(t, r0 + j, k0, sc + j * ng + g0, off + j * ng + g0, sc + j * ng + g1, off + j * ng + g1)
                      : _mm512_setzero_si512();
    transpose16(v);
    uint16_t* dst = b + (k0 / 32) * TILE;
    for (int d = 0; d < 16; ++d) _mm512_store_si512(dst + d * 32, v[d]);
  }
}

// Columns [32 p0, 32 p1) of out (clipped to N) for all M rows of xb [Mp, K].
void run_cols(const QW& w, const uint16_t* xb, int64_t M, int64_t Mp, const float* bias, float* out, int64_t p0,
              int64_t p1) {
  const int64_t N = w.n, K = w.k, KS = K / 32, pair_elems = 2 * KS * TILE;
  const int64_t chunk = std::max<int64_t>(2, CHUNK_BYTES / (2 * pair_elems)) / 2 * 2;   // whole 64-row tiles
  std::vector<uint16_t> bbuf(static_cast<size_t>(std::min(chunk, p1 - p0) * pair_elems) + 32);
  std::vector<float> off(static_cast<size_t>(16 * (K / w.group)));
  uint16_t* bt = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(bbuf.data()) + 63) & ~uintptr_t(63));
  alignas(64) float cbuf[4][256];
  zooinfer_amx::load_full_tiles();
  for (int64_t q0 = p0; q0 < p1; q0 += chunk) {
    const int64_t q1 = std::min(p1, q0 + chunk);
    // the chunk's weight rows, 64 at a time as `for_row_tiles` expands them, 16 per B tile
    for_row_tiles(w, 2, 32 * q0, std::min(N, 32 * q1), [&](const QW& t, int64_t r0, int64_t r1) {
      for (int64_t j = 0; j < r1 - r0; j += 16) {
        const int64_t vt = (r0 + j) / 16 - 2 * q0;          // vocab tile in the chunk: pair vt / 2, half vt % 2
        rows_to_tiles(t, j, std::min<int64_t>(16, r1 - r0 - j), bt + (vt / 2) * pair_elems + (vt % 2) * KS * TILE,
                      off.data());
      }
    });
    for (int64_t p = q0; p < q1; ++p)   // a pair past N's last tile: zero tiles (its outputs are not stored)
      if (32 * p + 16 >= N) std::memset(bt + (p - q0) * pair_elems + KS * TILE, 0, KS * TILE * sizeof(uint16_t));
    for (int64_t m = 0; m < Mp; m += 32) {
      const uint16_t* a0 = xb + m * K;
      const bool two = m + 16 < Mp;
      const int64_t r0 = std::clamp<int64_t>(M - m, 0, 16), r1 = std::clamp<int64_t>(M - m - 16, 0, 16);
      for (int64_t p = q0; p < q1; ++p) {
        const uint16_t* b0 = bt + (p - q0) * pair_elems;
        if (two) zooinfer_amx::pair_tiles<true>(a0, a0 + 16 * K, 2 * K, b0, b0 + KS * TILE, KS, cbuf);
        else zooinfer_amx::pair_tiles<false>(a0, nullptr, 2 * K, b0, b0 + KS * TILE, KS, cbuf);
        const int64_t n0 = 32 * p;
        const int64_t c0 = std::clamp<int64_t>(N - n0, 0, 16), c1 = std::clamp<int64_t>(N - n0 - 16, 0, 16);
        if (c0) zooinfer_amx::store_tile(cbuf[0], m, r0, n0, c0, out, N, bias);
        if (c1) zooinfer_amx::store_tile(cbuf[1], m, r0, n0 + 16, c1, out, N, bias);
        if (two && c0) zooinfer_amx::store_tile(cbuf[2], m + 16, r1, n0, c0, out, N, bias);
        if (two && c1) zooinfer_amx::store_tile(cbuf[3], m + 16, r1, n0 + 16, c1, out, N, bias);
      }
    }
  }
  _tile_release();
}
#endif

bool bf16_gemm_ready() {
#ifdef ZOOINFER_AMX_QUANT_BF16
  return zooinfer_amx::bf16_ready();
#else
  return false;
#endif
}

at::Tensor quant_linear_bf16_amx(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                                 const c10::optional<at::Tensor>& minv, int64_t bits, int64_t group, int64_t zero,
                                 const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& qh,
                                 const c10::optional<at::Tensor>& scale_d, const c10::optional<at::Tensor>& minv_d) {
  TORCH_CHECK(bf16_gemm_ready(), "quant_linear_bf16_amx: this CPU or build has no usable AMX-BF16 and AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "quant_linear_bf16_amx: x must be a 2-D float32 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  const QW w = make_qw(qs, scale, minv, bits, group, zero, x.size(1), qh, scale_d, minv_d);
  const int64_t M = x.size(0), N = w.n, K = w.k;
  at::Tensor out = at::empty({M, N}, x.options());
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "quant_linear_bf16_amx: bias must have ", N, " elements, got ", bias->numel());
    bf = bias->to(at::kFloat).contiguous();
  }
  if (M == 0 || N == 0) return out;
#ifdef ZOOINFER_AMX_QUANT_BF16
  const int64_t Mp = (M + 15) / 16 * 16;
  at::Tensor xb = at::empty({Mp, K}, x.options().dtype(at::kBFloat16));
  xb.narrow(0, 0, M).copy_(x);
  if (Mp > M) xb.narrow(0, M, Mp - M).zero_();
  const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (N + 31) / 32, 1, [&](int64_t p0, int64_t p1) { run_cols(w, xp, M, Mp, bp, op, p0, p1); });
#endif
  return out;
}

}  // namespace
}  // namespace zi_quant

TORCH_LIBRARY_FRAGMENT(zooinfer_cpu, m) {
  m.def("quant_linear_bf16_amx(Tensor x, Tensor qs, Tensor scale, Tensor? minv, int bits, int group, int zero, "
        "Tensor? bias, Tensor? qh, Tensor? scale_d, Tensor? min_d) -> Tensor");
  m.impl("quant_linear_bf16_amx", c10::DispatchKey::CPU, TORCH_FN(zi_quant::quant_linear_bf16_amx));
  m.def("quant_bf16_amx_available() -> bool", TORCH_FN(zi_quant::bf16_gemm_ready));
}
