"""Sampler (greedy, temperature, top-k / top-p / min-p, seeds, bans, logprobs) and
SamplingParams validation."""
import math

import pytest
import torch

torch.set_num_threads(1)

from runtime.worker.sampler import Sampler, SamplingMetadata, _apply_top_k_top_p  # noqa: E402
from runtime.limits import ParamError  # noqa: E402
from runtime.sampling_params import SamplingParams  # noqa: E402

sampler = Sampler()


def meta(n, temperature=1.0, top_k=None, top_p=None, min_p=None, generators=None, banned=None,
         max_logprobs=None):
    def vec(v, dtype):
        if v is None:
            return None
        if isinstance(v, (int, float)):
            return torch.full((n,), v, dtype=dtype)
        return torch.tensor(v, dtype=dtype)

    temp = vec(temperature, torch.float32)
    return SamplingMetadata(temperature=temp, top_k=vec(top_k, torch.int64),
                            top_p=vec(top_p, torch.float32), min_p=vec(min_p, torch.float32),
                            generators=generators or {}, all_greedy=bool((temp == 0).all()),
                            banned=banned, max_logprobs=max_logprobs)


def random_logits(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * 3


def counts(tokens, vocab):
    return torch.bincount(tokens, minlength=vocab)


def chi_square(observed: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * observed.sum()
    keep = expected > 0
    assert (observed[~keep] == 0).all(), "a zero-probability token was sampled"
    return float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# ----------------------------------------------------------------- greedy
def test_greedy_is_argmax():
    logits = random_logits(16, 50, 0)
    out = sampler(logits, meta(16, temperature=0.0))
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.sampled_ranks is None


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    torch.manual_seed(0)
    logits = random_logits(8, 50, 1)
    temp = [0.0, 1.0, 0.0, 2.0, 0.0, 1.0, 0.0, 0.5]
    out = sampler(logits, meta(8, temperature=temp, top_k=[0, 5, 3, 0, 0, 0, 1, 0]))
    greedy = [i for i, t in enumerate(temp) if t == 0]
    assert torch.equal(out.token_ids[greedy], logits.argmax(-1)[greedy])


def test_greedy_accepts_half_precision_logits():
    logits = random_logits(4, 30, 2).to(torch.bfloat16)
    out = sampler(logits, meta(4, temperature=0.0))
    assert torch.equal(out.token_ids, logits.float().argmax(-1))


# ----------------------------------------------------------------- seeds
def _seeded(logits, seeds, **kw):
    n = logits.shape[0]
    gens = {i: torch.Generator().manual_seed(s) for i, s in enumerate(seeds) if s is not None}
    return sampler(logits.clone(), meta(n, generators=gens, **kw)).token_ids


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    logits = torch.zeros(64, 100)     # uniform: every seed picks its own token
    a = _seeded(logits, [7] * 64)
    torch.manual_seed(123)            # the global stream must not matter to seeded rows
    b = _seeded(logits, [7] * 64)
    assert torch.equal(a, b)
    assert len(set(a.tolist())) == 1  # same seed, same logits -> same token in every row
    per_seed = _seeded(logits, list(range(64)))
    assert len(set(per_seed.tolist())) > 20
    assert torch.equal(per_seed, _seeded(logits, list(range(64))))


def test_seeded_row_independent_of_batch_position_and_neighbours():
    logits = random_logits(1, 40, 3).expand(6, 40).contiguous() / 3   # flat-ish
    alone = _seeded(logits[:1], [99], temperature=0.8, top_p=0.9)
    for pos in range(6):
        seeds = [None] * 6
        seeds[pos] = 99
        torch.manual_seed(pos)
        got = _seeded(logits, seeds, temperature=0.8, top_p=0.9)
        assert got[pos] == alone[0]


def test_seeded_generator_advances_per_call():
    logits = torch.zeros(1, 1000)
    g = torch.Generator().manual_seed(5)
    draws = [sampler(logits, meta(1, generators={0: g})).token_ids.item() for _ in range(5)]
    g2 = torch.Generator().manual_seed(5)
    again = [sampler(logits, meta(1, generators={0: g2})).token_ids.item() for _ in range(5)]
    assert draws == again
    assert len(set(draws)) > 1


def test_unseeded_rows_follow_global_seed():
    logits = torch.zeros(32, 100)
    torch.manual_seed(11)
    a = sampler(logits, meta(32)).token_ids
    torch.manual_seed(11)
    b = sampler(logits, meta(32)).token_ids
    torch.manual_seed(12)
    c = sampler(logits, meta(32)).token_ids
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


# ----------------------------------------------------------------- filters
def test_top_k_1_equals_greedy():
    torch.manual_seed(0)
    logits = random_logits(32, 64, 4)
    out = sampler(logits, meta(32, temperature=1.5, top_k=1))
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_tiny_top_p_equals_greedy():
    torch.manual_seed(0)
    logits = random_logits(32, 64, 5)
    out = sampler(logits, meta(32, temperature=1.0, top_p=1e-6))
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_top_k_restricts_to_top_k_set():
    torch.manual_seed(0)
    n, vocab, k = 4000, 20, 3
    row = torch.linspace(1.0, 0.0, vocab)[torch.randperm(vocab)]
    logits = row.expand(n, vocab).contiguous()
    out = sampler(logits, meta(n, temperature=1.0, top_k=k)).token_ids
    allowed = set(row.topk(k).indices.tolist())
    assert set(out.tolist()) == allowed     # only those, and each of them shows up
    # Within the top-k the distribution is the renormalised softmax.
    probs = torch.zeros(vocab)
    probs[list(allowed)] = row[list(allowed)].softmax(-1)
    assert chi_square(counts(out, vocab).float(), probs) < 16.27   # 2 dof, p = 0.0003


def test_top_k_per_row_and_disabled_rows():
    torch.manual_seed(0)
    n, vocab = 3000, 10
    logits = torch.arange(vocab, dtype=torch.float32).flip(0).expand(n, vocab).contiguous() / 4
    ks = torch.tensor([2, 0, 5]).repeat(n // 3)
    out = sampler(logits, meta(n, temperature=1.0, top_k=ks.tolist())).token_ids
    assert set(out[ks == 2].tolist()) == {0, 1}
    assert set(out[ks == 5].tolist()) == {0, 1, 2, 3, 4}
    assert max(out[ks == 0].tolist()) > 4     # 0 = off: the tail is reachable


def test_top_p_keeps_smallest_nucleus_and_renormalises():
    torch.manual_seed(0)
    n = 8000
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().expand(n, 4).contiguous()
    out = sampler(logits, meta(n, temperature=1.0, top_p=0.6)).token_ids
    # Sorted: 0.5, 0.3 | 0.15, 0.05. Mass ahead of 0.3 is 0.5 <= 0.6 -> kept; ahead of 0.15
    # is 0.8 > 0.6 -> dropped.
    assert set(out.tolist()) == {1, 3}
    expected = torch.tensor([0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8])
    assert chi_square(counts(out, 4).float(), expected) < 13.8   # 1 dof, p = 0.0002


def test_top_k_top_p_fast_paths_match_full_sort():
    """top-k alone (threshold), top-k + top-p on every row (sort of the top-k only) and the
    full-vocabulary sort (forced by one row without top-k) mask exactly the same logits."""
    n, vocab = 24, 50
    logits = random_logits(n, vocab, 9) / 6               # flat: nuclei reach the k-th token
    logits[3, :10] = float("-inf")                      # banned tokens ride along
    g = torch.Generator().manual_seed(1)
    ks = torch.randint(1, vocab + 10, (n,), generator=g)  # some k >= vocab
    ps = torch.rand(n, generator=g).clamp(min=0.05)
    ps[::3] = 1.0                                       # top-p on, but keeping all of top-k
    off = torch.tensor([0])
    one = torch.ones(1)
    extra = random_logits(1, vocab, 10)

    def full_sort(k, p):  # append a row without top-k: takes the full-sort path
        return _apply_top_k_top_p(torch.cat([logits, extra]), torch.cat([k, off]),
                                  None if p is None else torch.cat([p, one]))[:n]

    both = _apply_top_k_top_p(logits, ks, ps)
    assert torch.equal(both, full_sort(ks, ps))
    only_k = _apply_top_k_top_p(logits, ks, None)
    assert torch.equal(only_k, full_sort(ks, torch.ones(n)))
    # And what is kept is right: unmasked logits unchanged, k-th cut and nucleus cut.
    for i in range(n):
        kept = torch.isfinite(only_k[i])
        finite = torch.isfinite(logits[i])
        assert kept.sum() == min(int(ks[i]), int(finite.sum()))
        assert torch.equal(only_k[i][kept], logits[i][kept])
        if kept.sum() < finite.sum():
            assert logits[i][kept].min() > logits[i][finite & ~kept].max()
        nucleus = torch.isfinite(both[i])
        assert nucleus.sum() >= 1 and not (nucleus & ~kept).any()
        probs = logits[i].masked_fill(~kept, float("-inf")).softmax(-1)
        mass_kept = probs[nucleus].sum()
        smallest_kept = probs[nucleus].min()
        assert mass_kept - smallest_kept <= ps[i] + 1e-6  # mass ahead of the last kept <= p
        if nucleus.sum() < kept.sum():
            assert mass_kept > ps[i] - 1e-6                 # mass ahead of the first dropped > p
    assert (torch.isfinite(both).sum(-1) < torch.isfinite(only_k).sum(-1)).any()


def test_min_p_masks_low_probability_tokens():
    torch.manual_seed(0)
    n = 6000
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = probs.log().expand(n, 5).contiguous()
    # Floor = 0.3 * 0.4 = 0.12: tokens 3 (0.1) and 4 (0.05) go.
    out = sampler(logits, meta(n, temperature=1.0, min_p=0.3)).token_ids
    assert set(out.tolist()) == {0, 1, 2}
    expected = torch.tensor([0.4, 0.3, 0.15, 0.0, 0.0]) / 0.85
    assert chi_square(counts(out, 5).float(), expected) < 16.27
    # min_p 0 in the same batch leaves a row untouched.
    mp = [0.3, 0.0] * (n // 2)
    out = sampler(logits, meta(n, temperature=1.0, min_p=mp)).token_ids
    assert set(out[1::2].tolist()) == {0, 1, 2, 3, 4}
    assert set(out[0::2].tolist()) == {0, 1, 2}


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_distribution_matches_softmax(temperature):
    torch.manual_seed(1234)
    n = 20000
    row = torch.tensor([1.0, 0.2, -0.5, 0.7])
    logits = row.expand(n, 4).contiguous()
    out = sampler(logits, meta(n, temperature=temperature)).token_ids
    expected = (row / temperature).softmax(-1)
    assert chi_square(counts(out, 4).float(), expected) < 16.27   # 3 dof, p = 0.001
    # And it is not the greedy answer in disguise.
    assert counts(out, 4).min() > 0


def test_banned_tokens_never_sampled():
    torch.manual_seed(0)
    n, vocab = 2000, 6
    logits = torch.zeros(n, vocab)
    logits[:, 2] = 5.0                    # the favourite, banned in even rows
    rows = torch.arange(0, n, 2).repeat_interleave(2)
    toks = torch.tensor([2, 4]).repeat(n // 2)
    out = sampler(logits.clone(), meta(n, temperature=1.0, banned=(rows, toks))).token_ids
    assert not ({2, 4} & set(out[0::2].tolist()))
    assert set(out[0::2].tolist()) == {0, 1, 3, 5}
    assert (out[1::2] == 2).float().mean() > 0.9
    # Greedy rows too: the argmax falls to the best unbanned token.
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])
    got = sampler(logits.clone(), meta(1, temperature=0.0,
                                       banned=(torch.tensor([0]), torch.tensor([1])))).token_ids
    assert got.tolist() == [2]


def test_banning_leaves_input_and_logprobs_raw():
    """Bans steer sampling only: the caller's logits are not written, and logprobs are of
    the model's own distribution (a banned token keeps its real logprob and rank)."""
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])
    before = logits.clone()
    out = sampler(logits, meta(1, temperature=0.0, max_logprobs=2,
                               banned=(torch.tensor([0]), torch.tensor([1]))))
    assert torch.equal(logits, before)
    assert out.token_ids.tolist() == [2]
    ref = before.log_softmax(-1)[0]
    assert out.sampled_ranks.tolist() == [2]
    assert out.logprob_token_ids.tolist() == [[2, 1, 2]]
    torch.testing.assert_close(out.logprobs[0], ref[[2, 1, 2]])


# ----------------------------------------------------------------- logprobs
def test_logprobs_sampled_rank_and_sorted_top_k():
    torch.manual_seed(0)
    n, vocab, k = 64, 30, 5
    logits = random_logits(n, vocab, 6)
    out = sampler(logits, meta(n, temperature=1.0, max_logprobs=k))
    ref = logits.log_softmax(-1)
    tok = out.token_ids
    assert out.logprobs.shape == (n, 1 + k) and out.logprob_token_ids.shape == (n, 1 + k)
    assert torch.equal(out.logprob_token_ids[:, 0], tok)
    torch.testing.assert_close(out.logprobs[:, 0], ref.gather(-1, tok[:, None])[:, 0])
    # Rank: 1 + number of tokens strictly more likely.
    order = ref.argsort(-1, descending=True)
    expected_rank = (order == tok[:, None]).float().argmax(-1) + 1
    assert torch.equal(out.sampled_ranks, expected_rank)
    assert (out.sampled_ranks > 1).any()          # temperature 1 does not always pick the best
    # Top-k: the k best tokens, best first, with their log_softmax values.
    top = out.logprobs[:, 1:]
    assert (top[:, :-1] >= top[:, 1:]).all()
    assert torch.equal(out.logprob_token_ids[:, 1:], order[:, :k])
    torch.testing.assert_close(top, ref.gather(-1, order[:, :k]))


def test_logprobs_greedy_rank_one_and_k_zero():
    logits = random_logits(8, 30, 7)
    out = sampler(logits, meta(8, temperature=0.0, max_logprobs=0))
    ref = logits.log_softmax(-1)
    assert out.sampled_ranks.tolist() == [1] * 8
    assert out.logprobs.shape == (8, 1)
    assert torch.equal(out.logprob_token_ids[:, 0], logits.argmax(-1))
    torch.testing.assert_close(out.logprobs[:, 0], ref.max(-1).values)


def test_logprobs_ignore_temperature_and_filters():
    """Returned logprobs are of the model's distribution, not the processed one."""
    torch.manual_seed(0)
    logits = random_logits(16, 20, 8)
    out = sampler(logits.clone(), meta(16, temperature=0.3, top_k=2, max_logprobs=3))
    ref = logits.log_softmax(-1)
    torch.testing.assert_close(out.logprobs[:, 0], ref.gather(-1, out.token_ids[:, None])[:, 0])
    assert (out.sampled_ranks <= 2).all()
    torch.testing.assert_close(out.logprobs[:, 1:], ref.topk(3, -1).values)


# ----------------------------------------------------------------- SamplingParams
@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -1}, "temperature"),
    ({"temperature": 101}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"n": 65}, "n"),
    ({"n": 0}, "n"),
    ({"logprobs": -2}, "logprobs"),         # -1 is the whole vocabulary; the upper bound is the engine's
    ({"logprobs": 1.5}, "logprobs"),
    ({"stop": [""]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"seed": -1}, "seed"),
    # Past what the engine's int64 buffers and generators hold (runtime/limits.py).
    ({"seed": 2 ** 63}, "seed"),
    ({"seed": 2 ** 64}, "seed"),
    ({"top_k": 2 ** 63}, "top_k"),
    ({"max_tokens": 2 ** 63}, "max_tokens"),
    ({"min_tokens": 2 ** 63, "max_tokens": None}, "min_tokens"),
    ({"stop_token_ids": [2 ** 63]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(1025))}, "stop_token_ids"),
    ({"stop": ["x"] * 65}, "stop"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"min_p": float("nan")}, "min_p"),
    ({"top_k": True}, "top_k"),
    ({"n": True}, "n"),
])
def test_sampling_params_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field}: "):
        SamplingParams(**kwargs)


