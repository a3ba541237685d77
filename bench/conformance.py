"""Conformance: vLLM's own OpenAI-server tests, run against our server.

    python -m bench.conformance <vllm checkout> [--spec zoo/smollm2-135m.yaml] [--files a.py b.py]

A vLLM source checkout (the sdist from PyPI has the tests: `pip download vllm --no-deps
--no-binary :all:`, or a git clone) provides tests/entrypoints/openai. Nothing of it is
copied here: the runner makes a separate venv outside the repo (pytest, the openai client,
what the tests import; never vLLM itself), and runs each HTTP-level test file there with
`bench/conformance_plugin.py`, which replaces vLLM's `RemoteOpenAIServer` fixture with one
that starts `python -m runtime.serve <spec>`. `--confcutdir` keeps vLLM's top-level
conftest (which imports vLLM) out.

It prints pass / fail / skip per file, the pass rate over the applicable tests, what was
excluded and why, and each failure's reason. Not applicable, by construction:
- files that import vLLM internals (`vllm.*` beyond get_tokenizer) fail to collect: they
  test vLLM's Python objects, not the HTTP API;
- tests whose server needs LoRA, multimodal inputs / prompt embeddings, a reasoning parser,
  an MCP tool server, a vLLM example template or another vLLM-only flag are skipped by the
  fixture, naming the flag (`conformance_plugin.NOT_APPLICABLE`);
- tests that vLLM itself skips here (GPU-only, ROCm, big models) stay skipped.
Not part of the default test run (it needs the checkout and a venv); tests/test_conformance.py
checks the fixture substitution and the result parsing on a fake test file.
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from bench.conformance_skips import capable_model_reason

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("ZOOINFER_CONFORMANCE_VENV", Path.home() / ".cache" / "zooinfer-conformance-venv"))
PACKAGES = ["pytest", "pytest-asyncio", "openai", "httpx", "requests", "regex", "jsonschema", "transformers", "pybase64"]
SUITE = Path("tests/entrypoints/openai")


@dataclass
class FileResult:
    path: str
    passed: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)      # (test, reason)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    not_applicable: str | None = None                                # the whole file, and why


def ensure_venv(venv: Path = VENV) -> Path:
    """The runner's venv (created once): the tests' client-side dependencies, not vLLM."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *PACKAGES], check=True)
    return python


def server_files(checkout: Path) -> list[Path]:
    """The suite's HTTP-level files: those that start a server through RemoteOpenAIServer, in
    their own code or through a fixture of their folder's conftest.py (responses/)."""
    shared = {c.parent for c in (checkout / SUITE).rglob("conftest.py") if "RemoteOpenAIServer" in c.read_text()}
    return sorted(p for p in (checkout / SUITE).rglob("test_*.py")
                  if "RemoteOpenAIServer" in p.read_text() or p.parent in shared)


def _reason(node) -> str:
    text = (node.get("message") or node.text or "").strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return "?"
    # The last "E   ..." line of a traceback says most; otherwise the message's first line.
    errs = [ln.strip()[1:].strip() for ln in lines if ln.lstrip().startswith("E ")]
    return (errs[0] if errs else lines[0])[:200]


# Request fields that only mean something inside vLLM's own deployment machinery: a test that
# sends one (and gets our 400 for an unknown field) is not applicable, said so in the report.
# Files that test an endpoint of vLLM's own, not OpenAI's API: reported, not run.
VLLM_ONLY_FILES = {"decisions/test_decisions_e2e.py": "vLLM's own /v1/decisions endpoint",
                   "completion/test_tensorizer_entrypoint.py": "vLLM's tensorizer weight format (serialized "
                                                                "in-process by vLLM's model loader)"}
INTERNAL_FIELDS = {"kv_transfer_params": "disaggregated prefill (vLLM's KV transfer)"}
_UNKNOWN_FIELD = re.compile(r"unrecognized request argument supplied: (\w+)")
_IMPORT = re.compile(r"No module named '([^']+)'")
_FIXTURE = re.compile(r"fixture '(\w+)' not found")


