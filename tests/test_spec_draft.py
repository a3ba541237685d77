"""Draft-model speculation (runtime/spec_decode/draft.py): lossless with any draft of the
target's vocabulary, exact acceptance counts when the draft is the target, a hybrid draft's
state tracked across catch-up and lookahead, no leaked block in any group, and seeded
sampling that follows the target's distribution.

Drafts: the target itself (every draft accepted), `near` (the target's weights plus noise:
most drafts accepted, some rejected at every position), and another family's tiny model of
the same vocabulary (almost nothing accepted).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime import LLM, SamplingParams
from tests.conftest import TINY_VOCAB, hf_greedy
from tests.test_parity import NEW, _prompts
from tests.test_spec_decode import GREEDY, K, _all_free, _run, chi_square


PICK = (0, 2, 3, 5, 7)     # prompts of 1, 16, 17, 40 and 60 tokens (block size 16)


@pytest.fixture(scope="module")
def reference(tiny_hf):
    """family -> (checkpoint, prompts, HF greedy tokens), computed once per module."""
    done = {}

    def get(family: str):
        if family not in done:
            path, model = tiny_hf(family)
            prompts = [_prompts(TINY_VOCAB)[i] for i in PICK]
            ref = hf_greedy(model, prompts, NEW)
            assert len({tuple(r) for r in ref}) == len(ref), "reference outputs must vary"
            done[family] = (path, prompts, ref)
        return done[family]
    return get


def _draft(model, k: int = K, **extra) -> dict:
    return {"method": "draft", "model": str(model), "num_speculative_tokens": k, "adaptive": False, **extra}


@pytest.fixture(scope="module")
def near(tiny_hf, tmp_path_factory):
    """family -> a checkpoint of the family's tiny model with every weight perturbed."""
    made = {}

    def get(family: str, scale: float = 0.05):
        if family not in made:
            path, model = tiny_hf(family)
            g = torch.Generator().manual_seed(7)
            state = {k: v + scale * v.std() * torch.randn(v.shape, generator=g) if v.is_floating_point() and
                     v.numel() > 1 else v for k, v in model.state_dict().items()}
            copy = type(model)(model.config).eval()
            copy.load_state_dict(state)
            made[family] = tmp_path_factory.mktemp(f"near-{family}")
            copy.save_pretrained(made[family])
        return made[family]
    return get


def _stats(llm) -> dict:
    return llm.kv_cache_stats()


def _partly_accepted(llm) -> None:
    s = _stats(llm)
    acc = np.array(s["spec_decode_num_accepted_tokens_per_pos"])
    assert 0 < s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"], s
    assert (acc > 0).all(), acc           # accepted at every draft position, rejected too


def _draft_groups(llm) -> list[int]:
    """Groups holding a draft layer (cache id past the target's)."""
    draft = llm.engine.runner.draft
    return [gid for gid, g in enumerate(llm.engine.kv_manager.config.groups) if max(g.layer_ids) >= draft.offset]


@pytest.mark.parametrize("family", ["llama", "bamba"])
def test_draft_equals_target_accepts_every_draft(reference, family):
    """The target as its own draft: every draft accepted. Per request of NEW = 32 tokens and
    k = 4: the prefill's token, then 6 verified steps of 4 drafts + 1 (31 tokens), then one
    plain decode (no room for a draft before max_tokens). A hybrid's state survives the
    draft's lookahead steps exactly, or its drafts would stray."""
    path, prompts, ref = reference(family)
    llm = LLM(path, speculative=_draft(path))
    assert _run(llm, prompts) == ref
    s = _stats(llm)
    n = len(prompts)
    assert s["spec_decode_num_drafts"] == 6 * n
    assert s["spec_decode_num_draft_tokens"] == s["spec_decode_num_accepted_tokens"] == 24 * n
    assert s["spec_decode_acceptance_rate"] == 1.0
    assert _draft_groups(llm), "the draft's layers are in the pool's groups"
    _all_free(llm)


