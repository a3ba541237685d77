// How a quantized weight is stored, and its expansion into what the kernels read (quant_layout.h
// `QW`): int8 or 4-bit q with fp32 scale / min per group.
//
// Why storage differs from what the kernels read: a GGUF file's own layout is smaller, and a
// weight kept as it ships streams fewer bytes per decode step. So each weight keeps
//   - scales as fp32, as fp16 (the legacy GGUF formats' own), or two-level as the K-quants ship
//     them: an int8 sub-scale per group times an fp16 super-scale per super-block (Q4_K / Q5_K:
//     6-bit sc and m per 32 weights, d and dmin per 256; Q6_K: int8 per 16, d per 256);
//   - q as int8, as 4 bits, or as 5 / 6 bits: the low 4 bits as nibbles (the 4-bit block order)
//     plus 1 or 2 planes of high bits, one uint32 per 32-weight block each (bit j of plane p is
//     bit 4 + p of the block's weight j): Q5_0 / Q5_1 / Q5_K / Q6_K at their file's bits.
// `for_row_tiles` expands 64 rows at a time into L1/L2-sized buffers: scales to fp32 (fp16
// widens exactly; d * sc is one fp32 product, the one gguf's numpy dequantize computes), 5 / 6-bit
// q to int8 q - zero (exact). So the kernels see bits 4 or 8 with fp32 scales only, and their
// results do not depend on the storage.
#pragma once

#include "quant_layout.h"

#include <memory>

namespace zi_quant {

inline bool present(const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// The op arguments as a `QW` (checked; errors name the argument). scale / min: float32 or float16
// [N, K / group], or int8 [N, K / group] with scale_d / minv_d float16 [N, K / super]; bits 5 / 6
// need qh int32 [N, K / 32 * (bits - 4)].
inline QW make_qw(const at::Tensor& qs, const at::Tensor& scale, const c10::optional<at::Tensor>& minv, int64_t bits,
                  int64_t group, int64_t zero, int64_t k, const c10::optional<at::Tensor>& qh = std::nullopt,
                  const c10::optional<at::Tensor>& scale_d = std::nullopt,
                  const c10::optional<at::Tensor>& minv_d = std::nullopt) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "quant_linear: bits must be 4, 5, 6 or 8, got ", bits);
  const int64_t gmul = bits == 4 ? 32 : 16, row = bits == 8 ? k : k / 2;   // 5 / 6 bits run as int8
  TORCH_CHECK(group > 0 && group % gmul == 0 && k % group == 0 && k % 32 == 0,
              "quant_linear: group ", group, " must divide K=", k, " and be a multiple of ", gmul,
              " (K a multiple of 32)");
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() && qs.device().is_cpu() && qs.element_size() == 1 &&
                  qs.size(1) == row,
              "quant_linear: qs must be a contiguous 1-byte CPU tensor [N, ", row, "], got ", qs.sizes());
  const int64_t n = qs.size(0), ng = k / group;
  const auto dtype = scale.scalar_type();
  auto check_groups = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK((t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf || t.scalar_type() == at::kChar) &&
                    t.is_contiguous() && t.dim() == 2 && t.size(0) == n && t.size(1) == ng,
                "quant_linear: ", what, " must be contiguous float32, float16 or int8 [", n, ", ", ng, "], got ",
                t.sizes(), " ", t.scalar_type());
    TORCH_CHECK(t.scalar_type() == dtype, "quant_linear: scale and min must have one dtype");
  };
  check_groups(scale, "scale");
  QW w{static_cast<const uint8_t*>(qs.data_ptr()), nullptr, nullptr, n, k, group, zero, bits};
  const bool has_min = present(minv);
  if (has_min) check_groups(*minv, "min");
  if (dtype == at::kChar) {
    TORCH_CHECK(present(scale_d) && (present(minv_d) == has_min),
                "quant_linear: int8 scale / min need their float16 scale_d / minv_d");
    const int64_t nd = scale_d->dim() == 2 ? scale_d->size(1) : 0;
    TORCH_CHECK(nd > 0 && k % nd == 0 && (k / nd) % group == 0, "quant_linear: scale_d must be [N, K / super] with "
                "super a multiple of group ", group, ", got ", scale_d->sizes());
    for (const auto* d : {&*scale_d, has_min ? &*minv_d : &*scale_d})
      TORCH_CHECK(d->scalar_type() == at::kHalf && d->is_contiguous() && d->dim() == 2 && d->size(0) == n &&
                      d->size(1) == nd,
                  "quant_linear: scale_d / minv_d must be contiguous float16 [", n, ", ", nd, "], got ", d->sizes(),
                  " ", d->scalar_type());
    w.super = k / nd;
    w.scale_q = scale.data_ptr<int8_t>();
    w.scale_d = scale_d->data_ptr<at::Half>();
    w.minv_q = has_min ? minv->data_ptr<int8_t>() : nullptr;
    w.minv_d = has_min ? minv_d->data_ptr<at::Half>() : nullptr;
  } else if (present(scale_d) || present(minv_d)) {
    TORCH_CHECK(false, "quant_linear: scale_d / minv_d go with int8 scale / min only, got ", dtype, " scales");
  } else if (dtype == at::kHalf) {
    w.scale_h = scale.data_ptr<at::Half>();
    w.minv_h = has_min ? minv->data_ptr<at::Half>() : nullptr;
  } else {
    w.scale = scale.data_ptr<float>();
    w.minv = has_min ? minv->data_ptr<float>() : nullptr;
  }
  TORCH_CHECK((bits == 5 || bits == 6) == present(qh), "quant_linear: qh is needed exactly for bits 5 and 6");
  if (present(qh)) {
    TORCH_CHECK(qh->scalar_type() == at::kInt && qh->is_contiguous() && qh->numel() == n * (k / 32) * (bits - 4),
                "quant_linear: qh must be contiguous int32 with ", n * (k / 32) * (bits - 4), " elements, got ",
                qh->sizes(), " ", qh->scalar_type());
    w.qh = reinterpret_cast<const uint32_t*>(qh->data_ptr<int32_t>());
  }
  return w;
}

