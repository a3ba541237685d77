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
// Attention sinks (gpt-oss: a learned logit per query head in the softmax denominator, with
// no value) are the running max and sum's starting point: max = sink, sum = exp(0) = 1.
//
// Pages may hold float32, bfloat16 or int8 (kv_elem.h, cache/kv_dtype.py); every product and
// sum is fp32. bf16 rows widen exactly, so a bf16 cache gives bit for bit what a float32 cache
// holding the same (bf16-rounded) values gives. Int8 rows convert exactly and the page's
// per-(token, kv head) scales are applied once per key: the score as s_k * (q . k_int8), the
// weight as w * s_v, i.e. the fp32 reference on the dequantized cache up to fp32 rounding.
//
// Registered as a plain dispatcher op (no pybind): the build includes only ATen and the op
// library headers, which keeps the one-time JIT build short.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kv_elem.h"
#include "paged_checks.h"
#include "vec_exp.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// 8 floats as a GCC/Clang vector: one AVX register, two SSE ones on older targets; unaligned
// loads and stores through memcpy. Loops over a head's dims use it explicitly, so the
// code does not depend on what the auto-vectoriser makes of short runtime trip counts.
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));

inline vf load(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return vf{x, x, x, x, x, x, x, x}; }
inline float hsum(vf v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

inline vf vexp(vf x) { return zooinfer_vec::exp<vf, vi>(x); }   // see vec_exp.h

// Eight page elements of type T as floats (kv_elem.h).
template <class T>
inline vf load_kv(const T* p) { return zooinfer_kv::load_f<vf>(p); }
// int8: GCC scalarises the generic 8-byte vector conversion (movsbl + vpinsr per lane, half the
// fp32 kernel's speed on Zen 4), so on AVX2 and up it is one vpmovsxbd + vcvtdq2ps.
inline vf load_kv(const int8_t* p) {
#if defined(__AVX2__)
  int64_t x;
  __builtin_memcpy(&x, p, 8);
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(x)));
  vf v;
  __builtin_memcpy(&v, &f, sizeof v);
  return v;
#else
  return zooinfer_kv::load_f<vf>(p);
#endif
}
using zooinfer_kv::to_f;

// KD > 0: the head dim known at compile time (loops fully unrolled); KD == 0: runtime `dim`.
template <int64_t KD, class T>
inline float dot(const float* __restrict a, const T* __restrict b, int64_t dim) {
  const int64_t D = KD > 0 ? KD : dim;
  vf acc = splat(0.f);
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) acc += load(a + d) * load_kv(b + d);
  float s = hsum(acc);
  for (; d < D; ++d) s += a[d] * to_f(b[d]);
  return s;
}

template <int64_t KD, class T>
inline void axpy(float* __restrict y, float a, const T* __restrict x, int64_t dim) {
  const int64_t D = KD > 0 ? KD : dim;
  const vf av = splat(a);
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) store(y + d, load(y + d) + av * load_kv(x + d));
  for (; d < D; ++d) y[d] += a * to_f(x[d]);
}

#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define ZOO_HAVE_SHUFFLE 1
#endif
#endif

// Pairwise sums inside 128-bit halves: [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7].
#ifdef ZOO_HAVE_SHUFFLE
inline vf pair_sums(vf a, vf b) {
  return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}
#endif

