"""CUDA-graph decode on CPU: bucket lists, bucket choice, padding, fallback decisions, the
refusal of cuda_graphs=True without CUDA, and the runner's graph path with an eager stand-in
for capture/replay (padded dummy rows through the real model change no token). Capture and
replay themselves need a GPU: bench/gpu_check.py runs them."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from attention import BatchLayout
from attention.flashinfer_backend import paged_kv_csr
from cache.kv_cache_spec import FullAttentionSpec, StateSpec
from runtime import LLM, SamplingParams
from runtime.config import EngineConfig
from runtime.worker.cuda_graphs import (capture_sizes, choose_bucket, decode_bucket,
                                 pad_decode_layout, pad_tokens, unsupported_reason)
from runtime.worker.step_plan import StepBatch

torch.set_num_threads(1)


def test_capture_sizes_respect_max_num_seqs():
    assert capture_sizes(64, 256) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(12, 256) == [1, 2, 4, 8, 12]          # max_num_seqs itself is a bucket
    assert capture_sizes(5, 256) == [1, 2, 4, 5]
    assert capture_sizes(1, 256) == [1]
    assert capture_sizes(100, 30) == [1, 2, 4, 8, 16, 24, 30]   # the config cap wins when smaller
    for seqs in range(1, 80):
        sizes = capture_sizes(seqs, 256)
        assert sizes == sorted(set(sizes)) and sizes[-1] == seqs and max(sizes) <= seqs


def test_choose_bucket():
    sizes = capture_sizes(64, 256)
    assert [choose_bucket(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 63, 64)] == [1, 2, 4, 8, 8, 16, 24, 64, 64]
    assert choose_bucket(65, sizes) is None and choose_bucket(0, sizes) is None


def test_fallback_decisions():
    sizes = capture_sizes(16, 256)
    assert decode_bucket(np.ones(3, dtype=np.int64), sizes) == 4
    assert decode_bucket(np.array([1, 1, 7]), sizes) is None       # a prefill chunk in the batch
    assert decode_bucket(np.array([2]), sizes) is None             # several tokens (after preemption)
    assert decode_bucket(np.ones(17, dtype=np.int64), sizes) is None   # above the largest bucket
    assert decode_bucket(np.zeros(0, dtype=np.int64), sizes) is None


def test_pad_tokens():
    assert pad_tokens(np.array([5, 9, 3]), 4).tolist() == [5, 9, 3, 0]
    assert pad_tokens(np.array([5]), 1).tolist() == [5]


def test_pad_decode_layout_adds_null_block_dummies():
    table = torch.tensor([[4, 6, 0], [9, 0, 0], [2, 3, 5]], dtype=torch.int32)
    layout = BatchLayout(np.arange(4), np.array([7, 2, 12]), table, torch.tensor([25, 37, 83]), 4, None)
    padded = pad_decode_layout(layout, 8)
    assert padded.query_start_loc.tolist() == list(range(9))
    assert padded.seq_lens.tolist() == [7, 2, 12, 1, 1, 1, 1, 1]
    assert padded.block_table.tolist() == table.tolist() + [[0, 0, 0]] * 5
    assert padded.slot_mapping.tolist() == [25, 37, 83, 0, 0, 0, 0, 0]
    csr = paged_kv_csr(padded.query_start_loc, padded.seq_lens, padded.block_table.numpy(), 4, None, np.arange(8))
    assert csr.kv_indices.tolist() == [4, 6, 9, 2, 3, 5, 0, 0, 0, 0, 0]   # dummies: the null block
    assert csr.last_page_len.tolist() == [3, 2, 4, 1, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="3 requests do not fit bucket 2"):
        pad_decode_layout(layout, 2)
    kv = SimpleNamespace(groups=[SimpleNamespace(spec=FullAttentionSpec(4, 2, 16, torch.float16)),
                                 SimpleNamespace(spec=StateSpec(4, shapes=(("s", (4,)),), pool_page_bytes=8))])   # 2 pages
    dummy = StepBatch.dummy(kv, 2, 1, 3)      # what a bucket of 2 is captured with
    assert dummy.query_start_loc.tolist() == [0, 1, 2] and dummy.seq_lens.tolist() == [1, 1]
    assert dummy.block_tables[0].tolist() == [[0, 0, 0]] * 2 and dummy.block_tables[1].tolist() == [[0, 0]] * 2
    assert dummy.slot_mappings[0].tolist() == [0, 0] and dummy.slot_mappings[1] is None
    assert dummy.num_computed.tolist() == [0, 0]


def test_unsupported_set_ups_are_named():
    attn = SimpleNamespace(groups=[SimpleNamespace(spec=FullAttentionSpec(16, 2, 16, torch.float16))])
    hybrid = SimpleNamespace(groups=attn.groups + [SimpleNamespace(spec=StateSpec(16, shapes=(("s", (4,)),)))])
    fi = SimpleNamespace(name="flashinfer", supports_cuda_graphs=True)
    plain = SimpleNamespace(name="torch", supports_cuda_graphs=False)
    cuda = torch.device("cuda")
    assert unsupported_reason(torch.device("cpu"), fi, attn) == "cuda_graphs=True needs device='cuda', got device='cpu'"
    assert "attention_backend='flashinfer'), got 'torch'" in unsupported_reason(cuda, plain, attn)
    assert unsupported_reason(cuda, fi, hybrid).startswith("cuda_graphs=True does not support state layers")
    assert unsupported_reason(cuda, fi, attn) is None


def test_cuda_graphs_on_cpu_is_refused():
    with pytest.raises(ValueError, match=r"^cuda_graphs=True needs device='cuda', got device='cpu'$"):
        EngineConfig(cuda_graphs=True).validate()
    with pytest.raises(ValueError, match=r"^cuda_graphs=True needs device='cuda'"):
        LLM("zoo/smollm2-tiny.yaml", cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graph_max_bs must be a positive integer"):
        EngineConfig(cuda_graph_max_bs=0).validate()


class _EagerGraphs:
    """The runner-facing surface of CudaGraphRunner (bucket_for / plan / replay) with the
    captured graph replaced by an eager forward on the same padded inputs."""

    def __init__(self, runner, sizes):
        self.runner, self.sizes, self.replays = runner, sizes, []

    def bucket_for(self, num_scheduled):
        return decode_bucket(num_scheduled, self.sizes)

    def plan(self, bucket, gid, layout):
        return self.runner.backend.plan(pad_decode_layout(layout, bucket), self.runner.device)

    def replay(self, bucket, input_ids, positions):
        self.replays.append((len(input_ids), bucket))
        ids, pos = (torch.from_numpy(pad_tokens(a, bucket)) for a in (input_ids, positions))
        return self.runner.forward(ids, pos, self.runner.kv_caches)[:len(input_ids)]


@pytest.mark.parametrize("spec", ["zoo/smollm2-tiny.yaml", "zoo/mistral-sw-small.yaml"])
def test_padded_decode_path_keeps_greedy_tokens(spec):
    """Dummy rows write only the null block and their outputs are dropped: the graph path's
    padding leaves every token as in the plain eager run (sliding window included)."""
    prompts = [{"prompt_token_ids": list(range(3 + 7 * i, 3 + 7 * i + 5 + 9 * i))} for i in range(5)]
    params = [SamplingParams(max_tokens=12 + 6 * i, ignore_eos=True) for i in range(5)]   # batch shrinks 5..1
    ref = [o.outputs[0].token_ids for o in LLM(spec, max_model_len=128, num_kv_blocks=64).generate(prompts, params, use_tqdm=False)]
    llm = LLM(spec, max_model_len=128, num_kv_blocks=64, max_num_seqs=8)
    graphs = _EagerGraphs(llm.engine.runner, capture_sizes(8, 256))
    llm.engine.runner.graphs = graphs
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == ref
    assert len({tuple(t) for t in ref}) == len(ref) and all(len(set(t)) > 3 for t in ref)   # outputs vary
    # 5 rows padded to 8, then 4, 3 (padded to 4), 2 and 1 as requests finish
    assert sorted(set(graphs.replays)) == [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8)]
