"""Quantization at load time: the spec's (or the engine's) `quantization` applied to a loaded model,
and FP8 block-scaled checkpoint tensors decoded as they are read.

`apply_quantization` runs after `load_weights` and before `prepack_linears` (which then packs
only the linears left in float): `gguf` takes the linears' blocks from the checkpoint's GGUF
(models/quant_gguf.py), `int8` / `int4` / `int4_asym` quantize the loaded float weights
(models/quant.py). The LM head follows `quantization.lm_head` (int8 under the 4-bit methods);
`quantization.activations` (float32 / int8 / int8_bf16) says what x the products use. A quantized
head also gets the norms of its greedy screen (`attach_head_screen`, zooinfer_kernels/quant_head.py).

FP8 (e4m3) checkpoints as DeepSeek-V3 and Qwen3-Next ship them: each `*.weight` is float8 with a
`*.weight_scale_inv` of one float32 per 128 x 128 block (`quantization_config.weight_block_size`
in config.json); the loader calls `fp8_dequantize` on each such tensor, so the model runs in its
compute dtype. A first step: there is no FP8 kernel (the weights take their float size in memory).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from zooinfer_kernels.head_amx import make_amx_screen
from zooinfer_kernels.quant_head import make_quant_screen
from models.quant import QuantLinear, quantize_int4, quantize_int8
from models.spec import QUANT_METHODS, ModelSpec

FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
SCALE_SUFFIX = "_scale_inv"


def gguf_path(spec: ModelSpec) -> Path:
    """The GGUF holding the spec's quantized weights: the embedded model's, or the one *.gguf in
    an `hf` checkpoint directory."""
    ck = spec.checkpoint
    where = spec.source_file or spec.name
    if ck.source == "embedded":
        from models.embedded import embedded_gguf
        return embedded_gguf(ck.name)
    if ck.source == "hf":
        files = sorted(spec.resolve_path(ck.path).glob("*.gguf"))
        if len(files) == 1:
            return files[0]
        raise ValueError(f"{where}: quantization.method gguf needs exactly one *.gguf next to the safetensors in "
                         f"{spec.resolve_path(ck.path)}, found {len(files)}")
    raise ValueError(f"{where}: quantization.method gguf needs a checkpoint with a GGUF (source embedded or hf)")


@torch.no_grad()
def apply_quantization(model: nn.Module, spec: ModelSpec, method: str | None = None) -> dict[str, str]:
    """Swap the model's linears for `QuantLinear`s as `method` (default: the spec's) says;
    returns {module name: format}. `none` changes nothing."""
    q = spec.quantization
    method = q.method if method is None else method
    if method not in QUANT_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANT_METHODS)}, got {method!r}")
    if method == "none":
        return {}
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(f"quantization {method!r} runs on CPU only (the model is on {device}); use quantization='none'")
    if method == "gguf":
        from models.quant_gguf import quantize_from_gguf
        done = quantize_from_gguf(model, gguf_path(spec), lm_head=q.lm_head, activations=q.activations)
        attach_head_screen(model)
        return done
    make = {"int8": quantize_int8,
            "int4": lambda w: quantize_int4(w, q.group_size, symmetric=True),
            "int4_asym": lambda w: quantize_int4(w, q.group_size, symmetric=False)}[method]
    done: dict[str, str] = {}
    targets = [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear]
    for name, module in targets:
        if name == "lm_head" and not q.lm_head:
            continue
        # the head (the logits) takes int8 under the 4-bit methods, as GGUF files keep it at 6-8 bits:
        # in 4 bits it alone cost SmolLM2 most of its top-1 agreement (bench/quant.py)
        fmt = "int8" if name == "lm_head" else method
        bias = module.bias.detach() if module.bias is not None else None
        parent, _, child = name.rpartition(".")
        qw = (quantize_int8 if fmt == "int8" else make)(module.weight.detach())
        setattr(model.get_submodule(parent) if parent else model, child, QuantLinear(qw, bias, q.activations))
        done[name] = fmt
    attach_head_screen(model)
    return done


def attach_head_screen(model: nn.Module) -> None:
    """Give a quantized LM head the norms that let greedy steps take its argmax from the int8
    product, decided exactly (`quant_screen`, zooinfer_kernels/quant_head.py), and for steps past its
    16 rows its bf16 copy screened on AMX (`amx_screen`, zooinfer_kernels/head_amx.py); nothing
    where a kernel cannot run (the greedy head then computes the logits)."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, QuantLinear) and head.bias is None:
        head.quant_screen = make_quant_screen(head.qweight)
        head.amx_screen = make_amx_screen(head.qweight, head.quant_screen)   # batched steps, AMX only


def fp8_block_size(path: Path) -> tuple[int, int]:
    """`quantization_config.weight_block_size` of the checkpoint's config.json, default 128 x 128."""
    try:
        cfg = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        cfg = {}
    block = cfg.get("weight_block_size") or [128, 128]
    return int(block[0]), int(block[1])


def fp8_dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A float8 weight [N, K] times its per-block scales [ceil(N/bn), ceil(K/bk)] (the last
    blocks may be partial), in `dtype`."""
    n, k = weight.shape
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"has scale_inv of shape {list(scale_inv.shape)}, {block[0]}x{block[1]} blocks of "
                         f"[{n}, {k}] need {list(want)}")
    s = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (weight.float() * s).to(dtype)
