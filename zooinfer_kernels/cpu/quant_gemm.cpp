// Linears on quantized weights (models/quant.py `QuantLinear`): out[M, N] = x[M, K] @ W^T (+ bias)
// where W is stored as small integers with per-group scales and never exists in fp32 as a whole.
//
// The one weight layout (models/quant.py `QuantWeight`, every GGUF block format and the loader's
// own int8 / int4 are repacked into it without loss):
//   w[n, k] = scale[n, k / G] * (q[n, k] - zero) + min[n, k / G]      (min optional: 0)
//   bits 4: qs uint8 [N, K / 2]; each 32-weight block of a row is 16 bytes, byte j holding weight j
//           in its low nibble and weight j + 16 in its high nibble (GGUF Q4_0's order); G % 32 == 0.
//   bits 8: qs int8 [N, K]; G % 16 == 0.
//   bits 5 / 6: the low 4 bits as bits 4, the high bits in 1 or 2 bit planes (quant_storage.h).
//   scale / min: float32, float16 where the format's own scales are fp16 (the legacy GGUF
//           formats), or two-level as the K-quants ship them (int8 sub-scales x fp16 super-scales).
//           Storage other than bits 4 / 8 with fp32 scales is expanded 64 rows at a time
//           (quant_storage.h `for_row_tiles`, exact), so the kernels below read only that.
// K is a multiple of G (the Python wrapper pads x and the weight for other K).
//
// Decode (M <= DECODE_ROWS): threads split the output rows; each row's quantized bytes are read
// once, in address order, a 32-weight block at a time widened and converted in registers and
// multiplied into up to MR rows of x at once; each group's sum is scaled by one FMA, and the
// (min - zero * scale) part of the weights is applied as a dot product with the per-group sums of
// x (computed once per call): sum_k x w = sum_g s_g (sum_k x q) + (min_g - zero s_g) sum_k x. Prefill (more rows):
// on the AVX-512 path the weight is dequantized a panel at a time into the blocked fp32 GEMM's layout
// and multiplied by its register kernel (quant_gemm_panels.cpp: equal to that GEMM on the
// dequantized weight, bit for bit); on the AVX2 / scalar paths a tile of weight rows is dequantized
// once into an fp32 buffer (in parallel) and multiplied by all M rows with at::mm.
//
// Three instruction paths, picked at run time (`isa` -1: the best the CPU has; 0 scalar, 1 AVX2
// + FMA, 2 AVX-512 F/BW): functions carry their own `target` attributes, so every path is built
// into the one library whatever -march the build used, and tests run each of them on one machine.
// Each SIMD path has its own weight decoding (`block_*`, `tile`); the decode loop over rows and
// register tiles and the min / zero dot product are one template over the ISA (quant_layout.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "quant_panels.h"
#include "quant_storage.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

using namespace zi_quant;

// ------------------------------------------------------------------------------------ scalar
inline float weight_at(const QW& w, int64_t row, int64_t kk) {
  const uint8_t* r = w.qs + row * w.row_bytes();
  int32_t q;
  if (w.bits == 4) {
    const int64_t blk = kk / 32, j = kk % 32;
    const uint8_t b = r[blk * 16 + (j & 15)];
    q = j < 16 ? (b & 15) : (b >> 4);
  } else {
    q = static_cast<int8_t>(r[kk]);
  }
  const int64_t g = kk / w.group;
  return w.scale[row * (w.k / w.group) + g] * static_cast<float>(q) + w.offset(row, g);
}

void rows_scalar(const QW& w, const float* x, int64_t ldx, int64_t M, float* out, int64_t ldo,
                 int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t kk = 0; kk < w.k; ++kk) acc += x[m * ldx + kk] * weight_at(w, n, kk);
      out[m * ldo + n] = acc;
    }
}

void dequant_scalar(const QW& w, int64_t n0, int64_t n1, float* dst) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t kk = 0; kk < w.k; ++kk) dst[(n - n0) * w.k + kk] = weight_at(w, n, kk);
}

