"""Weights: stream safetensors into the built model, or fill it with seeded random values.

Only safetensors are read (never pickle). Tensors are opened one at a time with
`safe_open`, copied into their (possibly fused) parameter slice and dropped, so peak memory
is the model plus one tensor. Every shape is checked against the spec, and missing or
unexpected tensors are reported by name in one line.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from models.builder import CausalLM
from models.spec import ModelSpec


class WeightError(ValueError):
    """A checkpoint that does not fit its spec; the message names the file and tensor."""


# Checkpoint tensors that carry nothing we use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_dir(spec: ModelSpec) -> Path | None:
    """Directory holding the spec's safetensors (None for dummy weights)."""
    ck = spec.checkpoint
    if ck.source == "dummy":
        return None
    if ck.source == "embedded":
        from models.embedded import ensure_embedded
        return ensure_embedded(ck.name)
    path = spec.resolve_path(ck.path)
    if not path.is_dir():
        raise WeightError(f"{spec.source_file or spec.name}: checkpoint.path: no such directory {path} "
                          f"(download the weights there, or try the architecture with seeded random "
                          f"weights: a spec with `checkpoint: {{source: dummy}}`, e.g. zoo/qwen3-next-small.yaml)")
    return path


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise WeightError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from None
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise WeightError(f"{index}: lists files that are not there: {_fmt(missing)}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightError(f"{path}: no *.safetensors files (only safetensors are loaded, never pickles)")
    return files


@contextmanager
def _open(file: Path):
    """safe_open with its errors (not a safetensors file, truncated, corrupt header, a
    tensor past the end) turned into one line naming the file."""
    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise WeightError(f"{file}: not a readable safetensors file ({why})") from None


def _fmt(names: list[str], limit: int = 5) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _size_by_file(sources: dict[str, list], files: list[Path], params: dict) -> dict[str, list]:
    """Parts given as (name, None, None) are stacked in order with as many rows as the
    checkpoint tensor has: a concatenation whose split points the checkpoint decides (OLMo-
    Hybrid's q/k/v convs, which HF's save_pretrained re-splits into equal thirds). Their
    shapes come from the safetensors headers; the rows must add up to the parameter's."""
    flexible = {p: parts for p, parts in sources.items() if any(off is None for _, off, _ in parts)}
    if not flexible:
        return sources
    wanted = {name for parts in flexible.values() for name, _, _ in parts}
    rows_of: dict[str, int] = {}
    for file in files:
        with _open(file) as f:
            for name in wanted.intersection(f.keys()):
                rows_of[name] = f.get_slice(name).get_shape()[0]
    sources = dict(sources)
    for param, parts in flexible.items():
        if any(name not in rows_of for name, _, _ in parts):
            sources[param] = [(name, 0, 0) for name, _, _ in parts]     # reported as missing below
            continue
        offsets = [0]
        for name, _, _ in parts:
            offsets.append(offsets[-1] + rows_of[name])
        if offsets[-1] != params[param].shape[0]:
            raise WeightError(f"{files[0].parent}: {', '.join(n for n, _, _ in parts)} have {offsets[-1]} rows "
                              f"together, the spec expects {params[param].shape[0]}")
        sources[param] = [(name, off, rows_of[name]) for (name, _, _), off in zip(parts, offsets)]
    return sources


@torch.no_grad()
def load_safetensors(model: CausalLM, path: Path) -> None:
    params = dict(model.named_parameters())
    targets: dict[str, tuple[str, int, int]] = {}
    sources = _size_by_file(model.weight_sources(), _safetensors_files(path), params)
    for param, parts in sources.items():
        for ckpt_name, offset, rows in parts:
            targets[ckpt_name] = (param, offset, rows)
    seen: set[str] = set()
    unexpected: list[str] = []
    tied_head = model.spec.weight_name("lm_head") if model.spec.tie_word_embeddings else None
    for file in _safetensors_files(path):
        with _open(file) as f:
            for name in f.keys():
                if name not in targets:
                    if name != tied_head and not name.endswith(_IGNORED_SUFFIXES):
                        unexpected.append(name)
                    continue
                param_name, offset, rows = targets[name]
                param = params[param_name]
                tensor = f.get_tensor(name)   # a read past a truncated file raises in _open
                if tensor.dim() == param.dim() - 1:   # fused experts [E, r, c] filled as [E * r, c]
                    param = param.view(-1, *param.shape[2:])
                expected = (rows, *param.shape[1:])
                if tuple(tensor.shape) != expected:
                    raise WeightError(f"{file}: tensor '{name}' has shape {list(tensor.shape)}, "
                                      f"the spec expects {list(expected)}")
                param[offset: offset + rows].copy_(tensor)
                seen.add(name)
    missing = sorted(set(targets) - seen)
    if missing:
        raise WeightError(f"{path}: missing tensors: {_fmt(missing)}")
    if unexpected:
        raise WeightError(f"{path}: unexpected tensors (not in the spec): {_fmt(sorted(unexpected))}")


@torch.no_grad()
def init_dummy(model: CausalLM, seed: int, std: float) -> None:
    """Seeded random weights: normal(0, std) for matrices, 1 (or 0 for offset norms) for
    norm weights, zero biases. Same seed, same weights, on any machine."""
    from models.layers import RMSNorm
    gen = torch.Generator().manual_seed(seed)
    offset_norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm) and m.offset}
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(0.0 if id(p) in offset_norms else 1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)


def load_weights(model: CausalLM, spec: ModelSpec) -> None:
    path = checkpoint_dir(spec)
    if path is None:
        init_dummy(model, spec.checkpoint.seed, spec.checkpoint.init_std)
    else:
        load_safetensors(model, path)