// ------------------------------------------------------------------ scales to fp32
__attribute__((target("avx512f"))) inline void half_to_float_avx512(const at::Half* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(d + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i))));
  for (; i < n; ++i) d[i] = static_cast<float>(s[i]);
}

inline void half_to_float(const at::Half* s, float* d, int64_t n) {   // exact: every fp16 is an fp32
  static const bool avx512 = (__builtin_cpu_init(), __builtin_cpu_supports("avx512f"));
  if (avx512) return half_to_float_avx512(s, d, n);
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<float>(s[i]);
}

// two_level_to_float on AVX-512, for rows of at most 16 super-blocks: 16 groups a step, each
// lane's d picked from the row's widened d by one permute; the same single product per group.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void two_level_to_float_avx512(
    const at::Half* d, const int8_t* q, int64_t rows, int64_t ng, int64_t per, float* out) {
  const int64_t nd = ng / per;
  const __mmask16 kd = static_cast<__mmask16>((1u << nd) - 1);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(kd, d + r * nd));
    for (int64_t g = 0; g < ng; g += 16) {
      const __mmask16 k = static_cast<__mmask16>(ng - g >= 16 ? 0xFFFF : (1u << (ng - g)) - 1);
      const __m512i gi = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(g)),
                                          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      // g / per for per a power of two (the K-quants: 8 or 16); others take the scalar path
      const __m512i idx = _mm512_srli_epi32(gi, __builtin_ctzll(static_cast<uint64_t>(per)));
      const __m512 qv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(k, q + r * ng + g)));
      _mm512_mask_storeu_ps(out + r * ng + g, k, _mm512_mul_ps(_mm512_permutexvar_ps(idx, dv), qv));
    }
  }
}

// rows x ng fp32 scales from two-level storage: out[r, g] = d[r, g / per] * q[r, g] (one product)
inline void two_level_to_float(const at::Half* d, const int8_t* q, int64_t rows, int64_t ng, int64_t per, float* out) {
  const int64_t nd = ng / per;
  static const bool avx512 = (__builtin_cpu_init(), __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"));
  if (avx512 && nd <= 16 && (per & (per - 1)) == 0) return two_level_to_float_avx512(d, q, rows, ng, per, out);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t s = 0; s < nd; ++s) {
      const float ds = static_cast<float>(d[r * nd + s]);
      for (int64_t j = 0; j < per; ++j) out[r * ng + s * per + j] = ds * static_cast<float>(q[r * ng + s * per + j]);
    }
}

// ------------------------------------------------------------------ 5 / 6-bit q to int8
// One 32-weight block: nibbles (byte j: weight j low, weight j + 16 high) plus `planes` high-bit
// words -> 32 int8 values q - zero.
inline void unpack_block_scalar(const uint8_t* nib, const uint32_t* h, int planes, int zero, int8_t* dst) {
  for (int j = 0; j < 32; ++j) {
    int v = j < 16 ? (nib[j] & 15) : (nib[j - 16] >> 4);
    for (int p = 0; p < planes; ++p) v += static_cast<int>((h[p] >> j) & 1u) << (4 + p);
    dst[j] = static_cast<int8_t>(v - zero);
  }
}

ZI_AVX2 inline __m256i nibbles_avx2(const uint8_t* nib) {   // the block's 32 low 4-bit values as bytes
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(nib)), m4 = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m4), _mm_and_si128(b, m4));
}

