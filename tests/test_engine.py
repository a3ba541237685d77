"""Engine behaviour: stop conditions, seeded sampling, logprobs, dummy weights."""
from __future__ import annotations

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.sampling_params import RequestOutputKind


@pytest.fixture(scope="module")
def tiny(tiny_hf):
    return tiny_hf("llama")[0]


PROMPTS = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 23, 40)]


def test_stop_token_ids_and_min_tokens(tiny):
    llm = LLM(tiny)
    free = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    toks = free.outputs[0].token_ids
    stop_at = toks[5]
    first = toks.index(stop_at)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == toks[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_at)
    # min_tokens bans the stop token until enough tokens exist.
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, min_tokens=12,
                                                  stop_token_ids=[stop_at]), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 12 and stop_at not in out.token_ids and out.finish_reason == "length"


def test_output_kinds(tiny):
    """CUMULATIVE: an output after every step that gave the request a token; FINAL_ONLY: only
    the finished one, equal to the cumulative stream's last. LLM.generate asks for FINAL_ONLY
    without touching the caller's params."""
    llm = LLM(tiny)
    engine = llm.engine
    seen = {}
    for kind in RequestOutputKind:
        sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_kind=kind)
        engine.add_request(engine.make_request(PROMPTS[1], sp, request_id=kind.name))
    while engine.has_unfinished():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    cum, final = seen["CUMULATIVE"], seen["FINAL_ONLY"]
    assert [len(o.outputs[0].token_ids) for o in cum] == [1, 2, 3, 4, 5, 6]
    assert [o.finished for o in cum] == [False] * 5 + [True]
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs[0].token_ids == cum[-1].outputs[0].token_ids
    assert final[0].outputs[0].finish_reason == "length"
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate(PROMPTS[1], sp, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == cum[-1].outputs[0].token_ids
    assert sp.output_kind == RequestOutputKind.CUMULATIVE
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=1)


def test_max_model_len_caps_output(tiny):
    llm = LLM(tiny, max_model_len=32)
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=100), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 32 - 23 and out.outputs[0].finish_reason == "length"


def _sample(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_seeded_sampling_is_reproducible_across_batches(tiny):
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=s, max_tokens=16) for s in (7, 8, 7)]
    llm = LLM(tiny)
    batch = _sample(llm, PROMPTS[:1] * 3, params)
    assert batch[0] == batch[2] and batch[0] != batch[1]
    alone = _sample(llm, PROMPTS[:1], params[0])[0]
    assert alone == batch[0]
    # Chunked prefill and preemption do not change a seeded request's samples.
    chunked = LLM(tiny, max_num_batched_tokens=4, num_kv_blocks=8, max_model_len=96)
    mixed = _sample(chunked, [PROMPTS[0], PROMPTS[2], PROMPTS[0], PROMPTS[1]],
                    [params[0], SamplingParams(temperature=0, max_tokens=40), params[2],
                     SamplingParams(temperature=0, max_tokens=40)])
    assert chunked.kv_cache_stats()["num_preemptions"] > 0
    assert mixed[0] == mixed[2] == batch[0]


def test_logprobs(tiny):
    llm = LLM(tiny)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, logprobs=3), use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 6
    for tok, lp in zip(c.token_ids, c.logprobs):
        assert lp[tok].rank == 1                   # greedy picks the best token
        assert len(lp) == 3 and max(v.logprob for v in lp.values()) == lp[tok].logprob
    assert c.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)))


def test_dummy_weights_from_yaml_are_seeded():
    a = LLM("zoo/smollm2-tiny.yaml", max_model_len=128)
    b = LLM("zoo/smollm2-tiny.yaml", max_model_len=128)
    for pa, pb in zip(a.engine.model.parameters(), b.engine.model.parameters()):
        assert torch.equal(pa, pb)
    params = SamplingParams(temperature=0, max_tokens=8)
    assert _sample(a, PROMPTS[:2], params) == _sample(b, PROMPTS[:2], params)


def test_stop_string_with_real_tokenizer():
    llm = LLM("zoo/smollm2-135m.yaml", max_model_len=256)
    prompt = "The capital of France is"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    word = free.text.split()[1]
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop=[word]),
                       use_tqdm=False)[0].outputs[0]
    assert free.text.startswith(cut.text) and word not in cut.text
    assert (cut.finish_reason, cut.stop_reason) == ("stop", word)
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop=[word],
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == cut.text + word
    stats = llm.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