// The eight horizontal sums of v[0..7] as one vector (a transposed reduction: 7 shuffle-adds
// for eight dot products instead of a full reduction each).
inline vf hsum8(const vf* v) {
#ifdef ZOO_HAVE_SHUFFLE
  const vf u0 = pair_sums(pair_sums(v[0], v[1]), pair_sums(v[2], v[3]));
  const vf u1 = pair_sums(pair_sums(v[4], v[5]), pair_sums(v[6], v[7]));
  return __builtin_shufflevector(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
#else
  vf r;
  for (int i = 0; i < 8; ++i) r[i] = hsum(v[i]);
  return r;
#endif
}

// Software prefetch (into L2) of the next page, spread over this page's work. The rows [h0, h1)
// span of the next page's K and V slabs (2 * block_size rows `stride` bytes apart) is walked as
// one list of cache lines, a few lines per row of work here. Why spread: pages are scattered,
// so the hardware prefetcher restarts at each one, and each kv head's pass reads a quarter or a
// third of every line-row of the page (the heads of a token sit side by side), a pattern the
// hardware prefetcher hardly follows; whole-page bursts of prefetches stall on the miss buffers
// (on one Zen 3 core a read with this access pattern went from 6-7 GB/s with bursts to 10-11
// with a few lines per row; the kernel over 30 SmolLM2-shaped layer caches, 32 decodes of ~190
// tokens, took 1.34x less time than with the per-head bursts it replaced, bit for bit the same
// outputs). Prefetching two pages ahead measured no better.
struct PagePrefetch {
  const char* row = nullptr;    // the current row of the next page at head h0; nullptr: nothing to fetch
  int64_t stride = 0;           // bytes between token rows
  int64_t row_lines = 0;        // cache lines of one row's [h0, h1) span
  int64_t rows_left = 0;        // rows not yet fetched (2 * block_size at the start)
  int64_t per_call = 0;         // lines per `step`
  int64_t col = 0;              // the next line in `row`

  inline void step() {
    for (int64_t k = 0; k < per_call && rows_left > 0; ++k) {
      __builtin_prefetch(row + col * 64, 0, 2);
      if (++col == row_lines) {
        col = 0;
        row += stride;
        --rows_left;
      }
    }
  }
};

// Scores of one query head against rows [t0, t1) of one kv head's K in a page (rows
// `stride` floats apart): p[t] = q . k_t. KD > 0 (a multiple of 8): eight rows are reduced
// together, the query in registers a chunk of up to 128 dims at a time (Gemma-3's 256-dim heads
// take two chunks: 16 query and 8 sum registers fit AVX-512's 32, a whole 256-dim query would
// spill); KD == 0: one dot product per row.
template <int64_t KD>
constexpr int64_t kChunk = KD > 128 && KD % 128 == 0 ? 128 : KD;

template <int64_t KD, class T>
inline void head_scores(const float* __restrict qv, const T* __restrict k, int64_t stride, int64_t t0,
                        int64_t t1, int64_t dim, float* __restrict p, PagePrefetch* pf) {
  int64_t t = t0;
  if constexpr (KD > 0) {
    constexpr int64_t CH = kChunk<KD>, NV = CH / 8;
    for (; t + 8 <= t1; t += 8) {
      if (pf) for (int u = 0; u < 8; ++u) pf->step();
      vf a[8];
      for (int u = 0; u < 8; ++u) a[u] = splat(0.f);   // 0 + q k rounds as q k does: the same sums as a first product
      for (int64_t c0 = 0; c0 < KD; c0 += CH) {
        vf qr[NV];
        for (int64_t c = 0; c < NV; ++c) qr[c] = load(qv + c0 + 8 * c);
        // dims outer, rows inner: eight independent FMA chains in flight (rows outer left one
        // dependent chain of NV FMAs per row, latency-bound; each row's sum order is the same)
        for (int64_t c = 0; c < NV; ++c)
          for (int u = 0; u < 8; ++u) a[u] += qr[c] * load_kv(k + (t + u) * stride + c0 + 8 * c);
      }
      store(p + t, hsum8(a));
    }
  }
  for (; t < t1; ++t) {
    if (pf) pf->step();
    p[t] = dot<KD, T>(qv, k + t * stride, dim);
  }
}

// acc += sum over rows t in [t0, t1) of w[t] * v_t; KD > 0: the accumulator stays in registers,
// a chunk of up to 128 dims at a time (the page's V rows are in L1 by the second chunk).
template <int64_t KD, class T>
inline void head_values(float* __restrict acc, const float* __restrict w, const T* __restrict v,
                        int64_t stride, int64_t t0, int64_t t1, int64_t dim, PagePrefetch* pf) {
  if constexpr (KD > 0) {
    constexpr int64_t CH = kChunk<KD>, NV = CH / 8;
    for (int64_t c0 = 0; c0 < KD; c0 += CH) {
      vf o[NV];
      for (int64_t c = 0; c < NV; ++c) o[c] = load(acc + c0 + 8 * c);
      for (int64_t t = t0; t < t1; ++t) {
        if (pf && c0 == 0) pf->step();
        const vf wt = splat(w[t]);
        const T* row = v + t * stride + c0;
        for (int64_t c = 0; c < NV; ++c) o[c] += wt * load_kv(row + 8 * c);
      }
      for (int64_t c = 0; c < NV; ++c) store(acc + c0 + 8 * c, o[c]);
    }
  } else {
    for (int64_t t = t0; t < t1; ++t) {
      if (pf) pf->step();
      axpy<0, T>(acc, w[t], v + t * stride, dim);
    }
  }
}

using Shape = zooinfer_paged::PagedShape;

// Attention of decode `i` for kv heads [h0, h1) (query heads [h0 * group, h1 * group)).
// `scratch` holds (h1 - h0) * group * (2 * dim + block_size + 10) floats.
// `sinks`: nullptr, or one logit per query head.
template <int64_t KD, class T>
void decode_one(const float* q, const T* cache, const int32_t* table, int64_t row, int64_t tok,
                int64_t ctx, int64_t window, float scale, const float* sinks, float* out, const Shape& s,
                int64_t h0, int64_t h1, float* scratch) {
  const int64_t nq = (h1 - h0) * s.group, D = KD > 0 ? KD : s.dim, B = s.block_size, G = s.group;
  const int64_t Bp = (B + 7) / 8 * 8;                 // score rows padded to whole vectors
  const int64_t token_stride = s.kv_heads * D;        // one token's row: every kv head
  const int64_t page_stride = s.page_stride;          // one block: K slab then V slab (then padding)
  float* qs = scratch;                 // [nq, D] scaled queries
  float* acc = qs + nq * D;            // [nq, D] running weighted value sums
  float* p = acc + nq * D;             // [nq, Bp] this page's scores, then weights
  float* m = p + nq * Bp;              // [nq] running max
  float* l = m + nq;                   // [nq] running sum of weights
  for (int64_t j = 0; j < nq; ++j) {
    const float* src = q + tok * s.q_tok + (h0 * G + j) * s.q_head;
    for (int64_t d = 0; d < D; ++d) qs[j * D + d] = src[d] * scale;
    std::fill(acc + j * D, acc + (j + 1) * D, 0.f);
    m[j] = sinks ? sinks[h0 * G + j] : -std::numeric_limits<float>::infinity();
    l[j] = sinks ? 1.f : 0.f;   // the sink's own exp(sink - max)
  }
  const int64_t start = window > 0 ? std::max<int64_t>(ctx - window, 0) : 0;
  const int64_t last = (ctx - 1) / B;
  const int32_t* bt = table + row * s.bt_row;
  int64_t block = bt[(start / B) * s.bt_col];
  for (int64_t page = start / B; page <= last; ++page) {
    TORCH_CHECK(block >= 0 && block < s.num_blocks, "paged_decode: block id ", block, " out of range");
    const T* kpage = cache + block * page_stride + h0 * D;
    const T* vpage = kpage + B * token_stride;
    // int8: the page's scales [K|V][token][kv head] (paged_checks.h)
    const float* kscale = zooinfer_kv::scaled<T>
        ? reinterpret_cast<const float*>(reinterpret_cast<const char*>(cache + block * page_stride) + s.scales_offset)
        : nullptr;
    const int64_t next = page < last ? bt[(page + 1) * s.bt_col] : -1;
    const int64_t t0 = std::max(start - page * B, int64_t(0));
    const int64_t t1 = std::min(ctx - page * B, B);
    PagePrefetch pf;   // the next page, over this page's K and V passes (first query head of each kv head)
    if (next >= 0 && next < s.num_blocks) {
      pf.row = reinterpret_cast<const char*>(cache + next * page_stride + h0 * D);
      pf.stride = token_stride * static_cast<int64_t>(sizeof(T));
      pf.row_lines = ((h1 - h0) * D * static_cast<int64_t>(sizeof(T)) + 63) / 64;
      pf.rows_left = 2 * B;
      const int64_t visits = 2 * (h1 - h0) * (t1 - t0);
      pf.per_call = (2 * B * pf.row_lines + visits - 1) / visits;
    }
    PagePrefetch* pfp = pf.row ? &pf : nullptr;
    for (int64_t h = 0; h < h1 - h0; ++h) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t j = h * G + g;
        head_scores<KD, T>(qs + j * D, kpage + h * D, token_stride, t0, t1, D, p + j * Bp, g == 0 ? pfp : nullptr);
        if constexpr (zooinfer_kv::scaled<T>)
          for (int64_t t = t0; t < t1; ++t) p[j * Bp + t] *= kscale[t * s.kv_heads + h0 + h];
      }
    }
    for (int64_t j = 0; j < nq; ++j) {
      float* pj = p + j * Bp;
      float mx = m[j];
      for (int64_t t = t0; t < t1; ++t) mx = std::max(mx, pj[t]);
      if (mx > m[j]) {   // rescale what was accumulated under the old max (exp(-inf) = 0 at first)
        const float c = std::exp(m[j] - mx);
        l[j] *= c;
        for (int64_t d = 0; d < D; ++d) acc[j * D + d] *= c;
        m[j] = mx;
      }
      const vf mv = splat(mx);
      vf sum = splat(0.f);
      for (int64_t t = 0; t < Bp; t += 8) {   // whole vectors; slots outside [t0, t1) are zeroed
        const vi slot = vi{0, 1, 2, 3, 4, 5, 6, 7} + static_cast<int32_t>(t);
        const vi live = (slot >= static_cast<int32_t>(t0)) & (slot < static_cast<int32_t>(t1));
        const vf e = live ? vexp(load(pj + t) - mv) : splat(0.f);
        store(pj + t, e);
        sum += e;
      }
      l[j] += hsum(sum);
    }
    for (int64_t h = 0; h < h1 - h0; ++h) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t j = h * G + g;
        if constexpr (zooinfer_kv::scaled<T>)   // the weights now carry the V scale (l keeps the plain sum)
          for (int64_t t = t0; t < t1; ++t) p[j * Bp + t] *= kscale[(B + t) * s.kv_heads + h0 + h];
        head_values<KD, T>(acc + j * D, p + j * Bp, vpage + h * D, token_stride, t0, t1, D, g == 0 ? pfp : nullptr);
      }
    }
    block = next;
  }
  for (int64_t j = 0; j < nq; ++j) {
    float* dst = out + tok * s.o_tok + (h0 * G + j) * s.o_head;
    const float inv = 1.f / l[j];
    for (int64_t d = 0; d < D; ++d) dst[d] = acc[j * D + d] * inv;
  }
}

