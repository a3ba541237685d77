"""Weights: stream safetensors into the built model, or fill it with seeded random values.

Only safetensors are read (never pickle). Tensors are opened one at a time with
`safe_open`, copied into their (possibly fused) parameter slice and dropped, so peak memory
is the model plus one tensor. Every shape is checked against the spec, and missing or
unexpected tensors are reported by name in one line. Constant multipliers a family applies to a
projection's input or output (`weight_scales`) are folded into the loaded weights.
"""
from __future__ import annotations

import json
import re
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from models.builder import CausalLM
from models.kinds import KINDS
from models.quant_load import FP8_DTYPES, SCALE_SUFFIX, fp8_block_size, fp8_dequantize
from models.spec import ModelSpec


class WeightError(ValueError):
    """A checkpoint that does not fit its spec; the message names the file and tensor."""


# Checkpoint tensors that carry nothing we use, and the tables a layer kind recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",) + tuple(s for k in KINDS.values() for s in k.derived_tensors)

# Layout changes a weight source may ask for (a 4th entry: names applied left to right), for
# checkpoints that store a tensor otherwise than our param: GPT-OSS's experts are [E, in, out]
# with gate and up columns alternating.
TRANSFORMS = {
    "transpose": lambda t: t.transpose(-1, -2),                          # [.., a, b] -> [.., b, a]
    "deinterleave": lambda t: torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1),   # a0 b0 a1 b1 -> a0 a1 b0 b1
}


def apply_transforms(tensor: torch.Tensor, names: tuple[str, ...]) -> torch.Tensor:
    for name in names:
        tensor = TRANSFORMS[name](tensor)
    return tensor


def copy_source(param: torch.Tensor, tensor: torch.Tensor, offset: int, rows: int,
                transforms: tuple[str, ...] = (), where: str = "") -> None:
    """Copy one checkpoint tensor (after its transforms) into rows [offset, offset + rows) of
    `param`; a tensor with one dim fewer fills a fused [E, r, c] param viewed as [E * r, c]."""
    tensor = apply_transforms(tensor, transforms)
    if tensor.dim() == param.dim() - 1:
        param = param.view(-1, *param.shape[2:])
    expected = (rows, *param.shape[1:])
    if tuple(tensor.shape) != expected:
        raise WeightError(f"{where or 'tensor '}has shape {list(tensor.shape)}, the spec expects {list(expected)}")
    param[offset: offset + rows].copy_(tensor)


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
    flexible = {p: parts for p, parts in sources.items() if any(part[1] is None for part in parts)}
    if not flexible:
        return sources
    wanted = {part[0] for parts in flexible.values() for part in parts}
    rows_of: dict[str, int] = {}
    for file in files:
        with _open(file) as f:
            for name in wanted.intersection(f.keys()):
                rows_of[name] = f.get_slice(name).get_shape()[0]
    sources = dict(sources)
    for param, parts in flexible.items():
        if any(part[0] not in rows_of for part in parts):
            sources[param] = [(part[0], 0, 0) for part in parts]     # reported as missing below
            continue
        offsets = [0]
        for part in parts:
            offsets.append(offsets[-1] + rows_of[part[0]])
        if offsets[-1] != params[param].shape[0]:
            raise WeightError(f"{files[0].parent}: {', '.join(part[0] for part in parts)} have {offsets[-1]} rows "
                              f"together, the spec expects {params[param].shape[0]}")
        sources[param] = [(part[0], off, rows_of[part[0]], *part[3:]) for part, off in zip(parts, offsets)]
    return sources


def _fp8_weight(f, files: list[Path], name: str, tensor: torch.Tensor, dtype: torch.dtype, where: str) -> torch.Tensor:
    """An FP8 checkpoint tensor times its block scales (`<name>_scale_inv`, in any file), in `dtype`."""
    scale = None
    if name + SCALE_SUFFIX in f.keys():
        scale = f.get_tensor(name + SCALE_SUFFIX)
    else:
        for other in files:
            with _open(other) as g:
                if name + SCALE_SUFFIX in g.keys():
                    scale = g.get_tensor(name + SCALE_SUFFIX)
                    break
    if scale is None:
        raise WeightError(f"{where}is {tensor.dtype} but the checkpoint has no '{name}{SCALE_SUFFIX}'")
    try:
        return fp8_dequantize(tensor, scale, fp8_block_size(files[0].parent), dtype)
    except ValueError as e:
        raise WeightError(f"{where}{e}") from None


