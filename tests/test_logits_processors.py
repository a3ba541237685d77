"""Penalties, logit_bias and allowed_token_ids: greedy output equals HF `generate` with the
same edit as a logits processor (HF's own RepetitionPenaltyLogitsProcessor and
SequenceBiasLogitsProcessor, and OpenAI's presence / frequency formula written out below),
and the batched edit equals a per-row reference loop."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.limits import ParamError
from runtime.worker.logits_processors import LogitsEdits
from tests.conftest import TINY_VOCAB

NEW = 20


class OpenAIPenalties:
    """OpenAI's rule over HF logits: minus frequency * count + presence * (count > 0), output only."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        out = input_ids[0, self.prompt_len:]
        counts = torch.bincount(out, minlength=scores.shape[-1]).to(scores.dtype)
        return scores - self.frequency * counts - self.presence * (counts > 0)


class Allowed:
    def __init__(self, ids):
        self.ids = ids

    def __call__(self, input_ids, scores):
        keep = torch.full_like(scores, float("-inf"))
        keep[:, self.ids] = 0
        return scores + keep


def _prompts():
    g = torch.Generator().manual_seed(9)
    return [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in (1, 8, 23, 40)]


def _hf(model, prompt, **kwargs):
    from transformers import LogitsProcessorList
    procs = kwargs.pop("procs", [])
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0,
                             logits_processor=LogitsProcessorList(procs), **kwargs)
    return ids[0, len(prompt):].tolist()


CASES = {
    "repetition": (dict(repetition_penalty=1.8), lambda p: dict(repetition_penalty=1.8)),
    "repetition_below_1": (dict(repetition_penalty=0.7), lambda p: dict(repetition_penalty=0.7)),
    "presence_frequency": (dict(presence_penalty=1.5, frequency_penalty=0.9),
                           lambda p: dict(procs=[OpenAIPenalties(len(p), 1.5, 0.9)])),
    "negative_frequency": (dict(frequency_penalty=-1.2), lambda p: dict(procs=[OpenAIPenalties(len(p), 0.0, -1.2)])),
    "logit_bias": (dict(logit_bias={7: 6.0, 100: 4.5, 300: -100.0}),
                   lambda p: dict(sequence_bias={(7,): 6.0, (100,): 4.5, (300,): -100.0})),
    "allowed": (dict(allowed_token_ids=[5, 17, 99, 250, 400, 401]), lambda p: dict(procs=[Allowed([5, 17, 99, 250, 400, 401])])),
}


@pytest.fixture(scope="module")
def llama(tiny_hf):
    return tiny_hf("llama")


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_hf_with_the_same_edit(llama, case):
    path, model = llama
    ours, theirs = CASES[case]
    prompts = _prompts()
    plain = LLM(path).generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    llm = LLM(path)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, **ours), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [_hf(model, p, **theirs(p)) for p in prompts]
    assert got != [o.outputs[0].token_ids for o in plain], "the edit must change the output"
    stats = llm.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_rows_without_edits_are_untouched(llama):
    """One batch mixing edited and plain rows: the plain rows equal a plain run."""
    path, _ = llama
    prompts = _prompts()
    base = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    edited = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, repetition_penalty=2.0,
                            logit_bias={11: 3.0})
    plain = [o.outputs[0].token_ids for o in LLM(path).generate([{"prompt_token_ids": p} for p in prompts], base,
                                                               use_tqdm=False)]
    mixed = LLM(path).generate([{"prompt_token_ids": p} for p in prompts], [edited, base, edited, base], use_tqdm=False)
    assert [mixed[i].outputs[0].token_ids for i in (1, 3)] == [plain[1], plain[3]]
    assert [mixed[i].outputs[0].token_ids for i in (0, 2)] != [plain[0], plain[2]]


class _Batch:
    """The persistent-batch fields LogitsEdits reads."""

    def __init__(self, rows):
        n, width = len(rows), max(len(r["tokens"]) for r in rows)
        self.token_ids = np.zeros((n, width + 3), dtype=np.int64)
        for i, r in enumerate(rows):
            self.token_ids[i, :len(r["tokens"])] = r["tokens"]
        self.num_tokens = np.array([len(r["tokens"]) for r in rows])
        self.num_prompt_tokens = np.array([r["prompt"] for r in rows])
        self.repetition_penalty = np.array([r.get("rep", 1.0) for r in rows], dtype=np.float32)
        self.frequency_penalty = np.array([r.get("freq", 0.0) for r in rows], dtype=np.float32)
        self.presence_penalty = np.array([r.get("pres", 0.0) for r in rows], dtype=np.float32)
        self.logit_bias = [None if "bias" not in r else (np.array(list(r["bias"])), np.array(list(r["bias"].values()),
                                                                                              dtype=np.float32))
                           for r in rows]
        self.allowed_token_ids = [None if "allowed" not in r else np.array(r["allowed"]) for r in rows]
        self.bad_words = [r.get("bad") for r in rows]


