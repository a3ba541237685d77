"""Mamba2Mixer against HF's BambaMixer / GraniteMoeHybridMambaLayer / Mamba2Mixer
(`torch_forward`, no cache, whole sequence), under every way of splitting the sequence into
prefill chunks and decode steps, with states kept in (out-of-order) slots."""
from __future__ import annotations

import random

import pytest
import torch

from attention.state import StateMetadata
from models.mamba2 import Mamba2Mixer, Mamba2Plan, hf_mixer_kwargs

torch.set_num_threads(1)

HIDDEN = 64
# (heads, head_dim, expand, n_groups, use_bias, time_step_limit)
CONFIGS = {
    "g1": (4, 32, 2, 1, False, (0.0, float("inf"))),
    "g2": (4, 16, 1, 2, True, (0.05, 0.9)),   # finite dt clamp active on most tokens
}


def _bamba_config(name: str, family: str = "bamba"):
    heads, head_dim, expand, groups, bias, limit = CONFIGS[name]
    common = dict(hidden_size=HIDDEN, num_hidden_layers=1, vocab_size=32, num_attention_heads=4,
                  num_key_value_heads=2)
    mamba = dict(mamba_n_heads=heads, mamba_d_head=head_dim, mamba_expand=expand,
                 mamba_n_groups=groups, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=8,
                 mamba_conv_bias=True, mamba_proj_bias=bias, time_step_limit=limit)
    if family == "bamba":
        from transformers import BambaConfig
        return BambaConfig(**common, **mamba, intermediate_size=128)
    if family == "granitemoehybrid":
        from transformers import GraniteMoeHybridConfig
        return GraniteMoeHybridConfig(**common, **mamba)
    from transformers import Mamba2Config
    return Mamba2Config(hidden_size=HIDDEN, num_hidden_layers=1, vocab_size=32, num_heads=heads,
                        head_dim=head_dim, expand=expand, n_groups=groups, state_size=16,
                        conv_kernel=4, chunk_size=8, use_conv_bias=True, use_bias=bias,
                        time_step_limit=limit)


def _hf_mixer(config, family: str = "bamba", seed: int = 0):
    torch.manual_seed(seed)
    if family == "bamba":
        from transformers.models.bamba.modeling_bamba import BambaMixer as cls
    elif family == "granitemoehybrid":
        from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
            GraniteMoeHybridMambaLayer as cls)
    else:
        from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as cls
    m = cls(config, layer_idx=0)
    with torch.no_grad():   # perturb the deterministic inits so every parameter matters
        m.A_log.copy_(torch.randn_like(m.A_log) * 0.5)
        m.D.copy_(torch.randn_like(m.D))
        m.dt_bias.copy_(torch.randn_like(m.dt_bias) * 0.5)
        m.norm.weight.copy_(1 + 0.3 * torch.randn_like(m.norm.weight))
        for p in (m.in_proj.bias, m.out_proj.bias):
            if p is not None:
                p.copy_(torch.randn_like(p) * 0.1)
    return m.eval()


def _ours(hf, config) -> Mamba2Mixer:
    ours = Mamba2Mixer(**hf_mixer_kwargs(config))
    sd = hf.state_dict()
    assert set(sd) == set(ours.state_dict()), (set(sd) ^ set(ours.state_dict()))
    ours.load_state_dict(sd, strict=True)
    return ours.eval()


@torch.no_grad()
def _hf_out(hf, seq: torch.Tensor) -> torch.Tensor:
    return hf(seq[None])[0]


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-5):
    err = (a - b).abs().max().item()
    scale = max(b.abs().max().item(), 1.0)
    assert err <= tol * scale, f"max err {err:.3e} vs scale {scale:.3e}"


