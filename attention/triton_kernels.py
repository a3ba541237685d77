"""Triton kernels for the paged KV cache: the per-step k/v write and varlen paged attention.

Both kernels read the cache in the layout every backend shares,
``[num_blocks, 2 (K|V), block_size, num_kv_heads, head_dim]``, through its strides, and read
q/k/v through theirs, so the (often non-contiguous) projections are never copied, and a
layer packed into a larger pool page (cache/pool_layout.py: its block stride is the pool page,
not its own page) is read in place with no change.

Attention is one flash-attention style program per (query tile, group of query heads sharing
one kv head). Keys are loaded straight from their pages through the block table, one
``TILE_N``-token key tile at a time; a key tile may span pages, so the block size can be
anything (even smaller than the 16 rows ``tl.dot`` needs). The loop runs only over the key
range the tile can see: from the window start of its first query (sliding layers skip pages
wholly outside the window, which may already point at the null block) to its last query's
own position (causal tiles skip the future). Softmax is online in fp32 with ``exp2``.
Attention sinks (gpt-oss: a learned logit per query head in the denominator, with no value)
start a row's running max at its sink and its running sum at 1.

Where kernels run: on CUDA tensors they are compiled; on CPU tensors they run under Triton's
interpreter. The interpreter is chosen per launch, not by a process-wide ``TRITON_INTERPRET``
(which triton reads when ``@triton.jit`` runs, i.e. at import): the kernels below are plain
functions wrapped on first use, the CPU variant inside a ``triton.knobs`` scope, so importing
this module changes nothing for other code in the process.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

# Prefill query tile (tokens) and key tile (tokens); at most MAX_HEADS_PER_PROGRAM query heads
# of one kv head share a program, so a tile has at most 16 * 8 = 128 rows.
PREFILL_BLOCK_Q = 16
TILE_N = 16
MAX_HEADS_PER_PROGRAM = 8
_MIN_DOT = 16   # tl.dot needs every dimension >= 16 on GPU

# The kernels use only builtins plus tl.reduce with triton's own max/sum combiners: helpers
# such as tl.sum or tl.zeros are themselves @triton.jit functions, interpretable only when
# TRITON_INTERPRET was set before triton was first imported, whereas the interpreter maps
# these two combiners to numpy reductions whatever the import order.
_MAX = tl.standard._elementwise_max
_SUM = tl.standard._sum_combine


def _write_kv(k_ptr, v_ptr, cache_ptr, slot_ptr, num_tokens,
              stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
              stride_cb, stride_ckv, stride_cs, stride_ch, stride_cd,
              block_size, head_dim, num_kv_heads,
              BLOCK_T: tl.constexpr, HD_PAD: tl.constexpr):
    """Tokens pid*BLOCK_T ... : k[t], v[t] -> page slot // B, row slot % B. Slots < 0 are
    padding and skipped. Heads and dims are one flattened, masked axis of HD_PAD lanes."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    t_ok = slot >= 0
    slot = tl.where(t_ok, slot, 0)
    j = tl.arange(0, HD_PAD)
    h = j // head_dim
    d = j % head_dim
    j_ok = j < num_kv_heads * head_dim
    mask = t_ok[:, None] & j_ok[None, :]
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64[:, None] * stride_kt + (h * stride_kh + d * stride_kd)[None, :], mask=mask)
    v = tl.load(v_ptr + t64[:, None] * stride_vt + (h * stride_vh + d * stride_vd)[None, :], mask=mask)
    dst = cache_ptr + ((slot // block_size) * stride_cb + (slot % block_size) * stride_cs)[:, None] \
        + (h * stride_ch + d * stride_cd)[None, :]
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def _paged_attention(out_ptr, q_ptr, cache_ptr, block_table_ptr, query_start_loc_ptr, seq_lens_ptr,
                     tile_req_ptr, tile_q_ptr, sinks_ptr, scale_log2e, window,
                     stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
                     stride_cb, stride_ckv, stride_cs, stride_ch, stride_cd, stride_bt,
                     block_size, head_dim,
                     QPK: tl.constexpr, GROUP: tl.constexpr, CHUNKS: tl.constexpr,
                     BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_PAD: tl.constexpr,
                     TILE: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_DTYPE: tl.constexpr,
                     DOT_PREC: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Program (tile, c): queries tile_q[tile] ... + BLOCK_Q of request tile_req[tile], query
    heads GROUP at a time: chunk c % CHUNKS of kv head c // CHUNKS (QPK query heads per kv
    head). Row r of the [BLOCK_M, HEAD_PAD] tile is token r // GROUP, head r % GROUP."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1) // CHUNKS
    req = tl.load(tile_req_ptr + tile)
    q_off = tl.load(tile_q_ptr + tile)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    ctx = tl.load(seq_lens_ptr + req)
    first_pos = ctx - q_len                               # position of the request's first query

    r = tl.arange(0, BLOCK_M)
    tok = q_off + r // GROUP
    in_group = (tl.program_id(1) % CHUNKS) * GROUP + r % GROUP
    row_ok = (r // GROUP < BLOCK_Q) & (tok < q_len) & (in_group < QPK)
    head = kvh * QPK + in_group
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < head_dim
    tok64 = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + (tok64 * stride_qt + head * stride_qh)[:, None] + d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)
    q_pos = first_pos + tok

    # Keys this tile can see: [lo, hi) positions, walked in TILE-token steps aligned to TILE.
    hi = first_pos + tl.minimum(q_off + BLOCK_Q, q_len)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first_pos + q_off - window + 1, 0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.full([BLOCK_M], 0.0, tl.float32)
    if HAS_SINKS:   # the sink as a first key with no value: max = sink (log2 units), sum = 1
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32)
        m = tl.where(row_ok, sink * 1.4426950408889634, m)
        l_sum = tl.where(row_ok, 1.0, l_sum)
    acc = tl.full([BLOCK_M, HEAD_PAD], 0.0, tl.float32)
    n = tl.arange(0, TILE)
    for start in range(lo // TILE * TILE, hi, TILE):
        kpos = start + n
        k_ok = (kpos >= lo) & (kpos < hi)      # never touch a dead page below the window
        blk = tl.load(block_table_ptr + req * stride_bt + kpos // block_size, mask=k_ok, other=0).to(tl.int64)
        row = blk * stride_cb + (kpos % block_size) * stride_cs + kvh * stride_ch   # [TILE]
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(cache_ptr + row[:, None] + d[None, :] * stride_cd, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PREC) * scale_log2e   # [BLOCK_M, TILE]
        allowed = k_ok[None, :] & (kpos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (kpos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.reduce(s, 1, _MAX))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows that saw nothing yet
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.reduce(p, 1, _SUM)
        v = tl.load(cache_ptr + stride_ckv + row[:, None] + d[None, :] * stride_cd, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PREC)
        m = m_new
    acc = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    tl.store(out_ptr + (tok64 * stride_ot + head * stride_oh)[:, None] + d[None, :] * stride_od,
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@functools.cache
def _kernel(fn, interpret: bool):
    """`fn` as a Triton kernel: compiled, or interpreted (for CPU tensors) without turning the
    interpreter on for anything else in the process."""
    if not interpret:
        return triton.jit(fn)
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        return triton.jit(fn)


def _interpret(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" or bool(triton.knobs.runtime.interpret)


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
              torch.float64: tl.float64}


def _dot_dtype(dtype: torch.dtype, interpret: bool):
    """Matmul operands in the query dtype (fp32 accumulation either way), except bf16 under the
    interpreter, whose numpy matmul sees bf16 as raw uint16 bits: there, fp32 operands."""
    if dtype not in _TL_DTYPES:
        raise ValueError(f"triton attention: query dtype {dtype} is not supported "
                         f"(use one of {', '.join(str(d) for d in _TL_DTYPES)})")
    return tl.float32 if interpret and dtype == torch.bfloat16 else _TL_DTYPES[dtype]


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k[t], v[t] ([num_tokens, num_kv_heads, head_dim]) at cache slot slot_mapping[t]."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    hd_pad = _pow2(num_kv_heads * head_dim)
    block_t = max(1, min(64, 4096 // hd_pad))
    _kernel(_write_kv, _interpret(kv_cache))[(triton.cdiv(num_tokens, block_t),)](
        k, v, kv_cache, slot_mapping, num_tokens, *k.stride(), *v.stride(), *kv_cache.stride(),
        kv_cache.shape[2], head_dim, num_kv_heads, BLOCK_T=block_t, HD_PAD=hd_pad)


def paged_attention(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, tile_req: torch.Tensor,
                    tile_q: torch.Tensor, block_q: int, scale: float, window: int | None,
                    sinks: torch.Tensor | None = None) -> None:
    """out[queries of tile i] = attention of request tile_req[i]'s queries tile_q[i] ...
    tile_q[i] + block_q - 1 over its pages; one launch for all tiles of one tile size.
    sinks: None or `[num_heads]` logits joining each row's softmax denominator."""
    num_tiles = tile_req.numel()
    if num_tiles == 0:
        return
    _, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    qpk = num_heads // num_kv_heads
    group = min(_pow2(qpk), MAX_HEADS_PER_PROGRAM)
    chunks = triton.cdiv(qpk, group)
    block_m = max(_MIN_DOT, block_q * group)
    interpret = _interpret(kv_cache)
    if sinks is not None:
        sinks = sinks.detach().to(device=q.device, dtype=torch.float32).contiguous()
    _kernel(_paged_attention, interpret)[(num_tiles, num_kv_heads * chunks)](
        out, q, kv_cache, block_table, query_start_loc, seq_lens, tile_req, tile_q,
        q if sinks is None else sinks, scale * math.log2(math.e), window or 0, *q.stride(), *out.stride(), *kv_cache.stride(),
        block_table.stride(0), kv_cache.shape[2], head_dim,
        QPK=qpk, GROUP=group, CHUNKS=chunks, BLOCK_Q=block_q, BLOCK_M=block_m,
        HEAD_PAD=max(_MIN_DOT, _pow2(head_dim)), TILE=TILE_N, USE_WINDOW=bool(window),
        DOT_DTYPE=_dot_dtype(q.dtype, interpret), DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_SINKS=sinks is not None)


def _gated_delta_step(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, new_state_ptr,
                      stride_qr, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh,
                      stride_gr, stride_br, stride_sr, stride_sh, stride_sk, stride_sv,
                      stride_or, stride_oh, stride_nr, stride_nh, stride_nk, stride_nv,
                      dk, dv, DK_PAD: tl.constexpr, BLOCK_V: tl.constexpr):
    """Program (request, head, value block): the [dk, BLOCK_V] slice of one head's state.
    Value columns of the delta rule are independent, so the state splits along dv."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.arange(0, DK_PAD)
    j = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    i_ok = i < dk
    j_ok = j < dv
    mask = i_ok[:, None] & j_ok[None, :]
    k = tl.load(k_ptr + r * stride_kr + h * stride_kh + i, mask=i_ok, other=0.0).to(tl.float32)
    q = tl.load(q_ptr + r * stride_qr + h * stride_qh + i, mask=i_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + r * stride_vr + h * stride_vh + j, mask=j_ok, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + r * stride_gr + h).to(tl.float32))
    beta = tl.load(beta_ptr + r * stride_br + h).to(tl.float32)
    s = tl.load(state_ptr + r * stride_sr + h * stride_sh + i[:, None] * stride_sk + j[None, :] * stride_sv,
                mask=mask, other=0.0).to(tl.float32) * decay
    delta = (v - tl.reduce(s * k[:, None], 0, _SUM)) * beta       # [BLOCK_V]
    s = s + k[:, None] * delta[None, :]
    out = tl.reduce(s * q[:, None], 0, _SUM)
    tl.store(out_ptr + r * stride_or + h * stride_oh + j, out.to(out_ptr.dtype.element_ty), mask=j_ok)
    tl.store(new_state_ptr + r * stride_nr + h * stride_nh + i[:, None] * stride_nk + j[None, :] * stride_nv,
             s.to(new_state_ptr.dtype.element_ty), mask=mask)


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, new_state: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One Gated DeltaNet decode token per request, the math of
    `models.gated_deltanet.recurrent_gated_delta_step`: q, k [R, H, dk]; v [R, H, dv];
    g, beta [R, H]; state [R, H, dk, dv]. Returns (out [R, H, dv] float32, new state). Pass
    `new_state=state` to update the state in place (each program reads its slice before it
    writes it, and no two programs share a slice)."""
    num_reqs, heads, dk = q.shape
    dv = v.shape[-1]
    if new_state is None:
        new_state = torch.empty_like(state)
    out = torch.empty(num_reqs, heads, dv, dtype=torch.float32, device=q.device)
    if num_reqs == 0:
        return out, new_state
    if g.stride(1) != 1 or beta.stride(1) != 1 or q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("gated_delta_step: q, k, v, g and beta need a unit stride in their last dim")
    block_v = min(_pow2(dv), 64)
    _kernel(_gated_delta_step, _interpret(state))[(num_reqs, heads, triton.cdiv(dv, block_v))](
        q, k, v, g, beta, state, out, new_state, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), g.stride(0), beta.stride(0), *state.stride(), *out.stride()[:2],
        *new_state.stride(), dk, dv, DK_PAD=_pow2(dk), BLOCK_V=block_v)
    return out, new_state
