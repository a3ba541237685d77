// Paged varlen causal attention on CPU for prefill chunks (several query tokens per request),
// keys and values read in place from the block-major paged cache
// [num_blocks, 2 (K|V), block_size, num_kv_heads, head_dim].
//
// Why a kernel: the torch fallback gathers every request's pages, pads the queries to the
// longest chunk and runs one masked SDPA over [requests, heads, max_q, max_keys]: with chunks
// of 64-256 tokens most of that grid is padding or the masked upper triangle. Here a tile is
// (request, kv head, up to 256 query rows): the tile's query rows (tokens x the GQA group's query
// heads, which share every K/V row) attend, flash-style, to exactly the keys some row of the
// tile can see: positions [window start of its first token, position of its last token],
// bottom-right aligned (a chunk continuation or prefix hit has ctx - q_len earlier keys that
// live only in the pages). Keys are taken 2 vectors (32 on AVX-512) at a time: K transposed
// into a scratch tile so the scores are register-blocked broadcast-FMAs (8 rows x 32 keys), V
// copied contiguous for the weighted sum, the next chunk's rows prefetched; softmax is online
// (running max and sum per row) in fp32. Rows of a block skip key chunks wholly above their
// diagonal or below their window; pages outside the window are never read (their table
// slots may point at the null block). A work item is all tiles of one (request, kv head), so
// later tiles find the keys in cache (split into runs only when there are too few items for
// the threads); items are handed out longest first from an atomic counter, so two threads
// stay balanced whatever the mix of chunk lengths. Attention sinks (a learned logit per query
// head in the softmax denominator, with no value) start each row's running max at the sink
// and its running sum at 1.
//
// Pages may hold float32, bfloat16 or int8 (kv_elem.h, cache/kv_dtype.py): each key chunk is
// converted to fp32 once, in the transpose / copy into the scratch tiles (int8: times its
// per-(token, kv head) scale), so everything after is the float32 kernel and a bf16 or int8
// cache gives bit for bit what a float32 cache holding the dequantized values gives.
//
// Registered as a plain dispatcher op (no pybind), like paged_decode.cpp.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kv_elem.h"
#include "paged_checks.h"
#include "vec_exp.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

#ifdef __AVX512F__
#define ZOO_PF_VW 16     // floats per vector register
#else
#define ZOO_PF_VW 8      // AVX2 (or two SSE registers)
#endif
constexpr int VW = ZOO_PF_VW;
constexpr int KC = 2 * VW;             // keys per chunk: two vectors of scores per row
constexpr int RB = VW == 16 ? 8 : 4;   // query rows per score block (RB * 2 accumulators)
constexpr int ACC = VW == 16 ? 16 : 8; // accumulator registers for the value sum
static_assert(RB <= VW, "one vector holds a score block's rescale factors");
// Query rows (tokens x group heads) per tile. Each tile transposes the K (and copies the V) of
// every key chunk it reads, so larger tiles share that work among more row blocks: 256 rows
// ran a 2048-token prefill step of fresh prompts 5-12% faster than 64, and a step after a
// 512-token prefix 6-17% faster (512 gained no more: the rows' sums then spill out of L1).
constexpr int64_t TILE_ROWS = 256;

typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

