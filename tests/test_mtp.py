"""MTP speculation (models/mtp.py, runtime/spec_decode/mtp_proposer.py) on a tiny random
Qwen3-Next checkpoint saved by HF with hand-added `mtp.*` tensors (HF implements no MTP):
the checkpoint loads with MTP off, greedy output with MTP speculation equals HF's without,
no block leaks, and the MTP layer's output equals a plain re-implementation of the published
formula built from HF's own modules."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from runtime import LLM, SamplingParams
from tests.conftest import TINY_VOCAB, hf_greedy
from tests.test_parity import NEW, _prompts
from tests.test_spec_decode import GREEDY, _all_free, _run

K = 3
MTP = {"method": "mtp", "num_speculative_tokens": K, "adaptive": False}
# Per family: the full-attention layer the MTP layer copies, the MTP layer's checkpoint prefix,
# the names of its input norms, projection and output norm, and the norms' base weight
# (Qwen3-Next's norms are (1 + w)).
STYLES = {
    "qwen3_next": dict(src="model.layers.3.", layer="mtp.layers.0.", norm_e="mtp.pre_fc_norm_embedding",
                       norm_h="mtp.pre_fc_norm_hidden", fc="mtp.fc", norm="mtp.norm", base=0.0),
    "deepseek_v3": dict(src="model.layers.2.", layer="model.layers.3.", norm_e="model.layers.3.enorm",
                        norm_h="model.layers.3.hnorm", fc="model.layers.3.eh_proj",
                        norm="model.layers.3.shared_head.norm", base=1.0),
}


def _hf_model(tiny_hf, family: str):
    if family == "qwen3_next":
        return tiny_hf("qwen3_next")
    from tests.test_deepseek_v3 import _config, _model, _seed_moe
    model = _seed_moe(_model(_config(num_hidden_layers=3, first_k_dense_replace=1, num_nextn_predict_layers=1)))
    return None, model


@pytest.fixture(scope="module", params=list(STYLES))
def mtp_ckpt(request, tiny_hf, tmp_path_factory):
    """The family, its checkpoint with MTP tensors and without, the HF model, prompts, greedy
    output without MTP, the MTP tensors, the MTP decoder layer as an HF module. The layer is a perturbed copy of the
    model's last full-attention layer, written in the checkpoint's own format (HF's save of a
    model with that layer in place); DeepSeek's MTP layer also carries copies of the embedding
    and head (shared_head.head), which the target's are used for."""
    from safetensors.torch import load_file, save_file
    family, st = request.param, STYLES[request.param]
    _, model = _hf_model(tiny_hf, family)
    prompts = [_prompts(TINY_VOCAB)[i] for i in (1, 3, 5)]     # 7, 17, 40 tokens
    g = torch.Generator().manual_seed(5)
    idx = int(st["src"].split(".")[2])
    layer = copy.deepcopy(model.model.layers[idx])
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=g))
    carrier = copy.deepcopy(model)
    carrier.model.layers[idx] = layer
    tmp = tmp_path_factory.mktemp("carrier")
    carrier.save_pretrained(tmp)
    mtp = {st["layer"] + k[len(st["src"]):]: v for k, v in load_file(next(tmp.glob("*.safetensors"))).items()
           if k.startswith(st["src"])}
    h = model.config.hidden_size
    mtp[st["fc"] + ".weight"] = torch.randn(h, 2 * h, generator=g) * 0.15
    for name in ("norm_e", "norm_h", "norm"):
        mtp[st[name] + ".weight"] = st["base"] + torch.randn(h, generator=g) * 0.1
    if family == "deepseek_v3":
        mtp["model.layers.3.embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
        mtp["model.layers.3.shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    plain = tmp_path_factory.mktemp(f"{family}_plain")
    model.save_pretrained(plain)
    out = tmp_path_factory.mktemp(f"{family}_mtp")
    model.save_pretrained(out)
    f = next(out.glob("*.safetensors"))
    save_file({**load_file(f), **mtp}, f, metadata={"format": "pt"})
    ref = _run(LLM(plain), prompts)        # the target without MTP tensors (its HF parity: test_parity)
    assert len({tuple(r) for r in ref}) == len(ref)
    return SimpleNamespace(family=family, path=out, plain=plain, model=model, prompts=prompts, ref=ref,
                           mtp=mtp, layer=layer, style=st)


def test_checkpoint_with_mtp_loads_with_mtp_off(mtp_ckpt):
    """The MTP tensors are declared (spec.mtp) and skipped by the target's loader: the
    output equals the same weights saved without them, and HF's."""
    c = mtp_ckpt
    llm = LLM(c.path)
    assert llm.engine.spec.mtp == {"style": c.family, "num_layers": 1}
    assert LLM(c.plain).engine.spec.mtp is None
    assert _run(llm, c.prompts) == c.ref
    assert hf_greedy(c.model, c.prompts[:1], NEW) == c.ref[:1]


@pytest.mark.parametrize("kwargs", [dict(), dict(max_num_batched_tokens=5, enable_prefix_caching=True)],
                         ids=["default", "chunked-prefix"])
def test_mtp_greedy_equals_no_speculation(mtp_ckpt, kwargs):
    c = mtp_ckpt
    llm = LLM(c.path, speculative=MTP, **kwargs)
    assert _run(llm, c.prompts) == c.ref
    if kwargs:
        assert _run(llm, c.prompts) == c.ref      # the second wave hits the prefix cache
        assert llm.kv_cache_stats()["prefix_cache_hits"] > 0
    s = llm.kv_cache_stats()
    assert s["spec_decode_num_drafts"] > len(c.prompts) and s["spec_decode_num_draft_tokens"] > 2 * len(c.prompts)
    draft = llm.engine.runner.draft
    groups = llm.engine.kv_manager.config.groups
    # its KV in the pool: a group of its own (Qwen3-Next: the target's attention groups are
    # sized for 1 of 4 layers), or in the target's MLA group (DeepSeek: the same spec)
    assert [g for g in groups if max(g.layer_ids) >= draft.offset]
    assert (c.family == "qwen3_next") == any(min(g.layer_ids) >= draft.offset for g in groups)
    _all_free(llm)


def test_mtp_forward_matches_the_formula(mtp_ckpt):
    """After the prefill, the MTP layer's output at the prompt's last position (its hidden
    state + the sampled token) equals norm(layer(fc(cat(norm_e(embed(t[i+1])), norm_h(h[i])))))
    written out in torch (RMSNorm by hand, the decoder layer HF's module with the MTP weights),
    and the k drafts proposed are that formula chained on its own output and drafts."""
    c = mtp_ckpt
    st, model = c.style, c.model
    prompt = c.prompts[2]
    llm = LLM(c.path, speculative=MTP)
    eng = llm.engine
    req = eng.make_request({"prompt_token_ids": prompt}, GREEDY, request_id="r")
    eng.add_request(req)
    while not req.output_token_ids:         # the prefill (a hybrid's is chunked at its state checkpoint)
        eng.step()
    num, draft1, ours, q = eng.runner.draft.first["r"]
    assert q is None                         # greedy: a point-mass proposal
    seq = torch.tensor([prompt + c.ref[2][:1]])
    assert num == seq.shape[1]
    eps = model.config.rms_norm_eps

    def norm(name, x):
        w = c.mtp[st[name] + ".weight"] + (1.0 if c.family == "qwen3_next" else 0.0)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    def mtp(tokens, hidden):                  # h'[i] from token i+1 and h[i], every position
        x = torch.cat([norm("norm_e", model.model.embed_tokens(tokens)), norm("norm_h", hidden)], -1)
        x = (x @ c.mtp[st["fc"] + ".weight"].T)[None]
        pos = torch.arange(x.shape[1])[None]
        y = c.layer(x, position_embeddings=model.model.rotary_emb(x, pos), attention_mask=None, position_ids=pos)
        return norm("norm", y[0] if isinstance(y, tuple) else y)[0]
    with torch.no_grad():
        hidden = model.model(input_ids=seq).last_hidden_state[0, :-1]        # h[i], final norm applied
        tokens = seq[0, 1:]
        want = []
        for j in range(K):                   # drafts 2..k: h' and the draft as the next position's input
            out = mtp(tokens, hidden)
            if j == 0:
                torch.testing.assert_close(ours, out[-1], atol=1e-4, rtol=1e-4)
            want.append(int(model.lm_head(out[-1]).argmax()))
            hidden, tokens = torch.cat([hidden, out[-1:]]), torch.cat([tokens, torch.tensor(want[-1:])])
    assert draft1 == want[0]
    assert req.spec_token_ids == want        # the k drafts proposed after the step
    eng.abort(["r"])


def test_mtp_errors_in_one_line(tiny_hf):
    path, _ = tiny_hf("llama")
    with pytest.raises(ValueError, match=r"^speculative.method: 'mtp' needs multi-token-prediction layers"):
        LLM(path, speculative=MTP)


@pytest.mark.parametrize("mtp_ckpt", ["deepseek_v3", pytest.param("qwen3_next", marks=pytest.mark.slow)],
                         indirect=True)
def test_seeded_sampling_with_mtp_follows_the_target(mtp_ckpt):
    """Sampled requests draw MTP drafts from the head's distribution q and the rejection
    sampler verifies with q: over 2400 seeded requests at temperature 1, token 2 (draft 1)
    follows the target's p(t2 | t1) jointly with t1 (test_spec_draft.pairs_chi_square),
    drafts are rejected (and accepted, unfiltered), and the proposals carried q (not a point
    mass)."""
    from tests.test_spec_draft import pairs_chi_square
    c = mtp_ckpt
    llm = LLM(c.path, speculative={**MTP, "num_speculative_tokens": 2}, max_num_seqs=256)
    seen_q = []
    orig = llm.engine.runner.draft.proposal

    def proposal(*a):
        got = orig(*a)
        seen_q.append(got is not None and bool(((got > 0) & (got < 1)).any()))
        return got
    llm.engine.runner.draft.proposal = proposal
    n = 2400
    chi = pairs_chi_square(llm, c.model, c.prompts[0], n)
    s = llm.kv_cache_stats()
    assert s["spec_decode_num_drafts"] >= n and s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"]
    assert any(seen_q)
    assert chi < 37.7    # 15 dof, p = 0.001
    # Under top_k = 4, q is the random head's top 4, which rarely meets the target's top 4, so
    # few drafts or none are accepted. Unfiltered, q and p overlap and some drafts are.
    params = [SamplingParams(temperature=1.0, max_tokens=3, seed=s) for s in range(300)]
    llm.generate([{"prompt_token_ids": c.prompts[0]}] * 300, params, use_tqdm=False)
    after = llm.kv_cache_stats()
    accepted = after["spec_decode_num_accepted_tokens"] - s["spec_decode_num_accepted_tokens"]
    assert 0 < accepted < after["spec_decode_num_draft_tokens"] - s["spec_decode_num_draft_tokens"]
    _all_free(llm)