// ------------------------------------------------------------------------------------ AVX2
// 32 weights of row `row` from k = kb * 32 on, as four 8-float vectors.
ZI_AVX2 inline void block_avx2(const QW& w, int64_t row, int64_t kb, __m256 out[4]) {
  const uint8_t* r = w.qs + row * w.row_bytes();
  const int64_t g = kb * 32 / w.group;
  const __m256 s = _mm256_set1_ps(w.scale[row * (w.k / w.group) + g]);
  const __m256 o = _mm256_set1_ps(w.offset(row, g));
  if (w.bits == 4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + kb * 16));
    const __m256i lo8 = _mm256_cvtepu8_epi32(b), hi8 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    const __m256i mask = _mm256_set1_epi32(15);
    out[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(lo8, mask)), s, o);
    out[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(hi8, mask)), s, o);
    out[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(lo8, 4)), s, o);
    out[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(hi8, 4)), s, o);
    return;
  }
  for (int h = 0; h < 2; ++h) {       // two 16-weight halves, each may start a new group (G = 16)
    const int64_t gh = (kb * 32 + h * 16) / w.group;
    const __m256 sh = h == 0 ? s : _mm256_set1_ps(w.scale[row * (w.k / w.group) + gh]);
    const __m256 oh = h == 0 ? o : _mm256_set1_ps(w.offset(row, gh));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + kb * 32 + h * 16));
    out[2 * h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), sh, oh);
    out[2 * h + 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))), sh, oh);
  }
}

// acc[R] of a tile of R rows of x against weight row n: per group, the integer weights times x
// (two chains), then one FMA with the group's scale; the min / zero term comes from xsum.
template <int R>
ZI_AVX2 inline void tile(Avx2, const QW& w, int64_t n, const float* x, int64_t ldx, const float* xsum,
                         float* out, int64_t ldo) {
  const int64_t ng = w.k / w.group, G = w.group;
  const uint8_t* r = w.qs + n * w.row_bytes();
  const float* sc = w.scale + n * ng;
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  const __m256i mask = _mm256_set1_epi32(15);
  for (int64_t g = 0; G == 32 && g < ng; ++g) {   // one 32-weight block per group
    const int64_t k = g * 32;
    __m256 a, c, d, e;
    if (w.bits == 4) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + k / 2));
      const __m256i lo8 = _mm256_cvtepu8_epi32(b), hi8 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
      a = _mm256_cvtepi32_ps(_mm256_and_si256(lo8, mask));
      c = _mm256_cvtepi32_ps(_mm256_and_si256(hi8, mask));
      d = _mm256_cvtepi32_ps(_mm256_srli_epi32(lo8, 4));
      e = _mm256_cvtepi32_ps(_mm256_srli_epi32(hi8, 4));
    } else {
      const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + k));
      const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + k + 16));
      a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b0));
      c = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b0, 8)));
      d = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b1));
      e = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b1, 8)));
    }
    const __m256 sv = _mm256_set1_ps(sc[g]);
    for (int i = 0; i < R; ++i) {
      const float* xr = x + i * ldx + k;
      const __m256 t0 = _mm256_fmadd_ps(c, _mm256_loadu_ps(xr + 8), _mm256_mul_ps(a, _mm256_loadu_ps(xr)));
      const __m256 t1 = _mm256_fmadd_ps(e, _mm256_loadu_ps(xr + 24), _mm256_mul_ps(d, _mm256_loadu_ps(xr + 16)));
      acc[i] = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), sv, acc[i]);
    }
  }
  for (int64_t g = 0; G != 32 && g < ng; ++g) {
    __m256 t0[R], t1[R];
    for (int i = 0; i < R; ++i) t0[i] = t1[i] = _mm256_setzero_ps();
    const int64_t k0 = g * G, k1 = k0 + G;
    if (w.bits == 4) {
      for (int64_t k = k0; k < k1; k += 32) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + k / 2));
        const __m256i lo8 = _mm256_cvtepu8_epi32(b), hi8 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
        const __m256 a = _mm256_cvtepi32_ps(_mm256_and_si256(lo8, mask));
        const __m256 c = _mm256_cvtepi32_ps(_mm256_and_si256(hi8, mask));
        const __m256 d = _mm256_cvtepi32_ps(_mm256_srli_epi32(lo8, 4));
        const __m256 e = _mm256_cvtepi32_ps(_mm256_srli_epi32(hi8, 4));
        for (int i = 0; i < R; ++i) {
          const float* xr = x + i * ldx + k;
          t0[i] = _mm256_fmadd_ps(a, _mm256_loadu_ps(xr), t0[i]);
          t1[i] = _mm256_fmadd_ps(c, _mm256_loadu_ps(xr + 8), t1[i]);
          t0[i] = _mm256_fmadd_ps(d, _mm256_loadu_ps(xr + 16), t0[i]);
          t1[i] = _mm256_fmadd_ps(e, _mm256_loadu_ps(xr + 24), t1[i]);
        }
      }
    } else {
      for (int64_t k = k0; k < k1; k += 16) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + k));
        const __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
        for (int i = 0; i < R; ++i) {
          t0[i] = _mm256_fmadd_ps(a, _mm256_loadu_ps(x + i * ldx + k), t0[i]);
          t1[i] = _mm256_fmadd_ps(c, _mm256_loadu_ps(x + i * ldx + k + 8), t1[i]);
        }
      }
    }
    const __m256 sv = _mm256_set1_ps(sc[g]);
    for (int i = 0; i < R; ++i) acc[i] = _mm256_fmadd_ps(_mm256_add_ps(t0[i], t1[i]), sv, acc[i]);
  }
  for (int i = 0; i < R; ++i) out[i * ldo + n] = Avx2::sum(acc[i]) + (xsum ? offset_dot(Avx2{}, w, n, xsum + i * ng) : 0.f);
}

