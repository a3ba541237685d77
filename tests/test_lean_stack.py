"""The decoder layers in one C++ call (models/lean_stack.py, zooinfer_kernels/cpu/decode_stack.cpp):
greedy tokens, sampled logprobs and prompt logprobs are bit for bit the lean closures' for every
quantized-linear mode (exact, int8 activations, int8 + AMX-BF16 from 64 rows where the CPU has it),
Gemma-3's sandwich norms, q/k norms, sliding window and local rope, Llama with sinks and residual
multipliers, and int8 / bf16 KV pages; the stack runs on every step of such a model (prefill
chunks, mixed and decode steps); a replaced weight or a hook added after it was built sends the
step back to the lean closures; models it does not fit (float linears, state mixers) have none."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models import lean_stack
from runtime import LLM, SamplingParams
from tests.test_quant import needs_kernels

ZOO = Path(__file__).resolve().parent.parent / "zoo"
TINY = ZOO / "smollm2-tiny.yaml"
PROMPTS = [{"prompt_token_ids": [(5 * i + 3 * n) % 200 + 3 for i in range(n)]} for n in (5, 40, 90)]
SP = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2)


@pytest.fixture
def counted(monkeypatch):
    """Counts the forwards that took the stack and those it handed back (None)."""
    counts = {"stack": 0, "declined": 0}
    run = lean_stack.LeanStack.run

    def counting(self, *args):
        out = run(self, *args)
        counts["stack" if out is not None else "declined"] += 1
        return out
    monkeypatch.setattr(lean_stack.LeanStack, "run", counting)
    return counts


def _llm(path, **kw) -> LLM:
    return LLM(str(path), max_model_len=256, max_num_batched_tokens=96, enable_prefix_caching=False, **kw)


def _outputs(llm: LLM, prompts=PROMPTS):
    outs = llm.generate(prompts, SP, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs]


def _both(path, monkeypatch, **kw):
    """(outputs with the stack, outputs with the lean closures only, the first LLM)."""
    llm = _llm(path, **kw)
    assert llm.engine.model._stack is None      # built at the first eager forward
    with_stack = _outputs(llm)
    assert llm.engine.model._stack is not None
    build = lean_stack.build
    monkeypatch.setattr(lean_stack, "build", lambda layers, lean: None)
    try:
        lean = _outputs(_llm(path, **kw))
    finally:
        monkeypatch.setattr(lean_stack, "build", build)
    assert len({tuple(t) for t, _, _ in with_stack}) > 1      # the prompts' outputs differ: a real comparison
    return with_stack, lean, llm


@needs_kernels
@pytest.mark.parametrize("kw", [dict(quantization="int4_asym"),
                                dict(quantization="int4_asym", quantization_activations="int8"),
                                dict(quantization="int8", quantization_activations="int8_bf16"),
                                dict(quantization="int4", quantization_activations="int8", kv_cache_dtype="int8"),
                                dict(quantization="int8", kv_cache_dtype="bfloat16")],
                         ids=["int4_asym", "int4_asym-q8", "int8-bf16", "int4-q8-kv8", "int8-kvbf16"])
def test_stack_gives_the_lean_bits(monkeypatch, counted, kw):
    with_stack, lean, _ = _both(TINY, monkeypatch, **kw)
    assert with_stack == lean
    # 3 prompts of 5 / 40 / 90 tokens under a 96-token budget, then decodes: every forward took it
    assert counted["stack"] >= 9 and counted["declined"] == 0


@needs_kernels
def test_gemma3_and_sinks_with_multipliers(tiny_hf, tmp_path, monkeypatch, counted):
    """Gemma-3: sandwich norms, per-head q/k norms, 5 sliding (window 20) : 1 full layers with their
    own rope tables, GeGLU; a Llama with sinks and residual / embedding multipliers."""
    path, _ = tiny_hf("gemma3")
    with_stack, lean, llm = _both(path, monkeypatch, quantization="int8", quantization_activations="int8")
    assert with_stack == lean and llm.engine.model._stack.obj.size() == 6
    spec = tmp_path / "tiny-mult.yaml"
    spec.write_text(f"extends: {TINY}\nresidual_multiplier: 0.5\nembedding_multiplier: 2.0\n"
                    "attention: {sinks: true}\n")
    with_stack, lean, llm = _both(spec, monkeypatch, quantization="int4_asym")
    assert with_stack == lean
    assert llm.engine.model.layers[0].self_attn.sinks.abs().sum() > 0
    assert counted["declined"] == 0


@needs_kernels
def test_replaced_weights_and_late_hooks_leave_the_stack(monkeypatch, counted):
    """What the stack bound is checked every step: a linear's new weight tensors, a norm's new
    Parameter or a hook added after it was built send that step to the lean closures, which see
    them; `.to()` rebuilds it (without the hook, the stack again)."""
    kw = dict(quantization="int4_asym", quantization_activations="int8")
    llm = _llm(TINY, **kw)
    model = llm.engine.model
    base = _outputs(llm)
    assert counted["stack"] > 0 and counted["declined"] == 0
    qkv = model.layers[1].self_attn.qkv_proj
    qkv.scale = qkv.scale * 1.25                    # a new tensor: QuantLinear binds again
    changed = _outputs(llm)
    assert counted["declined"] > 0 and changed != base
    build = lean_stack.build
    monkeypatch.setattr(lean_stack, "build", lambda layers, lean: None)
    model._lean = None
    assert _outputs(llm) == changed                 # what the lean closures give on the new weight
    monkeypatch.setattr(lean_stack, "build", build)
    model._lean = None
    counted["declined"] = 0
    assert _outputs(llm) == changed and counted["declined"] == 0   # rebuilt on the new weight
    norm = model.layers[0].post_attention_layernorm
    norm.weight = torch.nn.Parameter(norm.weight.detach() * 0.5)
    normed = _outputs(llm)
    assert counted["declined"] > 0 and normed != changed
    handle = model.layers[0].mlp.down_proj.register_forward_hook(lambda m, args, out: out * 1.5)
    model._lean = None
    hooked = _outputs(llm)
    assert model._stack is None and hooked != normed   # a hooked layer does not fit: the lean closures
    handle.remove()
    model.float()
    assert model._stack is None and _outputs(llm) == normed and model._stack is not None


@needs_kernels
def test_models_the_stack_does_not_fit(tiny_hf):
    """Float linears (packed panels), and a hybrid with Mamba2 layers, keep the lean closures."""
    llm = _llm(TINY)
    _outputs(llm, PROMPTS[:1])
    assert llm.engine.model._lean is not None and llm.engine.model._stack is None
    path, _ = tiny_hf("bamba")
    llm = _llm(path, quantization="int8")
    _outputs(llm, PROMPTS[:1])
    assert llm.engine.model._lean is not None and llm.engine.model._stack is None


def test_add_layer_says_what_is_wrong():
    from zooinfer_kernels import cpu_build
    if not cpu_build.available():
        pytest.skip("the C++ kernel library did not build")
    stack = torch.classes.zooinfer_cpu.DecodeStack(8, 64)
    with pytest.raises(RuntimeError, match="expected 37 tensors, 23 ints, 15 floats, got 1, 0, 0"):
        stack.add_layer([None], [], [])
