"""Helpers for tests that drive a real server process on a free loopback port."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_chat_spec(folder: Path) -> Path:
    """Tiny seeded weights with SmolLM2's real tokenizer and chat template: fast, real text."""
    from models.embedded import ensure_embedded
    path = folder / "tiny-chat.yaml"
    path.write_text(f"extends: {ROOT / 'zoo' / 'smollm2-tiny.yaml'}\nname: tiny-chat\n"
                    f"tokenizer: {ensure_embedded('smollm2-135m')}\nmax_model_len: 256\n")
    return path


START_TIMEOUT = 300   # s; a quiet machine needs ~10, one shared by several jobs took over 120 (weight packing alone 106 s)


def start_server(spec: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "runtime.serve", str(spec), "--port", str(port),
                             "--max-num-seqs", "32", *extra], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not come up in {START_TIMEOUT} s")


@contextmanager
def running_server(spec: Path, *extra: str):
    """A server for the duration of the block; stopped with SIGINT (killed if it hangs)."""
    proc, base = start_server(spec, *extra)
    try:
        yield proc, base
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def metric(text: str, name: str) -> float:
    """One sample's value from a Prometheus text page (the first series of that name)."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_idle(base: str, timeout: float = 20.0) -> str:
    """/metrics once nothing runs (aborts land on the engine thread's next iteration)."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(base + "/metrics").text
        if metric(text, "zooinfer_num_requests_running") == 0 or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def error_of(resp: httpx.Response) -> dict:
    """The `error` object of an OpenAI-shaped error response (asserts the shape)."""
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) >= {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


@contextmanager
def tiny_chat_client(folder: Path, *extra: str):
    """A tiny-chat server with an httpx client on it, and SmolLM2's tokenizer to check
    against; on exit its log must hold no traceback."""
    from transformers import AutoTokenizer

    from models.embedded import ensure_embedded
    tok = AutoTokenizer.from_pretrained(ensure_embedded("smollm2-135m"))
    with running_server(tiny_chat_spec(folder), *extra) as (proc, base), \
            httpx.Client(base_url=base, timeout=60) as http:
        yield http, tok
    assert "Traceback" not in proc.stdout.read()