// out[token_index[i], h, :] = softmax(scale * q[token_index[i], h] . K[pos, h / group]) @ V
// over the visible positions of decode i (block_table row rows[i], seq_lens[i] tokens,
// the last `window` of them when window > 0).
void paged_decode(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                  const at::Tensor& rows, const at::Tensor& token_index, const at::Tensor& seq_lens,
                  int64_t window, double scale, const std::optional<at::Tensor>& sinks, const at::Tensor& out) {
  TORCH_CHECK(rows.scalar_type() == at::kLong && token_index.scalar_type() == at::kLong &&
                  seq_lens.scalar_type() == at::kLong && rows.is_contiguous() && token_index.is_contiguous() &&
                  seq_lens.is_contiguous(), "paged_decode: contiguous int64 rows, token_index, seq_lens");
  const int64_t n = rows.numel();
  TORCH_CHECK(token_index.numel() == n && seq_lens.numel() == n, "paged_decode: one row, token, length per decode");
  const Shape s = zooinfer_paged::paged_shape("paged_decode", q, kv_cache, block_table, out);
  const float* sp = zooinfer_paged::sinks_ptr("paged_decode", sinks, s.heads);
  const float* qp = q.data_ptr<float>();
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
  // pages then stream once for all its heads), else (request, kv head) pairs. Threads take
  // items from a shared counter, longest first: with a static split by count, a thread whose
  // share holds the longer contexts keeps streaming alone (at one core's DRAM rate) after
  // the other is done.
  const int64_t split = n >= at::get_num_threads() ? 1 : s.kv_heads;
  const int64_t heads_per_item = s.kv_heads / split;
  const int64_t items = n * split;
  std::vector<int64_t> order(items);
  for (int64_t k = 0; k < items; ++k) order[k] = k;
  auto cost = [&](int64_t item) {
    const int64_t len = lp[item / split];
    return window > 0 ? std::min(len, window) : len;
  };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost(a) > cost(b); });
  std::atomic<int64_t> next{0};
  const float sc = static_cast<float>(scale);
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), items);
  auto run = [&](auto* cp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(cp)>>;
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
      std::vector<float> scratch(heads_per_item * s.group * (2 * s.dim + s.block_size + 10));
      auto* fn = s.dim == 16 ? decode_one<16, T> : s.dim == 32 ? decode_one<32, T> : s.dim == 64 ? decode_one<64, T>
               : s.dim == 128 ? decode_one<128, T> : s.dim == 256 ? decode_one<256, T> : decode_one<0, T>;   // other dims: runtime loops
      for (int64_t k = next.fetch_add(1); k < items; k = next.fetch_add(1)) {
        const int64_t item = order[k];
        const int64_t i = item / split, h0 = (item % split) * heads_per_item;
        fn(qp, cp, bp, rp[i], tp[i], lp[i], window, sc, sp, op, s, h0, h0 + heads_per_item, scratch.data());
      }
    });
  };
  switch (kv_cache.scalar_type()) {   // paged_shape admitted these three
    case at::kBFloat16: run(static_cast<const c10::BFloat16*>(kv_cache.data_ptr())); break;
    case at::kChar: run(static_cast<const int8_t*>(kv_cache.data_ptr())); break;
    default: run(kv_cache.data_ptr<float>());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(zooinfer_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor kv_cache, Tensor block_table, Tensor rows, Tensor token_index, "
        "Tensor seq_lens, int window, float scale, Tensor? sinks, Tensor(a!) out) -> ()");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
}
