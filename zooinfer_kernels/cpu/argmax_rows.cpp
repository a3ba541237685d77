// Row-wise argmax of float32 logits for greedy sampling: the first index of each row's
// maximum, a NaN counting as the maximum (the first NaN wins), as `torch.argmax(x, -1)`.
//
// Why: torch's CPU argmax over the last dim is a scalar loop (4-8 ms for 64 x 32000 logits
// on this project's bench machine), and the chunked amax trick in zooinfer_kernels/lm_head.py costs
// several small ops whose thread hand-offs dominate at 2 threads (~2 ms). Here each row is
// one work item: a vectorised max pass (which also notices NaN), then a scan for the first
// index equal to that max while the row is still in L2. About 0.3 ms for 64 x 32000. Native-width
// vectors (panels.h): with 16-float ones an AVX2 build spent 11.9 ms on 64 x 32000 (Zen 3, one thread).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "panels.h"

#include <cmath>
#include <cstring>
#include <algorithm>
#include <limits>

namespace {

using zooinfer_panels::VW;      // lanes per native vector (panels.h: 16 with AVX-512, else 8)
using zooinfer_panels::vireg;
using zooinfer_panels::vload;
using zooinfer_panels::vreg;

// One pass: every lane keeps its running max and the first index it was seen at (strict >,
// so a lane keeps its first occurrence); the lanes are then reduced to the smallest index
// holding the overall max. NaN is only noticed here and then found by a scalar scan (rare).
int64_t argmax_row(const float* x, int64_t n) {
  const float ninf = -std::numeric_limits<float>::infinity();
  vreg mx;
  vireg at_idx = {}, lane = {}, nan = {};
  for (int i = 0; i < VW; ++i) {
    mx[i] = ninf;
    lane[i] = i;
  }
  int64_t j = 0;
  for (; j + VW <= n; j += VW) {
    const vreg v = vload(x + j);
    nan |= (v != v);
    const vireg gt = v > mx;
    mx = gt ? v : mx;
    at_idx = gt ? lane + static_cast<int32_t>(j) : at_idx;
  }
  float m = ninf;
  int64_t best = j > 0 ? std::numeric_limits<int64_t>::max() : -1;
  bool any_nan = false;
  for (int i = 0; i < VW && j > 0; ++i) {
    any_nan |= nan[i] != 0;
    if (mx[i] > m || (mx[i] == m && at_idx[i] < best)) {
      m = mx[i];
      best = at_idx[i];
    }
  }
  for (; j < n; ++j) {
    any_nan |= std::isnan(x[j]);
    if (x[j] > m || best < 0) {
      m = x[j];
      best = j;
    }
  }
  if (any_nan) {
    for (int64_t k = 0; k < n; ++k)
      if (std::isnan(x[k])) return k;
  }
  return m == ninf ? 0 : best;   // all -inf: the first element is a maximum
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "argmax_rows: a float32 CPU matrix, got ", x.scalar_type(), " with ", x.dim(), " dims");
  TORCH_CHECK(x.size(1) > 0 && x.size(1) < (int64_t(1) << 31), "argmax_rows: row length must be in [1, 2^31), got ",
              x.size(1));
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1), stride = xc.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = xc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  // One row is one item; short rows are batched so tiny inputs stay on one thread.
  const int64_t grain = std::max<int64_t>(1, 16384 / n);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * stride, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(zooinfer_cpu, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.impl("argmax_rows", c10::DispatchKey::CPU, TORCH_FN(argmax_rows));
}
