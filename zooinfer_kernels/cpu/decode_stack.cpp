// DecodeStack: the decoder layers of a model whose layers are all of the lean shape
// (models/lean_layers.py) with quantized linears, run as one call a step (models/lean_stack.py).
//
// Why: at batch 1 a SmolLM2 int4 decode step spent ~2.4 ms of a 9.6 ms forward (Intel AMX Xeon,
// 2 threads) between its ~300 kernel calls: the interpreter, torch.ops argument parsing (~3-5 us
// for a linear's 12 arguments), the attention backend's checks, and the views of the qkv output.
// Here the same kernels are called in the same order with the same arguments through typed
// dispatcher handles (~0.2 us a call), so the values are the lean closures' bit for bit
// (tests/test_lean_stack.py); everything per layer that does not change between steps (weights,
// norm constants, head counts, rope tables) is bound once by `add_layer`.
//
// What a layer computes (the order of lean_layers.lean_forward):
//   h, residual = add_rms_norm(x, residual)        (rms_norm(x), x at the first layer)
//   t = qkv(h); q, k, v = views of t; q/k norms; rope
//   write_kv(cache, k, v, slots); out = paged_decode / paged_prefill(q, cache)
//   y = o(out)
//   sandwich: y = norm(y); h, residual = add_rms_norm(y, residual); x = norm(down(act(gate_up(h))))
//   else:     h, residual = add_rms_norm(y, residual, beta); x = down(act(gate_up(h)))
// A linear's `mode` is what quant_gemm.bind picks for its weight: 0 the exact kernel, 1 int8
// activations (the GEMV below `q8_gemm_rows` rows, the GEMM-ordered kernel from there), 2 as 1
// below `bf16_rows` rows and AMX-BF16 from there.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

namespace {

using at::Tensor;
using OptT = c10::optional<at::Tensor>;

template <class Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

using QuantSig = Tensor(const Tensor&, const Tensor&, const Tensor&, const OptT&, int64_t, int64_t, int64_t,
                        const OptT&, int64_t, const OptT&, const OptT&, const OptT&);
using Q8Sig = Tensor(const Tensor&, const Tensor&, const Tensor&, const OptT&, int64_t, int64_t, int64_t,
                     const OptT&, const OptT&, const OptT&, const OptT&, int64_t);
using Bf16Sig = Tensor(const Tensor&, const Tensor&, const Tensor&, const OptT&, int64_t, int64_t, int64_t,
                       const OptT&, const OptT&, const OptT&, const OptT&);
using AttnSig = void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                     int64_t, double, const OptT&, const Tensor&);
using PrefillSig = void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                        const Tensor&, int64_t, double, const OptT&, const Tensor&);

// The kernels, looked up once (every .cpp of the library has registered its ops by then).
struct Ops {
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double, double)> rms_norm =
      find_op<Tensor(const Tensor&, const Tensor&, double, double)>("zooinfer_cpu::rms_norm");
  c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double, double,
                                                      double)>
      add_rms_norm = find_op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double, double,
                                                        double)>("zooinfer_cpu::add_rms_norm");
  c10::TypedOperatorHandle<Tensor(const Tensor&, int64_t)> act_mul =
      find_op<Tensor(const Tensor&, int64_t)>("zooinfer_cpu::act_mul");
  c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                      const Tensor&)>
      rope = find_op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                const Tensor&)>("zooinfer_cpu::rope");
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&)> write_kv =
      find_op<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&)>("zooinfer_cpu::write_kv");
  c10::TypedOperatorHandle<AttnSig> paged_decode = find_op<AttnSig>("zooinfer_cpu::paged_decode");
  c10::TypedOperatorHandle<PrefillSig> paged_prefill = find_op<PrefillSig>("zooinfer_cpu::paged_prefill");
  c10::TypedOperatorHandle<QuantSig> quant = find_op<QuantSig>("zooinfer_cpu::quant_linear");
  c10::TypedOperatorHandle<Q8Sig> q8 = find_op<Q8Sig>("zooinfer_cpu::quant_linear_q8");
  c10::TypedOperatorHandle<Q8Sig> q8_gemm = find_op<Q8Sig>("zooinfer_cpu::quant_linear_q8_gemm");
  c10::TypedOperatorHandle<Bf16Sig> bf16 = find_op<Bf16Sig>("zooinfer_cpu::quant_linear_bf16_amx");
};

const Ops& ops() {
  static const Ops o;
  return o;
}

struct Linear {
  Tensor qs, scale;
  OptT minv, bias, qh, scale_d, min_d;
  int64_t bits = 0, group = 0, zero = 0, mode = 0;
};

struct Layer {
  Linear qkv, o, gate_up, down;
  Tensor w_in;
  OptT w_post, w_pre, w_ffn, q_norm, k_norm, cos, sin, sinks;
  int64_t nq = 0, nkv = 0, hd = 0, cache = 0, act = 0;
  bool has_mlp = false, sandwich = false, qk_norm = false, has_rope = false;
  double e_in = 0, o_in = 0, e_post = 0, o_post = 0, e_pre = 0, o_pre = 0, e_ffn = 0, o_ffn = 0;
  double qe = 0, qo = 0, ke = 0, ko = 0, in_mult = 1, mix_beta = 1, scale = 1;
};

