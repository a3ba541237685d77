"""AsyncEngine: the engine step loop in its own thread, driven from asyncio.

The Engine is single-threaded by design, so every mutation (add, abort, step) happens on
the engine thread: the HTTP side only enqueues commands and awaits per-request streams that
the engine thread fills. What one step (or one drain of commands) has for the event loop goes
over in ONE `call_soon_threadsafe` for all streams, not one per stream: each call is a
self-pipe write and a loop wake-up, and both threads share the GIL. A stream that falls
behind is caught up in one piece: its cumulative outputs supersede the earlier ones of the
same sample, so a slow consumer gets every token, in order, in fewer chunks. A client that goes away closes its
output generator, which aborts the request and frees its blocks. A failure that belongs to
one request (admitting it, or its share of a step) fails that request alone. If the engine
thread dies, every waiting stream gets the error at once and `healthy` turns false:
requests never hang on a dead engine.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from runtime.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from runtime.engine import Engine
from runtime.metrics import ServerMetrics
from runtime.outputs import RequestOutput
from runtime.parallel_sampling import parent_id
from runtime.request import Request
from runtime.sampling_params import SamplingParams

log = logging.getLogger("zooinfer")


class EngineDeadError(RuntimeError):
    pass


def on_short_lived_thread(fn):
    """Run `fn` (building the Engine an AsyncEngine will drive, warming it up) on a short-lived
    thread and return its result or raise its exception; build and warm through it, not on the
    thread that stays (runtime.serve does). torch's CPU ops run on an OpenMP thread team that
    belongs to the thread that calls them and lives as long as it does. Built on the main
    thread, the engine left a team there beside the engine thread's; libgomp, finding more of
    its threads than cores, then only briefly spins between parallel regions and puts the
    workers to sleep, and every region of every step woke them again: served decode ran 40%
    slower than offline with 0.4 cores idle (README, "Measured here", Zen 5). Built here, the
    team ends with this thread and the engine thread's is the only one."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
            box["error"] = e

    t = threading.Thread(target=run, name="zooinfer-load")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class RequestFailedError(RuntimeError):
    """One request failed on the engine thread (not because of what the client sent); the
    engine aborted it alone and goes on serving the others."""


@dataclass(slots=True)
class _Stream:
    """One request's outputs on their way to the event loop. `items` and `waiter` are only
    touched on the loop (`_put_all`, `get`); the engine thread only reads `loop`."""
    loop: asyncio.AbstractEventLoop
    items: deque = field(default_factory=deque)
    waiter: asyncio.Future | None = None
    arrival: float = field(default_factory=time.monotonic)
    last_token: float | None = None
    sample_ids: list[str] = field(default_factory=list)        # set once admitted (n > 1: n of them)
    num_tokens: dict[int, int] = field(default_factory=dict)   # sample index -> tokens delivered

    def put(self, item) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self):
        """The next item; of several waiting RequestOutputs of one sample only the latest
        (outputs are cumulative: it holds all the earlier ones' tokens and text)."""
        while not self.items:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        item = self.items.popleft()
        while (self.items and isinstance(item, RequestOutput) and not item.finished and item.error is None
               and isinstance(self.items[0], RequestOutput)
               and self.items[0].outputs[0].index == item.outputs[0].index):
            item = self.items.popleft()
        return item


