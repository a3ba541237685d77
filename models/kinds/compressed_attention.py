"""compressed_sparse_attention (CSA) and heavily_compressed_attention (HCA): DeepSeek-V4's
attention layers with a compressor, sized by the `compressed_attention:` section.

The shared-KV attention block (`SharedKVAttention`: low-rank queries, one K=V row per token,
grouped output projection, sinks) is the sliding layers'; these layers add a compressor
(models/compressor.py) whose entries every query attends to beside its sliding window, in
one softmax: HCA (rate m', non-overlapping windows) all entries closed so far, CSA (rate m,
windows overlapping by one) the top `index_topk` the lightning indexer picks.

Caches: a layer owns several (`LayerKind.num_caches`), each its own KV cache group in the one
pool, all at the engine's block size, so prefix hits, copy-on-write forks, preemption and
freeing are the existing machinery's, with no scheduler special case:

    0  K=V sliding rows      SlidingRowsSpec(window W)              one [head_dim] row per token
    1  compressed entries    CompressedEntrySpec(m, head_dim)       kept like full attention
    2  source rows           SlidingRowsSpec(window 2m CSA / m HCA) the unclosed-window buffer
    3  indexer keys (CSA)    CompressedEntrySpec(m, index_head_dim)

Why the buffer is a sliding group rather than per-request state: the rows a window still to
close can read are exactly those of the last 2m (CSA: entry w pools windows w-1 and w) or m
(HCA) positions, so a sliding window of them holds the buffer and the CSA overlap state,
and a prefix hit at any 16-token boundary restores both exactly from cached row blocks: no
checkpoint copies (which a StateSpec would need, one per hit point) and nothing to roll
back (a rejected draft token's row, or an entry it closed, is simply rewritten when the real
token at that position is computed). The price: like any sliding group, a prefill chunk
holds its own rows' blocks until the window slides past them (CSA: 2560 values a token at
V4-Flash size), which dominates a short request's pool use at large chunks. An entry sits in the block of the token that closes it (cache/kv_cache_spec.py), so
HCA (m' = 128 > 16) allocates only every 8th block of its entry table and pays entry bytes
/ 128 per token. The rope of these layers and their compressor is `rope` (V4's "compress"
rope); the sliding layers' is `rope_local` (V4's "main").
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from attention.compressed import compressed_attention_op
from cache.kv_cache_spec import CompressedEntrySpec, SlidingRowsSpec
from models import shared_kv_attention as skv
from models.compressor import Compressor, compressor_sources
from models.kinds.base import Fail, LayerKind, Sources
from models.shared_kv_attention import SharedKVAttention

if TYPE_CHECKING:
    from models.spec import ModelSpec

CSA_NAME, HCA_NAME = "compressed_sparse_attention", "heavily_compressed_attention"
WEIGHT_NAMES = {"skv_compressor": "attn.compressor", "skv_indexer": "attn.indexer"}


def compress_rate(spec: ModelSpec, kind: str) -> int:
    return int(spec.compressed_attention.compress_rates[kind])


class CompressedAttention(SharedKVAttention):
    """A CSA or HCA layer on the flattened token dimension; `layer_id` is its first cache id."""

    def __init__(self, spec: ModelSpec, layer_id: int, rotary: nn.Module, kind: str):
        super().__init__(spec, layer_id, rotary)
        sec, a = spec.compressed_attention, spec.attention
        self.csa = kind == CSA_NAME
        self.topk = sec.index_topk if self.csa else 0
        self.compressor = Compressor(spec.hidden_size, a.head_dim, compress_rate(spec, kind), sec.q_lora_rank,
                                     sec.index_n_heads if self.csa else 0, sec.index_head_dim if self.csa else 0)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, caches: list[torch.Tensor]) -> torch.Tensor:
        q, kv, q_residual = self.project(positions, x)
        c = self.compressor
        cos, sin = self.rotary.cos, self.rotary.sin
        iq = iw = None
        if self.csa:
            iq, iw = c.index_queries(q_residual, x, cos[positions], sin[positions])
        o = compressed_attention_op()(q, kv, c.rows_proj(x), iq, iw, self.sinks, c.params(), cos, sin,
                                      list(caches), self.layer_id, self.topk, self.scale, self.eps)
        return self.finish(o, positions)


def forward(mixer: nn.Module, layer_id: int, positions: torch.Tensor, hidden: torch.Tensor,
            caches: list[torch.Tensor]) -> torch.Tensor:
    return mixer(positions, hidden, caches)


def cache_spec(spec: ModelSpec, mixer: CompressedAttention, block_size: int, dtype: torch.dtype) -> tuple:
    a, sec, m = spec.attention, spec.compressed_attention, mixer.compressor.position_bias.shape[0]
    specs = [SlidingRowsSpec(block_size, 1, a.head_dim, dtype, a.sliding_window),
             CompressedEntrySpec(block_size, m, a.head_dim, dtype),
             SlidingRowsSpec(block_size, 1, mixer.compressor.row_dim, dtype, 2 * m if mixer.csa else m,
                             compress_rate=m, overlap=mixer.csa)]
    if mixer.csa:
        specs.append(CompressedEntrySpec(block_size, m, sec.index_head_dim, dtype))
    for s in specs:
        if isinstance(s, CompressedEntrySpec):
            s.check()
    return tuple(specs)


def weight_sources(spec: ModelSpec, mixer: CompressedAttention, ours: str, hf: str) -> Sources:
    """The shared block's tensors (as the sliding layers'), then the compressor's."""
    src = skv.weight_sources(spec, mixer, ours, hf)
    indexer = hf + spec.weight_name("skv_indexer") if mixer.csa else None
    src.update(compressor_sources(ours + "compressor.", hf + spec.weight_name("skv_compressor"), indexer,
                                  spec.attention.head_dim, spec.compressed_attention.index_head_dim))
    return src


