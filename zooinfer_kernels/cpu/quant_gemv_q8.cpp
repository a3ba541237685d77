// Decode linears on quantized weights with int8 activations (models/quant.py, `activations: int8`):
// out[M, N] = x[M, K] @ W^T for M <= DECODE_ROWS, W in the layout of quant_layout.h.
//
// Why: the exact decode kernels (quant_gemm.cpp) widen every weight to fp32 and spend about
// eight instructions per 32 weights; memory is not the limit at the sizes of the embedded models.
// As llama.cpp does (its Q8_0 / Q8_1 activations), x is quantized once per call to int8 in blocks
// of 32 (d = max|x| / 127, xq = round(x / d)), and the integer dot products run on VNNI
// (vpdpbusd: 64 unsigned x signed byte products into 16 int32 lanes per instruction), so one
// 64-byte load of 4-bit weights (128 weights) costs about a dozen instructions.
//
// What it computes (the bound tests/test_quant_q8.py checks): with xq_k the quantized x and dx_b
// its block scale, sum_k x_k w_k = sum_g s_g sum_{k in g} q_k x_k + sum_g (min_g - zero s_g) xsum_g
// where the first sum uses dx_b * xq_k for x_k and the second the exact fp32 group sums of x.
// So |result - x @ dequantize(W)^T| <= sum_b |s| (dx_b / 2) sum_{k in b} |q_k| + fp32 rounding:
// the error of rounding x to int8, on the integer part only.
//
// Layouts inside a call (built by quantize_x, quant_xq.h):
//   4-bit: a chunk of 64 weight bytes = 4 blocks of 32 weights; its low nibbles are weights 0..15
//   of the 4 blocks, its high nibbles weights 16..31. xq per row is stored in that order (128 bytes
//   per chunk: [A0-15 B0-15 C0-15 D0-15][A16-31 ... D16-31]), so lo/hi nibbles dot xq directly.
//   int32 lane i of the dot product then belongs to block i / 4.
//   8-bit: natural order, 64 weights per chunk, lane i = weights 4i..4i+3 (block i / 8). Signed
//   weights: |w| as the unsigned operand and x negated where w < 0 (vpdpbusd is unsigned x signed).
//   5 / 6-bit: as 8-bit, each chunk's q - zero widened in registers from the stored nibbles and
//   high-bit words (`weights8`), the same integers the other paths unpack into a buffer first.
// Streaming (Zen 5, Gemma-3 Q4_K_M's body, 1 thread: 11.3 to 6.2 ms a step with the changes below):
// full chunks load unmasked and the quantized bytes are prefetched in software whole tiles ahead (masked loads
// kept the hardware prefetcher from following the rows, as in quant_head.cpp); even and odd chunks
// sum into two named sets of accumulators (indexed by c & 1 they lived on the stack); 5 / 6 bits
// skip the unpack buffer's store and reload; two-level scales widen 16 at a time (quant_storage.h).
// Row tiles (Intel AMX Xeon, SmolLM2 int4_asym, 1 x row, 2 threads: gate_up 3072 x 576 57.6 -> 36.8 us,
// down 576 x 1536 25.3 -> 17.1): at K = 576 a weight row is 4.5 chunks, so the per-row work (x's
// loads, two 16-lane sums, the min term) cost more than the chunks; one x row now runs against 4
// weight rows at a time (2 x rows against 2), the min term's lanes join the products before one
// fixed-tree sum, and `#pragma GCC unroll` keeps the [R][NR] accumulators in registers (without
// it GCC left them on the stack: no faster than the single-row tile).
// This kernel needs AVX-512 F/BW/VL + VNNI (isa 2); elsewhere (isa 1: AVX2 + FMA, or forced by
// the `isa` argument) the op runs quant_q8_avx2.cpp's row-order kernel, the same formula and
// bound, whose results do not depend on the row count. `quant_q8_available`: either path; without AVX2 + FMA
// the Python side falls back to the exact kernels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "quant_xq.h"