_NO_HUB = ("LocalEntryNotFoundError", "Invalid repository ID or local directory")
_VLLM_IMPORT = re.compile(r"^\s*(?:from|import) (vllm\.(?!tokenizers\b)[\w.]+)", re.M)


def parse_junit(xml_path: Path, rel: str, source: str = "") -> FileResult:
    """One file's results from pytest's junit XML (collection errors included). A file that
    fails to collect and imports vLLM modules (its `source`) is not applicable for that."""
    res = FileResult(rel)
    mode = xml_path.with_name(xml_path.name + ".vllm")
    real = mode.exists() and mode.read_text() == "real"     # vLLM importable: no import is "internal"
    internal = None if real else _VLLM_IMPORT.search(source)
    if not xml_path.exists():
        res.not_applicable = "no results (pytest crashed)"
        return res
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        name = case.get("name") or "<collection>"
        if (why := capable_model_reason(f"{rel}::{name}")) is not None:   # listed after its XML was written
            res.skipped.append((name, why))
            continue
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if problem is not None:
            reason = _reason(problem)
            missing = _IMPORT.search(problem.get("message", "") + (problem.text or ""))
            if not case.get("classname") or problem.get("message") == "collection failure":
                top = missing.group(1).split(".")[0] if missing else None
                offline = "LocalEntryNotFoundError" in (problem.text or "")
                res.not_applicable = ("downloads the test model's files from the HF hub at import (no hub here)"
                                      if offline else
                                      f"imports {internal.group(1)} (vLLM internals)" if internal else
                                      f"imports {missing.group(1)} (vLLM internals)" if top == "vllm" and not real else
                                      f"needs {missing.group(1)}" if missing else f"collection error: {reason}")
            elif _FIXTURE.search(problem.text or ""):
                fixture = _FIXTURE.search(problem.text).group(1)
                res.skipped.append((name, f"not applicable: vLLM's test fixture {fixture!r} (its conftest imports vLLM)"))
            elif missing and missing.group(1).startswith("vllm."):   # imported inside the test
                res.skipped.append((name, f"not applicable: imports {missing.group(1)} (vLLM internals)"))
            elif any(m in (problem.text or "") for m in _NO_HUB):    # loads the test's model files itself
                res.skipped.append((name, "not applicable: loads the test model's files from the HF hub (no hub here)"))
            elif "gpt_oss" in reason:        # the suite's own guard: these need gpt-oss's harmony stack
                res.skipped.append((name, "not applicable: gpt-oss harmony format (needs the gpt_oss package and model)"))
            elif (m := _UNKNOWN_FIELD.search(reason)) and m.group(1) in INTERNAL_FIELDS:
                res.skipped.append((name, f"not applicable: {INTERNAL_FIELDS[m.group(1)]} ({m.group(1)})"))
            else:
                res.failed.append((name, reason))
        elif skip is not None:
            res.skipped.append((name, _reason(skip)))
        else:
            res.passed.append(name)
    return res


@functools.lru_cache
def length_cap(spec: str, cap: int = 2048) -> int:
    """The servers' max_model_len: at most `cap` (a test without max_tokens generates up to
    it, on a shared CPU) and never past the spec's own."""
    from models import resolve_spec
    return min(cap, resolve_spec(spec).max_model_len)


@functools.lru_cache
def tokenizer_dir(spec: str) -> str:
    """Where the spec's tokenizer lives (for the tests' get_tokenizer)."""
    from models import resolve_spec
    from models.loader import checkpoint_dir
    s = resolve_spec(spec)
    return str(s.resolve_path(s.tokenizer) if s.tokenizer else checkpoint_dir(s))