def test_another_model_as_draft_changes_nothing(tiny_hf, reference):
    """Qwen3's tiny model (same vocabulary, unrelated weights, its own KV groups) drafting for
    Llama: nearly every draft rejected, output identical to HF's."""
    path, prompts, ref = reference("llama")
    other, _ = tiny_hf("qwen3")
    llm = LLM(path, speculative=_draft(other))
    assert _run(llm, prompts) == ref
    s = _stats(llm)
    assert s["spec_decode_num_draft_tokens"] > 0 and s["spec_decode_acceptance_rate"] < 0.2
    groups = _draft_groups(llm)
    target_groups = set(range(len(llm.engine.kv_manager.config.groups))) - set(groups)
    assert groups and target_groups and all(min(llm.engine.kv_manager.config.groups[g].layer_ids)
                                            >= llm.engine.runner.draft.offset for g in groups)
    _all_free(llm)


REGIMES = {"chunked": dict(max_num_batched_tokens=5),
           "preempt": dict(num_kv_blocks=12, max_model_len=160, max_num_batched_tokens=16),
           "prefix": dict(enable_prefix_caching=True)}


@pytest.mark.parametrize("regime", list(REGIMES))
def test_near_draft_greedy_parity(reference, near, regime):
    """A good but imperfect draft under chunked prefill, preemption, and prefix caching with a
    second wave of n = 2 samples: output equal to HF's, drafts accepted and rejected."""
    path, prompts, ref = reference("llama")
    llm = LLM(path, speculative=_draft(near("llama")), **REGIMES[regime])
    assert _run(llm, prompts) == ref
    if regime == "preempt":
        assert _stats(llm)["num_preemptions"] > 0
    if regime == "prefix":
        params = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, n=2)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in outs] == [[r, r] for r in ref]
        assert _stats(llm)["prefix_cache_hits"] > 0
    _partly_accepted(llm)
    _all_free(llm)


@pytest.mark.parametrize("target, draft", [("llama", "bamba"), ("bamba", "near-bamba"),
                                           pytest.param("qwen3_next", "bamba", marks=pytest.mark.slow)])
def test_hybrid_draft(tiny_hf, reference, near, target, draft):
    """A Mamba2 hybrid as the draft (its state groups in the target's pool), for an attention
    target, for a Mamba2 target (draft and target state layers of one spec share groups)
    with prefix caching, and for a Gated DeltaNet + MoE target: output equal to HF's."""
    path, prompts, ref = reference(target)
    dpath = near("bamba") if draft == "near-bamba" else tiny_hf(draft)[0]
    llm = LLM(path, speculative=_draft(dpath), enable_prefix_caching=True)
    assert _run(llm, prompts) == ref
    assert _run(llm, prompts) == ref          # the second wave hits the prefix cache
    assert _stats(llm)["prefix_cache_hits"] > 0
    assert llm.engine.runner.draft.state_groups
    if draft == "near-bamba":
        _partly_accepted(llm)
    _all_free(llm)


