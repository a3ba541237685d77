"""Lean eager forwards of the common decoder layers: the kernels a layer's modules call, in the same
order with the same arguments, without the per-call Python of the module tree.

Why: at batch 1 a SmolLM2 decode step on the CPU kernels spent ~3.2 ms of its 7.1 in Python and
dispatch (`python -m bench.quant_profile --model smollm2 --quantization int4_asym --activations
int8 --threads 2`), ~100 us a layer of ~10 kernel calls: each `nn.Module.__call__` (~1.5-3 us), the
`use_kernel` checks, parameter lookups through `nn.Module.__getattr__`, the split of the qkv output.
torch.compile does not remove it on CPU (measured slower, README "Measured here"). A layer of the
plain shape binds its modules and constants into one closure once: one attention mixer (full or
sliding, rope or NoPE, per-head q/k norms, sinks), pre-norm with or without Gemma's sandwich
norms, plain residual multipliers, a gated MLP whose activation has a fused kernel, or no MLP.
Other layers (MoE, state mixers, several mixers, post-norm, normed-input residuals, output gates,
q/k norms over all heads) and any module with a forward hook (tensor parallel's all-reduce) keep
their module forward.

`CausalLM.forward` takes these closures only where every fused kernel applies (eager, float32 CPU
activations, no grad, the kernel library on: `elementwise.use_kernel`) and no global module hook
is set. Tensors (norm weights, rope tables) and the linears are looked up in their modules'
`_parameters` / `_buffers` / `_modules` at each call (not through `nn.Module.__getattr__`), and a linear with a hook is called as a module (tensor parallel's all-reduce sits on o_proj /
down_proj; `linear`), so `.to()`, a replaced weight or a replaced linear is seen as by the modules;
a hook on any other module of the layer keeps the module forward (checked when the closures are
built, again after `.to()`). The outputs equal the module forward's bit for bit
(tests/test_lean_layers.py).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn.modules import module as _module

from attention.ops import attend
from models import prepack
from models.quant import QuantLinear
from zooinfer_kernels import elementwise as fused

LayerFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, list], tuple[torch.Tensor, torch.Tensor]]


def hooks_clear(layer: nn.Module, called: list[nn.Module]) -> bool:
    """No forward (pre-)hook on the modules of `layer` the closure bypasses: all but `called` (the
    linears it calls as modules) and what is below those."""
    keep = {id(m) for c in called for m in c.modules()}
    return not any(m._forward_hooks or m._forward_pre_hooks for m in layer.modules() if id(m) not in keep)


def linear(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`mod(x)` for a linear of a lean layer on 2-D float32 x: its hooks run where it has any; else a
    `QuantLinear` runs the kernel call it bound (`quant_gemm.bind`, what its forward runs on such
    x), any other linear its forward, without `nn.Module.__call__`."""
    if mod._forward_hooks or mod._forward_pre_hooks:
        return mod(x)
    run = getattr(mod, "_run", None)
    if run is None and isinstance(mod, QuantLinear):
        run = mod._bind()
    return run(x) if run else mod.forward(x)