namespace {

using namespace zi_quant;

constexpr int64_t PF_BYTES = 5120;   // least software prefetch distance in a weight's quantized bytes (see tile)

// The least multiple of `stride` that is at least `bytes` (a prefetch distance in whole tiles, see tile).
constexpr int64_t whole_strides(int64_t bytes, int64_t stride) { return stride > 0 ? (bytes + stride - 1) / stride * stride : 0; }

ZI_VNNI ZI_INLINE __m128 load2(const float* p) {   // p[0], p[1], zeros: an 8-byte load, not a masked one
  return _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p)));
}

// 4-bit chunk c of NR weight rows (r, sc: their bytes and scales) against R rows of xq: acc[i][j]
// lanes hold block lane / 4 of the chunk for x row m0 + i and weight row j. The xq loads are shared
// by the NR rows; each (i, j) product is the same arithmetic whatever NR is. Even chunks sum into
// `even`, odd ones into `odd` (two fma chains per pair, all in registers).
template <int R, int NR>
ZI_VNNI ZI_INLINE void chunk4(const QW& w, const uint8_t* const (&r)[NR], const float* const (&sc)[NR], int64_t c,
                              int64_t nb, const XQ& xq, int64_t m0, int64_t pf, __m512 (&acc)[R][NR]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const int blocks = static_cast<int>(std::min<int64_t>(4, nb - c * 4));
  __m512i xl[R], xh[R];
  __m128 dx[R];
  #pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    const int8_t* xr = xq.q.data() + (m0 + i) * xq.ldq + c * 128;
    xl[i] = _mm512_loadu_si512(xr), xh[i] = _mm512_loadu_si512(xr + 64);
    dx[i] = _mm_loadu_ps(xq.d.data() + (m0 + i) * xq.ldd + c * 4);
  }
  #pragma GCC unroll 8
  for (int j = 0; j < NR; ++j) {
    _mm_prefetch(reinterpret_cast<const char*>(r[j] + c * 64) + pf, _MM_HINT_T0);
    const __m512i v = blocks == 4 ? _mm512_loadu_si512(r[j] + c * 64)
                                  : _mm512_maskz_loadu_epi8((__mmask64(1) << (16 * blocks)) - 1, r[j] + c * 64);
    const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    __m128 sw;
    if (w.group == 32 && blocks == 4) {
      sw = _mm_loadu_ps(sc[j] + c * 4);
    } else if (w.group == 32) {
      sw = _mm_maskz_loadu_ps(static_cast<__mmask8>((1u << blocks) - 1), sc[j] + c * 4);
    } else {
      alignas(16) float s[4] = {0.f, 0.f, 0.f, 0.f};
      for (int b = 0; b < blocks; ++b) s[b] = sc[j][(c * 4 + b) * 32 / w.group];
      sw = _mm_load_ps(s);
    }
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      __m512i dp = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xl[i]);
      dp = _mm512_dpbusd_epi32(dp, hi, xh[i]);
      const __m512 s = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(sw, dx[i])));
      acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), s, acc[i][j]);
    }
  }
}

