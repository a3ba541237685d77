// Argument checks shared by the paged attention ops (paged_decode, paged_prefill): CPU float32
// q / out [T, H, D] with a contiguous last dim, one layer's contiguous paged cache
// [blocks, 2 (K|V), block_size, kv_heads, head_dim], an int32 block table, optional float32 sinks
// [heads]. Errors name the op.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace zooinfer_paged {

inline void check_common(const char* op, const at::Tensor& q, const at::Tensor& kv_cache,
                         const at::Tensor& block_table, const at::Tensor& out) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && kv_cache.scalar_type() == at::kFloat &&
                  out.scalar_type() == at::kFloat, op, ": float32 q, kv_cache and out");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && q.sizes() == out.sizes(), op, ": q and out [T, H, D]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && kv_cache.is_contiguous(),
              op, ": kv_cache must be a contiguous [blocks, 2, block_size, kv_heads, head_dim]");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, op, ": q and out need a contiguous last dim");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2, op, ": int32 block_table");
}

// The optional per-query-head sink logits: nullptr when absent, else a contiguous CPU float32 [heads].
inline const float* sinks_ptr(const char* op, const std::optional<at::Tensor>& sinks, int64_t heads) {
  if (!sinks.has_value()) return nullptr;
  const at::Tensor& t = *sinks;
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 1 &&
                  t.numel() == heads, op, ": sinks must be a contiguous CPU float32 [", heads, "], got ", t.sizes());
  return t.data_ptr<float>();
}

}  // namespace zooinfer_paged
