"""Draft-model speculation with the KV cache machinery around it: KV tiers below the pool
(cache/tiers, runtime/kv_tiers.py) carrying the draft's groups, and the checks that refuse a
draft whose tokenizer, vocabulary or context length does not match the target's."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from runtime import LLM
from tests.test_kv_tiers import TIGHT, assert_tiers_exercised, chat
from tests.test_spec_draft import _draft, _draft_groups, _partly_accepted, near  # noqa: F401 (fixture)
from tests.zoo_parity import assert_all_free

torch.set_num_threads(1)


def test_host_tier_with_a_draft_gives_the_same_greedy_output(tiny_hf, near):  # noqa: F811
    """A tight pool (evictions, preemptions by swap and recompute) with a host tier under it,
    and a near draft whose layers share the target's groups: the multi-turn chat's greedy
    answers equal those without speculation or tiers, the tier is hit (the draft's KV comes
    back with the target's), drafts are accepted and rejected, and no block or swap
    reservation is left."""
    path, _ = tiny_hf("llama")
    want = chat(LLM(path, **TIGHT, num_kv_blocks=400))
    probe = LLM(path, **TIGHT, num_kv_blocks=4096, speculative=_draft(near("llama")))
    groups = probe.engine.kv_manager.config.groups
    blocks = sum(g.spec.max_live_blocks(TIGHT["max_model_len"], TIGHT["max_num_batched_tokens"])
                 for g in groups) + 1 + 2
    on = LLM(path, **TIGHT, num_kv_blocks=blocks, kv_host_tier_bytes=1 << 24, preemption_mode="auto",
             swap_min_tokens=24, speculative=_draft(near("llama")))
    assert _draft_groups(on)
    assert chat(on) == want
    assert_tiers_exercised(on, preempted=False)
    _partly_accepted(on)


def test_tier_fingerprint_covers_the_draft(tiny_hf, near):  # noqa: F811
    """The same target and KV layout with drafts of one architecture but other weights (the
    target itself, its perturbed copy) or none: three fingerprints, so a shared disk or
    remote tier never hands one engine's draft KV to another."""
    path, _ = tiny_hf("llama")
    tier = dict(enable_prefix_caching=True, kv_host_tier_bytes=1 << 20, num_kv_blocks=64)
    fps = {LLM(path, **tier, speculative=d).engine.tiers.fingerprint
           for d in (_draft(path), _draft(near("llama")), {"method": None})}
    assert len(fps) == 3


def _with_tokenizer(src, dst, swap: bool = False):
    """A copy of checkpoint `src` at `dst` with a word-level tokenizer over its vocabulary
    (tokens t0..t{V-1}); `swap` exchanges the ids of t3 and t4 (same size, another map)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    shutil.copytree(src, dst)
    vocab_size = json.loads((dst / "config.json").read_text())["vocab_size"]
    vocab = {f"t{i}": i for i in range(vocab_size)}
    if swap:
        vocab["t3"], vocab["t4"] = 4, 3
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                  unk_token="t0")
    tok.save_pretrained(dst)
    return dst


def test_draft_with_another_tokenizer_or_shorter_context_is_refused(tiny_hf, tmp_path):
    """Both models ship a tokenizer: the same map is accepted, one of the same size with two
    ids exchanged is refused in one line; a draft whose max_model_len is below the target's
    is refused in one line naming the field."""
    path, _ = tiny_hf("llama")
    target = _with_tokenizer(path, tmp_path / "target")
    same = _with_tokenizer(path, tmp_path / "same")
    other = _with_tokenizer(path, tmp_path / "other", swap=True)
    assert LLM(target, speculative=_draft(same)).engine.runner.draft is not None
    with pytest.raises(ValueError, match=r"^speculative.model: the draft's tokenizer differs from the target's") as e:
        LLM(target, speculative=_draft(other))
    assert "\n" not in str(e.value)
    short = tmp_path / "short"
    shutil.copytree(path, short)
    cfg = json.loads((short / "config.json").read_text())
    target_len = cfg["max_position_embeddings"]
    cfg["max_position_embeddings"] = target_len // 2
    (short / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"^speculative.model: the draft's max_model_len {target_len // 2} is "
                                         rf"below the target's {target_len}; lower max_model_len") as e:
        LLM(path, speculative=_draft(short))
    assert "\n" not in str(e.value)


def test_blocks_published_after_accepted_drafts_hold_the_drafts_kv(tiny_hf):
    """The target as its own draft (k = 4, every draft accepted), so the draft's KV must equal
    the target's at every slot. A request of 26 tokens ends on a step that accepted all 4
    drafts (1 from the prefill + 5 x 5): the draft never ran on draft 4 and the request never
    proposes again, yet its published blocks hold the draft's KV of every token. Follow-up
    requests (prompt = the first's prompt + answer, twice) reuse those blocks and accept
    every draft, verifying as many as on an engine without prefix caching."""
    from runtime import SamplingParams
    from tests.conftest import TINY_VOCAB
    from tests.test_parity import _prompts
    from tests.test_spec_decode import _run
    path, _ = tiny_hf("llama")
    prompt = _prompts(TINY_VOCAB)[3]
    llm = LLM(path, speculative=_draft(path), enable_prefix_caching=True)
    first = _run(llm, [prompt], SamplingParams(temperature=0, max_tokens=26, min_tokens=26))[0]
    s = llm.kv_cache_stats()
    assert s["spec_decode_num_drafts"] == 5 and s["spec_decode_num_accepted_tokens"] == 20
    caches, offset = llm.engine.runner.kv_caches, llm.engine.runner.draft.offset
    published = torch.tensor(sorted({b.block_id for b in llm.engine.kv_manager.pool.cached.values()}))
    assert len(published) == (len(prompt) + 26 - 1) // 16      # every full block of computed tokens
    for cid in range(offset):     # the last, partial block is never published: the draft may lag there
        torch.testing.assert_close(caches[offset + cid][published], caches[cid][published], atol=1e-4, rtol=1e-4)
    follow = prompt + first
    fresh = LLM(path, speculative=_draft(path), enable_prefix_caching=False)
    base = _run(fresh, [follow])[0]
    base_drafted = fresh.kv_cache_stats()["spec_decode_num_draft_tokens"]
    for wave in range(2):
        s1 = llm.kv_cache_stats()
        assert _run(llm, [follow])[0] == base
        s2 = llm.kv_cache_stats()
        assert s2["prefix_cache_hits"] > s1["prefix_cache_hits"]
        drafted = s2["spec_decode_num_draft_tokens"] - s1["spec_decode_num_draft_tokens"]
        accepted = s2["spec_decode_num_accepted_tokens"] - s1["spec_decode_num_accepted_tokens"]
        assert accepted == drafted == base_drafted, (wave, accepted, drafted, base_drafted)
    assert_all_free(llm)


@pytest.mark.slow
def test_compiled_draft_equals_eager_and_compiles_once(tmp_path):
    """compile=True with a draft (the target's own small spec, k = 4): the warm-up compiles
    two graphs, target and draft; a workload of changing batches then compiles and
    recompiles nothing, and its greedy tokens equal the eager engine's without speculation."""
    import torch._dynamo.utils as dynamo_utils
    from tests.test_compile import ENGINE, PARAMS, PROMPTS, _graphs, _recompiles
    spec = "zoo/smollm2-tiny.yaml"
    ref = [o.outputs[0].token_ids for o in LLM(spec, **ENGINE).generate(PROMPTS, PARAMS, use_tqdm=False)]
    graphs = _graphs()
    llm = LLM(spec, compile=True, compile_cache_dir=str(tmp_path), speculative=_draft(spec), **ENGINE)
    assert llm.engine.runner.draft.compiled
    assert _graphs() - graphs == 2
    assert dynamo_utils.counters["graph_break"] == {}
    graphs, recompiles = _graphs(), _recompiles()
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert _graphs() - graphs == 0 and _recompiles() - recompiles == 0
    assert out == ref
    assert llm.kv_cache_stats()["spec_decode_num_accepted_tokens"] > 0
    assert_all_free(llm)