// The 64 signed weights q - zero of chunk c (weights 64c..64c + 63, natural order) of a row of
// BITS 8 (r: int8 [K]) or 5 / 6 (r: the low nibbles as 4-bit rows store them, 16 bytes a block;
// h: the row's high-bit words, BITS - 4 per block). `full`: else a 32-weight tail (zeros after it).
// 5 / 6 bits are widened here, in registers, instead of into a buffer (quant_storage.h
// `unpack_rows`, which the other paths use): the same integers.
template <int BITS>
ZI_VNNI ZI_INLINE __m512i weights8(const uint8_t* r, const uint32_t* h, int64_t c, bool full, int zero, int64_t pf,
                                   int64_t pf_h) {
  if constexpr (BITS == 8) {
    _mm_prefetch(reinterpret_cast<const char*>(r + c * 64) + pf, _MM_HINT_T0);
    return full ? _mm512_loadu_si512(r + c * 64) : _mm512_maskz_loadu_epi8((__mmask64(1) << 32) - 1, r + c * 64);
  } else {
    constexpr int planes = BITS - 4;
    _mm_prefetch(reinterpret_cast<const char*>(r + c * 32) + pf, _MM_HINT_T0);
    if ((c & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(h + c * 2 * planes) + pf_h, _MM_HINT_T0);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i b = full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + c * 32))
                           : _mm256_maskz_loadu_epi8(0xFFFF, r + c * 32);
    // 128-bit lanes [A 0-15, B 0-15, A 16-31, B 16-31] of the chunk's blocks A, B -> natural order
    __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(b, m4)),
                                   _mm256_and_si256(_mm256_srli_epi16(b, 4), m4), 1);
    v = _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0));
    const uint32_t* hw = h + c * 2 * planes;   // words A0 [A1] B0 [B1]: bit j of a word is weight j's
    const uint64_t hb = full ? hw[planes] : 0;
    v = _mm512_mask_add_epi8(v, static_cast<__mmask64>(hw[0] | hb << 32), v, _mm512_set1_epi8(16));
    if constexpr (planes == 2) {
      const uint64_t hb1 = full ? hw[3] : 0;
      v = _mm512_mask_add_epi8(v, static_cast<__mmask64>(hw[1] | hb1 << 32), v, _mm512_set1_epi8(32));
    }
    const __m512i q = _mm512_sub_epi8(v, _mm512_set1_epi8(static_cast<char>(zero)));
    return full ? q : _mm512_maskz_mov_epi8((__mmask64(1) << 32) - 1, q);
  }
}

// 8-bit (or 5 / 6-bit, see weights8) chunk c of NR weight rows: lane i covers weights 4i..4i+3
// (block i / 8, 16-group i / 4); the xq loads shared as in chunk4.
template <int BITS, int R, int NR>
ZI_VNNI ZI_INLINE void chunk8(const QW& w, const uint8_t* const (&r)[NR], const uint32_t* const (&h)[NR],
                              const float* const (&sc)[NR], int64_t c, const XQ& xq, int64_t m0, int64_t pf,
                              int64_t pf_h, __m512 (&acc)[R][NR]) {
  const __m512i by8 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i by4 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i zero = _mm512_setzero_si512();
  const int64_t k0 = c * 64, len = std::min<int64_t>(64, w.k - k0);   // 64 or a 32-weight tail
  const bool full = len == 64;
  __m512i xv[R];
  __m512 dx[R];
  #pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    xv[i] = _mm512_loadu_si512(xq.q.data() + (m0 + i) * xq.ldq + k0);
    dx[i] = _mm512_permutexvar_ps(by8, _mm512_castps128_ps512(load2(xq.d.data() + (m0 + i) * xq.ldd + c * 2)));
  }
  #pragma GCC unroll 8
  for (int j = 0; j < NR; ++j) {
    const __m512i v = weights8<BITS>(r[j], h[j], c, full, static_cast<int>(w.zero), pf, pf_h);
    const __m512i aw = _mm512_abs_epi8(v);
    const __mmask64 neg = _mm512_movepi8_mask(v);
    const float* s = sc[j];
    __m512 sw;    // the weight scale of each lane
    if (w.group == 16) {
      sw = _mm512_permutexvar_ps(by4, _mm512_castps128_ps512(full ? _mm_loadu_ps(s + k0 / 16) : load2(s + k0 / 16)));
    } else if (w.group == 32) {
      sw = _mm512_permutexvar_ps(by8, _mm512_castps128_ps512(full ? load2(s + k0 / 32) : _mm_load_ss(s + k0 / 32)));
    } else if (k0 / w.group == (k0 + len - 1) / w.group) {
      sw = _mm512_set1_ps(s[k0 / w.group]);
    } else {      // a chunk across two groups of a G that is not a multiple of 64 (e.g. 96)
      alignas(64) float t[16];
      for (int l = 0; l < 16; ++l) t[l] = k0 + 4 * l < w.k ? s[(k0 + 4 * l) / w.group] : 0.f;
      sw = _mm512_load_ps(t);
    }
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m512i dp = _mm512_dpbusd_epi32(zero, aw, _mm512_mask_sub_epi8(xv[i], neg, zero, xv[i]));
      acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), _mm512_mul_ps(sw, dx[i]), acc[i][j]);
    }
  }
}

