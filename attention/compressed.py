"""`zooinfer::compressed_attention`: DeepSeek-V4's CSA / HCA attention over paged caches.

One call per layer per step does what HF's `DeepseekV4Attention` + compressor + indexer do
with their dynamic caches, on the pool (plans in attention/compressed_plan.py):

1. write this step's K=V rows into the sliding cache and its compressor source rows
   (`[kv | gate]`, CSA also `[indexer kv | indexer gate]`) into the rows cache;
2. close every window this step completes: gather its source rows back from the pages
   (CSA entry w pools window w-1's Ca half and window w's Cb half, 2m rows; HCA m rows),
   gated softmax with the position bias, kv_norm, the compress rope at position w*m, and
   write the entry (and the indexer key) to its slot;
3. attend: each query sees its sliding window plus the compressed entries visible to it
   (w < (t+1) // m): all of them (HCA) or the indexer's top-k among them (CSA: scores
   sum_h w_{t,h} relu(q_{t,h} . k) * index_dim^-0.5), in one softmax with the per-head sink.
   Values are the keys (shared K=V, MQA).

Vectorised over requests: decodes in one padded part, prefill chunks in another (query
tiles bound the float32 scores, as in attention/mla.py), any chunking. Opaque to
torch.compile (it finds its plans in the forward context by cache id), so the model
compiles with fullgraph and new batch shapes never recompile.
"""
from __future__ import annotations

import torch

