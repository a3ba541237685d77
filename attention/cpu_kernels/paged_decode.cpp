// Paged decode attention on CPU: one query token per request, keys and values read in place
// from the block-major paged cache [num_blocks, 2 (K|V), block_size, num_kv_heads, head_dim].
//
// Why a kernel: the torch fallback (sampled_addmm + embedding_bag) takes one (head, key) dot
// product at a time, so every key row of a kv head is fetched with a stride of a whole token
// row, once per query head. Here a request's pages are walked once, token-major: one token's
// K row holds every kv head contiguously, and the query heads of a GQA group share each K/V
// row they read. Softmax is online (running max and sum, rescaled once per page), so K and V
// are each read exactly once, in one pass, with fp32 accumulation. Pages wholly below a
// sliding window are never touched (their table slots may point at the null block).
//
// Registered as a plain dispatcher op (no pybind): the build includes only ATen and the op
// library headers, which keeps the one-time JIT build short.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// Eight independent partial sums: vectorises without -ffast-math (no reassociation needed).
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float lanes[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) {
    for (int l = 0; l < 8; ++l) lanes[l] += a[d + l] * b[d + l];
  }
  float s = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
  for (int64_t d = 0; d < n; ++d) y[d] += a * x[d];
}

struct Shape {
  int64_t heads, kv_heads, group, dim, block_size, num_blocks;
  int64_t q_tok, q_head, o_tok, o_head;   // strides (elements) of q and out; last dim contiguous
  int64_t bt_row, bt_col;                 // strides of the block table
};

// Attention of decode `i` for kv heads [h0, h1) (query heads [h0 * group, h1 * group)).
// `scratch` holds (h1 - h0) * group * (2 * dim + block_size + 2) floats.
void decode_one(const float* q, const float* cache, const int32_t* table, int64_t row, int64_t tok,
                int64_t ctx, int64_t window, float scale, float* out, const Shape& s, int64_t h0,
                int64_t h1, float* scratch) {
  const int64_t nq = (h1 - h0) * s.group, D = s.dim, B = s.block_size;
  const int64_t token_stride = s.kv_heads * D;        // one token's row: every kv head
  const int64_t page_stride = 2 * B * token_stride;   // one block: K slab then V slab
  float* qs = scratch;                 // [nq, D] scaled queries
  float* acc = qs + nq * D;            // [nq, D] running weighted value sums
  float* p = acc + nq * D;             // [nq, B] this page's scores, then weights
  float* m = p + nq * B;               // [nq] running max
  float* l = m + nq;                   // [nq] running sum of weights
  for (int64_t j = 0; j < nq; ++j) {
    const float* src = q + tok * s.q_tok + (h0 * s.group + j) * s.q_head;
    for (int64_t d = 0; d < D; ++d) qs[j * D + d] = src[d] * scale;
    std::fill(acc + j * D, acc + (j + 1) * D, 0.f);
    m[j] = -std::numeric_limits<float>::infinity();
    l[j] = 0.f;
  }
  const int64_t start = window > 0 ? std::max<int64_t>(ctx - window, 0) : 0;
  const int32_t* bt = table + row * s.bt_row;
  for (int64_t page = start / B; page * B < ctx; ++page) {
    const int64_t block = bt[page * s.bt_col];
    TORCH_CHECK(block >= 0 && block < s.num_blocks, "paged_decode: block id ", block, " out of range");
    const float* kpage = cache + block * page_stride;
    const float* vpage = kpage + B * token_stride;
    const int64_t t0 = std::max(start - page * B, int64_t(0));
    const int64_t t1 = std::min(ctx - page * B, B);
    for (int64_t t = t0; t < t1; ++t) {
      const float* krow = kpage + t * token_stride + h0 * D;
      for (int64_t h = 0; h < h1 - h0; ++h) {
        for (int64_t g = 0; g < s.group; ++g) {
          const int64_t j = h * s.group + g;
          p[j * B + t] = dot(qs + j * D, krow + h * D, D);
        }
      }
    }
    for (int64_t j = 0; j < nq; ++j) {
      float* pj = p + j * B;
      float mx = m[j];
      for (int64_t t = t0; t < t1; ++t) mx = std::max(mx, pj[t]);
      if (mx > m[j]) {   // rescale what was accumulated under the old max (exp(-inf) = 0 at first)
        const float c = std::exp(m[j] - mx);
        l[j] *= c;
        for (int64_t d = 0; d < D; ++d) acc[j * D + d] *= c;
        m[j] = mx;
      }
      float sum = 0.f;
      for (int64_t t = t0; t < t1; ++t) {
        pj[t] = std::exp(pj[t] - mx);
        sum += pj[t];
      }
      l[j] += sum;
    }
    for (int64_t t = t0; t < t1; ++t) {
      const float* vrow = vpage + t * token_stride + h0 * D;
      for (int64_t h = 0; h < h1 - h0; ++h) {
        for (int64_t g = 0; g < s.group; ++g) {
          const int64_t j = h * s.group + g;
          axpy(acc + j * D, p[j * B + t], vrow + h * D, D);
        }
      }
    }
  }
  for (int64_t j = 0; j < nq; ++j) {
    float* dst = out + tok * s.o_tok + (h0 * s.group + j) * s.o_head;
    const float inv = 1.f / l[j];
    for (int64_t d = 0; d < D; ++d) dst[d] = acc[j * D + d] * inv;
  }
}

