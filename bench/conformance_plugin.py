"""pytest plugin that points vLLM's own OpenAI-server tests at our server.

Loaded by `bench.conformance` into a pytest run in a separate venv, inside a vLLM source
checkout (nothing of vLLM is copied into this repo). It registers, before any test module
is imported, a `tests.utils` module whose `RemoteOpenAIServer` starts `python -m
runtime.serve <spec>` (this repo, its own interpreter) under the model name the test asks
for, and a minimal `vllm.tokenizers.get_tokenizer` that loads the served model's tokenizer
(the tests only use it to count and spell tokens). Any other `vllm` import fails, so a test
module that needs vLLM internals fails to collect and is reported as not applicable.

A server argument we cannot honour skips the test with the reason "not applicable: ...";
the runner groups those reasons. Configuration comes from ZOOINFER_CONFORMANCE_* variables.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import types

import pytest

REPO = os.environ.get("ZOOINFER_CONFORMANCE_REPO", "")
PYTHON = os.environ.get("ZOOINFER_CONFORMANCE_PYTHON", sys.executable)
SPEC = os.environ.get("ZOOINFER_CONFORMANCE_SPEC", "zoo/smollm2-135m.yaml")
TOKENIZER = os.environ.get("ZOOINFER_CONFORMANCE_TOKENIZER", "")

# vLLM server flags, by what we do with them. Flags with a value consume it.
PASSED = {"--max-model-len", "--max-num-seqs", "--api-key", "--tool-call-parser", "--max-num-batched-tokens",
          "--served-model-name", "--port", "--structured-outputs-config.backend"}
# Sizing, precision and device knobs whose answer is ours (fp32 CPU, our backends), logging.
IGNORED_WITH_VALUE = {"--seed", "--dtype", "--gpu-memory-utilization", "--max-logprobs", "--tensor-parallel-size",
                      "--kv-cache-dtype", "--block-size", "--swap-space", "--distributed-executor-backend",
                      "--load-format", "--attention-backend", "--host"}
IGNORED = {"--enforce-eager", "--enable-auto-tool-choice", "--trust-remote-code", "--enable-prefix-caching",
           "--disable-log-requests", "--disable-uvicorn-access-log", "--enable-prompt-tokens-details",
           "--disable-log-stats", "--no-async-scheduling", "--enable-chunked-prefill", "--enable-per-request-metrics",
           "--trust-request-chat-template"}
NOT_APPLICABLE = {
    "--enable-lora": "LoRA", "--lora-modules": "LoRA", "--max-lora-rank": "LoRA", "--max-loras": "LoRA",
    "--enable-prompt-embeds": "multimodal / prompt embeddings", "--limit-mm-per-prompt": "multimodal",
    "--reasoning-parser": "reasoning models (vLLM reasoning parsers)", "--tool-server": "MCP tool server",
    "--chat-template": "a vLLM example chat template file", "--tokenizer-mode": "vLLM tokenizer modes",
    "--quantization": "quantized big model", "--speculative-config": "speculative decoding config",
    "--hf-overrides": "HF config overrides", "--root-path": "ASGI root path", "--uds": "unix sockets",
    "--return-tokens-as-token-ids": "vLLM server-wide flag (we take it per request)",
    "--enable-server-load-tracking": "vLLM-internal metrics", "--override-generation-config": "vLLM generation config",
    "--tool-parser-plugin": "vLLM plugin", "--lora-module": "LoRA", "--max-cpu-loras": "LoRA",
    "--enable-force-include-usage": "vLLM server-wide usage flag", "--watermark-config": "vLLM watermarking",
    "--skip-tokenizer-init": "serving without a tokenizer", "--runner": "pooling / non-generate runners",
    "--reasoning-config": "reasoning models", "--chat-template-content-format": "vLLM content-format modes",
    "--exclude-tools-when-tool-choice-none": "vLLM server-wide template flag",
    "--generation-config": "vLLM generation config", "--logprobs-mode": "vLLM logprobs modes",
}


def translate(model: str, args: list[str]) -> list[str]:
    """Our `runtime.serve` arguments for a vLLM `serve` command line; a flag we cannot honour
    skips the test (pytest.skip names it)."""
    out, i, port = ["--served-model-name", model], 0, None
    while i < len(args):
        a, value = args[i], None
        if "=" in a and a.startswith("--"):
            a, value = a.split("=", 1)
        takes = a in PASSED or a in IGNORED_WITH_VALUE or a in NOT_APPLICABLE
        if value is None and takes and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value, i = args[i + 1], i + 1
        i += 1
        if a in NOT_APPLICABLE:
            pytest.skip(f"not applicable: {NOT_APPLICABLE[a]} ({a})")
        if a in IGNORED or a in IGNORED_WITH_VALUE:
            continue
        if a in PASSED:
            if a == "--tool-call-parser" and value != "hermes":
                pytest.skip(f"not applicable: tool parser {value!r} (we have hermes)")
            if a == "--structured-outputs-config.backend":
                if value not in ("xgrammar", "auto"):
                    pytest.skip(f"not applicable: structured-outputs backend {value!r} (we use xgrammar)")
            elif a == "--served-model-name":
                out[1] = value
            elif a == "--port":
                port = int(value)
            else:
                out += [a, value]
            continue
        if a == "--no-enable-prefix-caching":
            out.append("--no-prefix-caching")
            continue
        pytest.skip(f"not applicable: vLLM server flag {a}")
    return out, port


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteOpenAIServer:
    """vLLM's test fixture, served by zooinfer: same constructor, URLs and clients."""
    DUMMY_API_KEY = "token-abc123"

    def __init__(self, model: str, vllm_serve_args: list[str], *, env_dict: dict | None = None, seed: int | None = 0,
                 auto_port: bool = True, max_wait_seconds: float | None = None, **_):
        args, port = translate(model, list(vllm_serve_args))
        self.host, self.port = "127.0.0.1", port or _free_port()
        env = {**os.environ, **(env_dict or {})}
        self.proc = subprocess.Popen([PYTHON, "-m", "runtime.serve", SPEC, "--port", str(self.port), *args],
                                     cwd=REPO, env=env, stdout=sys.stderr, stderr=sys.stderr)
        deadline = time.monotonic() + (max_wait_seconds or 240)
        import httpx
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"zooinfer server exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url_for("health"), timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        self._shutdown()
        raise RuntimeError("zooinfer server did not come up in time")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._shutdown()

    def _shutdown(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        return f"{self.url_root}/" + "/".join(p.strip("/") for p in parts if p)

    def get_client(self, **kwargs):
        import openai
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0,
                             **{"timeout": 600, **kwargs})

    def get_async_client(self, **kwargs):
        import openai
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0,
                                  **{"timeout": 600, **kwargs})


def get_tokenizer(*args, **kwargs):
    """vLLM's get_tokenizer, for any model name: the served model's tokenizer."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(TOKENIZER)


def _install_modules() -> None:
    utils = types.ModuleType("tests.utils")
    utils.RemoteOpenAIServer = RemoteOpenAIServer
    utils.ROCM_EXTRA_ARGS = []
    sys.modules["tests.utils"] = utils
    vllm = types.ModuleType("vllm")
    vllm.__path__ = []          # a package, so `import vllm.x` fails with "No module named 'vllm.x'"
    tokenizers = types.ModuleType("vllm.tokenizers")
    tokenizers.get_tokenizer = get_tokenizer
    vllm.tokenizers = tokenizers
    sys.modules.update({"vllm": vllm, "vllm.tokenizers": tokenizers})
    import tests          # the checkout's package (on PYTHONPATH): its `utils` is ours from here on
    tests.utils = utils


# At import (`-p conformance_plugin`), before pytest loads any conftest that imports tests.utils.
_install_modules()
