"""MTP speculation (models/mtp.py, runtime/spec_decode/mtp_proposer.py) on a tiny random
Qwen3-Next checkpoint saved by HF with hand-added `mtp.*` tensors (HF implements no MTP):
the checkpoint loads with MTP off, greedy output with MTP speculation equals HF's without,
no block leaks, and the MTP layer's output equals a plain re-implementation of the published
formula built from HF's own modules."""
from __future__ import annotations

import copy

import pytest
import torch

from runtime import LLM
from tests.conftest import TINY_VOCAB, hf_greedy
from tests.test_parity import NEW, _prompts
from tests.test_spec_decode import GREEDY, _all_free, _run

K = 3
MTP = {"method": "mtp", "num_speculative_tokens": K, "adaptive": False}
SRC = "model.layers.3."          # the tiny model's full-attention layer: the MTP layer's shape


@pytest.fixture(scope="module")
def mtp_ckpt(tiny_hf, tmp_path_factory):
    """(checkpoint dir with mtp.* tensors, HF model, prompts, greedy output without MTP, mtp tensors,
    the MTP decoder layer as an HF module). The layer is a perturbed copy of the model's
    full-attention layer, written in the checkpoint's own format (HF's save of a model with
    that layer in place)."""
    from safetensors.torch import load_file, save_file
    _, model = tiny_hf("qwen3_next")
    prompts = [_prompts(TINY_VOCAB)[i] for i in (1, 3, 5)]     # 7, 17, 40 tokens
    g = torch.Generator().manual_seed(5)
    layer = copy.deepcopy(model.model.layers[3])
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=g))
    carrier = copy.deepcopy(model)
    carrier.model.layers[3] = layer
    tmp = tmp_path_factory.mktemp("carrier")
    carrier.save_pretrained(tmp)
    mtp = {"mtp.layers.0." + k[len(SRC):]: v for k, v in load_file(next(tmp.glob("*.safetensors"))).items()
           if k.startswith(SRC)}
    h = model.config.hidden_size
    mtp["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=g) * 0.15
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{name}.weight"] = torch.randn(h, generator=g) * 0.1
    out = tmp_path_factory.mktemp("qwen3_next_mtp")
    model.save_pretrained(out)
    f = next(out.glob("*.safetensors"))
    save_file({**load_file(f), **mtp}, f, metadata={"format": "pt"})
    ref = _run(LLM(out), prompts)          # MTP off: the target alone (its HF parity: test_parity)
    assert len({tuple(r) for r in ref}) == len(ref)
    return out, model, prompts, ref, mtp, layer


def test_checkpoint_with_mtp_loads_with_mtp_off(mtp_ckpt, tiny_hf):
    """The MTP tensors are declared (spec.mtp) and skipped by the target's loader: the
    output equals the same weights saved without them, and HF's."""
    path, model, prompts, ref, _, _ = mtp_ckpt
    llm = LLM(path)
    assert llm.engine.spec.mtp == {"style": "qwen3_next", "num_layers": 1}
    plain = LLM(tiny_hf("qwen3_next")[0])
    assert plain.engine.spec.mtp is None
    assert _run(plain, prompts) == ref
    assert hf_greedy(model, prompts[:1], NEW) == ref[:1]


@pytest.mark.parametrize("kwargs", [dict(), dict(max_num_batched_tokens=5, enable_prefix_caching=True)],
                         ids=["default", "chunked-prefix"])
def test_mtp_greedy_equals_no_speculation(mtp_ckpt, kwargs):
    path, _, prompts, ref, _, _ = mtp_ckpt
    llm = LLM(path, speculative=MTP, **kwargs)
    assert _run(llm, prompts) == ref
    if kwargs:
        assert _run(llm, prompts) == ref          # the second wave hits the prefix cache
        assert llm.kv_cache_stats()["prefix_cache_hits"] > 0
    s = llm.kv_cache_stats()
    assert s["spec_decode_num_drafts"] > len(prompts) and s["spec_decode_num_draft_tokens"] > 2 * len(prompts)
    draft = llm.engine.runner.draft
    groups = llm.engine.kv_manager.config.groups
    assert [g for g in groups if min(g.layer_ids) >= draft.offset], "the MTP layer's KV is a group of its own"
    _all_free(llm)


def test_mtp_forward_matches_the_formula(mtp_ckpt):
    """After the prefill step, the MTP layer's output at the prompt's last position (hidden
    state of that position + the sampled token) equals
    norm(layer(fc(cat(norm_e(embed(t[i+1])), norm_h(h[i]))))) computed with HF's modules."""
    path, model, prompts, ref, mtp, layer = mtp_ckpt
    prompt = prompts[2]
    llm = LLM(path, speculative=MTP)
    eng = llm.engine
    req = eng.make_request({"prompt_token_ids": prompt}, GREEDY, request_id="r")
    eng.add_request(req)
    while not req.output_token_ids:         # the prefill (chunked at the state checkpoint)
        eng.step()
    num, draft1, ours = eng.runner.draft.first["r"]
    seq = torch.tensor([prompt + ref[2][:1]])
    assert num == seq.shape[1]
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm
    h = model.config.hidden_size

    def norm(name):
        n = Qwen3NextRMSNorm(h, eps=model.config.rms_norm_eps)
        n.weight.data.copy_(mtp[f"mtp.{name}.weight"])
        return n
    with torch.no_grad():
        hidden = model.model(input_ids=seq).last_hidden_state[0, :-1]        # h[i], final norm applied
        emb = model.model.embed_tokens(seq[0, 1:])                              # token i+1
        x = torch.cat([norm("pre_fc_norm_embedding")(emb), norm("pre_fc_norm_hidden")(hidden)], -1)
        x = (x @ mtp["mtp.fc.weight"].T)[None]
        pos = torch.arange(x.shape[1])[None]
        y = layer(x, position_embeddings=model.model.rotary_emb(x, pos), attention_mask=None, position_ids=pos)
        y = y[0] if isinstance(y, tuple) else y
        want = norm("norm")(y)[0, -1]
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)
    assert draft1 == int(model.lm_head(want).argmax())
    eng.abort(["r"])


def test_mtp_errors_in_one_line(tiny_hf):
    path, _ = tiny_hf("llama")
    with pytest.raises(ValueError, match=r"^speculative.method: 'mtp' needs multi-token-prediction layers"):
        LLM(path, speculative=MTP)
