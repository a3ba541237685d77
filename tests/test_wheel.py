"""The built wheel works on its own: installed (not editable) into a fresh venv, it builds the
C++ CPU kernels from its own copy of the sources (headers included: they are package data)
and generates the same greedy tokens as the in-repo engine.

The fresh venv has no pip and no torch of its own: a .pth line makes this interpreter's
site-packages visible (a path line does not run that directory's .pth files, so the
editable install's finder stays out), and this interpreter's pip installs the wheel into it.
The kernels build in a private ZOOINFER_CACHE (a cold build: most of this test's time).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 23, 40)]
MAX_TOKENS = 12
PACKAGES = ("attention", "cache", "zooinfer_kernels", "models", "runtime")

# Runs inside the fresh venv: one greedy generation, and where everything came from.
SCRIPT = """
import json, sys
import runtime
from zooinfer_kernels import cpu_build
from runtime import LLM, SamplingParams
llm = LLM(sys.argv[1])
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=int(sys.argv[3]),
                                                            ignore_eos=True), use_tqdm=False)
print(json.dumps({"runtime": runtime.__file__, "sources": str(cpu_build.SOURCES),
                  "available": cpu_build.available(), "library": cpu_build.library_path(),
                  "tokens": [o.outputs[0].token_ids for o in outs]}))
"""


def _run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{cmd[:4]} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def _folded_spec(folder: Path) -> Path:
    """zoo/smollm2-tiny.yaml with its base folded in (seeded dummy weights, no tokenizer):
    a spec the installed package runs without anything of the repo."""
    import yaml

    from models import resolve_spec
    from models.spec import spec_to_dict
    path = folder / "smollm2-tiny.yaml"
    path.write_text(yaml.safe_dump(spec_to_dict(resolve_spec(str(REPO / "zoo" / "smollm2-tiny.yaml")))))
    return path


def test_installed_wheel_builds_the_kernels_and_generates_the_same_tokens(tmp_path):
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")
    # Build from a copy of the sources, so the build leaves nothing (build/, *.egg-info) in the repo.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-q", "-w", str(dist), str(src)])
    (wheel,) = dist.glob("zooinfer-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for f in sorted((REPO / "zooinfer_kernels" / "cpu").iterdir()):
        if f.suffix in (".cpp", ".h"):
            assert f"zooinfer_kernels/cpu/{f.name}" in names, f"{f.name} is not in the wheel"

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    ours = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}   # this interpreter's deps (torch, ...)
    (site / "_zooinfer_test_deps.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel)])

    spec = _folded_spec(tmp_path)
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ZOOINFER_CPU_KERNELS")}
    env.update(ZOOINFER_CACHE=str(cache), HF_HUB_OFFLINE="1", TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"))
    out = json.loads(_run([str(py), "-c", SCRIPT, str(spec), json.dumps(PROMPTS), str(MAX_TOKENS)],
                          cwd=tmp_path, env=env).strip().splitlines()[-1])

    assert Path(out["runtime"]).is_relative_to(site), out["runtime"]        # the installed package, not the repo
    assert Path(out["sources"]) == site / "zooinfer_kernels" / "cpu"
    assert out["available"], "the installed package did not build its C++ kernels"
    library = Path(out["library"])
    assert library.is_file() and library.is_relative_to(cache)
    ninja = (library.parent / "build.ninja").read_text()
    assert str(site / "zooinfer_kernels" / "cpu" / "panel_gemm.cpp") in ninja and str(REPO / "zooinfer_kernels") not in ninja

    from runtime import LLM, SamplingParams
    llm = LLM(str(spec))
    want = [o.outputs[0].token_ids for o in
            llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                         use_tqdm=False)]
    assert len({tuple(t) for t in want}) > 1                                # outputs vary: a real comparison
    assert out["tokens"] == want