def _attention(attn) -> Callable | None:
    """q/k/v from the fused projection, per-head q/k norms, rope, the paged attention and o_proj."""
    from models.layers import Attention
    if type(attn) is not Attention or attn.output_gate or (attn.q_norm is not None and attn.qk_norm_all_heads):
        return None
    rot, q_norm, k_norm = attn.rotary, attn.q_norm, attn.k_norm
    if rot.rotary_dim and rot.cos.dtype != torch.float32:
        return None                   # RotaryEmbedding runs its torch code on such tables
    nq, nkv, hd, qs, kvs = attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.q_size, attn.kv_size
    layer_id, scale, has_rope = attn.layer_id, attn.scale, bool(rot.rotary_dim)
    norm_op, rope_op = torch.ops.zooinfer_cpu.rms_norm.default, torch.ops.zooinfer_cpu.rope.default
    qn = (float(q_norm.eps), float(q_norm.offset), float(k_norm.eps), float(k_norm.offset)) if q_norm is not None else None
    mods, params, tables = attn._modules, attn._parameters, rot._buffers   # live: read at every call
    qp, kp = (q_norm._parameters, k_norm._parameters) if q_norm is not None else (None, None)
    sinks = "sinks" in params

    def run(positions: torch.Tensor, h: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        t = linear(mods["qkv_proj"], h)
        q = t[:, :qs].view(-1, nq, hd)
        k = t[:, qs:qs + kvs].view(-1, nkv, hd)
        v = t[:, qs + kvs:].view(-1, nkv, hd)
        if qn is not None:
            q = norm_op(q, qp["weight"], qn[0], qn[1])
            k = norm_op(k, kp["weight"], qn[2], qn[3])
        if has_rope:
            q, k = rope_op(positions, q, k, tables["cos"], tables["sin"])
        o = attend(q, k, v, kv_cache, layer_id, scale, params["sinks"] if sinks else None)
        return linear(mods["o_proj"], o.view(-1, qs))
    return run


def _mlp(mlp) -> Callable | None:
    """down(act(gate) * up) with the activation fused (`act_mul`), or in the blocked GEMM's epilogue
    where `prepack.gate_up_act` applies, as `GatedMLP.forward` does."""
    from models.layers import GatedMLP
    if type(mlp) is not GatedMLP or not mlp.gated or mlp.activation is None:
        return None
    kind, act_op = fused.ACTIVATIONS[mlp.activation], torch.ops.zooinfer_cpu.act_mul.default

    mods = mlp._modules

    def run(h: torch.Tensor) -> torch.Tensor:
        gate_up = mods["gate_up_proj"]
        y = prepack.gate_up_act(gate_up, h, kind)
        return linear(mods["down_proj"], y if y is not None else act_op(linear(gate_up, h), kind))
    return run


def lean_forward(layer) -> LayerFn | None:
    """`layer.forward` (a `models.layers.DecoderLayer`) as one closure, or None where its shape is not
    covered (module docstring)."""
    from models.layers import DecoderLayer, RMSNorm
    if type(layer) is not DecoderLayer or layer.post_norm or len(layer._mixers) != 1:
        return None
    attr, _, _, ncaches = layer._mixers[0]
    mixer = getattr(layer, attr)
    attn = _attention(mixer) if ncaches == 1 else None
    mlp = _mlp(layer.mlp) if layer.mlp is not None else None
    if attn is None or (layer.mlp is not None and mlp is None) or layer.mix_alpha is not None \
            or layer.mlp_alpha is not None:
        return None
    linears = [mixer.qkv_proj, mixer.o_proj] + ([layer.mlp.gate_up_proj, layer.mlp.down_proj] if mlp else [])
    if not hooks_clear(layer, linears):
        return None
    norm_op, add_norm_op = torch.ops.zooinfer_cpu.rms_norm.default, torch.ops.zooinfer_cpu.add_rms_norm.default
    n_in, n_post = layer.input_layernorm, getattr(layer, "post_attention_layernorm", None)
    n_pre = getattr(layer, "pre_feedforward_layernorm", None) if layer.sandwich else None
    n_ffn = getattr(layer, "post_feedforward_layernorm", None) if layer.sandwich else None
    if not all(isinstance(n, RMSNorm) for n in (n_in, n_post, n_pre, n_ffn) if n is not None):
        return None
    in_mult, mix_beta, sandwich = float(layer.in_multiplier), float(layer.mix_beta), layer.sandwich
    e_in, o_in = float(n_in.eps), float(n_in.offset)
    e_post, o_post = (float(n_post.eps), float(n_post.offset)) if n_post is not None else (0.0, 0.0)
    e_pre, o_pre = (float(n_pre.eps), float(n_pre.offset)) if n_pre is not None else (0.0, 0.0)
    e_ffn, o_ffn = (float(n_ffn.eps), float(n_ffn.offset)) if n_ffn is not None else (0.0, 0.0)
    w_in, w_post, w_pre, w_ffn = (n._parameters if n is not None else None for n in (n_in, n_post, n_pre, n_ffn))

    def run(positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, caches: list):
        if residual is None:            # the first layer: x is the embeddings
            h, residual = norm_op(x, w_in["weight"], e_in, o_in), x
        else:
            h, residual = add_norm_op(x, residual, w_in["weight"], e_in, o_in, in_mult)
        y = attn(positions, h, caches[0])
        if mlp is None:
            return y, residual
        if sandwich:
            y = norm_op(y, w_post["weight"], e_post, o_post)
            h, residual = add_norm_op(y, residual, w_pre["weight"], e_pre, o_pre, 1.0)
            return norm_op(mlp(h), w_ffn["weight"], e_ffn, o_ffn), residual
        h, residual = add_norm_op(y, residual, w_post["weight"], e_post, o_post, mix_beta)
        return mlp(h), residual
    return run


def usable(x: torch.Tensor) -> bool:
    """Whether the closures may run on this forward's activations `x` (module docstring)."""
    return fused.use_kernel(x) and not (_module._global_forward_hooks or _module._global_forward_pre_hooks)
