// The column-panel layout of a linear weight, shared by the ops that read it (panel_gemm.cpp,
// linear_argmax.cpp): W [N, K] packed once (models/prepack.py `pack_panels`) as contiguous
// P [ceil(N/32), K, 32], panel p holding W[32p : 32p+32, :] transposed, zero-padded past N.
// Also their 16-float vector helpers (GCC/Clang vector extensions: one zmm with
// -march=native on AVX-512, narrower registers in the plain -O3 fallback build).
#pragma once

#include <ATen/ATen.h>

namespace zooinfer_panels {

constexpr int64_t NR = 32;   // panel width: two 16-float vectors

typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

inline vf16 load(const float* p) {
  vf16 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf16 v) { __builtin_memcpy(p, &v, sizeof v); }
inline vf16 splat(float s) { return vf16{s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }
inline vi16 splati(int32_t s) { return vi16{s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }

// The register tiles of the GEMMs (panel_gemm.cpp, panels_blocked.h) in the build's native vector
// width. A tile holds R rows x 2 vectors of accumulators: with AVX-512's 32 zmm registers 2 vectors
// are a whole 32-column panel (VW = 16); with AVX2's 16 ymm registers a tile covers half a panel
// (VW = 8) and the kernels run both halves. A vf16 tile on AVX2 would be lowered to twice the ymm
// registers and spill: 48 accumulators for 16 registers. Each output is still one FMA chain over
// k in increasing order, so the width changes no result.
#if defined(__AVX512F__)
constexpr int64_t VW = 16;
#else
constexpr int64_t VW = 8;
#endif
constexpr int64_t TC = 2 * VW;           // columns of one register tile
constexpr int64_t COL_TILES = NR / TC;   // register tiles across a panel: 1 (AVX-512) or 2
typedef float vreg __attribute__((vector_size(VW * 4)));
typedef int32_t vireg __attribute__((vector_size(VW * 4)));   // its comparison masks and lane indices

inline vreg vload(const float* p) {
  vreg v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline void vstore(float* p, vreg v) { __builtin_memcpy(p, &v, sizeof v); }
inline vreg vsplat(float s) { return s - vreg{}; }   // s - (+0) is s for every s, -0 included

// x [M, K] float32 on CPU, panels of the same K; `n` the weight's true row count. Errors name the op.
inline void check_inputs(const char* op, const at::Tensor& x, const at::Tensor& panels, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), op,
              ": x must be a 2-D float32 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == NR && panels.scalar_type() == at::kFloat &&
                  panels.is_contiguous() && panels.device().is_cpu(),
              op, ": panels must be a contiguous float32 CPU tensor [ceil(N/32), K, 32], got ", panels.sizes());
  TORCH_CHECK(panels.size(1) == x.size(1), op, ": x has K=", x.size(1), " but panels have K=", panels.size(1));
  TORCH_CHECK(n >= 0 && n < (int64_t(1) << 31) && (n + NR - 1) / NR == panels.size(0), op, ": n=", n,
              " does not match ", panels.size(0), " panels");
}

}  // namespace zooinfer_panels
