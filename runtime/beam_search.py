"""Beam search, driven from above the engine: the beams of one prompt are forked requests
that share KV blocks.

Each live beam is a Request with `external_tokens`: the engine computes its next-token
log-probabilities (top 2 * beam_width, from the raw logits), reports them
(`Engine.take_proposals`) and appends nothing, so the beam waits with all its tokens
computed. Once every live beam of a search has reported, `BeamSearchGroup.select` ranks all
(beam, token) continuations by cumulative log-probability and keeps the best `beam_width`;
`BeamSearch` then feeds each chosen token in as the beam's next input
(`Engine.append_tokens`). A beam chosen once continues as itself; a beam chosen k times also
forks k - 1 new requests (`Engine.fork`) that share its computed blocks (the partial last
block is copied, see `KVCacheManager.fork`); a beam chosen zero times is aborted and its
blocks go back to the pool. So memory holds each shared prefix once, however many beams
descend from it, and the scheduler knows nothing of beams.

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

from runtime.sampling_params import SamplingParams


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
        # and the search ends, or the driver re-registers them with add_beam.
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


class BeamSearch:
    """Runs any number of beam searches on one engine, batched together: `add` each, then
    `step` until `done` (each step is one engine step), then `output` for each."""

    def __init__(self, engine):
        self.engine = engine
        self.groups: dict[str, BeamSearchGroup] = {}     # live beam request id -> its search

    def prepare(self, prompt, params: BeamSearchParams):
        """Validate one search: its first beam (greedy, reporting the top 2W raw logprobs
        each step) and its group. Nothing is scheduled yet."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"beam search params must be BeamSearchParams, got {type(params).__name__}")
        params.validate()
        sp = SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=True,
                            logprobs=2 * params.beam_width)
        req = self.engine.make_request(prompt, sp)
        req.external_tokens = True
        return req, BeamSearchGroup(req.request_id, params, self.engine.eos_token_ids, req.max_tokens)

    def add(self, req, group: BeamSearchGroup) -> None:
        self.engine.add_request(req)
        self.groups[req.request_id] = group
        group.add_beam(req.request_id, [], 0.0)

    @property
    def done(self) -> bool:
        return not self.groups

    def step(self) -> None:
        self.engine.step()
        self.after_step()

    def after_step(self) -> None:
        """Take the step's proposals and advance every search whose round is complete (the
        async engine calls this after each of its own steps)."""
        complete: dict[int, BeamSearchGroup] = {}
        for beam_id, top in self.engine.take_proposals().items():
            group = self.groups.get(beam_id)
            if group is not None and group.record(beam_id, top):
                complete[id(group)] = group
        for group in complete.values():
            self._advance(group)

    def _advance(self, group: BeamSearchGroup) -> None:
        """Apply a finished round: chosen beams take their token (forking once per extra
        choice), the others end and free their blocks."""
        before = {beam_id: beam.tokens for beam_id, beam in group.live.items()}
        decisions = group.select()
        ended = []
        for beam_id, choices in decisions.items():
            if not choices:
                ended.append(beam_id)
                continue
            for token, cum in choices[1:]:     # fork before the parent takes its own token
                child_id = group.new_beam_id()
                self.engine.fork(beam_id, child_id)
                self.engine.append_tokens(child_id, [token])
                self.groups[child_id] = group
                group.add_beam(child_id, before[beam_id] + [token], cum)
            token, cum = choices[0]
            self.engine.append_tokens(beam_id, [token])
            group.add_beam(beam_id, before[beam_id] + [token], cum)
        # Beam order for the next round: best first (it only breaks exact score ties).
        group.live = dict(sorted(group.live.items(), key=lambda kv: -kv[1].cum_logprob))
        for beam_id in ended:
            del self.groups[beam_id]
        self.engine.abort(ended)

    def cancel_group(self, group: BeamSearchGroup) -> None:
        """Stop one search and free its beams."""
        beams = [b for b, g in self.groups.items() if g is group]
        group.cancel()
        for b in beams:
            del self.groups[b]
        self.engine.abort(beams)

    def cancel(self) -> None:
        """Stop every search and free every beam."""
        beams = list(self.groups)
        for group in {id(g): g for g in self.groups.values()}.values():
            group.cancel()
        self.groups.clear()
        self.engine.abort(beams)

    def output(self, req, group: BeamSearchGroup) -> BeamSearchOutput:
        seqs = group.results()
        tokenizer = self.engine.tokenizer
        if tokenizer is not None:
            for seq in seqs:
                seq.text = tokenizer.decode(seq.tokens, skip_special_tokens=True)
        return BeamSearchOutput(req.request_id, list(req.prompt_token_ids), seqs)
