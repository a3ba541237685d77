// act(gate) * up over one row, shared by act_mul (fused_elementwise.cpp) and the blocked GEMM's fused
// gate_up epilogue (panel_gemm_blocked.cpp), so both give the same bits: kind 0 silu, 1 gelu_tanh.
//
// The vectors are the CPU's native width (panels.h `vreg`): exp converts between float and int
// vectors and selects through masks, which GCC lowers lane by lane (scalar code) for a vector type
// wider than the target's registers; a 16-float vector on an AVX2-only CPU ran act_mul at ~6-7 ns
// per element. Every step is per element, so the width changes no result; the tail goes through a
// zero-padded vector, so it uses the same exp.
#pragma once

#include "panels.h"
#include "vec_exp.h"

#include <algorithm>
#include <cmath>

namespace zooinfer_act {

using zooinfer_panels::VW;
using zooinfer_panels::vreg;
using zooinfer_panels::vload, zooinfer_panels::vstore, zooinfer_panels::vsplat;

// silu: x / (1 + exp(-x)); gelu_tanh: x / (1 + exp(-2y)), y = sqrt(2/pi) (x + 0.044715 x^3)
// (0.5 x (1 + tanh y) rewritten), both times up.
inline vreg act_times(vreg x, vreg u, int kind) {
  constexpr float beta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = 0.044715f;
  const vreg y = kind == 0 ? -x : vsplat(-2.f) * (vsplat(beta) * (x + vsplat(kappa) * (x * x * x)));
  return x / (vsplat(1.f) + zooinfer_vec::exp<vreg, zooinfer_panels::vireg>(y)) * u;
}

// o[i] = act(g[i]) * u[i] for i < I
inline void act_row(const float* __restrict g, const float* __restrict u, float* __restrict o, int64_t I, int kind) {
  int64_t i = 0;
  if (kind == 0) {   // the kind tested once per row, outside the loop
    for (; i + VW <= I; i += VW) vstore(o + i, act_times(vload(g + i), vload(u + i), 0));
  } else {
    for (; i + VW <= I; i += VW) vstore(o + i, act_times(vload(g + i), vload(u + i), 1));
  }
  if (i < I) {
    float gb[VW] = {0.f}, ub[VW] = {0.f}, ob[VW];
    std::copy(g + i, g + I, gb);
    std::copy(u + i, u + I, ub);
    vstore(ob, act_times(vload(gb), vload(ub), kind));
    std::copy(ob, ob + (I - i), o + i);
  }
}

}  // namespace zooinfer_act
