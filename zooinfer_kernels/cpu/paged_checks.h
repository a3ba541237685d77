// Argument checks shared by the paged attention ops (paged_decode, paged_prefill, write_kv): CPU
// float32 q / out [T, H, D] with a contiguous last dim, one layer's paged cache (float32, bfloat16
// or int8 with scales, see check_int8_scales)
// [blocks, 2 (K|V), block_size, kv_heads, head_dim] whose pages are each contiguous, an int32
// block table, optional float32 sinks [heads]. Errors name the op.
//
// Pages need not be adjacent: when the pool packs several layers' pages into one pool page
// (cache/pool_layout.py), a layer's cache is a view whose block stride is the pool page, not its
// own page. The kernels step from block to block by `kv_cache.stride(0)` (`page_stride`).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace zooinfer_paged {

// [blocks, 2, block_size, kv_heads, head_dim], every page (dims 1-4) contiguous, pages at least a
// page apart (so they never overlap): the block stride is free.
inline bool pages_contiguous(const at::Tensor& c) {
  if (c.dim() != 5 || c.size(1) != 2) return false;
  const int64_t d = c.size(4), hd = c.size(3) * d, bhd = c.size(2) * hd;
  return (c.stride(4) == 1 || d == 1) && (c.stride(3) == d || c.size(3) == 1) &&
         (c.stride(2) == hd || c.size(2) == 1) && c.stride(1) == bhd &&
         (c.stride(0) >= 2 * bhd || c.size(0) == 1);
}

// Elements from one block's page to the next.
inline int64_t page_stride(const at::Tensor& c) { return c.size(0) == 1 ? 2 * c.size(2) * c.size(3) * c.size(4) : c.stride(0); }

inline void check_common(const char* op, const at::Tensor& q, const at::Tensor& kv_cache,
                         const at::Tensor& block_table, const at::Tensor& out) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), op, ": CPU tensors only");
  const auto kv = kv_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  (kv == at::kFloat || kv == at::kBFloat16 || kv == at::kChar),
              op, ": float32 q and out, float32 / bfloat16 / int8 kv_cache");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && q.sizes() == out.sizes(), op, ": q and out [T, H, D]");
  TORCH_CHECK(pages_contiguous(kv_cache),
              op, ": kv_cache must be [blocks, 2, block_size, kv_heads, head_dim] with contiguous pages, got sizes ",
              kv_cache.sizes(), " strides ", kv_cache.strides());
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, op, ": q and out need a contiguous last dim");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2, op, ": int32 block_table");
}

// Int8 pages (cache/kv_dtype.py): after a block's K and V data (2 * block_size * kv_heads * head_dim
// bytes, rounded up to 4) come float32 scales [2 (K|V), block_size, kv_heads], one per token and kv
// head; the element of token t, head h, dim d is data[t, h, d] * scale[t, h]. The tensor views the
// data only, so the scales lie beyond its last element: checked against the storage here.
inline int64_t int8_scales_offset(const at::Tensor& c) { return (2 * c.size(2) * c.size(3) * c.size(4) + 3) / 4 * 4; }

inline void check_int8_scales(const char* op, const at::Tensor& c) {
  if (c.scalar_type() != at::kChar) return;
  const int64_t end = int8_scales_offset(c) + 2 * c.size(2) * c.size(3) * 4;   // bytes of a page incl. scales
  const int64_t stride = c.size(0) == 1 ? end : c.stride(0);
  TORCH_CHECK(stride >= end && (c.storage_offset() + int8_scales_offset(c)) % 4 == 0 && stride % 4 == 0 &&
                  c.storage_offset() + (c.size(0) - 1) * stride + end <= static_cast<int64_t>(c.storage().nbytes()),
              op, ": int8 kv_cache pages need their float32 scales after the data (block stride >= ", end,
              " bytes, 4-byte aligned, inside the storage), got strides ", c.strides());
}

// What the paged attention kernels read of q, out, the cache and the block table: sizes and
// element strides, taken once per call.
struct PagedShape {
  int64_t heads, kv_heads, group, dim, block_size, num_blocks;
  int64_t page_stride;                    // elements from one block's page to the next (>= a page)
  int64_t scales_offset;                  // int8 pages: byte offset of the scales in a page (else 0)
  int64_t q_tok, q_head, o_tok, o_head;   // strides (elements) of q and out; last dim contiguous
  int64_t bt_row, bt_col;                 // strides of the block table
};

// check_common, then the shape; q's head count must be a multiple of the cache's kv heads.
inline PagedShape paged_shape(const char* op, const at::Tensor& q, const at::Tensor& kv_cache,
                              const at::Tensor& block_table, const at::Tensor& out) {
  check_common(op, q, kv_cache, block_table, out);
  PagedShape s;
  s.heads = q.size(1);
  s.dim = q.size(2);
  s.block_size = kv_cache.size(2);
  s.kv_heads = kv_cache.size(3);
  s.num_blocks = kv_cache.size(0);
  s.page_stride = page_stride(kv_cache);
  check_int8_scales(op, kv_cache);
  s.scales_offset = kv_cache.scalar_type() == at::kChar ? int8_scales_offset(kv_cache) : 0;
  if (kv_cache.scalar_type() == at::kChar && kv_cache.size(0) == 1) s.page_stride = s.scales_offset + 8 * s.block_size * s.kv_heads;
  TORCH_CHECK(kv_cache.size(4) == s.dim && s.heads % s.kv_heads == 0, op, ": head shapes disagree");
  s.group = s.heads / s.kv_heads;
  s.q_tok = q.stride(0);
  s.q_head = q.stride(1);
  s.o_tok = out.stride(0);
  s.o_head = out.stride(1);
  s.bt_row = block_table.stride(0);
  s.bt_col = block_table.stride(1);
  return s;
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
