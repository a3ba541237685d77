"""The KV cache dtype: which element type attention K/V pages hold (`kv_cache_dtype`).

`auto` keeps the model's dtype (the engine's behaviour before the option existed). The others
change only the pages of attention-like layers (full / sliding attention, MLA latents, ...):
state layers (Mamba2, Gated DeltaNet) keep their float32 states whatever is chosen, and the
model computes in its own dtype, converting on every store into the pages and every read:

- `float32`, `bfloat16`: plain element types. A bf16 page is half an fp32 page, so the same
  `kv_cache_memory` buys twice the blocks. On CPU the C++ kernels convert on store (round to
  nearest even, as `Tensor.to`) and read bf16 with fp32 accumulation.
- `int8`: attention (K/V) pages only, quantized symmetrically per (token, kv head) with one
  float32 scale each, stored in the same page after the K and V data
  (`cache.kv_cache_spec.AttentionSpec`, `attention/kv_quant.py`), so prefix caching, copy-on-
  write, swap and the tiers move the scales with the page bytes they belong to.
- `fp8_e4m3`: `torch.float8_e4m3fn` pages for the GPU backends; refused on CPU, where neither
  the C++ kernels nor the torch path attend from fp8 pages.
"""
from __future__ import annotations

import torch

KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8,
                   "fp8_e4m3": torch.float8_e4m3fn}
# Torch dtypes whose pages carry per-(token, head) scales next to the data.
QUANTIZED = (torch.int8,)


def check_kv_cache_dtype(name) -> None:
    """Raise a one-line ValueError unless `name` is a known kv_cache_dtype."""
    if name != "auto" and name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(KV_CACHE_DTYPES)}, got {name!r}")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: str, backend: str = "torch") -> torch.dtype:
    """The page dtype for kv_cache_dtype `name` with a model computing in `model_dtype` on
    `device` through attention backend `backend`."""
    check_kv_cache_dtype(name)
    if name == "auto":
        return model_dtype
    if name == "int8" and backend != "torch":
        raise ValueError(f"kv_cache_dtype int8 needs attention_backend='torch' (the {backend} kernels read no "
                         f"int8 scales); use bfloat16 or fp8_e4m3 there")
    if name == "fp8_e4m3" and not str(device).startswith("cuda"):
        raise ValueError("kv_cache_dtype fp8_e4m3 needs device='cuda' (no CPU kernel or torch path attends from "
                         "fp8 pages); use bfloat16 or int8 on CPU")
    return KV_CACHE_DTYPES[name]


def check_specs(layer_specs: dict, dtype: torch.dtype) -> None:
    """Refuse (one line naming the layer) a quantized KV dtype for a layer whose pages have no
    room for scales: only 5-D K/V attention pages (`AttentionSpec`) carry them."""
    if dtype not in QUANTIZED:
        return
    from cache.kv_cache_spec import AttentionSpec, StateSpec
    for layer, spec in sorted(layer_specs.items()):
        if isinstance(spec, StateSpec):     # float32 states whatever the KV dtype
            continue
        if not isinstance(spec, AttentionSpec) or type(spec).cache_shape is not AttentionSpec.cache_shape:
            raise ValueError(f"kv_cache_dtype int8: cache {layer} ({type(spec).__name__}) has no per-token scales; "
                             f"int8 pages are for full / sliding attention layers, use bfloat16 for this model")