ZI_AVX2 void dequant_avx2(const QW& w, int64_t n0, int64_t n1, float* dst) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t kb = 0; kb < w.k / 32; ++kb) {
      __m256 wv[4];
      block_avx2(w, n, kb, wv);
      float* d = dst + (n - n0) * w.k + kb * 32;
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(d + 8 * j, wv[j]);
    }
}

// ------------------------------------------------------------------------------------ AVX-512

ZI_AVX512 inline void block_avx512(const QW& w, int64_t row, int64_t kb, __m512& w0, __m512& w1) {
  const uint8_t* r = w.qs + row * w.row_bytes();
  const int64_t g = kb * 32 / w.group, ng = w.k / w.group;
  const __m512 s = _mm512_set1_ps(w.scale[row * ng + g]);
  const __m512 o = _mm512_set1_ps(w.offset(row, g));
  if (w.bits == 4) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + kb * 16)));
    w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))), s, o);
    w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), s, o);
    return;
  }
  const int64_t g1 = (kb * 32 + 16) / w.group;
  const __m512 s1 = g1 == g ? s : _mm512_set1_ps(w.scale[row * ng + g1]);
  const __m512 o1 = g1 == g ? o : _mm512_set1_ps(w.offset(row, g1));
  const __m128i* p = reinterpret_cast<const __m128i*>(r + kb * 32);
  w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p))), s, o);
  w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1))), s1, o1);
}

