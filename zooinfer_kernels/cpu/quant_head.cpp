// The quantized greedy head's kernels (zooinfer_kernels/quant_head.py): the screen's product of an 8-bit head
// (`quant_head_logits_q8`, below), and its candidate rows (`quant_head_candidates`): given the int8-activation
// logits a [M, N] and per row m a margin 2B_m (B_m bounds |a - exact| for every column), the
// columns n with a[m, n] >= max_n a[m, n] - 2B_m for some m, ascending. Only these can hold a
// row's exact maximum, so the exact product is computed on them alone.
//
// Why a kernel: the same in torch (amax, compare, any, nonzero) is four passes over the logits
// with an allocation each, ~0.2 ms a step for Gemma-3's 262144-token vocabulary; here it is one
// vectorised max pass and one compare pass per row, the few hits marked in a byte map.
//
// The threshold is computed in double and rounded down to float, so no column the bound keeps
// is dropped by rounding. A row whose maximum or threshold is not finite (NaN or inf logits: no
// bound) makes every column a candidate, i.e. the caller computes the exact product in full.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

namespace {

#define ZI_HEAD_AVX512 __attribute__((target("avx512f")))

ZI_HEAD_AVX512 float row_max(const float* a, int64_t n) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  bool nan = false;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(a + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
    m = _mm512_max_ps(m, v);
  }
  float best = _mm512_reduce_max_ps(m);
  for (; i < n; ++i) {
    nan |= std::isnan(a[i]);
    best = a[i] > best ? a[i] : best;
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : best;
}

// marks[n] = 1 where a[n] >= thr
ZI_HEAD_AVX512 void mark_at_least(const float* a, int64_t n, float thr, uint8_t* marks) {
  const __m512 t = _mm512_set1_ps(thr);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    uint32_t hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(a + i), t, _CMP_GE_OQ);
    while (hit) {
      marks[i + __builtin_ctz(hit)] = 1;
      hit &= hit - 1;
    }
  }
  for (; i < n; ++i)
    if (a[i] >= thr) marks[i] = 1;
}

at::Tensor quant_head_candidates(const at::Tensor& logits, const at::Tensor& margin) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.device().is_cpu(),
              "quant_head_candidates: logits must be a 2-D float32 CPU tensor, got ", logits.sizes(), " ",
              logits.scalar_type());
  TORCH_CHECK(margin.dim() == 1 && margin.size(0) == logits.size(0) && margin.scalar_type() == at::kDouble,
              "quant_head_candidates: margin must be float64 [", logits.size(0), "], got ", margin.sizes(), " ",
              margin.scalar_type());
  __builtin_cpu_init();
  TORCH_CHECK(__builtin_cpu_supports("avx512f"), "quant_head_candidates: this CPU lacks AVX-512");
  const at::Tensor a = logits.contiguous();
  const at::Tensor mg = margin.contiguous();
  const int64_t M = a.size(0), N = a.size(1);
  const float* ap = a.data_ptr<float>();
  const double* mp = mg.data_ptr<double>();
  // Rows split over threads (batched steps: 32 rows of Gemma-3's 262144 logits are 64 MB of reads),
  // each thread marking its own map; the maps are OR-ed after.
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), M));
  std::vector<std::vector<uint8_t>> maps(parts);
  std::atomic<bool> all{false};
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      std::vector<uint8_t>& marks = maps[p];
      marks.assign(N, 0);
      for (int64_t m = p * M / parts; m < (p + 1) * M / parts && !all.load(std::memory_order_relaxed); ++m) {
        const float top = row_max(ap + m * N, N);
        const double limit = static_cast<double>(top) - mp[m];
        if (!std::isfinite(top) || !std::isfinite(limit)) {
          all.store(true);
          break;
        }
        float thr = static_cast<float>(limit);
        if (static_cast<double>(thr) > limit) thr = std::nextafter(thr, -std::numeric_limits<float>::infinity());
        mark_at_least(ap + m * N, N, thr, marks.data());
      }
    }
  });
  if (all.load()) return at::arange(N, logits.options().dtype(at::kLong));
  std::vector<uint8_t>& marks = maps[0];
  for (int64_t p = 1; p < parts; ++p)
    for (int64_t n = 0; n < N; ++n) marks[n] |= maps[p][n];
  int64_t count = 0;
  for (int64_t n = 0; n < N; ++n) count += marks[n];
  at::Tensor cols = at::empty({count}, logits.options().dtype(at::kLong));
  int64_t* cp = cols.data_ptr<int64_t>();
  for (int64_t n = 0, j = 0; n < N; ++n)
    if (marks[n]) cp[j++] = n;
  return cols;
}