inline vf load(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
// A broadcast (`vf{} + x` would be a scalar add then a broadcast: 0 + x is not x for x = -0).
inline vf splat(float x) {
#if ZOO_PF_VW == 16
  return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#else
  return vf{x, x, x, x, x, x, x, x};
#endif
}
inline vi iota() {
  vi v;
  for (int i = 0; i < VW; ++i) v[i] = i;
  return v;
}
// Horizontal max and sum as log2(VW) halving steps (not a lane-by-lane scalar chain).
template <typename Op>
inline float reduce(vf v, Op op) {
#if ZOO_PF_VW == 16
  v = op(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = op(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = op(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
#else
  v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
  v = op(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
  v = op(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
#endif
  return v[0];
}
inline float hmax(vf v) {
  return reduce(v, [](vf a, vf b) { return a > b ? a : b; });
}
inline float hsum(vf v) {
  return reduce(v, [](vf a, vf b) { return a + b; });
}

inline vf vexp(vf x) { return zooinfer_vec::exp<vf, vi>(x); }   // see vec_exp.h

struct Shape : zooinfer_paged::PagedShape {
  int64_t window;
  float scale;
  const float* sinks;   // nullptr, or one logit per query head
};

// One tile: query tokens [t0, t1) (offsets in the request's chunk) of request `req`, against
// kv head `kvh`. A work item is a run of consecutive tiles of one (request, kv head): their
// keys overlap, so the later tiles find them in cache.
struct Item {
  int64_t req, kvh, t0, t1, cost;
};

// Per-thread scratch; DP = head dim rounded up to a multiple of VW (pads stay zero).
struct Scratch {
  std::vector<float> qs, o, kt, vc, s, m, l, c;
  std::vector<int64_t> pos;
  Scratch(int64_t rows, int64_t dp)
      : qs(rows * dp), o(rows * dp), kt(dp * KC, 0.f), vc(KC * dp, 0.f), s(RB * KC), m(rows), l(rows), c(VW),
        pos(rows) {}
};

// s[i, :] = qs[i, :] . kt[:, key] for RB rows and KC keys: rows broadcast, two key vectors.
template <int64_t DP>
inline void scores(const float* __restrict qs, const float* __restrict kt, float* __restrict s) {
  vf a0[RB], a1[RB];
  for (int i = 0; i < RB; ++i) a0[i] = a1[i] = splat(0.f);
  for (int64_t d = 0; d < DP; ++d) {
    const vf k0 = load(kt + d * KC), k1 = load(kt + d * KC + VW);
    for (int i = 0; i < RB; ++i) {
      const vf qd = splat(qs[i * DP + d]);
      a0[i] += qd * k0;
      a1[i] += qd * k1;
    }
  }
  for (int i = 0; i < RB; ++i) {
    store(s + i * KC, a0[i]);
    store(s + i * KC + VW, a1[i]);
  }
}

// o[i, :] = o[i, :] * c[i] + sum over keys t < n of p[i, t] * vc[t, :], for RB rows.
template <int64_t DP>
inline void values(float* __restrict o, const float* __restrict p, const float* __restrict vc,
                   const float* __restrict c, int64_t n) {
  constexpr int64_t NV = DP / VW;
  constexpr int64_t R2 = std::max<int64_t>(1, std::min<int64_t>(RB, ACC / NV));
  for (int64_t i0 = 0; i0 < RB; i0 += R2) {
    vf acc[R2][NV];
    for (int64_t i = 0; i < R2; ++i) {
      const vf ci = splat(c[i0 + i]);
      for (int64_t v = 0; v < NV; ++v) acc[i][v] = load(o + (i0 + i) * DP + v * VW) * ci;
    }
    for (int64_t t = 0; t < n; ++t) {
      vf vv[NV];
      for (int64_t v = 0; v < NV; ++v) vv[v] = load(vc + t * DP + v * VW);
      for (int64_t i = 0; i < R2; ++i) {
        const vf w = splat(p[(i0 + i) * KC + t]);
        for (int64_t v = 0; v < NV; ++v) acc[i][v] += w * vv[v];
      }
    }
    for (int64_t i = 0; i < R2; ++i)
      for (int64_t v = 0; v < NV; ++v) store(o + (i0 + i) * DP + v * VW, acc[i][v]);
  }
}

// Attention of one item. Row r of the tile is token t0 + r / group, query head
// kvh * group + r % group; rows are padded to a multiple of RB (pads repeat the last row's
// position, their queries are zero and their output is dropped).
template <int64_t DP, class T>
void tile(const float* q, const T* cache, const int32_t* table, float* out, const Shape& s, int64_t row,
          int64_t q_start, int64_t q_len, int64_t ctx, const Item& it, Scratch& w) {
  const int64_t G = s.group, D = s.dim, B = s.block_size, h = it.kvh;
  const int64_t nrows = (it.t1 - it.t0) * G, prows = (nrows + RB - 1) / RB * RB;
  const int64_t first = ctx - q_len;   // position of the chunk's first query token
  const float ninf = -std::numeric_limits<float>::infinity();
  float* qs = w.qs.data();
  float* o = w.o.data();
  for (int64_t r = 0; r < prows; ++r) {
    const int64_t rr = std::min(r, nrows - 1), tok = it.t0 + rr / G;
    w.pos[r] = first + tok;
    float* dst = qs + r * DP;
    std::fill(dst, dst + DP, 0.f);
    if (r < nrows) {
      const float* src = q + (q_start + tok) * s.q_tok + (h * G + rr % G) * s.q_head;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * s.scale;
    }
    std::fill(o + r * DP, o + (r + 1) * DP, 0.f);
    w.m[r] = s.sinks ? s.sinks[h * G + rr % G] : ninf;
    w.l[r] = s.sinks ? 1.f : 0.f;   // the sink's own exp(sink - max)
  }
  const int64_t kend = first + it.t1;   // keys at positions < kend (the last row's position + 1)
  const int64_t kstart = s.window > 0 ? std::max<int64_t>(first + it.t0 - s.window + 1, 0) : 0;
  const int64_t token_stride = s.kv_heads * D, page_stride = s.page_stride;   // pages may be padded apart
  const int32_t* bt = table + row * s.bt_row;
  const vi lane = iota();
  for (int64_t c0 = kstart; c0 < kend; c0 += KC) {
    const int64_t n = std::min<int64_t>(KC, kend - c0);
    // K of the chunk transposed into kt[d, t], V copied into vc[t, d] (pads beyond n keep
    // stale finite values or zeros: their scores are masked and the value sum stops at n).
    for (int64_t t = 0; t < n; ++t) {
      const int64_t p = c0 + t;
      const int64_t block = bt[(p / B) * s.bt_col];
      TORCH_CHECK(block >= 0 && block < s.num_blocks, "paged_prefill: block id ", block, " out of range");
      const T* krow = cache + block * page_stride + (p % B) * token_stride + h * D;
      const T* vrow = krow + B * token_stride;
      float* vdst = w.vc.data() + t * DP;
      if constexpr (zooinfer_kv::scaled<T>) {   // int8: dequantize with the token's K and V scales
        const float* sc = reinterpret_cast<const float*>(
            reinterpret_cast<const char*>(cache + block * page_stride) + s.scales_offset);
        const float ks = sc[(p % B) * s.kv_heads + h], vs = sc[(B + p % B) * s.kv_heads + h];
        for (int64_t d = 0; d < D; ++d) w.kt[d * KC + t] = static_cast<float>(krow[d]) * ks;
        for (int64_t d = 0; d < D; ++d) vdst[d] = static_cast<float>(vrow[d]) * vs;
      } else {
        for (int64_t d = 0; d < D; ++d) w.kt[d * KC + t] = zooinfer_kv::to_f(krow[d]);
        if (D == DP) {
          for (int64_t d = 0; d < DP; d += VW) store(vdst + d, zooinfer_kv::load_f<vf>(vrow + d));
        } else {
          for (int64_t d = 0; d < D; ++d) vdst[d] = zooinfer_kv::to_f(vrow[d]);
        }
      }
    }
    // The rows of the next chunk are scattered over pages (a token's row is kv_heads * D
    // floats wide, one head's slice of it is read): prefetch them while this chunk computes.
    for (int64_t p = c0 + KC; p < std::min(c0 + 2 * KC, kend); ++p) {
      const int64_t block = bt[(p / B) * s.bt_col];
      if (block < 0 || block >= s.num_blocks) continue;   // checked when read
      const char* krow = reinterpret_cast<const char*>(cache + block * page_stride + (p % B) * token_stride + h * D);
      const char* vrow = krow + B * token_stride * sizeof(T);
      for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64) {
        __builtin_prefetch(krow + b, 0, 3);
        __builtin_prefetch(vrow + b, 0, 3);
      }
    }
    for (int64_t rb = 0; rb < prows; rb += RB) {
      if (c0 > w.pos[rb + RB - 1]) continue;                                    // above the diagonal
      if (s.window > 0 && c0 + n - 1 <= w.pos[rb] - s.window) continue;         // below the window
      float* sc = w.s.data();
      scores<DP>(qs + rb * DP, w.kt.data(), sc);
      // Two passes over the block's rows: the masked scores and each row's new max, then the
      // RB rescale factors exp(m_old - m_new) as one vector exp (a libm exp per row took about
      // a tenth of the kernel), then the weights and sums. A row that sees no key of the chunk
      // keeps its max (factor exp(0) = 1) and gets zero weights.
      alignas(64) float m_old[VW] = {}, m_new[VW] = {};
      bool seen[RB];
      for (int i = 0; i < RB; ++i) {
        const int64_t r = rb + i, p = w.pos[r];
        // First and last key of the chunk this row sees, as chunk offsets clamped to [-1, KC]
        // (int32 lanes: a huge window must not wrap).
        const int64_t lo64 = s.window > 0 ? p - s.window + 1 - c0 : -1;
        const int32_t lo = static_cast<int32_t>(std::min<int64_t>(std::max<int64_t>(lo64, -1), KC));
        const int32_t hi = static_cast<int32_t>(std::min<int64_t>(std::max<int64_t>(p - c0, -1), KC));
        vf x[2];
        for (int j = 0; j < 2; ++j) {
          const vi k = lane + j * VW;
          const vi live = (k >= lo) & (k <= hi);
          x[j] = live ? load(sc + i * KC + j * VW) : splat(ninf);
          store(sc + i * KC + j * VW, x[j]);
        }
        const float mx = hmax(x[0] > x[1] ? x[0] : x[1]);
        seen[i] = mx != ninf;
        if (seen[i]) {
          m_old[i] = w.m[r];
          m_new[i] = std::max(w.m[r], mx);
        }
      }
      store(w.c.data(), vexp(load(m_old) - load(m_new)));   // exp(-inf) = 0 the first time
      for (int i = 0; i < RB; ++i) {
        const int64_t r = rb + i;
        if (!seen[i]) {   // nothing visible to this row in the chunk
          store(sc + i * KC, splat(0.f));
          store(sc + i * KC + VW, splat(0.f));
          continue;
        }
        const vf mv = splat(m_new[i]);
        vf sum = splat(0.f);
        for (int j = 0; j < 2; ++j) {
          const vf e = vexp(load(sc + i * KC + j * VW) - mv);
          store(sc + i * KC + j * VW, e);
          sum += e;
        }
        w.l[r] = w.l[r] * w.c[i] + hsum(sum);
        w.m[r] = m_new[i];
      }
      values<DP>(o + rb * DP, sc, w.vc.data(), w.c.data(), n);
    }
  }
  for (int64_t r = 0; r < nrows; ++r) {
    const int64_t tok = it.t0 + r / G;
    float* dst = out + (q_start + tok) * s.o_tok + (h * G + r % G) * s.o_head;
    const float inv = 1.f / w.l[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = o[r * DP + d] * inv;
  }
}

// For each request i: its queries q[query_start[i] : query_start[i] + query_lens[i]] sit at
// positions seq_lens[i] - query_lens[i] ... seq_lens[i] - 1; each attends the keys of block
// table row rows[i] at positions <= its own (and > its own - window when window > 0).
// Output rows of out at the same token indices; nothing else of out is written.
void paged_prefill(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                   const at::Tensor& rows, const at::Tensor& query_start, const at::Tensor& query_lens,
                   const at::Tensor& seq_lens, int64_t window, double scale, const std::optional<at::Tensor>& sinks,
                   const at::Tensor& out) {
  for (const at::Tensor* t : {&rows, &query_start, &query_lens, &seq_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1,
                "paged_prefill: contiguous 1-D int64 rows, query_start, query_lens, seq_lens");
  const int64_t n = rows.numel();
  TORCH_CHECK(query_start.numel() == n && query_lens.numel() == n && seq_lens.numel() == n,
              "paged_prefill: one row, query start, query length and seq length per request");
  Shape s;
  static_cast<zooinfer_paged::PagedShape&>(s) = zooinfer_paged::paged_shape("paged_prefill", q, kv_cache, block_table, out);
  TORCH_CHECK(s.dim <= 256, "paged_prefill: head_dim ", s.dim, " > 256 is not supported");
  s.window = window;
  s.scale = static_cast<float>(scale);
  s.sinks = zooinfer_paged::sinks_ptr("paged_prefill", sinks, s.heads);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* qsp = query_start.data_ptr<int64_t>();
  const int64_t* qlp = query_lens.data_ptr<int64_t>();
  const int64_t* lp = seq_lens.data_ptr<int64_t>();
  // Work items: every (request, kv head) is one item, or a few runs of its tiles when there
  // are too few of them to keep the threads balanced; costed by rows x keys read and
  // handed out longest first.
  const int64_t tile_tokens = std::max<int64_t>(1, TILE_ROWS / s.group);
  const int64_t threads = at::get_num_threads();
  const int64_t runs = threads > 1 ? std::max<int64_t>(1, (8 * threads + n * s.kv_heads - 1) / (n * s.kv_heads)) : 1;
  std::vector<Item> items;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(qlp[i] >= 1 && lp[i] >= qlp[i] && (lp[i] - 1) / s.block_size < block_table.size(1) &&
                    rp[i] >= 0 && rp[i] < block_table.size(0) && qsp[i] >= 0 && qsp[i] + qlp[i] <= q.size(0),
                "paged_prefill: request ", i, " has ", qlp[i], " queries at token ", qsp[i], ", seq_len ", lp[i],
                ", row ", rp[i], ": outside the block table or q, or more queries than keys");
    const int64_t first = lp[i] - qlp[i];
    const int64_t tiles = (qlp[i] + tile_tokens - 1) / tile_tokens;
    const int64_t parts = std::min(runs, tiles);
    for (int64_t part = 0; part < parts; ++part) {
      const int64_t t0 = tiles * part / parts * tile_tokens;
      const int64_t t1 = std::min(tiles * (part + 1) / parts * tile_tokens, qlp[i]);
      int64_t cost = 0;
      for (int64_t a = t0; a < t1; a += tile_tokens) {
        const int64_t b = std::min(a + tile_tokens, t1);
        const int64_t kstart = window > 0 ? std::max<int64_t>(first + a - window + 1, 0) : 0;
        cost += (b - a) * (first + b - kstart);
      }
      for (int64_t h = 0; h < s.kv_heads; ++h) items.push_back({i, h, t0, t1, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t dp = (s.dim + VW - 1) / VW * VW;
  const int64_t padded_dim = dp <= 16 ? 16 : dp <= 32 ? 32 : dp <= 64 ? 64 : dp <= 128 ? 128 : 256;
  const float* qp = q.data_ptr<float>();
  const int32_t* bp = block_table.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t max_rows = (tile_tokens * s.group + RB - 1) / RB * RB;
  auto run = [&](auto* cp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(cp)>>;
    auto* fn = padded_dim == 16 ? tile<16, T> : padded_dim == 32 ? tile<32, T> : padded_dim == 64 ? tile<64, T>
             : padded_dim == 128 ? tile<128, T> : tile<256, T>;
    at::parallel_for(0, std::min(threads, num_items), 1, [&](int64_t, int64_t) {
      Scratch w(max_rows, padded_dim);
      for (int64_t k = next.fetch_add(1); k < num_items; k = next.fetch_add(1)) {
        const Item& it = items[k];
        for (int64_t a = it.t0; a < it.t1; a += tile_tokens) {
          const Item one{it.req, it.kvh, a, std::min(a + tile_tokens, it.t1), 0};
          fn(qp, cp, bp, op, s, rp[it.req], qsp[it.req], qlp[it.req], lp[it.req], one, w);
        }
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
  m.def("paged_prefill(Tensor q, Tensor kv_cache, Tensor block_table, Tensor rows, Tensor query_start, "
        "Tensor query_lens, Tensor seq_lens, int window, float scale, Tensor? sinks, Tensor(a!) out) -> ()");
  m.impl("paged_prefill", c10::DispatchKey::CPU, TORCH_FN(paged_prefill));
}