// One group of the AVX-512 decode tile into acc: G == 32 (one block per group: every GGUF legacy /
// 4-bit format, int4 default), else G weights a 32 at a time plus a 16-weight rest.
template <int R>
ZI_AVX512 ZI_INLINE void group32(const QW& w, const uint8_t* r, const float* sc, int64_t g, const float* x,
                                 int64_t ldx, __m512 (&acc)[R]) {
  const int64_t k = g * 32;
  __m512 a, b;
  if (w.bits == 4) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + k / 2)));
    a = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    b = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  } else {
    const __m128i* p = reinterpret_cast<const __m128i*>(r + k);
    a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
    b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
  }
  const __m512 sv = _mm512_set1_ps(sc[g]);
  for (int i = 0; i < R; ++i) {
    const __m512 t = _mm512_fmadd_ps(b, _mm512_loadu_ps(x + i * ldx + k + 16),
                                     _mm512_mul_ps(a, _mm512_loadu_ps(x + i * ldx + k)));
    acc[i] = _mm512_fmadd_ps(t, sv, acc[i]);
  }
}

template <int R>
ZI_AVX512 ZI_INLINE void group_any(const QW& w, const uint8_t* r, const float* sc, int64_t g, const float* x,
                                   int64_t ldx, __m512 (&acc)[R]) {
  const int64_t G = w.group;
  const __m512i mask = _mm512_set1_epi32(15);
  __m512 t0[R], t1[R];
  for (int i = 0; i < R; ++i) t0[i] = t1[i] = _mm512_setzero_ps();
  const int64_t k0 = g * G, k1 = k0 + G;
  if (w.bits == 4) {
    for (int64_t k = k0; k < k1; k += 32) {
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + k / 2)));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, mask));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
      for (int i = 0; i < R; ++i) {
        t0[i] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + i * ldx + k), t0[i]);
        t1[i] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + i * ldx + k + 16), t1[i]);
      }
    }
  } else {
    int64_t k = k0;
    for (; k + 32 <= k1; k += 32) {
      const __m128i* p = reinterpret_cast<const __m128i*>(r + k);
      const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
      const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
      for (int i = 0; i < R; ++i) {
        t0[i] = _mm512_fmadd_ps(a, _mm512_loadu_ps(x + i * ldx + k), t0[i]);
        t1[i] = _mm512_fmadd_ps(b, _mm512_loadu_ps(x + i * ldx + k + 16), t1[i]);
      }
    }
    if (k < k1) {   // a 16-weight group (Q6_K) or a group's odd last 16
      const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + k))));
      for (int i = 0; i < R; ++i) t0[i] = _mm512_fmadd_ps(a, _mm512_loadu_ps(x + i * ldx + k), t0[i]);
    }
  }
  const __m512 sv = _mm512_set1_ps(sc[g]);
  for (int i = 0; i < R; ++i) acc[i] = _mm512_fmadd_ps(_mm512_add_ps(t0[i], t1[i]), sv, acc[i]);
}

// Even groups sum into `even`, odd ones into `odd` (two fma chains), unrolled by hand so both sets
// stay in registers (indexed by g & 1 they lived on the stack).
template <int R>
ZI_AVX512 inline void tile(Avx512, const QW& w, int64_t n, const float* x, int64_t ldx, const float* xsum,
                           float* out, int64_t ldo) {
  const int64_t ng = w.k / w.group;
  const uint8_t* r = w.qs + n * w.row_bytes();
  const float* sc = w.scale + n * ng;
  __m512 even[R], odd[R];
  for (int i = 0; i < R; ++i) even[i] = odd[i] = _mm512_setzero_ps();
  if (w.group == 32) {
    for (int64_t g = 0; g < ng; g += 2) {
      group32<R>(w, r, sc, g, x, ldx, even);
      if (g + 1 < ng) group32<R>(w, r, sc, g + 1, x, ldx, odd);
    }
  } else {
    for (int64_t g = 0; g < ng; g += 2) {
      group_any<R>(w, r, sc, g, x, ldx, even);
      if (g + 1 < ng) group_any<R>(w, r, sc, g + 1, x, ldx, odd);
    }
  }
  for (int i = 0; i < R; ++i)
    out[i * ldo + n] = _mm512_reduce_add_ps(_mm512_add_ps(even[i], odd[i])) +
                       (xsum ? offset_dot(Avx512{}, w, n, xsum + i * ng) : 0.f);
}

