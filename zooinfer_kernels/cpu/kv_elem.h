// Element types of KV cache pages for the paged attention kernels (paged_decode, paged_prefill):
// float32, bfloat16 and int8 (cache/kv_dtype.py). `load_f<VF>(p)` loads sizeof(VF) / 4 elements
// of a page row as floats: bf16 by widening its 16 bits into the top half of a float (exact), int8
// by integer -> float conversion (exact; the kernels apply the per-token scale). Written with
// GCC/Clang vector extensions, so the same source becomes AVX-512 (vpmovzxwd + vpslld,
// vpmovsxbd + vcvtdq2ps) on Zen 4, AVX2 or SSE on older CPUs, and scalar code elsewhere.
// A header (no op of its own), like vec_exp.h.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace zooinfer_kv {

// Non-template vector types (GCC rejects __builtin_convertvector on vector types that depend on
// a template parameter): 8 lanes (AVX2 register, paged_decode) and 16 (AVX-512, paged_prefill).
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int8_t i8x8 __attribute__((vector_size(8)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

template <class VF, class T>
inline VF bits(const T& x) {
  VF v;
  __builtin_memcpy(&v, &x, sizeof v);
  return v;
}

inline f32x8 load8(const float* p) { return bits<f32x8>(*reinterpret_cast<const float(*)[8]>(p)); }
inline f32x16 load16(const float* p) { return bits<f32x16>(*reinterpret_cast<const float(*)[16]>(p)); }
// bf16: GCC widens a 128-bit u16 vector to 256 bits as two 128-bit vpmovzxwd + vinserti128 (and
// 256 to 512 likewise), which made a bf16 cache 1.6x slower to attend than a float32 one (Emerald
// Rapids, Gemma-3's 256-dim heads); with AVX2 / AVX-512 it is one vpmovzxwd and one vpslld.
inline f32x8 load8(const c10::BFloat16* p) {
#if defined(__AVX2__)
  const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  return bits<f32x8>(w);
#else
  const u32x8 w = __builtin_convertvector(bits<u16x8>(*reinterpret_cast<const uint16_t(*)[8]>(p)), u32x8) << 16;
  return bits<f32x8>(w);
#endif
}
inline f32x16 load16(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  const __m512i w =
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  return bits<f32x16>(w);
#else
  const u32x16 w = __builtin_convertvector(bits<u16x16>(*reinterpret_cast<const uint16_t(*)[16]>(p)), u32x16) << 16;
  return bits<f32x16>(w);
#endif
}
inline f32x8 load8(const int8_t* p) {
  return __builtin_convertvector(__builtin_convertvector(bits<i8x8>(*reinterpret_cast<const int8_t(*)[8]>(p)), i32x8),
                                 f32x8);
}
inline f32x16 load16(const int8_t* p) {
  return __builtin_convertvector(
      __builtin_convertvector(bits<i8x16>(*reinterpret_cast<const int8_t(*)[16]>(p)), i32x16), f32x16);
}

// sizeof(VF) / 4 elements from p as floats; VF is an 8- or 16-float GCC vector.
template <class VF, class T>
inline VF load_f(const T* p) {
  static_assert(sizeof(VF) == 32 || sizeof(VF) == 64, "8 or 16 float lanes");
  if constexpr (sizeof(VF) == 32) return load8(p);
  else return load16(p);
}

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_f(int8_t x) { return static_cast<float>(x); }

// Whether pages of T carry per-(token, kv head) scales.
template <class T>
constexpr bool scaled = sizeof(T) == 1;

}  // namespace zooinfer_kv
