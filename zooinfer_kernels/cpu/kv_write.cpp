// Store this step's keys and values in the paged cache: k[t], v[t] go to slot slots[t] of the
// block-major cache [num_blocks, 2 (K|V), block_size, num_kv_heads, head_dim]. Each page must be
// contiguous; pages may sit further apart than a page (a layer packed into a larger pool page,
// cache/pool_layout.py): blocks are stepped by the cache's block stride.
//
// Why a kernel: the torch path is two `index_copy_` calls over the cache seen as rows, plus an
// add for the V row indices and a copy of v (a strided view of the qkv projection) to make it
// contiguous: four ops of 15-45 us each per layer on CPU, whatever the token count, which on a
// 30-layer model at 32 decodes is ~3 ms of a ~75 ms step. Here one pass copies each token's
// K row and V row (every kv head of a token is one contiguous row in the cache) straight from
// the strided inputs. A plain byte copy, so any dtype works as long as k, v and the cache agree.
//
// Float32 k / v into a bfloat16 or int8 cache (cache/kv_dtype.py) convert on store: bf16 by
// c10::BFloat16's round to nearest even (what `Tensor.to(torch.bfloat16)` does); int8 per (token,
// kv head) row of head_dim values: scale = max|x| / 127, q = round_half_even(x / scale) clamped to
// [-127, 127] (scale 0 for an all-zero row, stored as such), the scale written into the page's
// scales (paged_checks.h). The same arithmetic as attention/kv_quant.py's torch path, so both
// write identical bytes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>

#include "paged_checks.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace {

// Whether rows of `x` convert on store into `cache` (float32 into bf16 / int8) rather than copy.
bool converts(const at::Tensor& x, const at::Tensor& cache) {
  return x.scalar_type() == at::kFloat && (cache.scalar_type() == at::kBFloat16 || cache.scalar_type() == at::kChar);
}

void check_rows(const char* name, const at::Tensor& x, const at::Tensor& cache) {
  TORCH_CHECK(x.device().is_cpu() && ((x.scalar_type() == cache.scalar_type() && cache.scalar_type() != at::kChar) ||
                                      converts(x, cache)),
              "write_kv: ", name, " must be a CPU tensor of the cache's dtype ", cache.scalar_type(),
              " (or float32 into a bfloat16 / int8 cache), got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 3 && x.size(1) == cache.size(3) && x.size(2) == cache.size(4), "write_kv: ", name,
              " must be [tokens, ", cache.size(3), ", ", cache.size(4), "], got ", x.sizes());
  TORCH_CHECK(x.stride(2) == 1 && (x.size(1) == 1 || x.stride(1) == x.size(2)), "write_kv: each token's ", name,
              " row must be contiguous, got strides ", x.strides());
}

void write_kv(const at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) {
  TORCH_CHECK(kv_cache.device().is_cpu() && zooinfer_paged::pages_contiguous(kv_cache),
              "write_kv: the cache must be a CPU tensor [blocks, 2, block_size, kv_heads, head_dim] with contiguous "
              "pages, got sizes ", kv_cache.sizes(), " strides ", kv_cache.strides());
  check_rows("k", k, kv_cache);
  check_rows("v", v, kv_cache);
  const int64_t n = k.size(0);
  TORCH_CHECK(v.size(0) == n && slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == n,
              "write_kv: one int64 slot per token, got ", n, " k rows, ", v.size(0), " v rows, ", slots.numel(),
              " slots of ", slots.scalar_type());
  const int64_t block_size = kv_cache.size(2), capacity = kv_cache.size(0) * block_size;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < capacity, "write_kv: token ", t, " has slot ", sp[t], " outside [0, ",
                capacity, ")");
  zooinfer_paged::check_int8_scales("write_kv", kv_cache);
  const int64_t elem = kv_cache.element_size(), in_elem = k.element_size();
  const int64_t heads = kv_cache.size(3), dim = kv_cache.size(4);
  const int64_t row = heads * dim * elem;   // bytes of one token's K (or V) in the cache
  const bool int8 = kv_cache.scalar_type() == at::kChar, bf16 = converts(k, kv_cache) && !int8;
  const int64_t scales = int8 ? zooinfer_paged::int8_scales_offset(kv_cache) : 0;
  const int64_t page = int8 && kv_cache.size(0) == 1 ? scales + 8 * block_size * heads
                                                      : zooinfer_paged::page_stride(kv_cache) * elem;  // block to block
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t k_step = k.stride(0) * in_elem, v_step = v.stride(0) * in_elem;
  // One token's K or V (heads x dim floats) into its cache row; `scale`: that token's scales.
  auto store = [&](char* dst, const char* src, float* scale) {
    const float* x = reinterpret_cast<const float*>(src);
    if (bf16) {
      c10::BFloat16* y = reinterpret_cast<c10::BFloat16*>(dst);
      for (int64_t e = 0; e < heads * dim; ++e) y[e] = c10::BFloat16(x[e]);
    } else if (int8) {
      int8_t* y = reinterpret_cast<int8_t*>(dst);
      for (int64_t h = 0; h < heads; ++h) {
        const float* xh = x + h * dim;
        float amax = 0.f;
        for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(xh[d]));
        const float sc = amax / 127.f, div = sc > 0.f ? sc : 1.f;
        for (int64_t d = 0; d < dim; ++d)
          y[h * dim + d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(xh[d] / div))));
        scale[h] = sc;
      }
    } else {
      std::memcpy(dst, src, row);
    }
  };
  // ~64 KB of rows per work item: a decode batch stays on one thread, a prefill chunk splits.
  const int64_t grain = std::max<int64_t>(1, 65536 / (2 * row));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = sp[t] / block_size, offset = sp[t] % block_size;
      char* dst = cache + block * page + offset * row;
      float* sc = int8 ? reinterpret_cast<float*>(cache + block * page + scales) + offset * heads : nullptr;
      store(dst, kp + t * k_step, sc);
      store(dst + block_size * row, vp + t * v_step, int8 ? sc + block_size * heads : nullptr);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(zooinfer_cpu, m) {
  m.def("write_kv(Tensor(a!) kv_cache, Tensor k, Tensor v, Tensor slots) -> ()");
  m.impl("write_kv", c10::DispatchKey::CPU, TORCH_FN(write_kv));
}