@torch.no_grad()
def fill_from_safetensors(params: dict[str, torch.Tensor], sources: dict[str, list[tuple]], path: Path) -> list[str]:
    """Fill `params` from the safetensors under `path` as `sources` says (param name ->
    [(checkpoint tensor, row offset, rows[, transforms])]). Raises on a missing tensor or a
    wrong shape; returns the checkpoint tensors no source named."""
    files = _safetensors_files(path)
    sources = _size_by_file(sources, files, params)
    targets: dict[str, tuple] = {}
    for param, parts in sources.items():
        for ckpt_name, offset, rows, *transforms in parts:
            targets[ckpt_name] = (param, offset, rows, tuple(transforms[0]) if transforms else ())
    seen: set[str] = set()
    unused: list[str] = []
    for file in files:
        with _open(file) as f:
            for name in f.keys():
                if name not in targets:
                    if not (name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in targets):
                        unused.append(name)   # an FP8 weight's scales are read with the weight
                    continue
                param_name, offset, rows, transforms = targets[name]
                tensor = f.get_tensor(name)   # a read past a truncated file raises in _open
                if tensor.dtype in FP8_DTYPES:
                    tensor = _fp8_weight(f, files, name, tensor, params[param_name].dtype, f"{file}: tensor '{name}' ")
                copy_source(params[param_name], tensor, offset, rows, transforms, f"{file}: tensor '{name}' ")
                seen.add(name)
    missing = sorted(set(targets) - seen)
    if missing:
        raise WeightError(f"{path}: missing tensors: {_fmt(missing)}")
    return unused


def load_safetensors(model: CausalLM, path: Path) -> None:
    unused = fill_from_safetensors(dict(model.named_parameters()), model.weight_sources(), path)
    tied_head = model.spec.weight_name("lm_head") if model.spec.tie_word_embeddings else None
    skipped = tuple(model.spec.checkpoint.ignore)
    if model.spec.mtp is not None:      # MTP layers load with their head (models/mtp.py), if at all
        from models.mtp import skip_prefix
        skipped += (skip_prefix(model.spec),)
    unexpected = [n for n in unused if n != tied_head and not n.endswith(_IGNORED_SUFFIXES) and not n.startswith(skipped)]
    if unexpected:
        raise WeightError(f"{path}: unexpected tensors (not in the spec): {_fmt(sorted(unexpected))}")


@torch.no_grad()
def fold_weight_scales(model: CausalLM) -> None:
    """Multiply the loaded (or seeded) parameters by the spec's `weight_scales` (constant multipliers a
    family applies to a projection's input or output, Falcon-H1's muP factors): the rows a
    named checkpoint tensor filled are scaled, as a whole or per [rows, scale] segment. A key
    matches a tensor name exactly or, relative to the per-layer prefix, in every layer; a key
    that matches no tensor of the spec is an error (a typo would silently do nothing)."""
    spec = model.spec
    if not spec.weight_scales:
        return
    head, _, tail = spec.weight_name("layer").partition("{i}")
    layer = re.compile(re.escape(head) + r"\d+" + re.escape(tail))
    params = dict(model.named_parameters())
    used: set[str] = set()
    for param_name, parts in model.weight_sources().items():
        for ckpt_name, offset, rows, *_ in parts:
            key = ckpt_name
            if key not in spec.weight_scales and (m := layer.match(ckpt_name)):
                key = ckpt_name[m.end():]
            if key not in spec.weight_scales:
                continue
            used.add(key)
            scale, target = spec.weight_scales[key], params[param_name][offset: offset + rows]
            if isinstance(scale, list):
                if sum(n for n, _ in scale) != rows:
                    raise WeightError(f"{spec.source_file or spec.name}: weight_scales.{key}: segments cover "
                                      f"{sum(n for n, _ in scale)} rows, tensor '{ckpt_name}' has {rows}")
                scale = torch.cat([torch.full((n,), float(v)) for n, v in scale]).view(-1, *[1] * (target.dim() - 1))
            target.copy_(target.float() * scale)
    unused = sorted(set(spec.weight_scales) - used)
    if unused:
        raise WeightError(f"{spec.source_file or spec.name}: weight_scales: no checkpoint tensor of the spec "
                          f"is named {_fmt(unused)}")


@torch.no_grad()
def init_dummy(model: CausalLM, seed: int, std: float) -> None:
    """Seeded random weights: normal(0, std) for matrices, 1 (or 0 for offset norms) for
    norm weights, zero biases; a module with an `init_dummy_(generator)` fills its own integer
    tables. Same seed, same weights, on any machine."""
    from models.layers import RMSNorm
    gen = torch.Generator().manual_seed(seed)
    offset_norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm) and m.offset}
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(0.0 if id(p) in offset_norms else 1.0)
        elif name.endswith(".bias"):
            p.zero_()
        elif p.is_floating_point():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
    for m in model.modules():      # tables random normals do not fit (a hash router's expert ids)
        if hasattr(m, "init_dummy_"):
            m.init_dummy_(gen)


def load_weights(model: CausalLM, spec: ModelSpec) -> None:
    path = checkpoint_dir(spec)
    if path is None:
        init_dummy(model, spec.checkpoint.seed, spec.checkpoint.init_std)
    else:
        load_safetensors(model, path)
    fold_weight_scales(model)