def _validate(kind: str):
    def validate(spec: ModelSpec, fail: Fail) -> None:
        skv.validate(spec, fail)
        sec = spec.compressed_attention
        rates = sec.compress_rates if isinstance(sec.compress_rates, dict) else {}
        m = rates.get(kind)
        if not isinstance(m, int) or m <= 0 or (16 % m and m % 16):
            fail(f"compressed_attention.compress_rates.{kind}",
                 f"must be a positive int dividing 16 or a multiple of 16, got {m!r}")
        if not (spec.attention.sliding_window and spec.attention.sliding_window > 0):
            fail("attention.sliding_window", f"{kind} layers need a window > 0")
        if kind == CSA_NAME:
            for name in ("index_n_heads", "index_head_dim", "index_topk"):
                if not getattr(sec, name) or getattr(sec, name) <= 0:
                    fail(f"compressed_attention.{name}", f"must be > 0 for {kind} layers, got {getattr(sec, name)}")
            rotary = int(spec.attention.head_dim * spec.rope.partial_rotary_factor)
            if sec.index_head_dim < rotary:
                fail("compressed_attention.index_head_dim", f"the indexer ropes its last {rotary} dims (the "
                                                            f"model's rotary dim): needs >= {rotary}, got {sec.index_head_dim}")
    return validate


def import_hf(cfg: dict, spec: dict) -> None:
    """DeepseekV4Config's compressor and indexer fields (and the shared block's, and the
    window every V4 attention layer has)."""
    skv.import_hf(cfg, spec)
    rates = cfg.get("compress_rates") or {CSA_NAME: cfg.get("compress_rate_csa", 4),   # older configs' scalars
                                          HCA_NAME: cfg.get("compress_rate_hca", 128)}
    spec["compressed_attention"].update(compress_rates={k: int(v) for k, v in rates.items()},
                                        index_n_heads=cfg["index_n_heads"], index_head_dim=cfg["index_head_dim"],
                                        index_topk=cfg["index_topk"])
    spec["attention"]["sliding_window"] = cfg.get("sliding_window")


def _kind(name: str) -> LayerKind:
    return LayerKind(name=name, section="compressed_attention", section_spec=skv.CompressedAttentionSection,
                     attr="self_attn",
                     make_mixer=lambda spec, layer_id, rotary: CompressedAttention(spec, layer_id, rotary, name),
                     forward=forward, cache_spec=cache_spec, weight_names={**skv.WEIGHT_NAMES, **WEIGHT_NAMES},
                     weight_sources=weight_sources, validate=_validate(name), hf_layer_types=(name,),
                     import_hf=import_hf, num_caches=4 if name == CSA_NAME else 3)


CSA = _kind(CSA_NAME)
HCA = _kind(HCA_NAME)