ZI_AVX512 void dequant_avx512(const QW& w, int64_t n0, int64_t n1, float* dst) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t kb = 0; kb < w.k / 32; ++kb) {
      __m512 w0, w1;
      block_avx512(w, n, kb, w0, w1);
      float* d = dst + (n - n0) * w.k + kb * 32;
      _mm512_storeu_ps(d, w0);
      _mm512_storeu_ps(d + 16, w1);
    }
}

// Output rows n0..n1 of the decode product on the path I: the shared loop over rows and register
// tiles, each tile the path's own `tile` (x rows m0.., their group sums, out rows m0..).
template <class I>
ZI_INLINE void rows_simd(const QW& w, const float* x, int64_t ldx, int64_t M, float* out, int64_t ldo,
                         int64_t n0, int64_t n1, const float* xsum) {
  const int64_t ng = w.k / w.group;
  for_each_tile(w, M, n0, n1, [&](auto r, int64_t n, int64_t m0) {
    tile<decltype(r)::value>(I{}, w, n, x + m0 * ldx, ldx, xsum ? xsum + m0 * ng : nullptr, out + m0 * ldo, ldo);
  });
}

ZI_AVX2 void rows_avx2(const QW& w, const float* x, int64_t ldx, int64_t M, float* out, int64_t ldo,
                       int64_t n0, int64_t n1, const float* xsum) {
  rows_simd<Avx2>(w, x, ldx, M, out, ldo, n0, n1, xsum);
}

ZI_AVX512 void rows_avx512(const QW& w, const float* x, int64_t ldx, int64_t M, float* out, int64_t ldo,
                           int64_t n0, int64_t n1, const float* xsum) {
  rows_simd<Avx512>(w, x, ldx, M, out, ldo, n0, n1, xsum);
}

// ------------------------------------------------------------------------------------ dispatch
int64_t best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
  return 0;
}

int64_t resolve_isa(int64_t isa) {
  const int64_t best = best_isa();
  TORCH_CHECK(isa >= -1 && isa <= 2, "quant_linear: isa must be -1 (auto), 0, 1 or 2, got ", isa);
  TORCH_CHECK(isa <= best, "quant_linear: isa ", isa, " is not supported by this CPU (best: ", best, ")");
  return isa < 0 ? best : isa;
}

