"""LFM2 (short_conv + full attention with q/k layernorms) against HF: the short conv layer on
its own under any chunking and batching, the importer (adjusted MLP width, LFM2's checkpoint
names, tied embeddings), and greedy parity in every zoo_parity regime."""
from __future__ import annotations

import pytest
import torch

from attention.state import StateMetadata
from models.short_conv import ShortConv
from tests import zoo_parity

HIDDEN = 32


def _config(**overrides):
    from transformers import Lfm2Config
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=192, block_multiple_of=48,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  layer_types=["conv", "conv", "full_attention", "conv"], initializer_range=0.2,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return Lfm2Config(**{**fields, **overrides})


@pytest.fixture(scope="module")
def conv_pair():
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv
    config = _config(hidden_size=HIDDEN, conv_L_cache=4, conv_bias=True)
    torch.manual_seed(0)
    hf = Lfm2ShortConv(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ours = ShortConv(HIDDEN, kernel=4, bias=True).eval()
    ours.load_state_dict(hf.state_dict())            # same names and shapes
    return hf, ours


@pytest.mark.parametrize("steps", [
    [[(0, 29)]],                                                   # one prefill
    [[(0, 2), (1, 3)], [(0, 1), (1, 1)], [(0, 9), (1, 1)], [(0, 1), (1, 7)]],   # chunks shorter than the tail
    [[(1, 5), (0, 1), (2, 4)], [(2, 1), (0, 1), (1, 1)], [(0, 11), (2, 6), (1, 1)]],  # decodes mixed with chunks
])
def test_short_conv_matches_hf_whatever_the_schedule(conv_pair, steps):
    hf, ours = conv_pair
    g = torch.Generator().manual_seed(4)
    totals: dict[int, int] = {}
    for step in steps:
        for r, n in step:
            totals[r] = totals.get(r, 0) + n
    seqs = {r: torch.randn(n, HIDDEN, generator=g) for r, n in totals.items()}
    slot_of = {0: 3, 1: 0, 2: 5}
    conv = torch.randn(6, HIDDEN, 3, generator=g)                 # garbage: no initial state reads it
    untouched = conv[[1, 2, 4]].clone()
    done = {r: 0 for r in seqs}
    outs = {r: [] for r in seqs}
    for step in steps:
        x = torch.cat([seqs[r][done[r]:done[r] + n] for r, n in step])
        meta = StateMetadata.build([n for _, n in step], [slot_of[r] for r, _ in step], [done[r] > 0 for r, _ in step])
        with torch.no_grad():
            y = ours(x, conv, meta)
        for i, (r, n) in enumerate(step):
            outs[r].append(y[meta.query_start_loc[i]:meta.query_start_loc[i + 1]])
            done[r] += n
    for r, x in seqs.items():
        with torch.no_grad():
            want = hf(x.unsqueeze(0))[0]
            B, _, xin = hf.in_proj(x).chunk(3, dim=-1)
        assert want.abs().mean() > 1e-2
        torch.testing.assert_close(torch.cat(outs[r]), want, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(conv[slot_of[r]], (B * xin)[-3:].t())   # the tail: the last 3 B * x
    assert torch.equal(conv[[1, 2, 4]], untouched)


def test_import_reads_lfm2_fields(tmp_path):
    """The real MLP width is HF's adjusted one (2/3 of 192, rounded up to 48: 144), the layer
    types map to short_conv, LFM2's names and tied embeddings come through."""
    from transformers import Lfm2ForCausalLM

    from models.import_hf import spec_from_hf_dir
    torch.manual_seed(0)
    Lfm2ForCausalLM(_config(conv_L_cache=4)).save_pretrained(tmp_path)
    spec = spec_from_hf_dir(tmp_path)
    assert spec.mlp.intermediate_size == 144
    assert spec.layer_kinds == ["short_conv", "short_conv", "full_attention", "short_conv"]
    assert spec.short_conv.kernel == 4 and not spec.short_conv.bias
    assert spec.tie_word_embeddings and spec.attention.qk_norm and spec.norm.eps == 1e-5
    assert spec.weight_name("final_norm") == "model.embedding_norm.weight"


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    from transformers import Lfm2ForCausalLM
    torch.manual_seed(0)
    model = Lfm2ForCausalLM(_config()).eval()
    return zoo_parity.reference(model, tmp_path_factory.mktemp("lfm2"))


@pytest.mark.parametrize("regime", zoo_parity.REGIMES)
def test_lfm2_parity(lfm2, regime):
    zoo_parity.check_regime(lfm2, regime)
