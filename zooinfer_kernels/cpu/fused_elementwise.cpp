// Fused elementwise kernels for a decoder layer on CPU: RMSNorm, residual add + RMSNorm,
// act(gate) * up, and neox rotary embedding.
//
// Why: in eager mode each torch op is its own pass over memory (RMSNorm alone is pow, mean,
// add, rsqrt, mul, mul: six passes and five temporaries; rope is slices, four muls, two
// adds, two cats). Here each is one pass per row, the row kept in L1 between the reduction
// and the write. All math is fp32, in the same order as the torch formulas in
// models/layers.py (sum of squares accumulated in float), so results agree to a few ulp.
//
// Rows are parallel (at::parallel_for) with a grain of 32K output floats, ATen's GRAIN_SIZE,
// the policy of the torch ops replaced: a decode step of a few dozen tokens stays on one
// thread (a parallel region costs a wake-up, far more when another process holds the other
// core) and prefill chunks split.
// Inputs may be strided views (q/k/v and gate/up are column slices of one fused projection
// output): only the last dim must be contiguous. Outputs are new contiguous tensors, the
// same layout the torch code returns.
//
// Used from zooinfer_kernels/elementwise.py only in eager mode on fp32 CPU tensors; under torch.compile
// the torch code stays so inductor fuses it itself.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "act.h"

#include <algorithm>
#include <cmath>
#include <tuple>

namespace {

// 16 floats as a GCC/Clang vector (one AVX-512 register, two AVX ones, four SSE ones);
// unaligned loads and stores through memcpy. The sums of squares of the norms run in 16 lanes
// on every CPU, so a norm's rounding does not depend on the vector width of the build.
constexpr int64_t W = 16;
typedef float vf __attribute__((vector_size(64)));

inline vf load(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return x - vf{}; }
inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}

constexpr int64_t kGrain = 32768;   // output floats per parallel chunk, at least: ATen's GRAIN_SIZE
inline int64_t grain(int64_t out_per_row) { return std::max<int64_t>(1, kGrain / std::max<int64_t>(1, out_per_row)); }

// A tensor of up to 3 dims seen as rows of its last dim: row i = (i / n1, i % n1).
struct Rows {
  const float* base;
  int64_t n1, s0, s1;
  const float* row(int64_t i) const { return base + (i / n1) * s0 + (i % n1) * s1; }
};

Rows rows_of(const at::Tensor& x) {
  if (x.dim() == 1) return {x.data_ptr<float>(), 1, 0, 0};
  if (x.dim() == 2) return {x.data_ptr<float>(), 1, x.stride(0), 0};
  return {x.data_ptr<float>(), x.size(1), x.stride(0), x.stride(1)};
}

// x (any rank, fp32 CPU) with a contiguous last dim and at most 3 dims, else a contiguous copy.
at::Tensor as_rows(const at::Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, op, ": ", name, " must be a float32 CPU tensor");
  TORCH_CHECK(x.dim() >= 1, op, ": ", name, " needs at least one dim");
  if (x.dim() > 3) return x.contiguous().view({-1, x.size(-1)});
  return x.stride(-1) == 1 ? x : x.contiguous();
}

// Sum of squares of a row, in float: 16 lanes, then the tail.
inline float sum_sq(const float* __restrict x, int64_t D) {
  vf acc = splat(0.f);
  int64_t d = 0;
  for (; d + W <= D; d += W) {
    const vf v = load(x + d);
    acc += v * v;
  }
  float s = hsum(acc);
  for (; d < D; ++d) s += x[d] * x[d];
  return s;
}

// out = (w + offset) * (x * r), r = 1 / sqrt(mean(x^2) + eps): RMSNorm.forward's fp32 order.
inline void norm_row(const float* __restrict x, const float* __restrict w, float* __restrict out, int64_t D,
                     float eps, float offset) {
  const float r = 1.f / std::sqrt(sum_sq(x, D) / static_cast<float>(D) + eps);
  if (offset != 0.f) {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) out[d] = (w[d] + offset) * (x[d] * r);
  } else {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) out[d] = w[d] * (x[d] * r);
  }
}

at::Tensor check_weight(const at::Tensor& weight, int64_t D, const char* op) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 1 &&
                  weight.size(0) == D,
              op, ": weight must be float32 CPU [", D, "], got ", weight.scalar_type(), " ", weight.sizes());
  return weight.contiguous();
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps, double offset) {
  const at::Tensor x = as_rows(x_in, "rms_norm", "x");
  const int64_t D = x.size(-1);
  const at::Tensor weight = check_weight(weight_in, D, "rms_norm");
  at::Tensor out = at::empty(x_in.sizes(), x.options());
  const int64_t n = D ? x.numel() / D : 0;
  const Rows src = rows_of(x);
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps), off = static_cast<float>(offset);
  at::parallel_for(0, n, grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) norm_row(src.row(i), wp, op + i * D, D, e, off);
  });
  return out;
}