def _name_os_thread(name: str) -> None:
    """Give the calling thread its name in the OS too (Linux; Python 3.11 sets none), so that
    `top -H`, profilers and bench.serve_vllm's CPU split by thread can tell it apart; the
    OpenMP team it starts inherits the name."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def _put_all(items: list) -> None:
    """On the event loop: hand a batch of (stream, item) from the engine thread over."""
    for stream, item in items:
        stream.put(item)


class AsyncEngine:
    def __init__(self, engine: Engine, metrics: ServerMetrics | None = None, idle_wait: float = 0.05):
        self.engine = engine
        self.metrics = metrics
        self.idle_wait = idle_wait
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="zooinfer-engine", daemon=True)
        self._pending: list[tuple[_Stream, object]] = []    # engine thread: items for the loop, sent by _flush
        self._tokenizer_pool: ThreadPoolExecutor | None = None    # start(): the tokenizer thread and its copy
        self._tokenizer = None
        if metrics is not None:   # the per-token series, looked up once (labels() takes a lock each call)
            self._series = tuple(c.labels(metrics.model) for c in (metrics.generation_tokens, metrics.ttft,
                                                                    metrics.itl, metrics.e2e))
        # Beam searches (runtime/beam_search.py) driven between steps on the engine thread:
        # request id -> (first beam, its group, the asyncio future waiting for the result).
        self._beam = BeamSearch(engine)
        self._searches: dict[str, tuple] = {}

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self.metrics is not None:   # /metrics has every gauge from the first scrape on
            self.metrics.update_engine_state(self.engine.kv_cache_stats())
        if self.engine.tokenizer is not None:
            self._tokenizer = copy.deepcopy(self.engine.tokenizer)
            self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="zooinfer-tokenize")
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort whatever is left, stop the loop and join the thread."""
        self._commands.put(("abort_all", None))
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        if self._tokenizer_pool is not None:
            self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        if not self._thread.is_alive():
            self.engine.close()     # between steps now: KV tiers persist what the pool caches

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive() and not self._stop.is_set()

    def stats(self) -> dict:
        return self.engine.kv_cache_stats()

    # ------------------------------------------------------------- asyncio side
    async def add_request(self, prompt, params: SamplingParams, request_id: str, cap_max_tokens: bool = True,
                          priority: int = 0) -> tuple[Request, AsyncIterator[RequestOutput]]:
        """Validate and enqueue one request; returns it and its output stream, which
        yields the outputs of all its n samples (`outputs[0].index` says which) as they come.

        A text prompt is tokenized first on a thread of its own with its own copy of the
        tokenizer (`_pretokenize`: a long prompt's encoding does not stall every stream's
        step); the rest of validation runs on the engine thread. A bad request raises
        ValueError here, before any response has started, and any other failure to admit
        it raises RequestFailedError (the engine lives on).
        The stream yields outputs as tokens arrive, the last with finished=True; closing it
        early (client gone, cancellation) aborts the request and frees its blocks.
        """
        if not self.healthy:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        stream = _Stream(asyncio.get_running_loop())
        if request_id in self._streams or "#" in request_id:   # '#' separates sample ids
            raise ValueError(f"request id {request_id!r} is already in use or contains '#'")
        self._streams[request_id] = stream
        try:
            prompt = await self._pretokenize(prompt)
        except BaseException as e:      # nothing was enqueued: a bad prompt, a tokenizer bug, the client gone
            self._streams.pop(request_id, None)
            if isinstance(e, Exception) and not isinstance(e, ValueError):
                log.exception("request %s could not be tokenized", request_id)
                raise RequestFailedError(f"request could not be admitted: {type(e).__name__}: {e}") from e
            raise
        self._commands.put(("add", (prompt, params, request_id, cap_max_tokens, priority)))
        self._wake.set()
        try:
            first = await stream.get()
        except asyncio.CancelledError:   # the client left while we validated
            self._streams.pop(request_id, None)
            self._commands.put(("abort", [request_id]))
            self._wake.set()
            raise
        if isinstance(first, BaseException):
            self._streams.pop(request_id, None)
            if isinstance(first, (ValueError, RequestFailedError)):
                raise first
            raise EngineDeadError(f"engine failed: {first!r}") from first
        return first, self._outputs(request_id, stream)

    async def _pretokenize(self, prompt):
        """A text prompt (a str, or {"prompt": str, ...} without token ids) as
        {..., "prompt": text, "prompt_token_ids": ids}, encoded by `Engine.tokenize` on the
        tokenizer thread with that thread's own tokenizer copy (the engine thread keeps
        decoding with the original: one tokenizer is never used by two threads). Anything
        else, and models without a tokenizer, go to the engine as they came."""
        text_prompt = isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt_token_ids" not in prompt
                                                  and isinstance(prompt.get("prompt"), str))
        if not text_prompt or self.engine.tokenizer is None:
            return prompt
        if self._tokenizer_pool is None:     # not started (a test driving streams without start())
            return prompt
        text, ids = await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_pool, self.engine.tokenize, prompt, self._tokenizer)
        fields = prompt if isinstance(prompt, dict) else {}
        return {**fields, "prompt": text, "prompt_token_ids": ids}

    async def _outputs(self, rid: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        open_samples = set(range(len(stream.sample_ids)))
        try:
            while open_samples:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"engine failed: {item!r}") from item
                if item.error is not None:
                    raise RequestFailedError(f"request failed: {item.error}")
                if item.finished:
                    open_samples.discard(item.outputs[0].index)
                yield item
        finally:
            self._streams.pop(rid, None)
            if open_samples:
                self._commands.put(("abort", [stream.sample_ids[i] for i in open_samples]))
                self._wake.set()

    async def beam_search(self, prompt, params: BeamSearchParams, request_id: str) -> BeamSearchOutput:
        """Run one beam search on the engine thread; a bad request raises ValueError, a
        cancelled call (client gone) stops the search and frees its beams."""
        if not self.healthy:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(("beam", (prompt, params, request_id, future, loop)))
        self._wake.set()
        try:
            return await future
        except asyncio.CancelledError:
            self._commands.put(("beam_abort", request_id))
            self._wake.set()
            raise

    def _start_search(self, prompt, params, request_id, future, loop) -> None:
        try:
            req, group = self._beam.prepare(prompt, params)
            self._beam.add(req, group)
        except ValueError as e:
            loop.call_soon_threadsafe(future.set_exception, e)
            return
        self._searches[request_id] = (req, group, future, loop)

    def _advance_searches(self) -> None:
        self._beam.after_step()
        for rid, (req, group, future, loop) in list(self._searches.items()):
            if group.done:
                del self._searches[rid]
                out = self._beam.output(req, group)
                loop.call_soon_threadsafe(lambda f=future, o=out: f.done() or f.set_result(o))

    def _stop_search(self, request_id: str) -> None:
        entry = self._searches.pop(request_id, None)
        if entry is not None:
            self._beam.cancel_group(entry[1])

    # ------------------------------------------------------------- engine thread
    def _run(self) -> None:
        engine = self.engine
        _name_os_thread("zooinfer-engine")
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if not engine.has_unfinished():
                    self._wake.wait(self.idle_wait)
                    self._wake.clear()
                    continue
                outputs = engine.step()
                if self._searches:
                    self._advance_searches()
                now = time.monotonic()
                for out in outputs:
                    self._deliver(out, now)
                self._flush()
                if self.metrics is not None:
                    self.metrics.update_engine_state(engine.kv_cache_stats())
            self._drain_commands()
        except BaseException as e:   # noqa: BLE001 - anything here kills the engine
            log.exception("engine thread died")
            self.error = e
            self._pending.extend((stream, e) for stream in list(self._streams.values()))
            self._flush()
            for _, _, future, loop in self._searches.values():
                dead = EngineDeadError(f"engine failed: {e!r}")
                loop.call_soon_threadsafe(lambda f=future, x=dead: f.done() or f.set_exception(x))

    def _drain_commands(self) -> None:
        engine = self.engine
        handled = False
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            handled = True
            if kind == "add":
                self._add(*arg)
            elif kind == "beam":
                self._start_search(*arg)
            elif kind == "beam_abort":
                self._stop_search(arg)
            elif kind == "abort":
                engine.abort(arg)
            elif kind == "abort_all":
                for rid in list(self._searches):
                    self._stop_search(rid)
                live = list(engine.scheduler.requests)
                engine.abort(live)
        self._flush()       # the admitted requests' replies (and refusals), in one hand-over
        # Aborts change the pool with no step after them when nothing else runs: /metrics
        # must show it (the update after a step covers the rest).
        if handled and self.metrics is not None:
            self.metrics.update_engine_state(engine.kv_cache_stats())

    def _add(self, prompt, params: SamplingParams, request_id: str, cap_max_tokens: bool, priority: int = 0) -> None:
        stream = self._streams.get(request_id)
        if stream is None:      # the client left before we got here
            return
        try:
            request = self.engine.make_request(prompt, params, request_id, cap_max_tokens=cap_max_tokens,
                                               priority=priority)
            stream.sample_ids = self.engine.add_request(request, stream_text=True)   # all or nothing
        except ValueError as e:
            self._pending.append((stream, e))
            return
        except Exception as e:  # noqa: BLE001 - this request's failure: refuse it, keep serving
            log.exception("request %s could not be admitted", request_id)
            failure = RequestFailedError(f"request could not be admitted: {type(e).__name__}: {e}")
            self._pending.append((stream, failure))
            return
        stream.arrival = time.monotonic()
        if self.metrics is not None:
            self.metrics.prompt_tokens.labels(self.metrics.model).inc(request.num_prompt_tokens)
        self._pending.append((stream, request))

    def _deliver(self, out: RequestOutput, now: float) -> None:
        stream = self._streams.get(parent_id(out.request_id))
        if stream is None:
            return
        i, num = out.outputs[0].index, len(out.outputs[0].token_ids)
        m = self.metrics
        if m is not None:
            tokens, ttft, itl, e2e = self._series
            tokens.inc(max(num - stream.num_tokens.get(i, 0), 0))
            if stream.last_token is None:
                ttft.observe(now - stream.arrival)
            else:
                itl.observe(now - stream.last_token)
            if out.finished:
                e2e.observe(now - stream.arrival)
                m.finished.labels(m.model, out.outputs[0].finish_reason or "unknown").inc()
        stream.num_tokens[i] = num
        stream.last_token = now
        self._pending.append((stream, out))

    def _flush(self) -> None:
        """Send what is pending to the event loop(s): one call_soon_threadsafe per loop (one
        loop in the server; tests may drive streams from several)."""
        if not self._pending:
            return
        items, self._pending = self._pending, []
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in items:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:      # that loop is closed: nobody is left to read these
                pass