// ----------------------------------------------------------------------------- the screen's product
// Approximate logits of an 8-bit head (Q8_0, our int8: qs int8 [N, K], scale fp16 or fp32 [N, K / G],
// no min, zero 0) with x already rounded to int8 per 32-block (xq [M, K] in natural order and its
// block scales xd [M, K / 32], as `quantize_activations_q8` gives them): the formula of
// quant_gemv_q8.cpp's 8-bit path, sum_b s_b dx_b sum_{k in b} q_k xq_k, so its error bound holds.
//
// Why not that kernel: the head is the one weight where its per-row overheads show (262144 rows of
// 640 for Gemma-3): it widens each 64-row tile's fp16 scales into a buffer, builds each chunk's
// scale vector from two masked loads and two permutes, and prefetches every line of the next row.
// Here a weight row's block scales are loaded once per 32 blocks into two registers (`window`) and
// each chunk of 64 weights takes its two blocks' scales from them with one permute; x's block scales
// are laid out per chunk once per call (`x_chunk_scales`). The sums are the same operations in the
// same order as the earlier version, bit for bit. What it cost (Zen 5, Gemma-3's head, 1 thread):
// - the earlier version wrote s_b dx_b to a buffer per row and read it back 8 bytes per chunk; loads
//   that hit the just-written 64-byte stores are not forwarded (56 ns a row with the head in L2);
// - it loaded every chunk with a masked load, and masked loads keep the hardware prefetcher from
//   following the rows: 128 ns a row from DRAM, 5 GB/s, where torch's fp32 sum streams 33 GB/s.
//   Full chunks now load unmasked, and both streams (weights, scales) are prefetched in software
//   HEAD_PF_BYTES ahead;
// - the even/odd accumulators were indexed by c & 1 and lived on the stack; now two named sets.
// Together: 33 ms to 6.4 ms a call at 1 thread (28 GB/s), 4.8 ms at 2 (37 GB/s).
#define ZI_HEAD_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

constexpr int HEAD_MR = 4;        // rows of x per register tile
constexpr int64_t WINDOW = 16;    // chunks of 64 weights whose 32 block scales sit in two registers
constexpr int64_t HEAD_PF_BYTES = 2560;   // software prefetch distance in the weight stream (4 rows of 640)

// x's block scales per chunk: xdp[m][c] = {xd[m][2c] x 8, xd[m][2c + 1] x 8}, zero past the last block
std::vector<float> x_chunk_scales(const float* xd, int64_t M, int64_t nb, int64_t chunks) {
  std::vector<float> xdp(M * chunks * 16, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < chunks; ++c)
      for (int l = 0; l < 16; ++l) {
        const int64_t b = 2 * c + l / 8;
        xdp[(m * chunks + c) * 16 + l] = b < nb ? xd[m * nb + b] : 0.f;
      }
  return xdp;
}

// the scales of blocks [b0, b0 + 32) of weight row n (zero past nb): lo holds b0.., hi b0 + 16..
ZI_HEAD_VNNI inline void window(const void* scale, bool half, int64_t group, int64_t ng, int64_t n, int64_t b0,
                                int64_t nb, float* buf, __m512& lo, __m512& hi) {
  if (group == 32) {
    const int64_t l0 = std::clamp<int64_t>(nb - b0, 0, 16), l1 = std::clamp<int64_t>(nb - b0 - 16, 0, 16);
    const __mmask16 k0 = static_cast<__mmask16>((1u << l0) - 1), k1 = static_cast<__mmask16>((1u << l1) - 1);
    if (half) {
      const at::Half* s = static_cast<const at::Half*>(scale) + n * ng + b0;
      lo = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k0, s));
      hi = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k1, s + 16));
    } else {
      const float* s = static_cast<const float*>(scale) + n * ng + b0;
      lo = _mm512_maskz_loadu_ps(k0, s);
      hi = _mm512_maskz_loadu_ps(k1, s + 16);
    }
    return;
  }
  if (ng == 1) {   // one scale per row (our per-channel int8): a broadcast, zero past the last block
    const float v = half ? static_cast<float>(static_cast<const at::Half*>(scale)[n]) : static_cast<const float*>(scale)[n];
    const int64_t l0 = std::clamp<int64_t>(nb - b0, 0, 16), l1 = std::clamp<int64_t>(nb - b0 - 16, 0, 16);
    lo = _mm512_maskz_mov_ps(static_cast<__mmask16>((1u << l0) - 1), _mm512_set1_ps(v));
    hi = _mm512_maskz_mov_ps(static_cast<__mmask16>((1u << l1) - 1), _mm512_set1_ps(v));
    return;
  }
  // other groups past 32 weights (rare): `per` blocks share a scale, the group index advanced by
  // counting blocks. (Per-channel heads took this loop, with a division per block and the buffer's
  // store-to-load stall: SmolLM2's 49152 x 576 int8 head 1.09 ms a call at 2 threads, its Q8_0 one 0.55.)
  const int64_t per = group / 32;
  int64_t g = b0 / per, left = per - b0 % per;
  for (int64_t j = 0; j < 32; ++j) {
    buf[j] = b0 + j >= nb ? 0.f
                          : half ? static_cast<float>(static_cast<const at::Half*>(scale)[n * ng + g])
                                 : static_cast<const float*>(scale)[n * ng + g];
    if (--left == 0) {
      ++g;
      left = per;
    }
  }
  lo = _mm512_loadu_ps(buf);
  hi = _mm512_loadu_ps(buf + 16);
}