// rows n0..n1 of w dequantized, row r to dst + (r - base) * K
void dequant_rows(const QW& w, int64_t isa, int64_t n0, int64_t n1, float* dst, int64_t base) {
  for_row_tiles(w, isa, n0, n1, [&](const QW& t, int64_t r0, int64_t r1) {
    float* d = dst + (r0 - base) * w.k;
    if (isa == 2) dequant_avx512(t, 0, r1 - r0, d);
    else if (isa == 1) dequant_avx2(t, 0, r1 - r0, d);
    else dequant_scalar(t, 0, r1 - r0, d);
  });
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& minv, int64_t bits, int64_t group, int64_t zero,
                        const c10::optional<at::Tensor>& bias, int64_t isa, const c10::optional<at::Tensor>& qh,
                        const c10::optional<at::Tensor>& scale_d, const c10::optional<at::Tensor>& minv_d) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "quant_linear: x must be a 2-D float32 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  const QW w = make_qw(qs, scale, minv, bits, group, zero, x.size(1), qh, scale_d, minv_d);
  isa = resolve_isa(isa);
  const int64_t M = x.size(0), N = w.n, K = w.k;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M > 0 && N > 0) {
    at::Tensor xc = x.stride(1) == 1 && (M == 1 || x.stride(0) >= K) ? x : x.contiguous();
    const float* xp = xc.data_ptr<float>();
    const int64_t ldx = M > 1 ? xc.stride(0) : K;
    float* op = out.data_ptr<float>();
    if (M <= DECODE_ROWS) {
      const std::vector<float> xsum = group_sums(w, xp, ldx, M);   // for the min / zero term
      const float* xs = xsum.empty() ? nullptr : xsum.data();
      at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        for_row_tiles(w, isa, n0, n1, [&](const QW& t, int64_t r0, int64_t r1) {
          if (isa == 2) rows_avx512(t, xp, ldx, M, op + r0, N, 0, r1 - r0, xs);
          else if (isa == 1) rows_avx2(t, xp, ldx, M, op + r0, N, 0, r1 - r0, xs);
          else rows_scalar(t, xp, ldx, M, op + r0, N, 0, r1 - r0);
        });
      });
    } else if (isa == 2) {   // panels dequantized into the blocked fp32 GEMM's layout (quant_gemm_panels.cpp)
      if (bias.has_value() && bias->defined()) {
        TORCH_CHECK(bias->numel() == N, "quant_linear: bias must have ", N, " elements, got ", bias->numel());
        const at::Tensor bf = bias->to(at::kFloat).contiguous();
        quant_panel_gemm(w, xp, ldx, M, op, bf.data_ptr<float>());
        return out;
      }
      quant_panel_gemm(w, xp, ldx, M, op, nullptr);
    } else {
      // tiles of about 4 MB of fp32 weight rows: dequantized once (in parallel), used by all M rows
      const int64_t tile = std::max<int64_t>(64, ((int64_t(1) << 20) / K + 63) / 64 * 64);
      at::Tensor buf = at::empty({std::min(tile, N), K}, x.options());
      for (int64_t t0 = 0; t0 < N; t0 += tile) {
        const int64_t t1 = std::min(N, t0 + tile);
        float* bp = buf.data_ptr<float>();
        at::parallel_for(t0, t1, 8, [&](int64_t n0, int64_t n1) { dequant_rows(w, isa, n0, n1, bp, t0); });
        out.narrow(1, t0, t1 - t0).copy_(at::mm(xc, buf.narrow(0, 0, t1 - t0).t()));
      }
    }
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "quant_linear: bias must have ", N, " elements, got ", bias->numel());
    out.add_(bias->to(at::kFloat).view({1, N}));
  }
  return out;
}

at::Tensor quant_dequantize(const at::Tensor& qs, const at::Tensor& scale, const c10::optional<at::Tensor>& minv,
                            int64_t bits, int64_t group, int64_t zero, int64_t k, int64_t isa,
                            const c10::optional<at::Tensor>& qh, const c10::optional<at::Tensor>& scale_d,
                            const c10::optional<at::Tensor>& minv_d) {
  const QW w = make_qw(qs, scale, minv, bits, group, zero, k, qh, scale_d, minv_d);
  isa = resolve_isa(isa);
  at::Tensor out = at::empty({w.n, k}, scale.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  at::parallel_for(0, w.n, 8, [&](int64_t n0, int64_t n1) { dequant_rows(w, isa, n0, n1, op, 0); });
  return out;
}

int64_t quant_best_isa() { return best_isa(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(zooinfer_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor qs, Tensor scale, Tensor? minv, int bits, int group, int zero, "
        "Tensor? bias, int isa, Tensor? qh=None, Tensor? scale_d=None, Tensor? minv_d=None) -> Tensor");
  m.impl("quant_linear", c10::DispatchKey::CPU, TORCH_FN(quant_linear));
  m.def("quant_dequantize(Tensor qs, Tensor scale, Tensor? minv, int bits, int group, int zero, int k, int isa, "
        "Tensor? qh=None, Tensor? scale_d=None, Tensor? minv_d=None) -> Tensor");
  m.impl("quant_dequantize", c10::DispatchKey::CPU, TORCH_FN(quant_dequantize));
  m.def("quant_best_isa() -> int", TORCH_FN(quant_best_isa));
}