// residual_out = residual + x * multiplier, normed = rms_norm(residual_out): one pass per row.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, const at::Tensor& residual_in,
                                                const at::Tensor& weight_in, double eps, double offset,
                                                double multiplier) {
  TORCH_CHECK(x_in.sizes() == residual_in.sizes(), "add_rms_norm: x ", x_in.sizes(), " and residual ",
              residual_in.sizes(), " must have the same shape");
  const at::Tensor x = as_rows(x_in, "add_rms_norm", "x");
  const at::Tensor residual = as_rows(residual_in, "add_rms_norm", "residual");
  const int64_t D = x.size(-1);
  const at::Tensor weight = check_weight(weight_in, D, "add_rms_norm");
  at::Tensor normed = at::empty(x_in.sizes(), x.options());
  at::Tensor res_out = at::empty(x_in.sizes(), x.options());
  const int64_t n = D ? x.numel() / D : 0;
  const Rows xs = rows_of(x), rs = rows_of(residual);
  const float* wp = weight.data_ptr<float>();
  float* np_ = normed.data_ptr<float>();
  float* rp = res_out.data_ptr<float>();
  const float e = static_cast<float>(eps), off = static_cast<float>(offset), m = static_cast<float>(multiplier);
  at::parallel_for(0, n, grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* __restrict a = xs.row(i);
      const float* __restrict b = rs.row(i);
      float* __restrict r = rp + i * D;
      if (m == 1.f) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) r[d] = b[d] + a[d];
      } else {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) r[d] = b[d] + a[d] * m;
      }
      norm_row(r, wp, np_ + i * D, D, e, off);
    }
  });
  return {normed, res_out};
}

// out[t, i] = act(gate_up[t, i]) * gate_up[t, I + i]; kind 0: silu, 1: gelu (tanh approximation).
// silu(g) = g / (1 + exp(-g)) as torch computes it. gelu_tanh(g) = 0.5 g (1 + tanh(y)) is
// written as g / (1 + exp(-2y)), the same value without the cancellation of 1 + tanh(y) at
// large negative y.
at::Tensor act_mul(const at::Tensor& gate_up_in, int64_t kind) {
  TORCH_CHECK(kind == 0 || kind == 1, "act_mul: kind must be 0 (silu) or 1 (gelu_tanh), got ", kind);
  const at::Tensor gu = as_rows(gate_up_in, "act_mul", "gate_up");
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0, "act_mul: gate_up must be [tokens, 2 * intermediate], got ",
              gate_up_in.sizes());
  const int64_t n = gu.size(0), I = gu.size(1) / 2;
  at::Tensor out = at::empty({n, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  const int64_t gs = gu.stride(0);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, grain(I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) zooinfer_act::act_row(gp + t * gs, gp + t * gs + I, op + t * I, I, kind);
  });
  return out;
}

// Neox rope (rotate halves) over the first rotary_dim = 2 * cos.size(1) dims of every head:
// out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin; dims past rotary_dim are copied.
inline void rope_head(const float* __restrict x, const float* __restrict c, const float* __restrict s,
                      float* __restrict o, int64_t half, int64_t D) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    o[i] = x1 * c[i] - x2 * s[i];
    o[i + half] = x2 * c[i] + x1 * s[i];
  }
  for (int64_t i = 2 * half; i < D; ++i) o[i] = x[i];
}

std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& positions_in, const at::Tensor& q_in,
                                        const at::Tensor& k_in, const at::Tensor& cos_in,
                                        const at::Tensor& sin_in) {
  const at::Tensor q = as_rows(q_in, "rope", "q"), k = as_rows(k_in, "rope", "k");
  TORCH_CHECK(q_in.dim() == 3 && k_in.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "rope: q [T, H, D] and k [T, Hk, D] must agree on T and D, got ", q_in.sizes(), " and ", k_in.sizes());
  TORCH_CHECK(cos_in.sizes() == sin_in.sizes() && cos_in.dim() == 2 && cos_in.scalar_type() == at::kFloat &&
                  sin_in.scalar_type() == at::kFloat && cos_in.device().is_cpu() && sin_in.device().is_cpu(),
              "rope: cos and sin must be float32 CPU [max_positions, rotary_dim / 2], got ", cos_in.sizes(), " and ",
              sin_in.sizes());
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const int64_t T = q.size(0), H = q.size(1), Hk = k.size(1), D = q.size(2), half = cos.size(1),
                max_pos = cos.size(0);
  TORCH_CHECK(2 * half <= D, "rope: rotary_dim ", 2 * half, " exceeds head_dim ", D);
  TORCH_CHECK(positions_in.dim() == 1 && positions_in.numel() == T && positions_in.device().is_cpu(),
              "rope: positions must be a CPU [", T, "] tensor, got ", positions_in.sizes());
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "rope: position ", pp[t], " of token ", t, " outside the table of ",
                max_pos, " positions");
  at::Tensor qo = at::empty({T, H, D}, q.options()), ko = at::empty({T, Hk, D}, k.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *qop = qo.data_ptr<float>(), *kop = ko.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  at::parallel_for(0, T, grain((H + Hk) * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pp[t] * half;
      const float* s = sp + pp[t] * half;
      for (int64_t h = 0; h < H; ++h) rope_head(qp + t * qs0 + h * qs1, c, s, qop + (t * H + h) * D, half, D);
      for (int64_t h = 0; h < Hk; ++h) rope_head(kp + t * ks0 + h * ks1, c, s, kop + (t * Hk + h) * D, half, D);
    }
  });
  return {qo, ko};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(zooinfer_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, float offset) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, float offset, float multiplier) "
        "-> (Tensor, Tensor)");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.def("act_mul(Tensor gate_up, int kind) -> Tensor");
  m.impl("act_mul", c10::DispatchKey::CPU, TORCH_FN(act_mul));
  m.def("rope(Tensor positions, Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.impl("rope", c10::DispatchKey::CPU, TORCH_FN(rope));
}
