"""pytest plugin that points vLLM's own OpenAI-server tests at our server.

Loaded by `bench.conformance` into a pytest run inside a vLLM source checkout (nothing of vLLM
is copied into this repo), before any test module is imported. Its `RemoteOpenAIServer` starts
`python -m runtime.serve <spec>` (this repo, its own interpreter) under the model name the test
asks for, and `vllm.tokenizers.get_tokenizer` loads the served model's tokenizer (the tests name
hub models; there is no hub). Two modes:
- vLLM importable (`--python` a vLLM venv; the checkout's Python sources come first, so they
  match its tests): vLLM's own `tests.utils`, protocol types and helpers, only those two swapped;
- no vLLM: a `tests.utils` with our fixture and a `vllm` package holding only get_tokenizer, so a
  module needing more of vLLM fails to collect and is reported as not applicable.
A test that reaches no server (no RemoteOpenAIServer in it, its helpers or its fixtures) tests
vLLM's Python objects in-process and is skipped as not applicable.

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

from conformance_skips import capable_model_reason     # bench/ is on the runner's PYTHONPATH

REPO = os.environ.get("ZOOINFER_CONFORMANCE_REPO", "")
PYTHON = os.environ.get("ZOOINFER_CONFORMANCE_PYTHON", sys.executable)
SPEC = os.environ.get("ZOOINFER_CONFORMANCE_SPEC", "zoo/smollm2-135m.yaml")
TOKENIZER = os.environ.get("ZOOINFER_CONFORMANCE_TOKENIZER", "")
# A server the test gives no --max-model-len gets MAX_MODEL_LEN (its tests without max_tokens
# generate up to it, on a shared CPU); none gets more than the spec's own length.
MAX_MODEL_LEN = int(os.environ.get("ZOOINFER_CONFORMANCE_MAX_MODEL_LEN", "2048"))
SPEC_MAX_LEN = int(os.environ.get("ZOOINFER_CONFORMANCE_SPEC_MAX_LEN", "8192"))

# vLLM server flags, by what we do with them. Flags with a value consume it.
PASSED = {"--root-path", "--max-model-len", "--max-num-seqs", "--api-key", "--tool-call-parser", "--max-num-batched-tokens",
          "--served-model-name", "--port", "--structured-outputs-config.backend", "--max-logprobs"}
# Sizing, precision and device knobs whose answer is ours (fp32 CPU, our backends), logging.
IGNORED_WITH_VALUE = {"--seed", "--dtype", "--gpu-memory-utilization", "--tensor-parallel-size",
                      "--kv-cache-dtype", "--block-size", "--swap-space", "--distributed-executor-backend",
                      "--load-format", "--attention-backend", "--host"}
FLAGS = {"--return-tokens-as-token-ids", "--enable-force-include-usage", "--enable-per-request-metrics"}     # passed on, no value
IGNORED = {"--enforce-eager", "--enable-auto-tool-choice", "--trust-remote-code", "--enable-prefix-caching",
           "--disable-log-requests", "--disable-uvicorn-access-log", "--enable-prompt-tokens-details",
           "--disable-log-stats", "--no-async-scheduling", "--enable-chunked-prefill",
           "--trust-request-chat-template"}
# Request fields of vLLM's own machinery, not the API: a test sending one is not applicable.
SENDS_NOT_APPLICABLE = {"prompt_embeds": "prompt embeddings (vLLM's --enable-prompt-embeds)",
                        "kv_transfer_params": "disaggregated prefill (vLLM's KV transfer)"}
# LoRA: the server runs without the adapters; the tests that name one are skipped (LORA_NAMES).
LORA_FLAGS = {"--enable-lora", "--lora-modules", "--max-lora-rank", "--max-loras", "--max-cpu-loras", "--lora-module"}
LORA_NAMES: set[str] = set()
NOT_APPLICABLE = {
    "--enable-prompt-embeds": "multimodal / prompt embeddings", "--limit-mm-per-prompt": "multimodal",
    "--reasoning-parser": "reasoning models (vLLM reasoning parsers)", "--tool-server": "MCP tool server",
    "--chat-template": "a vLLM example chat template file", "--tokenizer-mode": "vLLM tokenizer modes",
    "--quantization": "quantized big model", "--speculative-config": "speculative decoding config",
    "--hf-overrides": "HF config overrides", "--uds": "unix sockets",
    "--enable-server-load-tracking": "vLLM-internal metrics", "--override-generation-config": "vLLM generation config",
    "--tool-parser-plugin": "vLLM plugin",
"--watermark-config": "vLLM watermarking",
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
        takes = a in PASSED or a in IGNORED_WITH_VALUE or a in NOT_APPLICABLE or a in LORA_FLAGS
        if value is None and takes and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value, i = args[i + 1], i + 1
        if a in ("--lora-modules", "--lora-module"):      # name=path ... (or JSON objects)
            while True:
                LORA_NAMES.add(value.split("=", 1)[0] if "=" in value else value)
                if i + 1 < len(args) and not args[i + 1].startswith("--"):
                    value, i = args[i + 1], i + 1
                else:
                    break
        i += 1
        if a in LORA_FLAGS:
            continue
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
            elif a == "--max-model-len":    # as asked (at most the spec's own: SPEC_MAX_LEN)
                out += [a, str(min(int(value), SPEC_MAX_LEN))]
            else:
                out += [a, value]
            continue
        if a in FLAGS:
            out.append(a)
            continue
        if a == "--no-enable-prefix-caching":
            out.append("--no-prefix-caching")
            continue
        pytest.skip(f"not applicable: vLLM server flag {a}")
    if "--max-model-len" not in out:
        out += ["--max-model-len", str(MAX_MODEL_LEN)]
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
        if (env_dict or {}).get("VLLM_API_KEY"):       # vLLM reads the key from the environment too
            args += ["--api-key", env_dict["VLLM_API_KEY"]]
        self.host, self.port = "127.0.0.1", port or _free_port()
        env = {**os.environ, **(env_dict or {})}
        self.proc = subprocess.Popen([PYTHON, "-m", "runtime.serve", SPEC, "--port", str(self.port), *args],
                                     cwd=REPO, env=env, stdout=sys.stderr, stderr=sys.stderr)
        deadline = time.monotonic() + max(max_wait_seconds or 0, 600)   # a shared, loaded machine
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


def _real_vllm() -> bool:
    """Whether vLLM imports here (`bench.conformance --python` with a vLLM venv; the checkout's
    own Python sources come first on PYTHONPATH, so they match its tests): then the tests'
    helpers and protocol types are vLLM's own and only the server is swapped."""
    if os.environ.get("ZOOINFER_CONFORMANCE_FAKE_VLLM"):
        return False
    try:
        import vllm.tokenizers  # noqa: F401
        return True
    except Exception:           # no vLLM, or one that does not import: the fake package below
        for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            del sys.modules[name]
        return False