def test_largest_values_are_accepted_and_sample_seeds_wrap():
    p = SamplingParams(seed=2 ** 63 - 1, top_k=2 ** 63 - 1, max_tokens=2 ** 63 - 1, min_tokens=2 ** 63 - 1,
                       stop_token_ids=[2 ** 63 - 1], n=3)
    assert [p.sample_params(i).seed for i in range(3)] == [2 ** 63 - 1, 0, 1]
    assert all(p.sample_params(i).n == 1 for i in range(3))
    assert SamplingParams(seed=None, n=2).sample_params(1).seed is None
    with pytest.raises(ParamError) as e:
        SamplingParams(seed=2 ** 63)
    assert e.value.param == "seed" and e.value.reason == "must be an integer in [0, 2^63)"
    assert len(str(_param_error(stop=["y" * 10 ** 6] * 65))) < 200      # hostile values are not echoed whole


def _param_error(**kwargs) -> ParamError:
    with pytest.raises(ParamError) as e:
        SamplingParams(**kwargs)
    return e.value


def test_sampling_params_valid_edges_and_normalisation():
    p = SamplingParams(temperature=0, top_p=1.0, top_k=-1, min_p=1.0, max_tokens=1, min_tokens=1,
                       logprobs=20, stop="###", seed=0)
    assert p.greedy and p.top_k == 0 and p.stop == ["###"]
    assert SamplingParams(logprobs=0).logprobs == 0
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None
    assert SamplingParams(temperature=100).temperature == 100
    assert not SamplingParams().greedy
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []
    # validate() runs again on mutation (the engine calls it before admitting a request).
    p = SamplingParams()
    p.temperature = -0.5
    with pytest.raises(ValueError, match=r"^SamplingParams\.temperature: "):
        p.validate()
    assert math.isclose(SamplingParams(top_p=0.01).top_p, 0.01)