// out[token_index[i], h, :] = softmax(scale * q[token_index[i], h] . K[pos, h / group]) @ V
// over the visible positions of decode i (block_table row rows[i], seq_lens[i] tokens,
// the last `window` of them when window > 0).
void paged_decode(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                  const at::Tensor& rows, const at::Tensor& token_index, const at::Tensor& seq_lens,
                  int64_t window, double scale, const at::Tensor& out) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "paged_decode: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && kv_cache.scalar_type() == at::kFloat &&
                  out.scalar_type() == at::kFloat, "paged_decode: float32 q, kv_cache and out");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && q.sizes() == out.sizes(), "paged_decode: q and out [T, H, D]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && kv_cache.is_contiguous(),
              "paged_decode: kv_cache must be a contiguous [blocks, 2, block_size, kv_heads, head_dim]");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "paged_decode: q and out need a contiguous last dim");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2, "paged_decode: int32 block_table");
  TORCH_CHECK(rows.scalar_type() == at::kLong && token_index.scalar_type() == at::kLong &&
                  seq_lens.scalar_type() == at::kLong && rows.is_contiguous() && token_index.is_contiguous() &&
                  seq_lens.is_contiguous(), "paged_decode: contiguous int64 rows, token_index, seq_lens");
  const int64_t n = rows.numel();
  TORCH_CHECK(token_index.numel() == n && seq_lens.numel() == n, "paged_decode: one row, token, length per decode");
  Shape s;
  s.heads = q.size(1);
  s.dim = q.size(2);
  s.block_size = kv_cache.size(2);
  s.kv_heads = kv_cache.size(3);
  s.num_blocks = kv_cache.size(0);
  TORCH_CHECK(kv_cache.size(4) == s.dim && s.heads % s.kv_heads == 0, "paged_decode: head shapes disagree");
  s.group = s.heads / s.kv_heads;
  s.q_tok = q.stride(0);
  s.q_head = q.stride(1);
  s.o_tok = out.stride(0);
  s.o_head = out.stride(1);
  s.bt_row = block_table.stride(0);
  s.bt_col = block_table.stride(1);
  const float* qp = q.data_ptr<float>();
  const float* cp = kv_cache.data_ptr<float>();
  const int32_t* bp = block_table.data_ptr<int32_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* tp = token_index.data_ptr<int64_t>();
  const int64_t* lp = seq_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(lp[i] > 0 && (lp[i] - 1) / s.block_size < block_table.size(1) && rp[i] >= 0 &&
                    rp[i] < block_table.size(0) && tp[i] >= 0 && tp[i] < q.size(0),
                "paged_decode: decode ", i, " has seq_len ", lp[i], ", row ", rp[i], ", token ", tp[i],
                " outside the block table or q");
  }
  // Work items: whole requests when there are enough to keep every thread busy (a request's
  // pages then stream once for all its heads), else (request, kv head) pairs.
  const int64_t split = n >= at::get_num_threads() ? 1 : s.kv_heads;
  const int64_t heads_per_item = s.kv_heads / split;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, n * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(heads_per_item * s.group * (2 * s.dim + s.block_size + 2));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / split, h0 = (item % split) * heads_per_item;
      decode_one(qp, cp, bp, rp[i], tp[i], lp[i], window, sc, op, s, h0, h0 + heads_per_item, scratch.data());
    }
  });
}

}  // namespace

TORCH_LIBRARY(zooinfer_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor kv_cache, Tensor block_table, Tensor rows, Tensor token_index, "
        "Tensor seq_lens, int window, float scale, Tensor(a!) out) -> ()");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
}