// one chunk c of 64 weights (or a 32-weight tail) of row w into R accumulators; sw: its blocks' scales
template <int R>
ZI_HEAD_VNNI inline void chunk(const int8_t* w, int64_t K, int64_t c, const int8_t* xq, const float* xdp, int64_t ldx,
                               __m512 sw, __m512 (&acc)[R]) {
  const bool full = K - c * 64 >= 64;
  const __mmask64 kb = full ? ~__mmask64(0) : (__mmask64(1) << 32) - 1;
  _mm_prefetch(reinterpret_cast<const char*>(w + c * 64) + HEAD_PF_BYTES, _MM_HINT_T0);
  // full chunks load unmasked: masked loads kept Zen 5's prefetcher from streaming the rows
  const __m512i v = full ? _mm512_loadu_si512(w + c * 64) : _mm512_maskz_loadu_epi8(kb, w + c * 64);
  const __m512i aw = _mm512_abs_epi8(v);
  const __mmask64 neg = _mm512_movepi8_mask(v);
  const __m512i zero = _mm512_setzero_si512();
  for (int i = 0; i < R; ++i) {
    const int8_t* x = xq + i * K + c * 64;
    const __m512i xv = full ? _mm512_loadu_si512(x) : _mm512_maskz_loadu_epi8(kb, x);
    const __m512i dp = _mm512_dpbusd_epi32(zero, aw, _mm512_mask_sub_epi8(xv, neg, zero, xv));
    const __m512 s = _mm512_mul_ps(sw, _mm512_loadu_ps(xdp + i * ldx + c * 16));
    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), s, acc[i]);
  }
}

// logits of weight row n (w: its K int8) against R rows of xq (stride K), x's chunk scales xdp (stride ldx).
// Even chunks sum into one set of accumulators and odd ones into another (two fma chains), unrolled by
// hand so that both sets stay in registers.
template <int R>
ZI_HEAD_VNNI inline void row_tile(const int8_t* w, int64_t K, const int8_t* xq, const float* xdp, int64_t ldx,
                                  const void* scale, bool half, int64_t group, int64_t ng, int64_t n, int64_t nb,
                                  float* buf, float* res, int64_t ldr) {
  const int64_t chunks = (K + 63) / 64;
  const __m512i by8 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i two = _mm512_set1_epi32(2), four = _mm512_set1_epi32(4);
  __m512 even[R], odd[R];
  for (int i = 0; i < R; ++i) even[i] = odd[i] = _mm512_setzero_ps();
  for (int64_t c0 = 0; c0 < chunks; c0 += WINDOW) {   // WINDOW is even: c0 is an even chunk
    __m512 lo, hi;
    window(scale, half, group, ng, n, 2 * c0, nb, buf, lo, hi);
    __m512i idx = by8;
    const int64_t c1 = std::min(chunks, c0 + WINDOW);
    for (int64_t c = c0; c < c1; c += 2, idx = _mm512_add_epi32(idx, four)) {
      chunk<R>(w, K, c, xq, xdp, ldx, _mm512_permutex2var_ps(lo, idx, hi), even);   // {s[2c] x 8, s[2c+1] x 8}
      if (c + 1 < c1)
        chunk<R>(w, K, c + 1, xq, xdp, ldx, _mm512_permutex2var_ps(lo, _mm512_add_epi32(idx, two), hi), odd);
    }
  }
  for (int i = 0; i < R; ++i) res[i * ldr] = _mm512_reduce_add_ps(_mm512_add_ps(even[i], odd[i]));
}