from attention.compressed_plan import EntryPart, EntryPlan, RowsPlan
from attention.context import get_forward_context
from attention.mla import SCORE_BYTES, MLAPlan, scatter_tile


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's rope: rotate the last 2 * cos.shape[-1] dims of x in interleaved pairs
    (x0, x1), (x2, x3), ... in float32; cos / sin broadcast against x[..., :r/2] (e.g.
    [T, 1, r/2] for [T, heads, d]). The shared-KV block (models/shared_kv_attention.py) and
    this op's compressed entries both use it."""
    r = 2 * cos.shape[-1]
    nope, rot = x[..., :-r], x[..., -r:].float()
    x1, x2 = rot[..., 0::2], rot[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((nope, out.to(x.dtype)), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's DeepseekV4RMSNorm: float32 statistics and weight, cast back once."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)


def pool_entries(src: torch.Tensor, valid: torch.Tensor, dim: int, overlap: bool, position_bias: torch.Tensor,
                 norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Compressed entries from their windows' source rows.

    src: [E, S, 2C] rows `[kv | gate]` with C = 2*dim (overlap: Ca | Cb halves) or dim;
    valid: [E, S] (False rows get no weight); cos / sin: [E, rope/2] at each entry's w*m."""
    c = src.shape[-1] // 2
    kv, gate = src[..., :c], src[..., c:]
    if overlap:
        m = src.shape[1] // 2
        kv = torch.cat((kv[:, :m, :dim], kv[:, m:, dim:]), dim=1)
        gate = torch.cat((gate[:, :m, :dim] + position_bias[:, :dim], gate[:, m:, dim:] + position_bias[:, dim:]), 1)
    else:
        gate = gate + position_bias
    gate = gate.masked_fill(~valid[..., None], float("-inf"))
    pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
    return rope_tail(rms_norm(pooled, norm_weight, eps), cos, sin)


def _select(iq: torch.Tensor, iw: torch.Tensor, ikeys: torch.Tensor, visible: torch.Tensor,
            topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The lightning indexer's choice: (entry indices [n, rows, k], valid [n, rows, k]), the
    top-k visible entries by sum_h w_h relu(q_h . k) (iq: [n, rows, IH, ID]; iw: [n, rows, IH],
    already scaled). A query that sees fewer than k entries gets invalid picks for the rest."""
    scores = torch.einsum("nrhd,ned->nrhe", iq.float(), ikeys.float()).relu() * iq.shape[-1] ** -0.5
    scores = (scores * iw.float()[..., None]).sum(dim=2).masked_fill(~visible, float("-inf"))
    top = scores.topk(min(topk, scores.shape[-1]), dim=-1).indices
    return top, visible.gather(-1, top)


def _close_windows(meta: list, cache_id: int, rows: torch.Tensor, caches: list[torch.Tensor], dim: int,
                   index_dim: int, params: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                   eps: float) -> None:
    """Write this step's source rows, then pool every window it closes into its entry (and,
    with an indexer, its key) in the pages."""
    ep: EntryPlan = meta[cache_id + 1]
    rp: RowsPlan = meta[cache_id + 2]
    r_cache, csa = caches[2], len(caches) == 4
    r_cache.index_put_((rp.slot_block, rp.slot_offset), rows.to(r_cache.dtype))
    if not rp.num_new:
        return
    src = r_cache[rp.src_block, rp.src_offset].to(rows.dtype)                  # [E, S, R]
    c, s = cos[rp.entry_pos], sin[rp.entry_pos]                                 # rope at w * m
    main = 4 * dim if csa else 2 * dim
    entries = pool_entries(src[..., :main], rp.src_valid, dim, csa, params[0], params[1], eps, c, s)
    caches[1].index_put_((ep.dst_block, ep.dst_slot), entries.to(caches[1].dtype))
    if csa:
        ip: EntryPlan = meta[cache_id + 3]
        keys = pool_entries(src[..., main:], rp.src_valid, index_dim, True, params[2], params[3], eps, c, s)
        caches[3].index_put_((ip.dst_block, ip.dst_slot), keys.to(caches[3].dtype))


def compressed_attend(q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor | None, iq: torch.Tensor | None,
                      iw: torch.Tensor | None, sinks: torch.Tensor, params: list[torch.Tensor],
                      cos: torch.Tensor, sin: torch.Tensor, caches: list[torch.Tensor], cache_id: int,
                      topk: int, scale: float, eps: float) -> torch.Tensor:
    """One V4 attention layer's step (module docstring): CSA (4 caches, `iq` given), HCA
    (3 caches) or sliding only (1 cache, `rows` None: V4's sliding layers, K stored once).

    q: [t, H, D] (normed, roped); kv: [t, D] K=V rows; rows: [t, R] compressor source rows;
    iq: [t, IH, ID] roped indexer queries, iw: [t, IH] their head weights (CSA); params:
    position bias and kv_norm weight of the compressor (then of the indexer, CSA); cos / sin:
    the compress rope tables [positions, rope/2]; caches: sliding, entries, rows (, indexer
    keys) at cache ids `cache_id`, +1, +2 (, +3). Returns [t, H, D]."""
    meta = get_forward_context().layer_meta
    sp: MLAPlan = meta[cache_id]
    k_cache, dim, num_heads = caches[0], q.shape[-1], q.shape[1]
    k_cache.index_put_((sp.slot_block, sp.slot_offset), kv.to(k_cache.dtype))
    compressed, csa = len(caches) > 1, iq is not None
    if compressed:
        _close_windows(meta, cache_id, rows, caches, dim, iq.shape[-1] if csa else 0, params, cos, sin, eps)
    out = q.new_empty(q.shape)
    for i, part in enumerate(sp.parts):
        n, max_q = part.token_index.shape
        keys = k_cache.index_select(0, part.pages).view(n, -1, dim)
        if compressed:
            epart: EntryPart = meta[cache_id + 1].parts[i]
            if csa:     # the indexer scores every visible entry; attention reads only its picks
                ikeys = caches[3].index_select(0, meta[cache_id + 3].parts[i].pages).view(n, -1, iq.shape[-1])
                entry_pages, per_page = epart.pages.view(n, -1), caches[1].shape[1]
            else:       # HCA: every visible entry, dense
                keys = torch.cat((keys, caches[1].index_select(0, epart.pages).view(n, -1, dim)), dim=1)
        keys = keys.to(q.dtype)
        # query tiles bound both float32 score tensors: attention's and (CSA) the indexer's
        per_query = num_heads * (keys.shape[1] + topk) + (iq.shape[1] * ikeys.shape[1] if csa else 0)
        tile = max(1, SCORE_BYTES // (4 * n * per_query))
        for q0 in range(0, max_q, tile):
            index = part.token_index[:, q0: q0 + tile]
            r = index.shape[1]
            queries = q[index]                                                       # [n, r, H, D]
            mask = part.mask[:, 0, q0: q0 + tile]                                   # [n, r, K]
            if compressed and not csa:
                mask = torch.cat((mask, epart.visible(q0, q0 + r)), dim=-1)
            scores = torch.bmm(queries.view(n, r * num_heads, dim), keys.transpose(1, 2)).view(n, r, num_heads, -1)
            if csa:     # the picked entries of each query, gathered from their pages: [n, r, k, D]
                top, picked = _select(iq[index], iw[index], ikeys, epart.visible(q0, q0 + r), topk)
                rows = torch.arange(n, device=top.device)[:, None, None]
                chosen = caches[1][entry_pages[rows, top // per_page], top % per_page].to(q.dtype)
                scores = torch.cat((scores, torch.einsum("nrhd,nrkd->nrhk", queries, chosen)), dim=-1)
                mask = torch.cat((mask, picked), dim=-1)
            scores = scores.float() * scale
            scores = scores.masked_fill(~mask[:, :, None, :], float("-inf"))
            sink = sinks.float().view(1, 1, num_heads, 1).expand(n, r, num_heads, 1)
            probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1].to(q.dtype)
            window = keys.shape[1]
            o = torch.bmm(probs[..., :window].reshape(n, r * num_heads, -1), keys).view(n, r, num_heads, dim)
            if csa:
                o = o + torch.einsum("nrhk,nrkd->nrhd", probs[..., window:], chosen)
            scatter_tile(out, o, index, part.valid, q0, tile)
    return out


@torch.library.custom_op("zooinfer::compressed_attention", mutates_args=("caches",))
def compressed_attention(q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor | None, iq: torch.Tensor | None,
                         iw: torch.Tensor | None, sinks: torch.Tensor, params: list[torch.Tensor],
                         cos: torch.Tensor, sin: torch.Tensor, caches: list[torch.Tensor], cache_id: int,
                         topk: int, scale: float, eps: float) -> torch.Tensor:
    return compressed_attend(q, kv, rows, iq, iw, sinks, params, cos, sin, caches, cache_id, topk, scale, eps)


@compressed_attention.register_fake
def _(q, kv, rows, iq, iw, sinks, params, cos, sin, caches, cache_id, topk, scale, eps):
    return torch.empty_like(q)


def compressed_attention_op():
    """The custom op under torch.compile (opaque to the graph), the plain function in eager."""
    return torch.ops.zooinfer.compressed_attention if torch.compiler.is_compiling() else compressed_attend


__all__ = ["compressed_attend", "compressed_attention", "compressed_attention_op", "pool_entries", "rms_norm",
           "rope_tail"]