class _NoHub:
    """vLLM's hf_api() for the LoRA fixtures: no hub here, so a path that names the adapter
    (the server runs without it, and the tests that use it are skipped)."""

    def snapshot_download(self, repo_id: str, **_) -> str:
        return f"/nonexistent-lora/{repo_id}"


def _install_real() -> None:
    """vLLM importable: its tests.utils (every helper the tests import), with RemoteOpenAIServer
    replaced by ours and get_tokenizer answering with the served model's tokenizer (the tests
    name hub models; the machine has no hub)."""
    import tests.utils as utils
    import vllm.tokenizers as tokenizers
    import vllm.transformers_utils.repo_utils as repo_utils
    utils.RemoteOpenAIServer = RemoteOpenAIServer
    tokenizers.get_tokenizer = get_tokenizer
    repo_utils.hf_api = _NoHub


def _install_fake() -> None:
    """No vLLM: a `tests.utils` with our fixture and a `vllm` package holding only
    get_tokenizer, so a file needing any other vLLM module fails to collect (not applicable)."""
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


def _uses_server(item) -> bool:
    """Whether a test reaches a server: RemoteOpenAIServer in its body, in a module helper it
    calls, or in a fixture of its closure. The others test vLLM's Python objects in-process."""
    import inspect

    def src(fn) -> str:
        try:
            return inspect.getsource(fn)
        except (OSError, TypeError):
            return ""
    module = getattr(item, "module", None)
    helpers = {n for n, f in vars(module).items() if inspect.isfunction(f) and "RemoteOpenAIServer(" in src(f)} if module else set()
    funcs = [getattr(item, "function", None)] + [fd.func for fds in item._fixtureinfo.name2fixturedefs.values() for fd in fds]
    return any("RemoteOpenAIServer" in text or any(h + "(" in text for h in helpers) for text in map(src, funcs))


def pytest_configure(config):
    xml = getattr(config.option, "xmlpath", None)
    if xml:       # tells the runner which vLLM the tests ran with (real: import failures are errors)
        with open(xml + ".vllm", "w") as f:
            f.write("real" if REAL_VLLM else "fake")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    """A test that asks for a LoRA adapter (a parameter or a literal naming one) is skipped:
    its server runs without adapters; so is one that sends a field of vLLM's own machinery."""
    import inspect
    params = getattr(getattr(item, "callspec", None), "params", {})
    try:
        source = inspect.getsource(item.function)
    except (OSError, TypeError):
        source = ""
    source = source[source.find("def "):]     # the body: a parametrize list naming the adapter is not use
    used = [n for n in LORA_NAMES if n in params.values() or f'"{n}"' in source or f"'{n}'" in source]
    if used:
        pytest.skip(f"not applicable: LoRA adapter {used[0]!r}")
    for name, why in SENDS_NOT_APPLICABLE.items():
        if f'"{name}"' in source:
            pytest.skip(f"not applicable: {why} ({name})")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not _uses_server(item):
            item.add_marker(pytest.mark.skip(reason="not applicable: in-process test of vLLM's Python objects (no server)"))
        elif (why := capable_model_reason(item.nodeid)) is not None:
            item.add_marker(pytest.mark.skip(reason=why))


REAL_VLLM = _real_vllm()
# At import (`-p conformance_plugin`), before pytest loads any conftest that imports tests.utils.
(_install_real if REAL_VLLM else _install_fake)()
