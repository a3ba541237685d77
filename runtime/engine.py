"""The Engine: spec -> model + KV cache -> scheduler/runner step loop -> outputs.

`step()` is one iteration: schedule under the token budget, run the model on exactly the
scheduled tokens, feed sampled tokens back to the scheduler, and turn what changed into
RequestOutputs. Everything a user sends is validated in `make_request` before it touches
the scheduler, so a bad request is a ValueError for that request, never a broken engine. A
failure in one request's share of a step (logprobs, detokenizing, stop strings) finishes that
request alone, with finish_reason "error"; only a failure of the step itself propagates.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from pathlib import Path

import torch

from cache.kv_dtype import check_specs as check_kv_specs, resolve_kv_cache_dtype
from cache.manager import KVCacheManager
from cache.sizing import make_kv_cache_config, requests_that_fit
from zooinfer_kernels import cpu_features
from models import resolve_spec
from models.builder import DTYPES
from models.parallel import shard_spec
from models.pipeline import stage_layers
from models.loader import checkpoint_dir
from runtime.config import EngineConfig
from runtime.detokenizer import IncrementalDetokenizer
from runtime.kv_tiers import attach_tiers, close_tiers
from runtime.limits import INT64_MAX, ParamError, check_text, is_int
from runtime.structured_outputs import GrammarCache, StructuredOutputs
from runtime.executor import make_executor
from runtime import vocab_logprobs
from runtime.worker import prompt_logprobs
from runtime.outputs import CompletionOutput, Logprob, RequestOutput
from runtime.parallel_sampling import fan_out
from runtime.request import Request, RequestStatus
from runtime.sampling_params import RequestOutputKind, SamplingParams
from runtime.scheduler import Scheduler
from runtime.spec_decode.config import SpeculativeConfig
from runtime.spec_decode.decoder import SpecDecoder
from runtime.spec_decode.draft import DraftProposer
from runtime.spec_decode.mtp_proposer import MTPProposer
from runtime.spec_decode.timing import device_clock
from runtime import thread_guard

log = logging.getLogger("zooinfer")


def load_tokenizer(path: Path | None):
    if path is None or not (path / "tokenizer_config.json").exists() and not (path / "tokenizer.json").exists():
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path))


class Engine:
    def __init__(self, model: str | Path, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        config.validate()
        self.startup_seconds: dict[str, float] = {}
        clock = time.perf_counter()

        def phase(name: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            self.startup_seconds[name] = now - clock
            clock = now

        self.spec = spec = resolve_spec(model)
        if config.max_model_len is not None:
            if config.max_model_len > spec.max_model_len:
                raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's {spec.max_model_len}")
            spec.max_model_len = config.max_model_len
        self.max_model_len = spec.max_model_len
        if config.quantization_activations is not None:   # x of the quantized products (models/quant.py)
            spec.quantization.activations = config.quantization_activations
            if config.quantization_activations != "float32" and (config.quantization or spec.quantization.method) == "none":
                raise ValueError(f"quantization_activations={config.quantization_activations!r} rounds the inputs of "
                                 f"quantized linears, but {spec.name} "
                                 f"runs unquantized weights (quantization 'none'): choose a quantization too")
        self.spec_decoder = self._speculative(config.speculative, spec)   # validated before any weights load
        dtype_name = config.dtype or spec.dtype
        if dtype_name not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype_name!r}")
        dtype = DTYPES[dtype_name]
        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, config.device,
                                          config.attention_backend)   # K/V pages only
        torch.manual_seed(config.seed)
        ckpt = checkpoint_dir(spec)
        phase("spec")
        if config.tensor_parallel_size > 1:                   # one-line errors before any process starts
            shard_spec(spec, config.tensor_parallel_size)
        if config.pipeline_parallel_size > 1:
            stage_layers(spec, config.pipeline_parallel_size)
        # The model (rank 0's shard with tensor parallelism), weights loaded and packed.
        self.executor = make_executor(spec, config, dtype)
        self.model = self.executor.model
        phase("weights")
        if config.device == "cpu":
            cpu_features.log_once(log)   # CPU model, flags and the kernel paths, once per process
        self._thread_guard = thread_guard.ThreadGuard() if (config.adaptive_threads and thread_guard.env_enabled()
                                               and config.device == "cpu" and config.tensor_parallel_size == 1
                                               and config.pipeline_parallel_size == 1) else None
        tok_dir = spec.resolve_path(spec.tokenizer) if spec.tokenizer else ckpt
        self.tokenizer = load_tokenizer(tok_dir)
        # Token texts for logprob entries; every token's, once, for whole-vocabulary rows.
        self._vocab_words = vocab_logprobs.VocabWords(self.tokenizer, spec.vocab_size)
        eos = list(spec.eos_token_ids)
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = [self.tokenizer.eos_token_id]
        # An id past the vocabulary can never be sampled; banning it before min_tokens would index
        # past the logits (a small variant inheriting its full model's eos, e.g. bamba-small).
        self.eos_token_ids = tuple(t for t in eos if 0 <= t < spec.vocab_size)
        phase("tokenizer")
        draft = getattr(self.spec_decoder, "proposer", None)
        try:
            layer_specs = self.model.kv_cache_specs(config.block_size, kv_dtype)
            if isinstance(draft, DraftProposer):      # the draft's layers join the pool after the target's
                draft.load(dtype, config, self.model)
                layer_specs = draft.join_kv_specs(layer_specs, config.block_size, kv_dtype)
            check_kv_specs(layer_specs, kv_dtype)
            kv_config = make_kv_cache_config(
                layer_specs, config.block_size,
                num_blocks=config.num_kv_blocks, memory_bytes=config.kv_cache_memory,
                min_tokens=self.max_model_len, max_num_seqs=config.max_num_seqs,
                chunk_tokens=config.max_num_batched_tokens)
        except ValueError:
            self.executor.shutdown()        # a pool too small, a bad draft: no worker process outlives the failed start
            raise
        self.kv_manager = KVCacheManager(kv_config, enable_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_manager, policy=config.scheduling_policy, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_model_len=self.max_model_len)
        self.executor.init_runner(kv_config, max_num_reqs=config.max_num_seqs,
                                  max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids,
                                  attention_backend=config.attention_backend, device=config.device,
                                  kv_dtype=kv_dtype, compile=config.compile,
                                  compile_cache_dir=config.compile_cache_dir,
                                  cuda_graphs=config.cuda_graphs, cuda_graph_max_bs=config.cuda_graph_max_bs)
        self.runner = self.executor.runner      # rank 0's runner
        if isinstance(draft, DraftProposer):
            draft.bind(self)
        self.tiers = attach_tiers(self, config, kv_config)    # None unless a KV tier is configured
        phase("KV cache")
        if config.compile:
            self.executor.warm_up()
            phase("compile")
            log.info("compiled in %.1f s", self.startup_seconds["compile"])
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._structured: StructuredOutputs | None = None    # made on the first constrained request
        self._structured_lock = threading.Lock()
        self._next_id = itertools.count()
        log.info("engine ready: %s, KV %d blocks x %d tokens (%d tokens)", spec.name,
                 kv_config.num_blocks - 1, config.block_size, (kv_config.num_blocks - 1) * config.block_size)

    def _speculative(self, value, spec) -> SpecDecoder | None:
        """The engine's speculative decoder: from the config, else the spec's section."""
        if isinstance(value, dict) and value.get("method", "ngram") is None:
            return None                      # explicitly off, whatever the spec says
        where = "speculative"
        if value is None and spec.speculative is not None:
            value, where = spec.speculative, f"{spec.source_file or spec.name}: speculative"
        cfg = SpeculativeConfig.parse(value, where)
        if cfg is not None and (self.config.tensor_parallel_size > 1 or self.config.pipeline_parallel_size > 1):
            raise ValueError(f"{where}: not supported with tensor_parallel_size or pipeline_parallel_size > 1 yet")
        if cfg is None:
            return None
        proposer = DraftProposer(cfg, spec, where) if cfg.method == "draft" else \
            MTPProposer(cfg, spec, where) if cfg.method == "mtp" else None
        return SpecDecoder(cfg, self.max_model_len, proposer, clock=device_clock(self.config.device))

    def warm_up(self, params: SamplingParams) -> None:
        """Run one short request end to end (compiles the forward when compile is on)."""
        req = self.make_request({"prompt_token_ids": [0, 1, 2]}, params, request_id="warm-up")
        self.add_request(req)
        while self.has_unfinished():
            self.step()

    # ------------------------------------------------------------- requests
    def tokenize(self, prompt, tokenizer=None) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt; `tokenizer`: a copy of this model's tokenizer to
        encode with instead (the server tokenizes off the engine thread with its own)."""
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str):
            text, special = prompt["prompt"], prompt.get("add_special_tokens", True)
        elif isinstance(prompt, str):
            text, special = prompt, True
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(is_int(t) for t in ids):
                raise ParamError("prompt_token_ids must be a list of ints", "prompt")
            return prompt.get("prompt"), list(ids)
        else:
            raise ParamError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}",
                             "prompt")
        if self.tokenizer is None:
            raise ParamError("this model has no tokenizer: pass {'prompt_token_ids': [...]}", "prompt")
        check_text(text, "prompt")
        return text, (tokenizer or self.tokenizer).encode(text, add_special_tokens=special)

    def make_request(self, prompt, params: SamplingParams, request_id: str | None = None,
                     cap_max_tokens: bool = True, priority: int = 0) -> Request:
        """Validate one prompt + params into a Request (nothing is scheduled yet). Every
        check that can fail because of what the caller sent happens here, so a request that
        passes cannot break a step. A max_tokens beyond the room left in max_model_len is
        capped to that room (`LLM`), or refused with cap_max_tokens=False (the server, as
        vLLM's does)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        params.validate_for_model(self.spec.vocab_size)
        if params.prompt_logprobs is not None and self.config.pipeline_parallel_size > 1:
            raise ParamError("prompt_logprobs: not supported with pipeline_parallel_size > 1 yet", "prompt_logprobs")
        text, ids = self.tokenize(prompt)
        if params.bad_words:
            self._tokenize_bad_words(params)
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs, "structured_outputs")
        if not ids:
            raise ParamError("prompt is empty", "prompt")
        vocab = self.spec.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ParamError(f"prompt token ids must be in [0, {vocab}) (out of vocabulary: got "
                             f"{min(ids)}..{max(ids)})", "prompt")
        if len(ids) >= self.max_model_len:
            raise ParamError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                             f"(room for at least one generated token is needed)", "prompt")
        room = self.max_model_len - len(ids)
        wanted = params.max_tokens if params.max_tokens is not None else params.min_tokens
        if not cap_max_tokens and wanted > room:
            name = "max_tokens" if params.max_tokens is not None else "min_tokens"
            raise ParamError(f"this model's maximum context length is {self.max_model_len} tokens, but "
                             f"{len(ids)} prompt tokens + {wanted} {name} were requested; reduce the prompt "
                             f"or {name}", name)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        params = vocab_logprobs.resolve(params, vocab, self.config.max_logprobs, len(ids), max_tokens)
        if request_id is None:
            request_id = str(next(self._next_id))
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and not isinstance(salt, str):
            raise ParamError("cache_salt must be a string", "cache_salt")
        if salt is not None:
            check_text(salt, "cache_salt")
        if not is_int(priority) or not -INT64_MAX - 1 <= priority <= INT64_MAX:
            raise ParamError("priority must be an integer within int64", "priority")
        if priority and self.scheduler.policy != "priority":
            raise ParamError("priority: only the priority scheduling policy takes it "
                             "(scheduling_policy='priority', --scheduling-policy priority)", "priority")
        return Request(request_id, ids, params, self.eos_token_ids, max_tokens, prompt=text, cache_salt=salt,
                       priority=priority)

    def _tokenize_bad_words(self, params: SamplingParams) -> None:
        """Each bad word as the tokenizer spells it alone and after a space (vLLM's rule)."""
        if self.tokenizer is None:
            raise ParamError("bad_words: this model has no tokenizer to spell them with", "bad_words")
        seqs: list[list[int]] = []
        for word in params.bad_words:
            check_text(word, "bad_words")
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in seqs:
                    seqs.append(ids)
        params.bad_words_token_ids = seqs

    def _structured_outputs(self) -> StructuredOutputs:
        """The matchers and grammar cache, made on first use (under a lock: the server asks
        for the cache from worker threads)."""
        with self._structured_lock:
            if self._structured is None:
                if self.tokenizer is None:
                    raise ParamError("structured_outputs: this model has no tokenizer to constrain", "structured_outputs")
                self._structured = StructuredOutputs(GrammarCache(self.tokenizer, self.spec.vocab_size,
                                                                  list(self.eos_token_ids)))
        return self._structured

    @property
    def grammars(self) -> GrammarCache:
        """The compiled-grammar cache for this model's tokenizer (thread-safe: the server
        compiles on worker threads before a request reaches the engine)."""
        return self._structured_outputs().grammars

    def add_request(self, request: Request, stream_text: bool = False) -> list[str]:
        """Schedule a request; with n > 1 it becomes n samples (`parallel_sampling.fan_out`:
        ids `<id>`, `<id>#1`, ...) that fork from sample 0. Returns the sample ids.
        All or nothing: what can fail is built before the scheduler sees a sample, and a
        sample the scheduler refuses takes the others back out."""
        samples = fan_out(request)
        detoks = {}
        for s in samples:
            sp = s.sampling_params
            if self.tokenizer is not None and (sp.stop or stream_text):
                detoks[s.request_id] = IncrementalDetokenizer(
                    self.tokenizer, s.prompt_token_ids, sp.stop, sp.include_stop_str_in_output,
                    sp.skip_special_tokens)
        try:
            self.scheduler.add_request(request)
            for child in samples[1:]:
                self.scheduler.add_fork(child, request.request_id)
        except BaseException:
            self.scheduler.finish_requests([s.request_id for s in samples], RequestStatus.FINISHED_ABORTED)
            raise
        self._detok.update(detoks)
        if request.sampling_params.structured_outputs is not None:
            structured = self._structured_outputs()
            for s in samples:
                structured.add(s.request_id, s.sampling_params.structured_outputs)
        return [s.request_id for s in samples]

    # ------------------------------------------------------------- drivers above the engine
    def fork(self, parent_id: str, child_id: str) -> None:
        """Start `child_id` as a copy of a running request, sharing its computed blocks
        (copy-on-write); between steps only. Beam search forks its beams with it."""
        self.scheduler.fork(parent_id, self.scheduler.requests[parent_id].clone(child_id))
        if self._structured is not None:
            self._structured.fork(parent_id, child_id)

    def append_tokens(self, request_id: str, tokens: list[int]) -> None:
        """Feed a request its next tokens from outside (see Request.external_tokens)."""
        self.scheduler.append_tokens(request_id, tokens)

    def take_proposals(self) -> dict[str, dict[int, float]]:
        """{request id: {token id: logprob}} (its top-k, best first) for each external-token
        request that reached the end of its tokens since the last call."""
        return self.scheduler.take_proposals()

    def abort(self, request_ids) -> None:
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)
        for rid in request_ids:
            self._detok.pop(rid, None)
            if self._structured is not None:
                self._structured.remove(rid)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------- one step
    def step(self) -> list[RequestOutput]:
        """Run one iteration. Returns an output for each request that got a token this step
        (a FINAL_ONLY request only when it finishes)."""
        guard = self._thread_guard
        if guard is None:
            return self._step()
        guard.tick()
        try:
            return self._step()
        finally:
            guard.ended()

    def _step(self) -> list[RequestOutput]:
        # Speculation's cost model fits the whole step as the engine spends it (schedule,
        # forward, sampling / verification, bookkeeping, outputs), not the forward alone.
        started = self.spec_decoder.clock() if self.spec_decoder is not None else 0.0
        so = self.scheduler.schedule()
        if so.is_empty:
            # Only removals (and maybe fork copies) this step: the runner still applies them.
            self.executor.execute(so)
            self.scheduler.update(so, {})
            if self.scheduler.waiting and not self.scheduler.running:
                # Sizing guarantees one max_model_len request fits, so this is a bug, and
                # looping forever on it would hide it.
                raise RuntimeError("scheduler admitted nothing with an idle engine and "
                                   f"{len(self.scheduler.waiting)} waiting requests")
            return []
        if self._structured is not None and self._structured.matchers:
            so.grammar_bitmask = self._structured.bitmask(self._sampling_now(so))
        result = self.executor.execute(so)
        outputs = [out for out in map(self._record_prompt_logprobs, (result.prompt_logprobs or {}).items())
                   if out is not None]
        updated = self.scheduler.update(so, result.sampled, result.logprobs, result.spec)
        for req in updated:
            try:
                out = self._process(req)
            except Exception as e:  # noqa: BLE001 - this request's failure, not the engine's
                out = self._fail(req, e)
            if out is not None:
                outputs.append(out)
        if self.spec_decoder is not None:     # record this step's acceptance, propose the next drafts
            self.spec_decoder.step(result.spec, self.scheduler.running, so, self.spec_decoder.clock() - started)
        return outputs

    def _sampling_now(self, so) -> list[str]:
        """The scheduled requests whose step reaches the end of their tokens (they sample)."""
        reqs = self.scheduler.requests
        return [rid for rid, n in so.num_scheduled_tokens.items()
                if rid in reqs and reqs[rid].num_computed_tokens + n >= reqs[rid].num_tokens]

    def _process(self, req: Request) -> RequestOutput | None:
        """One request's share of a step after sampling: its grammar, logprobs,
        detokenization, stop strings, its output. Nothing here touches another request.
        A speculative step may have added several tokens: each is taken in turn, and a stop
        string drops the tokens after the one that completed it, as if they never came."""
        first = req.num_output_tokens - max(req.num_new_tokens, 1)
        for i in range(first, req.num_output_tokens):
            if self._process_token(req, i, i + 1 == req.num_output_tokens) and i + 1 < req.num_output_tokens:
                del req.output_token_ids[i + 1:]
                del req.all_token_ids[req.num_prompt_tokens + i + 1:]
                if req.logprobs is not None:
                    del req.logprobs[i + 1:]
                break
        if req.status.finished or req.sampling_params.output_kind == RequestOutputKind.CUMULATIVE:
            return self._make_output(req)
        return None

    def _process_token(self, req: Request, i: int, last: bool = True) -> bool:
        """Output token i's grammar step, logprobs and detokenization; True if it ended the
        request by a stop string or a complete grammar. A token before the step's last one
        is checked for stop strings even when the last one finished the request (max_tokens,
        EOS): the earlier stop wins, as it would have one token at a time."""
        token = req.output_token_ids[i]
        stopped = False
        if self._structured is not None and req.request_id in self._structured.matchers:
            done = self._structured.accept(req.request_id, token)
            if done and not req.status.finished:     # the grammar is complete: so is the request
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
                req.stop_reason = token
                stopped = True
            if req.status.finished:
                self._structured.remove(req.request_id)
        if req.logprobs is not None:
            self._convert_logprobs(req, i)
        detok = self._detok.get(req.request_id)
        if detok is not None and (not req.status.finished or not last):
            stop = detok.update(token)
            if stop is not None:
                if req.status.finished:     # by a later token of this step: freed already
                    req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, None
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
                req.stop_reason = stop
                stopped = True
        elif detok is not None:
            detok.update(token)
        return stopped

    def _fail(self, req: Request, error: Exception) -> RequestOutput:
        """Finish one request whose own processing raised: its blocks are freed and its
        caller gets the error; the engine and every other request go on."""
        log.exception("request %s failed; aborting it alone", req.request_id)
        self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ERROR)
        self._detok.pop(req.request_id, None)
        if self._structured is not None:
            self._structured.remove(req.request_id)
        completion = CompletionOutput(req.sample_index, "", list(req.output_token_ids), None, None, "error", None)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion], True,
                             error=f"{type(error).__name__}: {error}")

    def _record_prompt_logprobs(self, item) -> RequestOutput | None:
        """Keep a step's prompt-logprob entries on their request (before `update` can finish it);
        a failure here fails that request alone."""
        rid, chunk = item
        req = self.scheduler.requests.get(rid)
        if req is None or req.prompt_logprobs is None:
            return None
        try:
            prompt_logprobs.record(req.prompt_logprobs, chunk, self._spell_tokens)
        except Exception as e:  # noqa: BLE001 - this request's failure, not the engine's
            return self._fail(req, e)
        return None

    def _spell_tokens(self, ids: list[int]) -> list[str | None]:
        """Each id's text (a whole-vocabulary row from a table spelled once: vocab_logprobs.py)."""
        return self._vocab_words.spell(ids)

    def _convert_logprobs(self, req: Request, i: int = -1) -> None:
        """Turn output token i's raw logprob entry into {token_id: Logprob} once, decoding the
        token strings here on the engine thread (the tokenizer is not shared across threads)."""
        entry = req.logprobs[i]
        words = self._spell_tokens(list(entry["top"]) + [entry["token_id"]])
        with vocab_logprobs.gc_paused(len(words) > vocab_logprobs.MAX_LOGPROBS + 1):
            d = {tid: Logprob(lp, None, w) for (tid, lp), w in zip(entry["top"].items(), words)}
        d[entry["token_id"]] = Logprob(entry["logprob"], entry["rank"], words[-1])
        req.logprobs[i] = d
        req.cumulative_logprob += entry["logprob"]

    def _make_output(self, req: Request) -> RequestOutput:
        finished = req.status.finished
        detok = self._detok.get(req.request_id)
        if detok is not None:
            text = detok.text
        elif finished and self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_token_ids,
                                         skip_special_tokens=req.sampling_params.skip_special_tokens)
        else:
            text = ""
        logprobs = None if req.logprobs is None else list(req.logprobs)
        cumulative = None if req.logprobs is None else req.cumulative_logprob
        completion = CompletionOutput(req.sample_index, text, list(req.output_token_ids), cumulative, logprobs,
                                      req.status.finish_reason, req.stop_reason)
        if finished:
            self._detok.pop(req.request_id, None)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion], finished,
                             num_cached_tokens=req.num_cached_tokens, prompt_logprobs=req.prompt_logprobs)

    def close(self) -> None:
        """Shut down between steps: KV tiers persist what the pool caches (runtime/kv_tiers.py),
        and the executor's worker processes (tensor / pipeline parallel) stop."""
        close_tiers(self)
        self.executor.shutdown()

    def kv_cache_capacity(self, num_tokens: int) -> int:
        """Requests of `num_tokens` tokens (prompt + output) that fit in the pool at once."""
        return requests_that_fit(self.kv_manager.config, num_tokens, self.config.max_num_batched_tokens)

    def kv_cache_stats(self) -> dict:
        stats = self.kv_manager.stats()
        stats["num_preemptions"] = self.scheduler.num_preemptions
        stats["num_running"] = len(self.scheduler.running)
        stats["num_waiting"] = len(self.scheduler.waiting)
        if self.spec_decoder is not None:
            stats.update(self.spec_decoder.stats())
        if self.tiers is not None:
            stats["kv_tiers"] = self.tiers.stats()
            stats["num_waiting"] += stats["kv_tiers"]["num_waiting_for_kv"]
        return stats
