"""swa_shared_kv: DeepSeek-V4's sliding-window layers (HF layer type `sliding_attention` in a
deepseek_v4 config): the shared-KV attention block (models.shared_kv_attention) over the last
`attention.sliding_window` tokens, with per-head sinks, on the main rope (`rope_local`).

The cache is the compressed kinds' K=V sliding rows (`SlidingRowsSpec`): one [head_dim] row
per token, the key that is also the value, stored once; `zooinfer::compressed_attention`
(attention/compressed.py) attends over it with only the sliding part (no entries).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from attention.compressed import compressed_attention_op
from cache.kv_cache_spec import SlidingRowsSpec
from models import shared_kv_attention as skv
from models.kinds.attention import forward       # mixer(positions, hidden, kv_cache)
from models.kinds.base import Fail, LayerKind

if TYPE_CHECKING:
    from models.spec import ModelSpec


class SlidingSharedKV(skv.SharedKVAttention):
    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        q, kv, _ = self.project(positions, x)
        o = compressed_attention_op()(q, kv, None, None, None, self.sinks, [], self.rotary.cos, self.rotary.sin,
                                      [kv_cache], self.layer_id, 0, self.scale, self.eps)
        return self.finish(o, positions)


def cache_spec(spec: ModelSpec, mixer: nn.Module, block_size: int, dtype: torch.dtype) -> SlidingRowsSpec:
    return SlidingRowsSpec(block_size, 1, spec.attention.head_dim, dtype, spec.attention.sliding_window or 0)


def validate(spec: ModelSpec, fail: Fail) -> None:
    skv.validate(spec, fail)
    if not (spec.attention.sliding_window and spec.attention.sliding_window > 0):
        fail("attention.sliding_window", "swa_shared_kv layers need a window > 0")


def import_hf(cfg: dict, spec: dict) -> None:
    skv.import_hf(cfg, spec)
    spec["attention"]["sliding_window"] = cfg.get("sliding_window")


KIND = LayerKind(name="swa_shared_kv", section="compressed_attention", section_spec=skv.CompressedAttentionSection,
                 attr="self_attn", make_mixer=SlidingSharedKV, forward=forward, cache_spec=cache_spec,
                 weight_names=skv.WEIGHT_NAMES, weight_sources=skv.weight_sources, validate=validate,
                 import_hf=import_hf, local_rope=True)