at::Tensor quant_head_logits_q8(const at::Tensor& xq, const at::Tensor& xd, const at::Tensor& qs, const at::Tensor& scale,
                                int64_t group) {
  __builtin_cpu_init();
  TORCH_CHECK(__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl"),
              "quant_head_logits_q8: this CPU lacks AVX-512 VNNI");
  TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == at::kChar && xq.is_contiguous(),
              "quant_head_logits_q8: xq must be contiguous int8 [M, K], got ", xq.sizes(), " ", xq.scalar_type());
  const int64_t M = xq.size(0), K = xq.size(1), nb = K / 32;
  TORCH_CHECK(K % 32 == 0 && group > 0 && group % 32 == 0 && K % group == 0,
              "quant_head_logits_q8: K=", K, " and group ", group, " must be multiples of 32, group dividing K");
  TORCH_CHECK(xd.scalar_type() == at::kFloat && xd.is_contiguous() && xd.dim() == 2 && xd.size(0) == M && xd.size(1) == nb,
              "quant_head_logits_q8: xd must be contiguous float32 [", M, ", ", nb, "], got ", xd.sizes());
  TORCH_CHECK(qs.scalar_type() == at::kChar && qs.is_contiguous() && qs.dim() == 2 && qs.size(1) == K,
              "quant_head_logits_q8: qs must be contiguous int8 [N, ", K, "], got ", qs.sizes(), " ", qs.scalar_type());
  const int64_t N = qs.size(0), ng = K / group;
  TORCH_CHECK((scale.scalar_type() == at::kHalf || scale.scalar_type() == at::kFloat) && scale.is_contiguous() &&
                  scale.dim() == 2 && scale.size(0) == N && scale.size(1) == ng,
              "quant_head_logits_q8: scale must be contiguous float16 or float32 [", N, ", ", ng, "], got ", scale.sizes(),
              " ", scale.scalar_type());
  at::Tensor out = at::empty({M, N}, xd.options());
  if (M == 0 || N == 0) return out;
  const bool half = scale.scalar_type() == at::kHalf;
  const void* sp = scale.data_ptr();
  const int8_t* wp = qs.data_ptr<int8_t>();
  const int8_t* xp = xq.data_ptr<int8_t>();
  float* op = out.data_ptr<float>();
  const int64_t chunks = (K + 63) / 64, ldx = chunks * 16;
  const std::vector<float> xdp = x_chunk_scales(xd.data_ptr<float>(), M, nb, chunks);
  const char* sc = static_cast<const char*>(sp);
  const int64_t sbytes = ng * (half ? 2 : 4), pf_rows = (HEAD_PF_BYTES + K - 1) / K;
  at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
    alignas(64) float buf[32];
    for (int64_t n = n0; n < n1; ++n) {
      if (n + pf_rows < N)   // the scale stream, as far ahead as the weights' (its loads are masked too)
        for (int64_t b = 0; b < sbytes; b += 64) _mm_prefetch(sc + (n + pf_rows) * sbytes + b, _MM_HINT_T0);
      for (int64_t m0 = 0; m0 < M; m0 += HEAD_MR) {
        const int8_t* x = xp + m0 * K;
        const float* xs = xdp.data() + m0 * ldx;
        float* r = op + m0 * N + n;
        switch (std::min<int64_t>(HEAD_MR, M - m0)) {
          case 1: row_tile<1>(wp + n * K, K, x, xs, ldx, sp, half, group, ng, n, nb, buf, r, N); break;
          case 2: row_tile<2>(wp + n * K, K, x, xs, ldx, sp, half, group, ng, n, nb, buf, r, N); break;
          case 3: row_tile<3>(wp + n * K, K, x, xs, ldx, sp, half, group, ng, n, nb, buf, r, N); break;
          default: row_tile<4>(wp + n * K, K, x, xs, ldx, sp, half, group, ng, n, nb, buf, r, N); break;
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(zooinfer_cpu, m) {
  m.def("quant_head_candidates(Tensor logits, Tensor margin) -> Tensor");
  m.impl("quant_head_candidates", c10::DispatchKey::CPU, TORCH_FN(quant_head_candidates));
  m.def("quant_head_logits_q8(Tensor xq, Tensor xd, Tensor qs, Tensor scale, int group) -> Tensor");
  m.impl("quant_head_logits_q8", c10::DispatchKey::CPU, TORCH_FN(quant_head_logits_q8));
}
