"""torch.compile of the whole forward, state hybrids included.

Each zoo family's small spec runs one workload eager and compiled. The compiled run must give
the same greedy tokens, logprobs within fp32 tolerance, and compile exactly one graph, at
engine start (the warm-up). Afterwards a workload whose batch composition changes every step
compiles nothing and recompiles nothing: prompts of 1 to 70 tokens, prefill chunked by a
16-token budget, 3 slots for 7 requests so requests finish and others join, and a repeated
prompt that hits the prefix cache (state checkpoints for hybrids).

Every zoo family's small spec is here, every kind included (MLA: DeepSeek-V3 and Kimi-Linear;
KDA, lightning attention, short_conv, NoPE, sinks, parallel and mixer-less layers); the 18
cold compiles take about 3 minutes together on two cores. Inductor writes to a private
per-session cache (`compile_cache_dir`), so nothing leaks between sessions.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch._dynamo.utils as dynamo_utils

from runtime import LLM, SamplingParams

_LONG = [(11 * j) % 500 + 1 for j in range(40)]
PROMPTS = [{"prompt_token_ids": ids} for ids in (
    [(7 * j) % 500 + 3 for j in range(70)],
    [5, 9],
    _LONG,
    [(13 * j) % 500 + 2 for j in range(23)],
    [42],
    _LONG + [17, 4],                     # shares _LONG's first 32-token blocks: a prefix hit
    [(3 * j) % 500 + 1 for j in range(9)],
)]
# Different lengths, so requests finish at different steps and waiting ones join.
PARAMS = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2)
          for m in (6, 14, 9, 12, 4, 10, 7)]
ENGINE = dict(max_model_len=256, max_num_seqs=3, max_num_batched_tokens=16)


@pytest.fixture(scope="session")
def inductor_cache(tmp_path_factory):
    """A private inductor cache for the session; the environment is restored afterwards
    (the runner sets TORCHINDUCTOR_CACHE_DIR from compile_cache_dir)."""
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    path = tmp_path_factory.mktemp("inductor")
    yield str(path)
    if before is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def _graphs() -> int:
    return dynamo_utils.counters["stats"]["unique_graphs"]


def _recompiles() -> int:
    return sum(dynamo_utils.counters["recompiles"].values())


def _run(llm: LLM):
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.mark.parametrize("spec", [
    "zoo/smollm2-tiny.yaml",                                                # llama, full attention
    "zoo/bamba-small.yaml",                                                 # mamba2 + attention
    "zoo/mistral-sw-small.yaml",                                            # sliding window
    "zoo/qwen3-next-small.yaml",                                            # gated DeltaNet + MoE
    "zoo/granite-hybrid-small.yaml",                                        # mamba2 + granite MoE
    "zoo/lfm2-small.yaml",                                                  # short_conv + attention
    "zoo/smollm3-small.yaml",                                               # rope + NoPE layers
    "zoo/olmo-hybrid-small.yaml",                                           # separate-proj DeltaNet, post norms
    "zoo/gpt-oss-small.yaml",                                               # sliding/full + sinks, yarn, MoE
    "zoo/nemotron-h-small.yaml",                                            # mixer-only + MLP-only layers
    "zoo/falcon-h1-small.yaml",                                             # parallel attention + mamba2
    "zoo/deepseek-v3-small.yaml",                                           # mla (latent cache) + MoE
    "zoo/kimi-linear-small.yaml",                                           # kda + mla (no rope) + MoE
    "zoo/minimax-small.yaml",                                               # lightning attention + MoE
    "zoo/qwen3.5-small.yaml",                                               # DeltaNet, Qwen3.5's projections
    "zoo/deepseek-v4-small.yaml",                                           # CSA / HCA / shared-KV sliding, mHC, hash MoE
])
def test_compiled_equals_eager_one_graph_no_recompiles(spec, inductor_cache):
    eager = LLM(spec, **ENGINE)
    ref = _run(eager)
    assert len({t for c in ref for t in c.token_ids}) > 5, "degenerate model: outputs do not vary"

    graphs, recompiles = _graphs(), _recompiles()
    llm = LLM(spec, compile=True, compile_cache_dir=inductor_cache, **ENGINE)
    assert _graphs() - graphs == 1                      # the warm-up compiled the whole model
    assert dynamo_utils.counters["graph_break"] == {}
    # The warm-up allocated no blocks and left the pool as it was allocated: all zeros.
    stats = llm.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["cached_blocks"] == 0
    assert all(int(c.count_nonzero()) == 0 for c in llm.engine.runner.kv_caches)
    assert any(os.scandir(inductor_cache))

    graphs, recompiles = _graphs(), _recompiles()
    out = _run(llm)
    assert _graphs() - graphs == 0
    assert _recompiles() - recompiles == 0
    assert [c.token_ids for c in out] == [c.token_ids for c in ref]
    for got, want in zip(out, ref):
        for g, w in zip(got.logprobs, want.logprobs):
            assert g.keys() == w.keys()
            for tok in w:
                assert g[tok].logprob == pytest.approx(w[tok].logprob, abs=1e-4)
    stats = llm.kv_cache_stats()
    assert stats["prefix_cache_hits"] > 0               # the repeated prefix was served from cache
    assert stats["num_running"] == stats["num_waiting"] == 0


def test_compile_cache_dir_must_be_a_path():
    with pytest.raises(ValueError, match="compile_cache_dir must be a path"):
        LLM("zoo/smollm2-tiny.yaml", compile=True, compile_cache_dir=3)


def test_state_pages_typed_as_bf16_kv_keep_fp32_states():
    """A bf16 KV group and fp32 states share one pool buffer, typed as the KV (one autograd
    base for torch.compile); gather reinterprets the pages, so states keep every fp32 bit."""
    from attention.state import StatePlan
    buffer = torch.zeros(4, 64, dtype=torch.uint8)
    as_f32, as_bf16 = buffer.view(torch.float32), buffer.view(torch.bfloat16)
    as_f32[2] = torch.linspace(-1, 1, 16) / 3                # values bf16 cannot represent
    shapes = [(2, 3), (10,)]
    plan = StatePlan.build([1], [True], torch.tensor([[2]]))
    rows16, (a16, b16) = plan.gather(as_bf16, shapes)
    _, (a32, b32) = plan.gather(as_f32, shapes)
    assert a16.dtype == torch.float32 and torch.equal(a16, a32) and torch.equal(b16, b32)
    a16.mul_(3)
    plan.scatter(as_bf16, rows16)
    assert torch.equal(as_f32[2, :6], (torch.linspace(-1, 1, 16)[:6] / 3) * 3)