def pairs_chi_square(llm, model, prompt: list[int], n: int = 2400, topk: int = 4) -> float:
    """Tokens 1 and 2 of n seeded requests at temperature 1, top_k `topk` (topk^2 possible
    pairs) from `llm`: the chi-square of their joint frequency against the target's
    p(t1) p(t2 | t1), computed from the HF model's logits (topk^2 - 1 dof)."""
    def dist(logits):
        v, i = logits.topk(topk)
        return i, torch.softmax(v, -1)
    with torch.no_grad():
        i1, p1 = dist(model(torch.tensor([prompt])).logits[0, -1].double())
        joint, cells = [], []
        for a, pa in zip(i1.tolist(), p1.tolist()):
            i2, p2 = dist(model(torch.tensor([prompt + [a]])).logits[0, -1].double())
            joint += (pa * p2).tolist()
            cells += [(a, b) for b in i2.tolist()]
    params = [SamplingParams(temperature=1.0, top_k=topk, max_tokens=3, seed=s) for s in range(n)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    index = {c: j for j, c in enumerate(cells)}
    observed = torch.zeros(len(cells))
    for o in outs:
        observed[index[tuple(o.outputs[0].token_ids[:2])]] += 1
    return chi_square(observed, torch.tensor(joint, dtype=torch.float32))


def test_seeded_sampling_with_a_draft_follows_the_target(tiny_hf, near):
    """Token 2 of 2400 seeded requests drafted by the near draft (from its distribution q)
    and verified by rejection sampling: tokens 1 and 2 follow the target (pairs_chi_square)."""
    path, model = tiny_hf("llama")
    llm = LLM(path, speculative=_draft(near("llama"), k=2), max_num_seqs=256)
    n = 2400
    chi = pairs_chi_square(llm, model, _prompts(TINY_VOCAB)[1], n)
    s = _stats(llm)
    assert s["spec_decode_num_drafts"] >= n and 0 < s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"]
    assert chi < 37.7    # 15 dof, p = 0.001
    _all_free(llm)


def test_draft_config_errors_in_one_line(tiny_hf, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    path, model = tiny_hf("llama")
    small = LlamaConfig(**{**model.config.to_dict(), "vocab_size": 256})
    LlamaForCausalLM(small).save_pretrained(tmp_path / "v256")
    with pytest.raises(ValueError, match=r"^speculative.model: the draft's vocab_size 256 differs"):
        LLM(path, speculative=_draft(tmp_path / "v256"))
    with pytest.raises(ValueError, match=r"^speculative.model: .*no such spec file"):
        LLM(path, speculative=_draft(tmp_path / "missing"))


def test_yaml_section_names_the_draft_relative_to_the_spec(tiny_hf, reference, tmp_path):
    """A zoo YAML's `speculative:` section with a draft path relative to the YAML file."""
    import shutil

    import yaml
    from models import resolve_spec
    from models.spec import spec_to_dict
    path, prompts, ref = reference("llama")
    shutil.copytree(tiny_hf("qwen3")[0], tmp_path / "drafts" / "qwen3")
    data = spec_to_dict(resolve_spec(path))
    data["checkpoint"]["path"] = str(path)
    data["speculative"] = {"method": "draft", "model": "drafts/qwen3", "num_speculative_tokens": 2}
    f = tmp_path / "spec.yaml"
    f.write_text(yaml.safe_dump(data))
    llm = LLM(str(f))
    assert llm.engine.runner.draft is not None
    assert _run(llm, prompts[:2]) == ref[:2]
    assert _stats(llm)["spec_decode_num_draft_tokens"] > 0


def test_rejection_with_a_proposal_distribution_follows_the_target():
    """Drafts drawn from q, verified with q (rejection.verify's `proposal`): the emitted token
    follows p, and a draft is accepted with probability sum(min(p, q))."""
    from runtime.spec_decode.rejection import verify
    vocab, r = 6, 20000
    g = torch.Generator().manual_seed(0)
    p0, p1, q0 = (torch.softmax(torch.randn(vocab, generator=g), 0) for _ in range(3))
    drafts = torch.multinomial(q0, r, replacement=True, generator=g).numpy()[:, None]
    probs = torch.stack([p0, p1]).repeat(r, 1)
    proposal = torch.stack([q0, torch.zeros(vocab)]).repeat(r, 1)
    torch.manual_seed(1)
    emitted, acc = verify(probs.argmax(-1), probs, np.zeros(r, dtype=bool), drafts, np.ones(r, dtype=np.int64),
                          {}, proposal)
    assert chi_square(torch.bincount(torch.from_numpy(emitted[:, 0]), minlength=vocab).float(), p0) < 20.5
    assert abs(acc.mean() - float(torch.minimum(p0, q0).sum())) < 0.02
    assert chi_square(torch.bincount(torch.from_numpy(emitted[acc == 1, 1]), minlength=vocab).float(), p1) < 20.5


def test_beam_search_unchanged_by_a_draft(reference, near):
    """Beams never speculate; the draft still follows their forks and frees their blocks."""
    from runtime.beam_search import BeamSearchParams
    path, prompts, _ = reference("llama")
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    prompt = {"prompt_token_ids": prompts[3]}
    plain = LLM(path).beam_search([prompt], params)[0]
    llm = LLM(path, speculative=_draft(near("llama")))
    got = llm.beam_search([prompt], params)[0]
    assert [s.tokens for s in got.sequences] == [s.tokens for s in plain.sequences]
    _all_free(llm)
