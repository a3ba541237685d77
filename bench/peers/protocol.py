"""The runner side of the peer protocol (stdlib only: it runs inside each peer's own venv).

A runner is started as ``<peer venv python> run_<peer>.py <workload.json>``. The workload file
holds ``model_dir``, ``prompts`` (token id lists), ``new_tokens``, ``threads``,
``max_num_seqs``, ``max_num_batched_tokens``, ``warmup_prompts``, ``warmup_new_tokens`` and
peer-specific ``options``. The runner loads the model once, warms up, then answers one
command per stdin line:

- it first prints ``READY {"load_s", "warmup_s", "version"}``;
- ``run``: generate the whole workload once, print ``RESULT {"seconds", "outputs"}``;
- ``quit`` or end of input: exit.

Why a long-lived process driven round by round: loading vLLM or compiling an OpenVINO model
takes tens of seconds, yet the parent must alternate engines round by round so drift on a
shared machine hits all of them alike. Protocol lines go to a private copy of the original
stdout; fd 1 is pointed at stderr so the peer's own prints (and its child processes') cannot
corrupt the stream.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any, Callable


def _protocol_stream():
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(2, 1)
    return proto


def serve(load: Callable[[dict], Any], generate: Callable[[Any, list, int], list], version: str) -> int:
    """Drive one runner: ``load(workload) -> engine``, ``generate(engine, prompts, n) -> outputs``.

    Each output is the list of generated token ids of the prompt at the same index.
    """
    proto = _protocol_stream()
    wl = json.loads(open(sys.argv[1]).read())

    def send(kind: str, payload: dict) -> None:
        proto.write(kind + " " + json.dumps(payload) + "\n")
        proto.flush()

    try:
        t0 = time.perf_counter()
        engine = load(wl)
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        generate(engine, wl["warmup_prompts"], wl["warmup_new_tokens"])
        send("READY", {"load_s": load_s, "warmup_s": time.perf_counter() - t0, "version": version})
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "quit":
                break
            if cmd != "run":
                send("ERROR", {"error": f"unknown command {cmd!r}"})
                continue
            t0 = time.perf_counter()
            outs = generate(engine, wl["prompts"], wl["new_tokens"])
            send("RESULT", {"seconds": time.perf_counter() - t0, "outputs": [list(map(int, o)) for o in outs]})
    except BaseException as e:   # report, then exit non-zero: the parent prints the error line
        traceback.print_exc()
        send("ERROR", {"error": f"{type(e).__name__}: {e}"})
        return 1
    return 0
