"""The n-gram proposer over its token history (runtime/spec_decode/token_history.py): the
same drafts as a brute-force prompt lookup on random histories that grow, get cut, change
owner and outgrow the window and the slots, and rows updated from the new tokens only."""
from __future__ import annotations

import random

import numpy as np

from runtime import SamplingParams
from runtime.request import Request
from runtime.spec_decode.proposer import NgramProposer


def brute(tokens: list[int], k: int, n_min: int, n_max: int, window: int) -> list[int]:
    """Prompt lookup, one request at a time: the longest suffix (n_max down to n_min) that
    occurs earlier in the last `window` tokens, at its latest earlier start; the k tokens
    that followed it."""
    t = tokens[-window:]
    for n in range(n_max, n_min - 1, -1):
        if len(t) <= n:
            continue
        for s in range(len(t) - n - 1, -1, -1):
            if t[s: s + n] == t[-n:]:
                return t[s + n: s + n + k]
    return []


def _request(rid: str, rng: random.Random, vocab: int) -> Request:
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=10_000), (), 10_000)


def test_history_drafts_equal_brute_force_on_random_histories():
    """300 steps over up to 100 live requests (past the 64 initial slots), a window of 24
    tokens (histories outgrow it and the 48-token rows), vocabularies of 3 and 6 tokens (many
    matches of every length): every step's drafts equal the brute-force lookup's and the list
    path's. Requests grow by 1-5 tokens, some finish, and a new request may take a finished
    one's id. Some are cut (a stop string): such a request grows no more, as in the engine,
    where the cut finishes it, but it may still be searched once."""
    for vocab, (n_min, n_max, k) in ((3, (1, 4, 4)), (6, (2, 3, 3))):
        rng = random.Random(vocab)
        p = NgramProposer(k=k, n_min=n_min, n_max=n_max, search_window=24)
        live = {f"r{i}": _request(f"r{i}", rng, vocab) for i in range(80)}
        matched, cut_ids = 0, set()
        for step in range(300):
            for rid, req in list(live.items()):
                roll = rng.random()
                if roll < 0.03 or rid in cut_ids:          # finished; maybe its id comes back
                    del live[rid]
                    cut_ids.discard(rid)
                    if rng.random() < 0.5:
                        live[rid] = _request(rid, rng, vocab)
                elif roll < 0.06 and req.num_output_tokens > 2:   # cut after a stop string
                    cut = rng.randrange(1, req.num_output_tokens)
                    del req.output_token_ids[-cut:]
                    del req.all_token_ids[-cut:]
                    cut_ids.add(rid)
                else:
                    for _ in range(rng.randrange(1, 6)):
                        req.append_output_token(rng.randrange(vocab))
            if step % 10 == 0:
                for i in range(rng.randrange(0, 12)):
                    live[f"s{step}-{i}"] = _request(f"s{step}-{i}", rng, vocab)
            batch = rng.sample(list(live.values()), min(len(live), rng.randrange(1, 100)))
            ks = np.array([rng.randrange(0, k + 1) for _ in batch], dtype=np.int64)
            want = [brute(r.all_token_ids, int(kk), n_min, n_max, 24) for r, kk in zip(batch, ks)]
            assert p.propose_requests(batch, ks) == want, step
            assert p.propose([r.all_token_ids for r in batch], ks) == want, step
            matched += sum(map(bool, want))
        assert matched > 1000                                 # the lookups found plenty
        assert len(p.history.count) > 64                      # the slots grew


def test_history_appends_only_the_new_tokens():
    """A row is brought in step from the request's new tokens alone: an earlier token changed
    behind the history's back (never done to a real request) still reads as before, while
    a new Request object under the same id starts its row again."""
    p = NgramProposer(k=2, n_min=1, n_max=1)
    req = Request("a", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=100), (), 100)
    assert p.propose_requests([req], np.array([2])) == [[]]            # 8 occurs nowhere before
    req.all_token_ids[1] = 9                                  # not seen: only tokens past 4 are read
    req.append_output_token(5)
    assert p.propose_requests([req], np.array([2])) == [[6, 7]]        # after the earlier 5, as held
    again = Request("a", list(req.all_token_ids), SamplingParams(temperature=0, max_tokens=100), (), 100)
    assert p.propose_requests([again], np.array([2])) == [[9, 7]]      # read afresh
