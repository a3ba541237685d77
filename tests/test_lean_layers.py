"""Lean eager layer forwards (models/lean_layers.py): where a layer's shape is covered, the engine's
greedy tokens, sampled logprobs and prompt logprobs are bit for bit those of the module forwards
(Llama, Qwen3's per-head q/k norms, Mistral's sliding window, Gemma-3's sandwich norms and local
rope, residual multipliers, quantized linears with int8 activations); uncovered layers (state
mixers, MoE) keep their module forward; hooks on linears run, a hook elsewhere in a layer keeps
the module forward for it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models import lean_layers
from runtime import LLM, SamplingParams
from tests.test_quant import needs_kernels

ZOO = Path(__file__).resolve().parent.parent / "zoo"
PROMPTS = [{"prompt_token_ids": [(5 * i + 3 * n) % 200 + 3 for i in range(n)]} for n in (5, 40, 70)]
SP = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2)


def _run(path, monkeypatch, lean: bool, **kw):
    usable = lean_layers.usable
    monkeypatch.setattr(lean_layers, "usable", usable if lean else (lambda x: False))
    try:
        llm = LLM(str(path), max_model_len=256, max_num_batched_tokens=64, enable_prefix_caching=False, **kw)
        outs = llm.generate(PROMPTS, SP, use_tqdm=False)
    finally:
        monkeypatch.setattr(lean_layers, "usable", usable)
    got = [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs]
    model = llm.engine.model
    covered = None if model._lean is None else sum(not isinstance(f, torch.nn.Module) for f in model._lean)
    return got, covered


@needs_kernels
@pytest.mark.parametrize("family,covered", [("llama", 2), ("qwen3", 2), ("mistral", 2), ("gemma3", 6),
                                            ("bamba", 1), ("granite", 0)])
def test_lean_layers_give_the_module_forwards_bits(tiny_hf, monkeypatch, family, covered):
    """bamba: its attention layer is covered, its mamba2 layers are not; granite: MoE MLPs, none."""
    path, _ = tiny_hf(family)
    lean, n = _run(path, monkeypatch, True)
    plain, none = _run(path, monkeypatch, False)
    assert n == covered and none is None
    assert lean == plain
    assert len({tuple(t) for t, _, _ in lean}) > 1          # the prompts' outputs differ: a real comparison


@needs_kernels
def test_multipliers_and_quantized_linears(tmp_path, monkeypatch):
    """Residual multipliers (Granite's 0.5 on a plain Llama) with attention sinks, and int8-activation
    quantized linears (their bound kernel calls), give the module forwards' bits."""
    spec = tmp_path / "tiny-mult.yaml"
    spec.write_text(f"extends: {ZOO / 'smollm2-tiny.yaml'}\nresidual_multiplier: 0.5\nembedding_multiplier: 2.0\n"
                    "attention: {sinks: true}\n")     # and gpt-oss's sink logits
    lean, n = _run(spec, monkeypatch, True)
    assert n == 2 and lean == _run(spec, monkeypatch, False)[0]
    llm = LLM(str(spec), max_model_len=256)
    assert llm.engine.model.layers[0].self_attn.sinks.abs().sum() > 0   # the sinks are real (random) logits
    kw = dict(quantization="int4_asym", quantization_activations="int8")
    lean, n = _run(ZOO / "smollm2-tiny.yaml", monkeypatch, True, **kw)
    assert n == 2 and lean == _run(ZOO / "smollm2-tiny.yaml", monkeypatch, False, **kw)[0]


@needs_kernels
def test_hooks_are_honoured(monkeypatch):
    """A hook on a linear runs on the lean path (tensor parallel's all-reduce is one); a hook on
    another module of a layer (a norm) keeps that layer's module forward; `.to()` rebuilds."""
    llm = LLM(str(ZOO / "smollm2-tiny.yaml"), max_model_len=256, enable_prefix_caching=False)
    model = llm.engine.model
    base = llm.generate(PROMPTS, SP, use_tqdm=False)
    handle = model.layers[0].self_attn.o_proj.register_forward_hook(lambda m, args, out: out * 1.5)
    model._lean = None
    hooked = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SP, use_tqdm=False)]
    assert sum(not isinstance(f, torch.nn.Module) for f in model._lean) == 2   # still lean: the linear's hook runs
    usable = lean_layers.usable
    monkeypatch.setattr(lean_layers, "usable", lambda x: False)
    assert hooked == [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SP, use_tqdm=False)]
    monkeypatch.setattr(lean_layers, "usable", usable)
    assert hooked != [o.outputs[0].token_ids for o in base]       # the hook changed something
    handle.remove()
    norm_hook = model.layers[1].input_layernorm.register_forward_hook(lambda m, args, out: out)
    model.float()                                                   # `.to()`-like: the closures are rebuilt
    assert model._lean is None
    llm.generate(PROMPTS[:1], SP, use_tqdm=False)
    assert lean_layers.lean_forward(model.layers[1]) is None and isinstance(model._lean[1], torch.nn.Module)
    assert not isinstance(model._lean[0], torch.nn.Module)
    norm_hook.remove()