// The min / zero term of weight row `row` for one x row, per lane: the lanes of
// sum_g (min_g - zero s_g) xsum_g, 16 groups at a time (a masked tail).
ZI_VNNI ZI_INLINE __m512 offset_lanes(const QW& w, int64_t row, const float* xsum) {
  const int64_t ng = w.k / w.group;
  const float* sp = w.scale + row * ng;
  const float* mp = w.minv ? w.minv + row * ng : nullptr;
  const __m512 z = _mm512_set1_ps(static_cast<float>(w.tile_zero()));
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; g += 16) {
    const __mmask16 k = ng - g >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (ng - g)) - 1);
    const __m512 mv = mp ? _mm512_maskz_loadu_ps(k, mp + g) : _mm512_setzero_ps();
    acc = _mm512_fmadd_ps(_mm512_fnmadd_ps(z, _mm512_maskz_loadu_ps(k, sp + g), mv), _mm512_maskz_loadu_ps(k, xsum + g),
                          acc);
  }
  return acc;
}

// Sums of 16 lanes in one fixed tree, (lane j + lane j + 8) + (j + 4, j + 12), then (0 + 2) + (1 + 3):
// `sum16` for one vector and `sum16x4` for four at once (a 4 x 4 transpose), the same value per vector.
ZI_VNNI ZI_INLINE __m128 quarter_sums(__m512 a) {
  const __m256 s = _mm256_add_ps(_mm512_castps512_ps256(a),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

ZI_VNNI ZI_INLINE float sum16(__m512 a) {
  const __m128 u = quarter_sums(a);
  const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

ZI_VNNI ZI_INLINE __m128 sum16x4(__m512 a, __m512 b, __m512 c, __m512 d) {
  __m128 u0 = quarter_sums(a), u1 = quarter_sums(b), u2 = quarter_sums(c), u3 = quarter_sums(d);
  _MM_TRANSPOSE4_PS(u0, u1, u2, u3);     // u_l: lane l of a, b, c, d
  return _mm_add_ps(_mm_add_ps(u0, u2), _mm_add_ps(u1, u3));
}

// Weight rows n..n + NR of a tile against x rows m0..m0 + R, written to out: per (x row, weight row)
// the chunk products, the min / zero term's lanes, then one 16-lane sum. NR > 1 shares the xq
// loads and the final sums between rows (at K = 576 the per-row work was ~60% of a SmolLM2 linear);
// every (x row, weight row) gets the same arithmetic for any NR and R, so a row's result does not
// depend on the batch.
template <int BITS, int R, int NR>
ZI_VNNI void tile(const QW& w, int64_t n, const XQ& xq, int64_t m0, const float* xsum, float* out, int64_t ldo) {
  const int64_t nb = w.k / 32, ng = w.k / w.group;
  const int64_t chunks = BITS == 4 ? (nb + 3) / 4 : (w.k + 63) / 64;
  const uint8_t* r[NR];
  const uint32_t* h[NR];
  const float* sc[NR];
  #pragma GCC unroll 8
  for (int j = 0; j < NR; ++j) {
    r[j] = w.qs + (n + j) * w.row_bytes();
    h[j] = BITS == 5 || BITS == 6 ? w.qh + (n + j) * nb * (BITS - 4) : nullptr;
    sc[j] = w.scale + (n + j) * ng;
  }
  // Prefetch distance: a whole number of tiles (NR rows) ahead and at least PF_BYTES, so each row's
  // chunk c fetches the same chunk of a row some tiles on (the 5 / 6-bit high-bit words likewise).
  // A fixed 2560 bytes reached only ~1.5 rows past a 4-row tile at K = 2048; Gemma-3's Q4_K / Q6_K
  // down_proj (K = 2048) at one x row, 2 threads, in forward order: 57 -> 50 and 80 -> 72 us,
  // the body 3% less, one more tile ahead ~2% more (interleaved A/B in one process).
  const int64_t pf = whole_strides(PF_BYTES, NR * w.row_bytes());
  const int64_t pf_h = whole_strides(PF_BYTES / 2, BITS == 5 || BITS == 6 ? NR * nb * (BITS - 4) * 4 : 0);
  __m512 even[R][NR], odd[R][NR];
  #pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
    #pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) even[i][j] = odd[i][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; c += 2) {
    if constexpr (BITS == 4) {
      chunk4<R, NR>(w, r, sc, c, nb, xq, m0, pf, even);
      if (c + 1 < chunks) chunk4<R, NR>(w, r, sc, c + 1, nb, xq, m0, pf, odd);
    } else {
      chunk8<BITS, R, NR>(w, r, h, sc, c, xq, m0, pf, pf_h, even);
      if (c + 1 < chunks) chunk8<BITS, R, NR>(w, r, h, sc, c + 1, xq, m0, pf, pf_h, odd);
    }
  }
  #pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    __m512 t[NR];
    #pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      t[j] = _mm512_add_ps(even[i][j], odd[i][j]);
      if (xsum) t[j] = _mm512_add_ps(t[j], offset_lanes(w, n + j, xsum + (m0 + i) * ng));
    }
    float* o = out + (m0 + i) * ldo + n;
    if constexpr (NR == 4) {
      _mm_storeu_ps(o, sum16x4(t[0], t[1], t[2], t[3]));
    } else {
      #pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) o[j] = sum16(t[j]);
    }
  }
}

