"""Beam search: the beams of one prompt as forked requests that share KV blocks.

Each live beam is a Request. A round is one token: every live beam computes its next-token
log-probabilities (top 2 * beam_width, from the raw logits) and pauses; once every live beam
has reported, `BeamSearchGroup.select` ranks all (beam, token) continuations by cumulative
log-probability and keeps the best `beam_width`. A beam chosen once continues as itself; a
beam chosen k times also forks k - 1 new requests that share its computed blocks (the
partial last block is copied, see `KVCacheManager.fork`); a beam chosen zero times is freed
and its blocks go back to the pool. So memory holds each shared prefix once, however many
beams descend from it.

The selection rule (also what the brute-force reference in the tests implements):
- candidates: for each live beam, its top 2W tokens; score = beam cum logprob + token logprob;
  sorted by score, descending (ties: earlier beam, then better-ranked token, first);
- walking the sorted list, an end-of-sequence candidate ranked within the top W becomes a
  finished sequence; other candidates become the new live beams until W are taken;
- beams that reach max_tokens finish; the search ends when no beam is live;
- results: finished + length-capped sequences, ranked by cum_logprob / len ** length_penalty
  (len = output tokens, EOS included), the best `beam_width` returned.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int = 16
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= 10:
            raise ValueError(f"BeamSearchParams.beam_width: must be an integer in [1, 10], got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"BeamSearchParams.max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.length_penalty, (int, float)):
            raise ValueError(f"BeamSearchParams.length_penalty: must be a number, got {self.length_penalty!r}")


@dataclass(slots=True)
class BeamSequence:
    """One finished hypothesis: output tokens (after the prompt) and their summed logprob."""
    tokens: list[int]
    cum_logprob: float
    finished_by_eos: bool
    text: str = ""

    def score(self, length_penalty: float) -> float:
        return self.cum_logprob / (len(self.tokens) ** length_penalty)


@dataclass(slots=True)
class BeamSearchOutput:
    request_id: str
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]      # best first


@dataclass(slots=True)
class _Beam:
    tokens: list[int]
    cum_logprob: float


@dataclass(slots=True)
class BeamSearchGroup:
    group_id: str
    params: BeamSearchParams
    eos_token_ids: tuple[int, ...]
    max_tokens: int                                         # params.max_tokens capped by the model
    live: dict[str, _Beam] = field(default_factory=dict)    # beam request id -> beam, in beam order
    candidates: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    completed: list[BeamSequence] = field(default_factory=list)
    num_forks: int = 0

    def add_beam(self, beam_id: str, tokens: list[int], cum_logprob: float) -> None:
        self.live[beam_id] = _Beam(tokens, cum_logprob)

    def new_beam_id(self) -> str:
        self.num_forks += 1
        return f"{self.group_id}~{self.num_forks}"

    @property
    def done(self) -> bool:
        return not self.live

    def record(self, beam_id: str, top: dict[int, float]) -> bool:
        """A beam's next-token logprobs (best first); True when the round is complete."""
        if beam_id in self.live:
            self.candidates[beam_id] = sorted(top.items(), key=lambda kv: (-kv[1], kv[0]))
        return self.round_complete()

    def round_complete(self) -> bool:
        return bool(self.live) and len(self.candidates) == len(self.live)

    def cancel(self) -> None:
        """Stop the search: no beam is live any more, so no round completes again."""
        self.live.clear()
        self.candidates.clear()

    def discard(self, beam_id: str) -> None:
        """A beam ended from outside (abort): the search goes on without it."""
        self.live.pop(beam_id, None)
        self.candidates.pop(beam_id, None)

    def select(self) -> dict[str, list[tuple[int, float]]]:
        """End the round: for every beam that was live, the (token, new cum logprob) it
        continues with (first: the beam itself, rest: forks); an empty list drops it."""
        width = self.params.beam_width
        ranked = []
        for order, (beam_id, beam) in enumerate(self.live.items()):
            for rank, (token, lp) in enumerate(self.candidates[beam_id][: 2 * width]):
                ranked.append((-(beam.cum_logprob + lp), order, rank, beam_id, token))
        ranked.sort()
        decisions: dict[str, list[tuple[int, float]]] = {beam_id: [] for beam_id in self.live}
        taken = 0
        for position, (neg_score, _, _, beam_id, token) in enumerate(ranked):
            if taken == width:
                break
            beam = self.live[beam_id]
            if token in self.eos_token_ids and not self.params.ignore_eos:
                if position < width:
                    self.completed.append(BeamSequence(beam.tokens + [token], -neg_score, True))
                continue
            decisions[beam_id].append((token, -neg_score))
            taken += 1
        # Every live beam has the same length: either all continuations hit max_tokens
        # and the search ends, or the scheduler re-registers them with add_beam.
        at_cap = any(len(self.live[b].tokens) + 1 >= self.max_tokens for b in decisions)
        if at_cap:
            for beam_id, choices in decisions.items():
                tokens = self.live[beam_id].tokens
                self.completed.extend(BeamSequence(tokens + [t], cum, False) for t, cum in choices)
            decisions = {beam_id: [] for beam_id in decisions}
        self.live = {}
        self.candidates = {}
        return decisions

    def results(self) -> list[BeamSequence]:
        lp = self.params.length_penalty
        # Stable sort: equal scores keep the order they were found in.
        return sorted(self.completed, key=lambda s: -s.score(lp))[: self.params.beam_width]