@pytest.mark.parametrize("kernel", [True, False], ids=["cpp", "chunked"])
@pytest.mark.parametrize("vocab", [200, 32000, 32001, 1000])
def test_chunked_argmax_equals_torch_argmax(vocab, kernel, monkeypatch):
    """The greedy fast paths (the C++ `argmax_rows` and the chunked torch fallback) return
    exactly torch's argmax: first index among ties, NaN counted as the maximum, all -inf rows
    give 0, a maximum in the ragged last chunk."""
    from zooinfer_kernels import cpu_build
    from zooinfer_kernels.lm_head import argmax as _argmax
    if kernel and not cpu_build.available():
        pytest.skip("C++ CPU kernels unavailable")
    if not kernel:
        monkeypatch.setattr(cpu_build, "available", lambda: False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, vocab, generator=g)
    x[0, 3] = x[0, vocab - 2] = 50.0                      # a tie across chunks: the first wins
    x[1, vocab - 1] = 50.0                                # in the last (maybe partial) chunk
    x[2] = 1.0                                            # a row of ties
    x[3, 7], x[3, vocab // 2] = float("nan"), float("nan")
    x[4] = float("-inf")
    x[5, 130], x[5, 129] = 60.0, 60.0                     # a tie inside one chunk
    x[6] = torch.round(x[6])                              # many ties at the top
    assert torch.equal(_argmax(x), x.argmax(dim=-1))
    assert _argmax(x).tolist()[:6] == [3, vocab - 1, 0, 7, 0, 129]


@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 31, 33, 49152])
def test_cpp_argmax_rows_small_odd_and_strided(vocab):
    """`argmax_rows` on rows shorter than, equal to and just past one 16-float vector, with
    the maximum / a NaN / -inf in the scalar tail, and on a strided view."""
    from zooinfer_kernels import cpu_build
    if not cpu_build.available():
        pytest.skip("C++ CPU kernels unavailable")
    f = torch.ops.zooinfer_cpu.argmax_rows
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab + 3, generator=g)[:, 1:vocab + 1]        # strided rows
    x[1, -1] = 99.0                                                   # max in the tail
    x[2, -1] = float("nan")                                           # NaN in the tail
    x[3] = float("-inf")
    x[4] = float("-inf")
    x[4, -1] = -1e30                                                  # one finite value last
    x[5] = 0.0
    x[5, -1] = -0.0                                                   # signed-zero tie
    assert torch.equal(f(x), x.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="float32"):
        f(x.double())