// Weight rows [n0, n1) against every row of xq: 4 weight rows a tile for one x row, 2 for two,
// 1 for 3-4 (the accumulators: 2 R NR of the 32 zmm registers).
template <int BITS>
ZI_VNNI void rows_bits(const QW& w, const XQ& xq, int64_t M, const float* xsum, float* out, int64_t ldo, int64_t n0,
                       int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4)
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
      switch (std::min<int64_t>(MR, M - m0)) {
        case 1: tile<BITS, 1, 4>(w, n, xq, m0, xsum, out, ldo); break;
        case 2:
          tile<BITS, 2, 2>(w, n, xq, m0, xsum, out, ldo);
          tile<BITS, 2, 2>(w, n + 2, xq, m0, xsum, out, ldo);
          break;
        case 3:
          for (int j = 0; j < 4; ++j) tile<BITS, 3, 1>(w, n + j, xq, m0, xsum, out, ldo);
          break;
        default:
          for (int j = 0; j < 4; ++j) tile<BITS, 4, 1>(w, n + j, xq, m0, xsum, out, ldo);
          break;
      }
    }
  for (; n < n1; ++n)
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
      switch (std::min<int64_t>(MR, M - m0)) {
        case 1: tile<BITS, 1, 1>(w, n, xq, m0, xsum, out, ldo); break;
        case 2: tile<BITS, 2, 1>(w, n, xq, m0, xsum, out, ldo); break;
        case 3: tile<BITS, 3, 1>(w, n, xq, m0, xsum, out, ldo); break;
        default: tile<BITS, 4, 1>(w, n, xq, m0, xsum, out, ldo); break;
      }
    }
}