class Runner:
    """Drives Mamba2Mixer through a schedule like the engine does."""

    def __init__(self, mixer: Mamba2Mixer, num_slots: int, dtype=torch.float32):
        shapes = mixer.state_shapes()
        g = torch.Generator().manual_seed(123)
        # Garbage everywhere: a request's first chunk must not read its slot.
        self.conv = torch.randn(num_slots, *shapes["conv"], generator=g).to(dtype)
        self.ssm = torch.randn(num_slots, *shapes["ssm"], generator=g).to(dtype)
        self.mixer = mixer
        self.pos: dict[int, int] = {}
        self.outs: dict[int, list[torch.Tensor]] = {}
        self.paths: list[bool] = []

    @torch.no_grad()
    def step(self, seqs: dict[int, torch.Tensor], sched: list[tuple[int, int]], slots: dict[int, int]):
        """sched: [(request id, num tokens)] in batch order."""
        rows, lens, sl, init = [], [], [], []
        for rid, n in sched:
            p = self.pos.get(rid, 0)
            assert p + n <= len(seqs[rid]), "schedule runs past the sequence"
            rows.append(seqs[rid][p:p + n])
            lens.append(n)
            sl.append(slots[rid])
            init.append(p > 0)
        meta = StateMetadata.build(lens, sl, init)
        self.paths.append(meta.all_decode)
        out = self.mixer(torch.cat(rows), self.conv, self.ssm, meta)
        assert out.shape == (sum(lens), HIDDEN)
        for i, (rid, n) in enumerate(sched):
            self.outs.setdefault(rid, []).append(out[meta.query_start_loc[i]:meta.query_start_loc[i + 1]])
            self.pos[rid] = self.pos.get(rid, 0) + n

    def output(self, rid: int) -> torch.Tensor:
        return torch.cat(self.outs[rid])


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request):
    config = _bamba_config(request.param)
    hf = _hf_mixer(config)
    return hf, _ours(hf, config)