// One KV cache group's attention plan for this step (attention/torch_backend.py `kernel_plan`).
struct Plan {
  Tensor slots;
  OptT d_table, d_rows, d_tokens, d_seq_lens, p_table, p_rows, p_start, p_lens, p_seq_lens;
  int64_t window = 0;
};

constexpr int64_t PLAN_TENSORS = 10;
constexpr int64_t LINEAR_TENSORS = 7, LINEAR_INTS = 4;

class DecodeStack : public torch::CustomClassHolder {
 public:
  DecodeStack(int64_t q8_gemm_rows, int64_t bf16_rows) : q8_gemm_rows_(q8_gemm_rows), bf16_rows_(bf16_rows) {
    (void)ops();
  }

  // t: w_in, w_post, w_pre, w_ffn, q_norm, k_norm, cos, sin, sinks (None where absent), then 7 per
  //    linear (qs, scale, minv, bias, qh, scale_d, min_d) for qkv, o, gate_up, down (the MLP's None
  //    when it has none);
  // i: nq, nkv, head_dim, cache index, act kind, has_mlp, sandwich, then bits, group, zero, mode per linear;
  // f: eps / offset of input, post, pre, ffn, q, k norms, in_multiplier, mix_beta, attention scale.
  void add_layer(c10::List<OptT> t, std::vector<int64_t> i, std::vector<double> f) {
    TORCH_CHECK(t.size() == 9 + 4 * LINEAR_TENSORS && i.size() == 7 + 4 * LINEAR_INTS && f.size() == 15,
                "DecodeStack.add_layer: expected 37 tensors, 23 ints, 15 floats, got ", t.size(), ", ", i.size(),
                ", ", f.size());
    Layer L;
    TORCH_CHECK(t.get(0).has_value(), "DecodeStack.add_layer: the input norm's weight is required");
    L.w_in = *t.get(0);
    L.w_post = t.get(1), L.w_pre = t.get(2), L.w_ffn = t.get(3);
    L.q_norm = t.get(4), L.k_norm = t.get(5), L.cos = t.get(6), L.sin = t.get(7), L.sinks = t.get(8);
    L.nq = i[0], L.nkv = i[1], L.hd = i[2], L.cache = i[3], L.act = i[4];
    L.has_mlp = i[5] != 0, L.sandwich = i[6] != 0;
    L.qk_norm = L.q_norm.has_value(), L.has_rope = L.cos.has_value();
    TORCH_CHECK(L.qk_norm == L.k_norm.has_value() && L.has_rope == L.sin.has_value(),
                "DecodeStack.add_layer: q/k norms and cos/sin come in pairs");
    Linear* lins[4] = {&L.qkv, &L.o, &L.gate_up, &L.down};
    for (int64_t j = 0; j < (L.has_mlp ? 4 : 2); ++j) {
      const int64_t b = 9 + j * LINEAR_TENSORS;
      TORCH_CHECK(t.get(b).has_value() && t.get(b + 1).has_value(), "DecodeStack.add_layer: linear ", j,
                  " needs its qs and scale");
      Linear& l = *lins[j];
      l.qs = *t.get(b), l.scale = *t.get(b + 1);
      l.minv = t.get(b + 2), l.bias = t.get(b + 3), l.qh = t.get(b + 4), l.scale_d = t.get(b + 5),
      l.min_d = t.get(b + 6);
      const int64_t c = 7 + j * LINEAR_INTS;
      l.bits = i[c], l.group = i[c + 1], l.zero = i[c + 2], l.mode = i[c + 3];
    }
    L.e_in = f[0], L.o_in = f[1], L.e_post = f[2], L.o_post = f[3], L.e_pre = f[4], L.o_pre = f[5];
    L.e_ffn = f[6], L.o_ffn = f[7], L.qe = f[8], L.qo = f[9], L.ke = f[10], L.ko = f[11];
    L.in_mult = f[12], L.mix_beta = f[13], L.scale = f[14];
    layers_.push_back(std::move(L));
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // x: the embeddings [T, hidden]; caches: the attention cache of each stack cache index;
  // layer_plan[l]: the plan of layer l; plans: PLAN_TENSORS per plan (slots, decode table, rows,
  // tokens, seq_lens, prefill table, rows, query_start, query_lens, seq_lens); windows: one per plan.
  // Returns (x, residual) after the last layer, as the lean loop leaves them.
  std::tuple<Tensor, Tensor> run(const Tensor& x, const Tensor& positions, c10::List<Tensor> caches,
                                 std::vector<int64_t> layer_plan, c10::List<OptT> plans,
                                 std::vector<int64_t> windows) const {
    const int64_t n_plans = static_cast<int64_t>(windows.size());
    TORCH_CHECK(static_cast<int64_t>(layer_plan.size()) == size() &&
                    static_cast<int64_t>(plans.size()) == PLAN_TENSORS * n_plans,
                "DecodeStack.run: one plan per layer and ", PLAN_TENSORS, " tensors per plan");
    std::vector<Plan> ps(n_plans);
    for (int64_t g = 0; g < n_plans; ++g) {
      const int64_t b = g * PLAN_TENSORS;
      TORCH_CHECK(plans.get(b).has_value(), "DecodeStack.run: plan ", g, " has no slots");
      Plan& p = ps[g];
      p.slots = *plans.get(b);
      p.d_table = plans.get(b + 1), p.d_rows = plans.get(b + 2), p.d_tokens = plans.get(b + 3);
      p.d_seq_lens = plans.get(b + 4), p.p_table = plans.get(b + 5), p.p_rows = plans.get(b + 6);
      p.p_start = plans.get(b + 7), p.p_lens = plans.get(b + 8), p.p_seq_lens = plans.get(b + 9);
      p.window = windows[g];
    }
    const Ops& k = ops();
    Tensor cur = x, residual, h;
    for (int64_t l = 0; l < size(); ++l) {
      const Layer& L = layers_[l];
      const int64_t g = layer_plan[l];
      TORCH_CHECK(g >= 0 && g < n_plans && L.cache < static_cast<int64_t>(caches.size()),
                  "DecodeStack.run: layer ", l, " has no plan or cache");
      if (l == 0) {
        h = k.rms_norm.call(cur, L.w_in, L.e_in, L.o_in);
        residual = cur;
      } else {
        std::tie(h, residual) = k.add_rms_norm.call(cur, residual, L.w_in, L.e_in, L.o_in, L.in_mult);
      }
      Tensor y = attention(L, positions, h, caches.get(L.cache), ps[g]);
      if (!L.has_mlp) {
        cur = y;
        continue;
      }
      if (L.sandwich) {
        y = k.rms_norm.call(y, *L.w_post, L.e_post, L.o_post);
        std::tie(h, residual) = k.add_rms_norm.call(y, residual, *L.w_pre, L.e_pre, L.o_pre, 1.0);
        cur = k.rms_norm.call(mlp(L, h), *L.w_ffn, L.e_ffn, L.o_ffn);
      } else {
        std::tie(h, residual) = k.add_rms_norm.call(y, residual, *L.w_post, L.e_post, L.o_post, L.mix_beta);
        cur = mlp(L, h);
      }
    }
    return {cur, residual};
  }

 private:
  Tensor linear(const Linear& l, const Tensor& x) const {
    const Ops& k = ops();
    const int64_t rows = x.size(0);
    if (l.mode == 0)
      return k.quant.call(x, l.qs, l.scale, l.minv, l.bits, l.group, l.zero, l.bias, -1, l.qh, l.scale_d, l.min_d);
    if (l.mode == 2 && rows >= bf16_rows_)
      return k.bf16.call(x, l.qs, l.scale, l.minv, l.bits, l.group, l.zero, l.bias, l.qh, l.scale_d, l.min_d);
    const auto& op = rows < q8_gemm_rows_ ? k.q8 : k.q8_gemm;
    return op.call(x, l.qs, l.scale, l.minv, l.bits, l.group, l.zero, l.bias, l.qh, l.scale_d, l.min_d, -1);
  }

  Tensor attention(const Layer& L, const Tensor& positions, const Tensor& h, const Tensor& cache,
                   const Plan& p) const {
    const Ops& k = ops();
    const int64_t qsz = L.nq * L.hd, kvs = L.nkv * L.hd;
    const Tensor t = linear(L.qkv, h);
    Tensor q = t.narrow(1, 0, qsz).view({-1, L.nq, L.hd});
    Tensor kk = t.narrow(1, qsz, kvs).view({-1, L.nkv, L.hd});
    const Tensor v = t.narrow(1, qsz + kvs, kvs).view({-1, L.nkv, L.hd});
    if (L.qk_norm) {
      q = k.rms_norm.call(q, *L.q_norm, L.qe, L.qo);
      kk = k.rms_norm.call(kk, *L.k_norm, L.ke, L.ko);
    }
    if (L.has_rope) std::tie(q, kk) = k.rope.call(positions, q, kk, *L.cos, *L.sin);
    k.write_kv.call(cache, kk, v, p.slots);
    const Tensor out = at::empty({q.size(0), L.nq, L.hd}, q.options());
    if (p.d_table.has_value())
      k.paged_decode.call(q, cache, *p.d_table, *p.d_rows, *p.d_tokens, *p.d_seq_lens, p.window, L.scale, L.sinks,
                          out);
    if (p.p_table.has_value())
      k.paged_prefill.call(q, cache, *p.p_table, *p.p_rows, *p.p_start, *p.p_lens, *p.p_seq_lens, p.window, L.scale,
                           L.sinks, out);
    return linear(L.o, out.view({-1, qsz}));
  }

  Tensor mlp(const Layer& L, const Tensor& h) const {
    return linear(L.down, ops().act_mul.call(linear(L.gate_up, h), L.act));
  }

  std::vector<Layer> layers_;
  int64_t q8_gemm_rows_, bf16_rows_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(zooinfer_cpu, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("size", &DecodeStack::size)
      .def("run", &DecodeStack::run);
}