// Rows [n0, n1) of a tile (bits 4, 8, or 5 / 6 as stored: for_row_tiles without unpacking).
ZI_VNNI void rows_q8(const QW& w, const XQ& xq, int64_t M, const float* xsum, float* out, int64_t ldo, int64_t n0,
                     int64_t n1) {
  switch (w.bits) {
    case 4: return rows_bits<4>(w, xq, M, xsum, out, ldo, n0, n1);
    case 5: return rows_bits<5>(w, xq, M, xsum, out, ldo, n0, n1);
    case 6: return rows_bits<6>(w, xq, M, xsum, out, ldo, n0, n1);
    default: return rows_bits<8>(w, xq, M, xsum, out, ldo, n0, n1);
  }
}

at::Tensor quant_linear_q8(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                           const c10::optional<at::Tensor>& minv, int64_t bits, int64_t group, int64_t zero,
                           const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& qh,
                           const c10::optional<at::Tensor>& scale_d, const c10::optional<at::Tensor>& minv_d,
                           int64_t isa) {
  const int64_t path = q8_pick_isa(isa, "quant_linear_q8");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "quant_linear_q8: x must be a 2-D float32 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(x.size(0) <= DECODE_ROWS, "quant_linear_q8: at most ", DECODE_ROWS, " rows (decode), got ", x.size(0));
  const QW w = make_qw(qs, scale, minv, bits, group, zero, x.size(1), qh, scale_d, minv_d);
  const int64_t M = x.size(0), N = w.n;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M > 0 && N > 0) {
    const at::Tensor xc = x.contiguous();
    const float* xp = xc.data_ptr<float>();
    float* op = out.data_ptr<float>();
    if (path == 1) {
      q8_linear_avx2(w, xp, M, op, N, false);     // quant_q8_avx2.cpp, row order
    } else {
      const XQ xq = quantize_x(xp, w.k, M, w.k, bits == 4);
      const std::vector<float> xsum = group_sums(w, xp, w.k, M);
      const float* xs = xsum.empty() ? nullptr : xsum.data();
      at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        for_row_tiles(w, 2, n0, n1, [&](const QW& t, int64_t r0, int64_t r1) { rows_q8(t, xq, M, xs, op + r0, N, 0, r1 - r0); },
                      false);
      });
    }
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "quant_linear_q8: bias must have ", N, " elements, got ", bias->numel());
    out.add_(bias->to(at::kFloat).view({1, N}));
  }
  return out;
}

// xq and its block scales as the kernel computes them (for the tests' exact emulation): int8 [M, K]
// in natural order and float32 [M, K / 32].
std::vector<at::Tensor> quantize_activations_q8(const at::Tensor& x, int64_t isa) {
  const int64_t path = q8_pick_isa(isa, "quantize_activations_q8");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % 32 == 0,
              "quantize_activations_q8: x must be float32 [M, K] with K a multiple of 32, got ", x.sizes());
  const at::Tensor xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const XQ xq = quantize_x(xc.data_ptr<float>(), K, M, K, false, path);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar)), d = at::empty({M, K / 32}, x.options());
  for (int64_t m = 0; m < M; ++m) {
    std::copy_n(xq.q.data() + m * xq.ldq, K, q.data_ptr<int8_t>() + m * K);
    std::copy_n(xq.d.data() + m * xq.ldd, K / 32, d.data_ptr<float>() + m * (K / 32));
  }
  return {q, d};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(zooinfer_cpu, m) {
  m.def("quant_linear_q8(Tensor x, Tensor qs, Tensor scale, Tensor? minv, int bits, int group, int zero, "
        "Tensor? bias, Tensor? qh=None, Tensor? scale_d=None, Tensor? minv_d=None, int isa=-1) -> Tensor");
  m.impl("quant_linear_q8", c10::DispatchKey::CPU, TORCH_FN(quant_linear_q8));
  m.def("quantize_activations_q8(Tensor x, int isa=-1) -> Tensor[]");
  m.impl("quantize_activations_q8", c10::DispatchKey::CPU, TORCH_FN(quantize_activations_q8));
  m.def("quant_q8_available() -> bool", TORCH_FN(q8_available));
  m.def("quant_q8_best_isa() -> int", TORCH_FN(q8_best_isa));
}
