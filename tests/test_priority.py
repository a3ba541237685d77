"""The priority scheduling policy: admission in (priority, arrival) order, lower first; the
lowest-ranked running request is the one preempted; outputs are unchanged; FCFS refuses a
priority."""
from __future__ import annotations

import pytest

from runtime import LLM, SamplingParams
from runtime.limits import ParamError
from tests.zoo_parity import assert_all_free, tight_pool_blocks

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _prompt(k: int) -> dict:
    return {"prompt_token_ids": [(7 * k + 3 * j) % 500 + 3 for j in range(5 + k)]}


def test_admission_follows_priority_then_arrival(tiny_hf):
    llm = LLM(tiny_hf("llama")[0], scheduling_policy="priority", max_num_seqs=1)
    engine = llm.engine
    prios = [3, 1, 2, 1, 0, 3]
    ids = [engine.add_request(engine.make_request(_prompt(k), GREEDY, priority=p))[0] for k, p in enumerate(prios)]
    order = []
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == [ids[k] for k in (4, 1, 3, 2, 0, 5)]
    assert_all_free(llm)


def test_lowest_priority_is_preempted_and_outputs_hold(tiny_hf):
    path = tiny_hf("llama")[0]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [_prompt(20 + k) for k in range(4)]
    ref = [o.outputs[0].token_ids for o in LLM(path).generate(prompts, params, use_tqdm=False)]
    llm = LLM(path, scheduling_policy="priority", max_model_len=128, max_num_batched_tokens=16,
              num_kv_blocks=tight_pool_blocks(path, 128, 16) + 2)
    engine = llm.engine
    reqs = [engine.make_request(p, params, priority=pr) for p, pr in zip(prompts, [5, 0, 1, 0])]
    engine.add_request(reqs[0])             # running first: FCFS would preempt a later arrival
    done = {}
    for _ in range(3):
        engine.step()
    for r in reqs[1:]:
        engine.add_request(r)
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert [done[r.request_id] for r in reqs] == ref
    assert reqs[0].num_preemptions > 0          # priority 5, admitted first, is the victim
    assert reqs[1].num_preemptions == 0 and reqs[3].num_preemptions == 0
    assert_all_free(llm)


def test_fcfs_refuses_a_priority(tiny_hf):
    llm = LLM(tiny_hf("llama")[0])
    with pytest.raises(ParamError, match="priority: only the priority scheduling policy"):
        llm.generate(_prompt(1), GREEDY, use_tqdm=False, priority=[2])
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(tiny_hf("llama")[0], scheduling_policy="lifo")
    assert llm.generate(_prompt(1), GREEDY, use_tqdm=False, priority=[0])[0].finished
