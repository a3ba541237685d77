"""Peer engines for side-by-side benchmarks: where each lives and how to reach it.

Every peer (vLLM CPU, OpenVINO GenAI, llama-cpp-python, CTranslate2) gets its own virtual
environment under ``$ZOOINFER_CACHE/peers/<name>/venv`` (default ``~/.cache/zooinfer/peers``),
never inside the repo and never a dependency of the project: their pins (torch, transformers)
fight ours and each other's. ``python -m bench.peers.setup`` builds them; a runner script in
this folder is then started with the peer's own python as a subprocess (see ``protocol``).

HF transformers ``generate`` and ``generate_batch`` run with the project venv's own python,
in a runner process of their own like the others (``run_hf.py``).
"""
from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name -> runner script in this folder (run by the peer's venv python)
RUNNERS = {
    "vllm": "run_vllm.py",
    "openvino": "run_openvino.py",
    "llamacpp": "run_llamacpp.py",
    "ct2": "run_ct2.py",
    "hf": "run_hf.py",
    "hf-cb": "run_hf.py",
}
VENV_PEERS = ("vllm", "openvino", "llamacpp", "ct2")   # the ones that need their own venv
MARKER = ".zooinfer-peer-ok"


def peers_root() -> Path:
    root = os.environ.get("ZOOINFER_CACHE") or Path.home() / ".cache" / "zooinfer"
    return Path(root) / "peers"


def venv_dir(name: str) -> Path:
    return peers_root() / name / "venv"


def venv_python(name: str) -> Path:
    return venv_dir(name) / "bin" / "python"


def is_installed(name: str) -> bool:
    """True once setup finished for this peer (its marker file exists)."""
    return (venv_dir(name) / MARKER).exists()


def converted_dir(name: str, model_key: str) -> Path:
    """Where a peer keeps its own format of a model (OpenVINO IR, GGUF, CT2), outside the repo."""
    return peers_root() / name / "models" / model_key
