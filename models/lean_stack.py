"""The decoder layers as one C++ call a step (`zooinfer_cpu.DecodeStack`, zooinfer_kernels/cpu/decode_stack.cpp),
where every layer is of the lean shape (models/lean_layers.py) and its linears are quantized.

Why: the lean closures still cost ~80 us of Python a layer at batch 1 (Intel AMX Xeon, SmolLM2
int4_asym with int8 activations, 2 threads: 2.4 ms of a 9.6 ms forward outside the kernels): the
calls through `torch.ops` (argument parsing, ~3-5 us for a quantized linear's 12 arguments), the
attention backend's checks, the qkv views. The stack binds each layer's weights and constants once
and calls the same kernels in the same order with the same arguments from C++, so the outputs are
the lean closures' bit for bit (tests/test_lean_stack.py).

A model gets a stack when every layer has a lean forward, no module of any layer has a hook, each
linear is a `QuantLinear` whose kernel call is bound (`QuantLinear._bind`), and head_dim <= 256
(the prefill kernel's limit). A step takes it when, in addition, the attention backend is the torch
backend with a kernel plan for every group (`TorchAttentionMetadata.kernel_plan`), every cache can
be read in place by the kernels, and what the stack bound is still what the modules hold (the
linears, their bound calls, the norm weights, rope tables and sinks: `_bound`); otherwise the
lean closures run that step. `CausalLM` builds it with the lean closures and drops it with them
(`_apply`, i.e. `.to()`).
"""
from __future__ import annotations

import operator

import torch

from attention.context import get_forward_context
from attention.torch_backend import TorchAttentionBackend
from models import lean_layers
from models.quant import QuantLinear
from zooinfer_kernels import elementwise as fused
from zooinfer_kernels import paged_attention, quant_gemm

LINEAR_FIELDS = ("qs", "scale", "minv", "bias", "qh", "scale_d", "min_d")


def _norm(n) -> tuple[float, float]:
    return (float(n.eps), float(n.offset)) if n is not None else (0.0, 0.0)


class LeanStack:
    """One model's `DecodeStack` and what it bound (module docstring)."""
    __slots__ = ("obj", "layer_ids", "cache_ids", "_dicts", "_keys", "_bound", "_hooks", "_caches")

    def __init__(self):
        self.obj = torch.classes.zooinfer_cpu.DecodeStack(quant_gemm.q8_gemm_min_rows(), quant_gemm.BF16_MIN_ROWS)
        self.layer_ids: list[int] = []
        self.cache_ids: list[int] = []
        self._dicts, self._keys, self._bound = [], [], []   # dicts[i][keys[i]] is bound[i] while valid
        self._hooks: list[dict] = []        # the linears' hook dicts: empty while valid
        self._caches: tuple = ()            # the caches last found readable by the kernels

    def _bind(self, d: dict, key: str):
        """d[key], recorded so a step sees when it is replaced."""
        self._dicts.append(d), self._keys.append(key), self._bound.append(d[key])
        return d[key]

    def _linear(self, parent, name: str) -> tuple[list, list[int]] | None:
        mod = self._bind(parent._modules, name)
        if type(mod) is not QuantLinear or not mod._bind():
            return None
        self._bind(mod.__dict__, "_run")
        self._hooks += [mod._forward_hooks, mod._forward_pre_hooks]
        return [getattr(mod, f) for f in LINEAR_FIELDS], [mod.bits, mod.group, mod.zero, quant_gemm.bound_mode(mod.act)]

    def add(self, layer, lean) -> bool:
        """Bind `layer` (a `DecoderLayer`; `lean`: its lean closure, or the layer where it has none);
        False where it is not of the stack's shape."""
        if lean is layer or not lean_layers.hooks_clear(layer, []):
            return False
        attr = layer._mixers[0][0]
        attn, mlp = getattr(layer, attr), layer.mlp
        if attn.head_dim > 256:
            return False
        linears = [self._linear(attn, "qkv_proj"), self._linear(attn, "o_proj")]
        if mlp is not None:
            linears += [self._linear(mlp, "gate_up_proj"), self._linear(mlp, "down_proj")]
        if any(lin is None for lin in linears):
            return False
        norms = [layer.input_layernorm, getattr(layer, "post_attention_layernorm", None)]
        norms += [getattr(layer, "pre_feedforward_layernorm", None), getattr(layer, "post_feedforward_layernorm", None)] \
            if layer.sandwich else [None, None]
        weights = [self._bind(n._parameters, "weight") if n is not None else None for n in norms]
        qk = [attn.q_norm, attn.k_norm]
        weights += [self._bind(n._parameters, "weight") if n is not None else None for n in qk]
        rot = attn.rotary
        weights += [self._bind(rot._buffers, "cos"), self._bind(rot._buffers, "sin")] if rot.rotary_dim else [None, None]
        sinks = self._bind(attn._parameters, "sinks") if "sinks" in attn._parameters else None
        weights.append(paged_attention._f32(sinks))
        tensors, ints = weights, [attn.num_heads, attn.num_kv_heads, attn.head_dim, len(self.cache_ids),
                                  fused.ACTIVATIONS[mlp.activation] if mlp is not None else 0,
                                  int(mlp is not None), int(layer.sandwich)]
        for t, i in linears + [([None] * len(LINEAR_FIELDS), [0, 0, 0, 0])] * (4 - len(linears)):
            tensors += t
            ints += i
        floats = [v for n in norms + qk for v in _norm(n)]
        floats += [float(layer.in_multiplier), float(layer.mix_beta), float(attn.scale)]
        self.obj.add_layer(tensors, ints, floats)
        self.layer_ids.append(attn.layer_id)
        self.cache_ids.append(layer.cache_ids[0])
        return True

    def valid(self) -> bool:
        """What the stack bound is what the modules hold, and no linear has a hook."""
        return all(map(operator.is_, map(dict.get, self._dicts, self._keys), self._bound)) and not any(map(len, self._hooks))

    def run(self, positions: torch.Tensor, x: torch.Tensor, kv_caches: list) -> tuple | None:
        """(x, residual) after the last layer, as the lean loop leaves them, or None where this step
        cannot take the stack (module docstring)."""
        if not self.valid():
            return None
        ctx = get_forward_context()
        if type(ctx.backend) is not TorchAttentionBackend:
            return None
        metas, plans, windows, index, seen = ctx.layer_meta, [], [], [], {}
        for lid in self.layer_ids:
            meta = metas[lid]
            g = seen.get(id(meta))
            if g is None:
                plan = meta.kernel_plan()
                if plan is None:
                    return None
                g = seen[id(meta)] = len(windows)
                plans += plan[0]
                windows.append(plan[1])
            index.append(g)
        caches = tuple(kv_caches[c] for c in self.cache_ids)
        if not (len(caches) == len(self._caches) and all(map(operator.is_, caches, self._caches))):
            if not all(kv.is_cpu and kv.dtype in paged_attention.KV_DTYPES and paged_attention.pages_contiguous(kv)
                       for kv in caches):
                return None
            self._caches = caches
        return self.obj.run(x, positions, list(caches), index, plans, windows)


def build(layers, lean: list) -> LeanStack | None:
    """A stack of `layers` (a model's `DecoderLayer`s, in order; `lean` their entries of
    `CausalLM._lean`), or None where one of them does not fit it. Called inside an eager forward that
    takes the lean closures (the kernel library on)."""
    if not layers:
        return None
    stack = LeanStack()
    return stack if all(stack.add(layer, run) for layer, run in zip(layers, lean)) else None
