"""torch.compile of the whole forward: same greedy tokens as eager, one graph, no recompiles
as batch composition changes. Slow (a cold compile takes tens of seconds on CPU)."""
from __future__ import annotations

import os

import pytest

from runtime import LLM, SamplingParams

pytestmark = pytest.mark.slow


def test_compiled_equals_eager_without_recompiles(tmp_path_factory):
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
    import torch._dynamo.utils as dynamo_utils
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 23, 40, 17, 1)]
    params = SamplingParams(temperature=0, max_tokens=16)
    eager = LLM("zoo/smollm2-tiny.yaml", max_model_len=128)
    compiled = LLM("zoo/smollm2-tiny.yaml", max_model_len=128, compile=True, max_num_batched_tokens=16)
    ref = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    dynamo_utils.counters.clear()
    out = [o.outputs[0].token_ids for o in compiled.generate(prompts, params, use_tqdm=False)]
    assert out == ref
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    assert graphs == 1
    # Different batch sizes, chunk sizes and block tables: no new graph.
    more = [o.outputs[0].token_ids for o in compiled.generate(prompts[1:3], params, use_tqdm=False)]
    assert more == ref[1:3]
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs
    assert sum(dynamo_utils.counters["recompiles"].values()) == 0