def _seq(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


def test_param_names_and_state_shapes(pair):
    hf, ours = pair
    assert {k: tuple(v.shape) for k, v in hf.state_dict().items()} == \
        {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    conv_dim = ours.intermediate_size + 2 * ours.n_groups * ours.state_size
    assert ours.state_shapes() == {"conv": (conv_dim, 3), "ssm": (ours.num_heads, ours.head_dim, 16)}


def test_whole_sequence(pair):
    hf, ours = pair
    seq = _seq(37, 1)
    r = Runner(ours, num_slots=4)
    r.step({0: seq}, [(0, 37)], {0: 3})
    _close(r.output(0), _hf_out(hf, seq))


def test_chunked_across_steps(pair):
    hf, ours = pair
    seq = _seq(37, 1)
    whole = Runner(ours, num_slots=4)
    whole.step({0: seq}, [(0, 37)], {0: 3})
    r = Runner(ours, num_slots=4)
    for n in (5, 13, 1, 1, 17):
        r.step({0: seq}, [(0, n)], {0: 3})
    assert r.paths == [False, False, True, True, False]
    _close(r.output(0), _hf_out(hf, seq))
    # The final states do not depend on the split either.
    _close(r.ssm[3], whole.ssm[3], 1e-5)
    assert torch.equal(r.conv[3], whole.conv[3])
    assert torch.equal(r.conv[3], seq_conv_tail(ours, seq))


def seq_conv_tail(ours: Mamba2Mixer, seq: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        xbc = ours.in_proj(seq)[:, ours.intermediate_size:ours.intermediate_size + ours.conv_dim]
    return xbc[-(ours.conv_kernel - 1):].T


def test_varlen_batch_slots_out_of_order_then_mixed_then_decode(pair):
    hf, ours = pair
    seqs = {0: _seq(18, 10), 1: _seq(36, 11), 2: _seq(9, 12), 3: _seq(8, 13), 4: _seq(4, 14)}
    slots = {0: 2, 1: 0, 2: 5, 3: 4, 4: 1}
    r = Runner(ours, num_slots=6)
    conv0, ssm0 = r.conv.clone(), r.ssm.clone()
    r.step(seqs, [(0, 11), (1, 23), (2, 3)], slots)                 # varlen prefill
    for s in (1, 3, 4):                                              # untouched slots
        assert torch.equal(r.conv[s], conv0[s]) and torch.equal(r.ssm[s], ssm0[s])
    r.step(seqs, [(0, 1), (1, 7), (2, 1), (3, 2)], slots)           # mixed; new req, 2-token first chunk
    assert torch.equal(r.conv[1], conv0[1]) and torch.equal(r.ssm[1], ssm0[1])
    # all-decode steps; request 4 joins with a 1-token first chunk inside an all-decode step
    r.step(seqs, [(2, 1), (0, 1), (3, 1), (1, 1), (4, 1)], slots)
    r.step(seqs, [(4, 1), (1, 1), (2, 1), (3, 1), (0, 1)], slots)
    r.step(seqs, [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)], slots)
    r.step(seqs, [(4, 1), (0, 2), (3, 3), (1, 1)], slots)          # mixed again (2 decodes)
    assert r.paths == [False, False, True, True, True, False]
    for rid, seq in seqs.items():
        n = r.pos[rid]
        _close(r.output(rid), _hf_out(hf, seq[:n]))


def test_short_first_chunks(pair):
    """First chunks shorter than conv_kernel - 1 (1 and 2 tokens), then short follow-ups."""
    hf, ours = pair
    seqs = {0: _seq(12, 20), 1: _seq(12, 21)}
    slots = {0: 0, 1: 1}
    r = Runner(ours, num_slots=2)
    r.step(seqs, [(0, 1), (1, 2)], slots)
    r.step(seqs, [(0, 2), (1, 1)], slots)
    r.step(seqs, [(1, 2), (0, 1)], slots)
    r.step(seqs, [(0, 8), (1, 7)], slots)
    for rid, seq in seqs.items():
        _close(r.output(rid), _hf_out(hf, seq))


def test_random_schedules(pair):
    hf, ours = pair
    rng = random.Random(0)
    lens = [rng.randint(1, 30) for _ in range(5)]
    seqs = {i: _seq(n, 30 + i) for i, n in enumerate(lens)}
    slots = {i: s for i, s in enumerate(rng.sample(range(8), 5))}
    r = Runner(ours, num_slots=8)
    while any(r.pos.get(i, 0) < n for i, n in enumerate(lens)):
        live = [i for i, n in enumerate(lens) if r.pos.get(i, 0) < n]
        rng.shuffle(live)
        sched = [(i, min(rng.choice([1, 1, 2, 3, 9, 17]), lens[i] - r.pos.get(i, 0)))
                 for i in live[:rng.randint(1, len(live))]]
        r.step(seqs, sched, slots)
    for rid, seq in seqs.items():
        _close(r.output(rid), _hf_out(hf, seq))


def test_plan_reuse_matches_inline(pair):
    _, ours = pair
    seqs = {0: _seq(10, 40), 1: _seq(1, 41)}
    meta = StateMetadata.build([10, 1], [1, 0], [False, False])
    x = torch.cat([seqs[0], seqs[1]])
    shapes = ours.state_shapes()
    st = [(torch.zeros(2, *shapes["conv"]), torch.zeros(2, *shapes["ssm"])) for _ in range(2)]
    with torch.no_grad():
        a = ours(x, *st[0], meta)
        b = ours(x, *st[1], meta, plan=Mamba2Plan.build(meta, ours.chunk_size, ours.conv_kernel))
    assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["granitemoehybrid", "mamba2"])
def test_other_hf_mixers(family):
    config = _bamba_config("g2", family)
    hf = _hf_mixer(config, family)
    ours = _ours(hf, config)
    seq = _seq(29, 50)
    r = Runner(ours, num_slots=3)
    for n in (2, 11, 1, 15):
        r.step({0: seq}, [(0, n)], {0: 2})
    _close(r.output(0), _hf_out(hf, seq))


def test_bf16_runs_close(pair):
    hf, ours = pair
    seq = _seq(21, 60)
    b16 = _ours(hf, _bamba_config("g1" if ours.n_groups == 1 else "g2")).to(torch.bfloat16)
    r = Runner(b16, num_slots=2, dtype=torch.float32)
    for n in (9, 1, 11):
        r.step({0: seq.bfloat16()}, [(0, n)], {0: 1})
    out = r.output(0)
    assert out.dtype == torch.bfloat16
    ref = _hf_out(hf, seq)
    assert (out.float() - ref).abs().max().item() <= 0.05 * max(ref.abs().max().item(), 1.0)