def test_batched_edits_equal_a_per_row_loop():
    vocab = 50
    g = torch.Generator().manual_seed(0)
    rows = [dict(tokens=[1, 2, 2, 9, 9, 9, 4], prompt=3, rep=1.5, freq=0.5, pres=0.25),
            dict(tokens=[3, 3, 3], prompt=3),
            dict(tokens=[7, 8, 7, 7, 1], prompt=1, freq=-0.75, bias={7: 2.0, 40: -5.0}),
            dict(tokens=[5], prompt=1, allowed=[0, 5, 49], rep=0.5),
            dict(tokens=[6, 6, 2, 2], prompt=2, pres=2.0),
            # bad words: 11 always; 13 after output ending [2, 9]; 14 after [4] (not the tail)
            dict(tokens=[1, 2, 9], prompt=1, bad=[[11], [2, 9, 13], [4, 14], [1, 2, 9, 15]])]
    logits = torch.randn(len(rows), vocab, generator=g) * 3
    want = logits.clone()
    for i, r in enumerate(rows):
        toks, out = r["tokens"], r["tokens"][r["prompt"]:]
        if "allowed" in r:
            mask = torch.full((vocab,), float("-inf"))
            mask[r["allowed"]] = 0
            want[i] += mask
        for t, b in r.get("bias", {}).items():
            want[i, t] += b
        for t in set(toks):
            x = want[i, t]
            want[i, t] = x / r.get("rep", 1.0) if x > 0 else x * r.get("rep", 1.0)
        for seq in r.get("bad", []):     # the prompt never counts: [1, 2, 9, 15] bans nothing
            if out[len(out) - len(seq) + 1:] == seq[:-1] and len(out) >= len(seq) - 1:
                want[i, seq[-1]] = float("-inf")
        for t in set(out):
            want[i, t] -= r.get("freq", 0.0) * out.count(t) + r.get("pres", 0.0)
    edits = LogitsEdits.build(_Batch(rows), np.arange(len(rows)), vocab, "cpu")
    before = logits.clone()
    got = edits.apply(logits)
    torch.testing.assert_close(got, want)
    assert torch.equal(logits, before)                  # the model's logits stay for logprobs
    assert LogitsEdits.build(_Batch([dict(tokens=[1, 2], prompt=1)]), np.arange(1), vocab, "cpu") is None


@pytest.mark.parametrize("kwargs, field", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(logit_bias={3: 101.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
])
def test_bounds(kwargs, field):
    with pytest.raises(ParamError, match=rf"SamplingParams\.{field}: "):
        SamplingParams(**kwargs)


def test_ids_must_be_in_the_vocabulary(llama):
    llm = LLM(llama[0])
    for kwargs, field in ((dict(logit_bias={TINY_VOCAB: 1.0}), "logit_bias"),
                          (dict(allowed_token_ids=[1, TINY_VOCAB + 5]), "allowed_token_ids")):
        with pytest.raises(ParamError, match=rf"SamplingParams\.{field}: token id \d+ is not in the vocabulary"):
            llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(**kwargs), use_tqdm=False)
    stats = llm.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_bad_words_are_never_completed(tmp_path):
    """With a real tokenizer: a word the model greedily emits, given as a bad word, no longer
    appears in any spelling of it (alone or after a space)."""
    from tests.serving import tiny_chat_spec
    llm = LLM(tiny_chat_spec(tmp_path))
    tok = llm.get_tokenizer()
    params = dict(temperature=0, max_tokens=16, ignore_eos=True)
    plain = llm.generate("Once upon a time", SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    word = tok.decode(plain.token_ids[:1]).strip()
    assert word
    out = llm.generate("Once upon a time", SamplingParams(bad_words=[word], **params), use_tqdm=False)[0].outputs[0]
    spellings = [tok.encode(w, add_special_tokens=False) for w in (word, " " + word)]
    singles = {s[0] for s in spellings if len(s) == 1}
    assert singles and not singles & set(out.token_ids)
    assert out.token_ids != plain.token_ids
    with pytest.raises(ParamError, match="bad_words"):
        SamplingParams(bad_words=["  "])