def run_file(python: Path, checkout: Path, test: Path, spec: str, out_dir: Path, timeout: int,
             reuse: bool = False) -> FileResult:
    """Run one test file against our server (or, with `reuse`, re-read its last results)."""
    rel = str(test.relative_to(checkout))
    only = next((why for f, why in VLLM_ONLY_FILES.items() if rel.endswith(f)), None)
    if only is not None:
        return FileResult(rel, not_applicable=only)
    xml = out_dir / (rel.replace("/", "__") + ".xml")
    if reuse and xml.exists():
        return parse_junit(xml, rel, test.read_text())
    xml.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{checkout}{os.pathsep}{ROOT / 'bench'}", "ZOOINFER_CONFORMANCE_REPO": str(ROOT),
           "ZOOINFER_CONFORMANCE_PYTHON": sys.executable, "ZOOINFER_CONFORMANCE_SPEC": spec,
           "ZOOINFER_CONFORMANCE_TOKENIZER": tokenizer_dir(spec),
           "ZOOINFER_CONFORMANCE_MAX_MODEL_LEN": str(length_cap(spec)),
           "ZOOINFER_CONFORMANCE_SPEC_MAX_LEN": str(length_cap(spec, 1 << 30))}
    cmd = [str(python), "-m", "pytest", rel, "-p", "conformance_plugin", "--confcutdir", str(checkout / SUITE.parent),
           "-p", "no:cacheprovider", "-q", "-o", "asyncio_mode=auto", f"--junitxml={xml}"]
    try:     # pytest's and the server's output, beside the XML, for reading a failure
        with open(xml.with_suffix(".log"), "w") as log:
            subprocess.run(cmd, cwd=checkout, env=env, timeout=timeout, stdout=log, stderr=subprocess.STDOUT)
    except subprocess.TimeoutExpired:
        res = FileResult(rel)
        res.failed.append(("<file>", f"timed out after {timeout} s"))
        return res
    return parse_junit(xml, rel, test.read_text())


def report(results: list[FileResult]) -> str:
    lines = [f"{'file':60s} {'pass':>5s} {'fail':>5s} {'skip':>5s}"]
    for r in results:
        note = f"  n/a: {r.not_applicable}" if r.not_applicable else ""
        lines.append(f"{r.path:60s} {len(r.passed):5d} {len(r.failed):5d} {len(r.skipped):5d}{note}")
    passed = sum(len(r.passed) for r in results)
    failed = sum(len(r.failed) for r in results)
    skipped = sum(len(r.skipped) for r in results)
    applicable = passed + failed
    rate = 100.0 * passed / applicable if applicable else 0.0
    lines.append(f"applicable {applicable}: passed {passed}, failed {failed} ({rate:.1f}% pass); skipped {skipped}; "
                 f"files not applicable {sum(r.not_applicable is not None for r in results)}")
    why = Counter(reason if reason.startswith("not applicable") else "skipped by the test: " + reason
                  for r in results for _, reason in r.skipped)
    lines.append("skipped, by reason:")
    lines += [f"  {n:4d}  {reason}" for reason, n in why.most_common()]
    by_reason = defaultdict(list)
    for r in results:
        for name, reason in r.failed:
            by_reason[reason].append(f"{r.path}::{name}")
    lines.append("failures, by reason:")
    for reason, tests in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"  {len(tests):4d}  {reason}")
        lines += [f"          {t}" for t in tests[:6]] + ([f"          ... {len(tests) - 6} more"] if len(tests) > 6 else [])
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkout", type=Path, help="a vLLM source checkout (has tests/entrypoints/openai)")
    ap.add_argument("--spec", default="zoo/smollm2-135m.yaml")
    ap.add_argument("--files", nargs="*", help="only these files (paths under the checkout)")
    ap.add_argument("--python", type=Path, help="run pytest with this interpreter instead of the runner's venv")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per file")
    ap.add_argument("--out", type=Path, default=Path("/tmp/zooinfer-conformance"), help="junit XML per file")
    ap.add_argument("--reuse", action="store_true", help="report from the XML of the last run where there is one")
    args = ap.parse_args(argv)
    checkout = args.checkout.resolve()
    if not (checkout / SUITE).is_dir():
        ap.error(f"checkout: {checkout / SUITE} does not exist")
    python = args.python or ensure_venv()
    files = [checkout / f for f in args.files] if args.files else server_files(checkout)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for f in files:
        r = run_file(python, checkout, f, args.spec, args.out, args.timeout, args.reuse)
        print(f"{r.path}: {len(r.passed)} passed, {len(r.failed)} failed, {len(r.skipped)} skipped"
              + (f" (n/a: {r.not_applicable})" if r.not_applicable else ""), flush=True)
        results.append(r)
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
