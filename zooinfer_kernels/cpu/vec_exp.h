// Vectorised exp shared by the CPU kernels (paged_decode, paged_prefill, fused_elementwise),
// for any GCC/Clang float vector type VF with its same-width int32 vector VI.
//
// Cephes-style: exp(x) = 2^n * p(r), r = x - n ln 2, a few ulp over the float range. Inputs
// below -87 (incl. -inf) give exactly 0; inputs are clamped at 88, so exp stays finite
// (exp(88) ~ 1.7e38) and callers such as x / (1 + exp(-x)) never see inf / inf.
// A header (no op of its own): every *.cpp in this folder is one translation unit of the
// library, and each includes this.
#pragma once

namespace zooinfer_vec {

template <class VF, class VI>
inline VF exp(VF x) {
  const VF zero = VF{};
  const VI dead = x < (zero - 87.f);
  x = dead ? (zero - 87.f) : x;
  x = x > (zero + 88.f) ? (zero + 88.f) : x;
  VF fx = x * 1.44269504088896341f + 0.5f;
  VF n = __builtin_convertvector(__builtin_convertvector(fx, VI), VF);
  n = n > fx ? n - 1.f : n;   // floor
  const VF r = x - n * 0.693359375f - n * -2.12194440e-4f;
  VF y = zero + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.f;
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  VF scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  y = y * scale;
  return dead ? zero : y;
}

}  // namespace zooinfer_vec