ZI_AVX2 inline void unpack_rows_avx2(const QW& w, int64_t r0, int64_t r1, int8_t* dst) {
  const int planes = static_cast<int>(w.bits - 4), nb = static_cast<int>(w.k / 32);
  // byte j of a broadcast word picks the word's byte j / 8 and tests its bit j % 8
  const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                                        3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i z = _mm256_set1_epi8(static_cast<char>(w.zero));
  for (int64_t r = r0; r < r1; ++r)
    for (int b = 0; b < nb; ++b) {
      __m256i v = nibbles_avx2(w.qs + r * w.row_bytes() + b * 16);
      const uint32_t* h = w.qh + (r * nb + b) * planes;
      for (int p = 0; p < planes; ++p) {
        const __m256i x = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(h[p])), pick);
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(x, bit), bit);
        v = _mm256_add_epi8(v, _mm256_and_si256(set, _mm256_set1_epi8(static_cast<char>(16 << p))));
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (r - r0) * w.k + b * 32), _mm256_sub_epi8(v, z));
    }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma"))) inline void unpack_rows_avx512(const QW& w, int64_t r0,
                                                                                            int64_t r1, int8_t* dst) {
  const int planes = static_cast<int>(w.bits - 4), nb = static_cast<int>(w.k / 32);
  const __m256i z = _mm256_set1_epi8(static_cast<char>(w.zero));
  const __m256i b4 = _mm256_set1_epi8(16), b5 = _mm256_set1_epi8(32);
  for (int64_t r = r0; r < r1; ++r)
    for (int b = 0; b < nb; ++b) {
      __m256i v = nibbles_avx2(w.qs + r * w.row_bytes() + b * 16);
      const uint32_t* h = w.qh + (r * nb + b) * planes;
      v = _mm256_mask_add_epi8(v, static_cast<__mmask32>(h[0]), v, b4);          // bit 4 where plane 0 has it
      if (planes == 2) v = _mm256_mask_add_epi8(v, static_cast<__mmask32>(h[1]), v, b5);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (r - r0) * w.k + b * 32), _mm256_sub_epi8(v, z));
    }
}

// rows [r0, r1) of a 5 / 6-bit weight as int8 q - zero [r1 - r0, k], on the instruction path `isa`
inline void unpack_rows(const QW& w, int64_t isa, int64_t r0, int64_t r1, int8_t* dst) {
  static const bool vl = (__builtin_cpu_init(), __builtin_cpu_supports("avx512vl"));
  if (isa == 2 && vl) return unpack_rows_avx512(w, r0, r1, dst);
  if (isa >= 1) return unpack_rows_avx2(w, r0, r1, dst);
  const int planes = static_cast<int>(w.bits - 4);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t b = 0; b < w.k / 32; ++b)
      unpack_block_scalar(w.qs + r * w.row_bytes() + b * 16, w.qh + (r * (w.k / 32) + b) * planes, planes,
                          static_cast<int>(w.zero), dst + (r - r0) * w.k + b * 32);
}

// f(tile, r0, r1) for rows [n0, n1) in tiles of up to 64 rows: `tile` is the weight of rows r0..r1
// (its row 0 is row r0) as the kernels read it, bits 4 or 8 with fp32 scales, expanded from the
// storage into local buffers when it is anything else (see the header; `isa` picks the unpacking).
// `unpack` false: 5 / 6-bit q stay as stored (qs, qh and zero of the tile's rows), for a kernel
// that widens them in registers (quant_gemv_q8.cpp); the scales are expanded all the same.
template <class F>
inline void for_row_tiles(const QW& w, int64_t isa, int64_t n0, int64_t n1, F&& f, bool unpack = true) {
  constexpr int64_t TILE = 64;
  const int64_t ng = w.k / w.group;
  const bool widen = w.scale == nullptr, has_min = w.has_min();
  std::vector<float> buf(widen ? TILE * ng * (has_min ? 2 : 1) : 0);
  std::unique_ptr<int8_t[]> qbuf(w.qh && unpack ? new int8_t[TILE * w.k] : nullptr);
  for (int64_t r0 = n0; r0 < n1; r0 += TILE) {
    const int64_t r1 = std::min(n1, r0 + TILE);
    QW t{w.qs + r0 * w.row_bytes(), nullptr, nullptr, r1 - r0, w.k, w.group, w.zero, w.bits};
    if (!widen) {
      t.scale = w.scale + r0 * ng;
      t.minv = w.minv ? w.minv + r0 * ng : nullptr;
    } else {
      float* s = buf.data();
      float* m = has_min ? s + TILE * ng : nullptr;
      if (w.scale_h) {
        half_to_float(w.scale_h + r0 * ng, s, t.n * ng);
        if (m) half_to_float(w.minv_h + r0 * ng, m, t.n * ng);
      } else {
        const int64_t per = w.super / w.group, nd = w.k / w.super;
        two_level_to_float(w.scale_d + r0 * nd, w.scale_q + r0 * ng, t.n, ng, per, s);
        if (m) two_level_to_float(w.minv_d + r0 * nd, w.minv_q + r0 * ng, t.n, ng, per, m);
      }
      t.scale = s;
      t.minv = m;
    }
    if (w.qh && !unpack) {
      t.qh = w.qh + r0 * (w.k / 32) * (w.bits - 4);
    } else if (w.qh) {
      unpack_rows(w, isa, r0, r1, qbuf.get());
      t.qs = reinterpret_cast<const uint8_t*>(qbuf.get());
      t.bits = 8;
      t.zero = 0;
    }
    f(t, r0, r1);
  }
}

}  // namespace zi_quant
