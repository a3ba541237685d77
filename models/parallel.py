"""Tensor parallelism: a rank's shard of a causal LM, from the same model loaded whole.

`shard_spec(spec, tp)` divides the sizes the layer kinds' `TPRule`s name (models/kinds),
plus the MLP's and the MoE experts' intermediate sizes; the rank's model is built from that
spec, so each mixer and its cache spec come out at the rank's size with no kind-specific
code here. `shard_model` then fills the rank model from the whole one: every parameter
whose shape shrank in one dim takes its rank's slice of that dim, block by block
(`_segments`: fused q | k | v, gate | up, Mamba2's z | x | B | C | dt ...); a block with
fewer shards than ranks (KV heads, Mamba2 groups) is replicated, rank r taking shard
r * n // tp. Weights that shrank in their input (last) dim make a row-parallel product:
their module's output is all-reduced (a forward hook, so weight packing and module types
stay as they are) and its bias is kept on rank 0 only. An MoE block's routed experts and
shared expert are split in their intermediate dim and the block's summed output is reduced
once. The embedding and LM head split the vocabulary (`VocabParallelEmbedding`,
`TPCausalLM`): greedy rows take each rank's (max, index) and reduce those, never the logits.

The whole model is loaded in every rank first (simple and exact; a rank therefore needs
the memory of the full checkpoint at load time: reading only the rank's slices from the
safetensors files is the next step for models larger than one device).
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from zooinfer_kernels.lm_head import argmax
from models.builder import CausalLM, build_model
from models.kinds import KINDS
from models.layers import GatedRMSNorm
from models.moe import MoE
from models.spec import ModelSpec


@dataclass
class TPGroup:
    """The group a rank's model talks over (a c10d process group object: gloo or NCCL,
    runtime/executor/multiproc.py; tensor-parallel ranks, or pipeline stages, which use
    `send` / `recv` and `broadcast`), and the seconds its collectives took
    (`comm_seconds`, for bench/parallel.py). Collectives wait on the group's timeout."""
    rank: int = 0
    size: int = 1
    group: object = None
    store: object = None               # the TCP store the group was made from (kept alive with it)
    comm_seconds: float = field(default=0.0)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's `t`, in place."""
        start = time.perf_counter()
        self.group.allreduce([t]).wait()
        self.comm_seconds += time.perf_counter() - start
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[size, *t.shape]: every rank's `t`, by rank."""
        start = time.perf_counter()
        out = t.new_empty((self.size * t.shape[0], *t.shape[1:]))
        self.group._allgather_base(out, t.contiguous()).wait()     # the backend's all_gather_into_tensor
        self.comm_seconds += time.perf_counter() - start
        return out.view(self.size, *t.shape)

    def send(self, t: torch.Tensor, dst: int):
        """Start sending `t` to rank `dst` (pipeline stages); returns the work to wait on."""
        start = time.perf_counter()
        work = self.group.send([t.contiguous()], dst, 0)
        self.comm_seconds += time.perf_counter() - start
        return work

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Rank `src`'s next `send`, into `t`."""
        start = time.perf_counter()
        self.group.recv([t], src, 0).wait()
        self.comm_seconds += time.perf_counter() - start
        return t

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s `t` on every rank, in place."""
        start = time.perf_counter()
        self.group.broadcast(t, src).wait()
        self.comm_seconds += time.perf_counter() - start
        return t


# ----------------------------------------------------------------- the rank's spec
def _get(spec, path: str):
    obj = spec
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _set(spec, path: str, value) -> None:
    *head, last = path.split(".")
    obj = spec
    for part in head:
        obj = getattr(obj, part)
    setattr(obj, last, value)


def shard_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    """The spec of one tensor-parallel rank's model: the sizes its kinds' `TPRule`s and the
    MLP / MoE split divided by `tp` (replicated ones set to 1). Raises a one-line ValueError
    naming the field that `tp` cannot split."""
    rank_spec = copy.deepcopy(spec)
    if tp == 1:
        return rank_spec
    split: dict[str, bool] = {}          # path -> may replicate
    for name in dict.fromkeys(k for _, k in spec.cache_layers()):
        rule = KINDS[name].tp
        if rule is None:
            raise ValueError(f"tensor_parallel_size {tp}: layer kind {name} has no tensor-parallel rule")
        reason = rule.check(spec, tp)
        if reason:
            raise ValueError(f"tensor_parallel_size {tp}: {reason}")
        split.update({p: False for p in rule.split})
        split.update({p: True for p in rule.split_or_replicate})
    ffn = {spec.ffn_kind(i) for i in range(spec.num_layers)}
    if "mlp" in ffn:
        split["mlp.intermediate_size"] = False
    if "moe" in ffn:
        if spec.moe.latent_size:
            raise ValueError(f"tensor_parallel_size {tp}: moe.latent_size (latent experts) has no "
                             "tensor-parallel rule")
        split["moe.intermediate_size"] = False
        if spec.moe.shared_expert_intermediate_size:
            split["moe.shared_expert_intermediate_size"] = False
    for path, replicate in split.items():
        n = _get(spec, path)
        if n % tp == 0:
            _set(rank_spec, path, n // tp)
        elif replicate and tp % n == 0:
            _set(rank_spec, path, 1)
        else:
            how = "divide it, nor is it a divisor of it" if replicate else "divide it"
            raise ValueError(f"tensor_parallel_size {tp}: {path} is {n}; the tensor-parallel size must {how}")
    return rank_spec


# ----------------------------------------------------------------- modules
class VocabParallelEmbedding(nn.Module):
    """The rank's rows [start, start + rows) of the embedding (padded to equal rows per rank);
    ids outside them look up zeros, and the all-reduce sums every rank's part."""

    def __init__(self, weight: torch.Tensor, start: int, vocab: int, tp: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.vocab, self.tp = start, vocab, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.tp.all_reduce(x * inside.unsqueeze(-1).to(x.dtype))


class TPCausalLM(CausalLM):
    """A CausalLM whose LM head holds the rank's vocab rows (`lm_head` [rows, hidden],
    `vocab_start`): `compute_logits` gathers the full logits (sampled rows), `greedy_head`
    reduces each rank's (max logit, index) to the first maximum over the vocab, as
    argmax over the gathered logits would (the lowest rank wins a tie)."""
    tp: TPGroup
    vocab_start: int

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        real = self.spec.vocab_size - self.vocab_start      # padding rows of the last rank
        if real < logits.shape[1]:
            logits[:, max(real, 0):] = float("-inf")
        return logits / self.spec.logits_scaling if self.spec.logits_scaling != 1.0 else logits

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        parts = self.tp.all_gather(self._local_logits(hidden))        # [tp, rows, shard]
        return parts.permute(1, 0, 2).reshape(hidden.shape[0], -1)[:, :self.spec.vocab_size]

    @property
    def greedy_head(self):
        return self._greedy

    def _greedy(self, hidden: torch.Tensor, compute_logits=None) -> torch.Tensor:
        logits = self._local_logits(hidden)
        idx = argmax(logits)
        best = torch.stack((logits.gather(1, idx[:, None])[:, 0].double(), (idx + self.vocab_start).double()))
        both = self.tp.all_gather(best)                                 # [tp, 2, rows]
        winner = both[:, 0].argmax(0)                                   # the first rank holding the max
        return both[:, 1].gather(0, winner[None])[0].long()


class _Reduced:
    """Forward hook: all-reduce a row-parallel module's output over the TP group."""

    def __init__(self, tp: TPGroup):
        self.tp = tp

    def __call__(self, module, args, out):
        return self.tp.all_reduce(out)


class ReducedGatedRMSNorm(GatedRMSNorm):
    """A gated norm whose group spans every rank (Mamba2 with one group): the mean of squares
    is all-reduced over the TP group, so each rank normalises by the whole group's RMS."""

    def init_tp(self, tp: TPGroup, full_group: int) -> "ReducedGatedRMSNorm":
        self.tp, self.full_group = tp, full_group
        return self

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        sq = x.pow(2).sum(-1, keepdim=True)
        return x * torch.rsqrt(self.tp.all_reduce(sq) / self.full_group + self.eps)


# ----------------------------------------------------------------- filling the rank model
def _segments(name: str, full: CausalLM, rank: CausalLM, dim: int, full_src: dict, rank_src: dict,
              declared: dict) -> tuple[list[int], list[int]]:
    """(full sizes, rank sizes) of the independently split blocks of param `name`'s dim `dim`."""
    fp, rp = full.get_parameter(name), rank.get_parameter(name)
    if name in declared:
        return declared[name]
    if name.removesuffix(".weight").removesuffix(".bias").removesuffix("_bias").endswith("gate_up_proj"):
        return [fp.shape[dim] // 2] * 2, [rp.shape[dim] // 2] * 2
    fs, rs = full_src.get(name, []), rank_src.get(name, [])
    if dim == 0 and len(fs) > 1 and len(fs) == len(rs) and all(p[2] is not None for p in fs + rs):
        return [p[2] for p in fs], [p[2] for p in rs]
    return [fp.shape[dim]], [rp.shape[dim]]


def _take(t: torch.Tensor, dim: int, full_sizes: list[int], rank_sizes: list[int], rank: int, tp: int,
          name: str) -> torch.Tensor:
    pieces, offset = [], 0
    for f, r in zip(full_sizes, rank_sizes):
        n = f // r if r else 0
        if not r or f % r or (tp % n and n % tp):
            raise ValueError(f"tensor parallel: cannot split {name} dim {dim} ({f} -> {r} rows per rank)")
        pieces.append(t.narrow(dim, offset + (rank * n // tp) * r, r))
        offset += f
    return torch.cat(pieces, dim)


def shard_model(full: CausalLM, rank_spec: ModelSpec, tp: TPGroup) -> tuple[TPCausalLM, list[str]]:
    """The rank's model, filled from `full` (weights loaded, not packed). Returns it and the
    names of its row-parallel modules: `install_reductions` hooks them once packing (which
    may replace linears) is done."""
    p = next(full.parameters())
    model = build_model(rank_spec, p.device, p.dtype, cls=TPCausalLM)
    model.tp = tp
    declared: dict[str, tuple[list[int], list[int]]] = {}
    for (cid, kind, fm), (_, _, rm) in zip(full.mixers(), model.mixers()):
        layer = rank_spec.cache_layers()[cid][0]
        prefix = f"layers.{layer}.{kind.attr}."
        f_seg, r_seg = kind.tp.segments(fm), kind.tp.segments(rm)
        declared.update({prefix + k: (f_seg[k], r_seg[k]) for k in f_seg if k in r_seg})
    full_src, rank_src = full.weight_sources(), model.weight_sources()
    sharded_last: set[str] = set()       # weights split along their input (last) dim: row parallel
    with torch.no_grad():
        for name, rp in model.named_parameters():
            if name.startswith(("embed_tokens.", "lm_head.")):
                continue
            fp = full.get_parameter(name)
            dims = [d for d in range(fp.dim()) if fp.shape[d] != rp.shape[d]]
            if not dims:
                rp.copy_(fp)
                continue
            if len(dims) > 1:
                raise ValueError(f"tensor parallel: {name} shrank in dims {dims}; one is supported")
            d = dims[0]
            rp.copy_(_take(fp, d, *_segments(name, full, model, d, full_src, rank_src, declared),
                           tp.rank, tp.size, name))
            if d == fp.dim() - 1 and d > 0 and not name.endswith("bias"):   # a weight's input dim
                sharded_last.add(name)
        for name, buf in model.named_buffers():   # rotary tables as built; any other buffer from `full`
            fb = full.get_buffer(name)
            if fb.shape != buf.shape:
                raise ValueError(f"tensor parallel: buffer {name} has no split rule ({tuple(fb.shape)} -> "
                                 f"{tuple(buf.shape)})")
            buf.copy_(fb)
        _shard_vocab(full, model, tp)
    row_parallel = _row_parallel(model, sharded_last, tp)
    for name, module in model.named_modules():
        if isinstance(module, GatedRMSNorm) and module.weight.shape != full.get_submodule(name).weight.shape:
            f = full.get_submodule(name)
            f_group = f.group_size or f.weight.shape[0]
            if f_group != (module.group_size or module.weight.shape[0]):
                if f.group_size not in (None, f.weight.shape[0]):
                    raise ValueError(f"tensor parallel: {name} normalises groups that span ranks partly")
                module.__class__ = ReducedGatedRMSNorm
                module.init_tp(tp, f_group)
    return model, row_parallel


def _shard_vocab(full: CausalLM, model: TPCausalLM, tp: TPGroup) -> None:
    """Embedding and LM head rows [rank * rows, (rank + 1) * rows), rows = ceil(vocab / tp),
    zero-padded past the vocabulary (the head masks those logits)."""
    vocab = full.spec.vocab_size
    rows = -(-vocab // tp.size)
    start = tp.rank * rows

    def rows_of(w: torch.Tensor) -> torch.Tensor:
        out = w.new_zeros(rows, w.shape[1])
        n = max(0, min(rows, vocab - start))
        out[:n] = w[start:start + n]
        return out

    model.embed_tokens = VocabParallelEmbedding(rows_of(full.embed_tokens.weight), start, vocab, tp)
    head = nn.Linear(full.spec.hidden_size, rows, bias=False, device=full.lm_head.weight.device,
                     dtype=full.lm_head.weight.dtype)
    if full.spec.tie_word_embeddings:
        head.weight = model.embed_tokens.weight
    else:
        head.weight.data = rows_of(full.lm_head.weight)
    model.lm_head = head
    model.vocab_start = start


def _row_parallel(model: TPCausalLM, sharded_last: set[str], tp: TPGroup) -> list[str]:
    """Modules whose output is a partial sum: an MoE block with split experts (reduced once,
    its parts not), else each module owning a weight split in its input dim. Their output
    biases stay on rank 0 only, so the reduced sum adds them once."""
    moe = [n for n, m in model.named_modules() if isinstance(m, MoE)
           and any(p.startswith(n + ".") for p in sharded_last)]
    names: list[str] = list(moe)
    for pname in sorted(sharded_last):
        owner = pname.rsplit(".", 1)[0]
        if any(owner == m or owner.startswith(m + ".") for m in moe) or owner in names:
            continue
        names.append(owner)
    if tp.rank:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for pname in sharded_last:
                bias = pname[:-len("weight")] + "bias" if pname.endswith(".weight") else pname + "_bias"
                if bias in params:
                    params[bias].zero_()
    return names


def install_reductions(model: nn.Module, names: list[str], tp: TPGroup) -> None:
    """All-reduce the outputs of the row-parallel modules `names` (after weight packing)."""
    hook = _Reduced(tp)
    for n in names:
        model.get_submodule(n).register_forward_hook(hook)


def tp_model(full: CausalLM, tp: TPGroup) -> tuple[TPCausalLM, list[str]]:
    """The rank's model from the whole one: `shard_model(full, shard_spec(full.spec, tp.size), tp)`."""
    return shard_model(full, shard_spec(full.spec, tp.size), tp)
