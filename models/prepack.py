"""Pre-packed weights for the CPU float32 linears (`prepack_linears`): which linears, which copy.

Why: a decode step multiplies few rows (one per running request) by every weight of the
model. The weights do not fit the cache, so the step streams all of them from DRAM, and
`F.linear` (MKL sgemm) also re-packs each weight into its blocked layout on every call.

Two kinds of packed copy; each linear holds exactly one, and `choose_kind` picks one per model:
- panels (needs the C++ kernel library, `cpu_build.available()`): column panels
  (`zooinfer_kernels.gemm.pack_panels`) multiplied by `zooinfer_kernels.gemm.panel_linear`, which streams each
  weight byte once in address order while the FMA units work on the previous ones. Chosen
  when the model's linear weights exceed the last-level cache (`PANEL_MIN_WEIGHT_BYTES`), so
  a decode step streams them from DRAM, or when the start-up probe measured the panel kernel
  faster than MKL's packed GEMM on a cached weight (`zooinfer_kernels.gemm_choice`: AMD Zen 4); used
  for products of up to `PANEL_MAX_ROWS` rows (decode steps). Larger ones (prefill chunks)
  run the blocked panel kernel (`gemm.panel_linear_blocked`) where the probe measured it
  faster than `F.linear` (MKL sgemm), else `F.linear` on the original weight.
- MKL packed (weights that stay cached, where the products are compute-bound, or no kernel
  library; torch built with MKL): `cblas_sgemm_pack` once at load, `cblas_sgemm_compute` per
  call, as `torch.ops.mkl._mkl_reorder_linear_weight` / `torch.ops.mkl._mkl_linear`
  (inductor's weight freezing uses them). `_mkl_linear` uses the packed weight only when the
  row count equals its `prepack_batch_size` argument; MKL's packed layout for B does not
  depend on the row count, so we pass the actual row count on every call. Products above
  `MKL_MAX_ROWS` rows run `F.linear`.
The row limits and the cache threshold are where one path overtook the other on the
project's bench machine; the README ("Execution", `panel_gemm`) has the measurements.

Each packed weight is checked right after packing against `F.linear` at several row counts
(for MKL the row-count reuse is an observation, not a documented promise); a weight that fails
stays a plain `nn.Linear` (and a warning says so).

Under torch.compile the packed product runs as the opaque custom op `zooinfer::packed_linear`
(dynamo cannot trace an MKL-DNN tensor nor the C++ op's choice), which finds the packed
weight by key.

The LM head gets panels whatever the model's kind (when the kernel library is built), so
greedy steps can take their tokens straight from them without logits (`linear_argmax`;
`zooinfer_kernels.lm_head.GreedyHead` decides when). Where a screen instruction set is usable
(`lm_head.screen_isa()`: AMX, AVX-512 BF16 or AVX2) the head also gets a bf16 copy (an int16 one
on AVX2) laid out for it (`lm_head.make_screen`, checked here against `linear_argmax`) for `screened_argmax`; it costs
half the head's fp32 bytes more.

Memory: the packed copy is as large as the weight (panels: plus the padding of N to a multiple
of 32; MKL: the allocation is larger but its tail is never touched), and the original stays
(ties, state dicts, large products and fallbacks use it), so packed linears take twice their
weight bytes. `EngineConfig.prepack_weights=False` turns it off.
"""
from __future__ import annotations

import itertools
import warnings
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from zooinfer_kernels import cpu_build, gemm, gemm_choice, lm_head

_PACKED: dict[int, tuple[str, torch.Tensor, bool]] = {}   # key -> (kind, packed, blocked), for the compiled path
_keys = itertools.count()
_CHECK_ROWS = (1, 3, 17, 64)
PANEL_MAX_ROWS = 64         # products of more rows run F.linear (panels stop winning past 64 rows)
MKL_MAX_ROWS = 256          # likewise for MKL packing (F.linear is as fast from 512 rows)


def _last_level_cache_bytes() -> int:
    """Size of the largest CPU cache (sysfs), 32 MiB when it cannot be read."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
            best = max(best, int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1], 0))
        except (OSError, ValueError, IndexError):
            continue
    return best or 32 << 20


# Panels pay off when the weights stream from DRAM on every decode step, i.e. do not fit the
# last-level cache; weights that stay cached are compute-bound there, where MKL's packed
# kernel is faster. Read once at import.
PANEL_MIN_WEIGHT_BYTES = _last_level_cache_bytes()


def mkl_supported() -> bool:
    """Whether this torch build has the MKL packed-GEMM ops."""
    return bool(getattr(torch._C, "has_mkl", False)) and hasattr(torch.ops.mkl, "_mkl_linear")


def supported() -> bool:
    """Whether weights can be packed here: the C++ panel kernel or MKL's packed GEMM."""
    return cpu_build.available() or mkl_supported()


def _checked_screen(w: torch.Tensor, panels: torch.Tensor) -> lm_head.HeadScreen | None:
    """`lm_head.make_screen(w)` if `screened_argmax` on it returns `linear_argmax`'s tokens for
    random rows (as packed weights are checked against `F.linear`), else None with a warning."""
    screen = lm_head.make_screen(w)
    if screen is None:
        return None
    x = torch.randn(max(_CHECK_ROWS), w.shape[1], generator=torch.Generator().manual_seed(0))
    want = lm_head.linear_argmax(x, panels, w.shape[0])
    got = lm_head.screened_argmax(x, panels, w.shape[0], screen)
    if not torch.equal(got, want):
        warnings.warn("the LM head's screen disagreed with its fp32 argmax; greedy steps use the fp32 "
                      "kernel", RuntimeWarning, stacklevel=3)
        return None
    return screen


def _packed_matmul(x: torch.Tensor, kind: str, packed: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None, blocked: bool = False) -> torch.Tensor:
    """The product on the packed copy; `blocked`: panel products past PANEL_MAX_ROWS rows run
    the blocked panel kernel instead of F.linear."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if kind == "mkl":
        if rows > MKL_MAX_ROWS:
            return F.linear(x, weight, bias)
        return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)
    if rows > PANEL_MAX_ROWS and not blocked:
        return F.linear(x, weight, bias)
    x2 = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(rows, k)
    op = gemm.panel_linear_blocked if rows > PANEL_MAX_ROWS else gemm.panel_linear
    out = op(x2, packed, weight.shape[0], bias)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], weight.shape[0])


def gate_up_act(linear: nn.Module, x: torch.Tensor, act: int) -> torch.Tensor | None:
    """act(gate) * up (`act`: the act_mul kernel's kind) computed in the blocked panel kernel's
    epilogue (`gemm.panel_linear_blocked_act`) when `linear` (a gated MLP's gate_up) has blocked
    panels and x (fp32, eager) has more rows than PANEL_MAX_ROWS; None otherwise (the caller runs
    the product, then act_mul). Bit for bit the unfused result."""
    if not isinstance(linear, PackedLinear) or not linear.blocked:
        return None
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if rows <= PANEL_MAX_ROWS:
        return None
    x2 = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(rows, k)
    out = gemm.panel_linear_blocked_act(x2, linear.packed, linear.out_features, linear.bias, act)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


@torch.library.custom_op("zooinfer::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: int) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed with the packed copy of `weight` registered under `key`."""
    return _packed_matmul(x, *_PACKED[key][:2], weight, bias, _PACKED[key][2])


@packed_linear.register_fake
def _(x, weight, bias, key):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class PackedLinear(nn.Module):
    """An `nn.Linear` whose product runs on a packed copy of its weight (`kind` "panel" or
    "mkl", see the module docstring). Holds the same `weight` / `bias` Parameters as the
    module it replaces (ties survive)."""

    def __init__(self, linear: nn.Linear, packed: torch.Tensor, kind: str, blocked: bool = False):
        super().__init__()
        if kind not in ("panel", "mkl"):
            raise ValueError(f"PackedLinear: kind must be 'panel' or 'mkl', got {kind!r}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.kind = kind
        self.packed = packed                 # a plain attribute, not a buffer (state dicts stay unchanged)
        self.blocked = kind == "panel" and blocked   # rows past PANEL_MAX_ROWS: blocked panel kernel
        self.screen: lm_head.HeadScreen | None = None   # the LM head's screen copy, set by `prepack_linears`
        self.key = next(_keys)
        _PACKED[self.key] = (kind, packed, self.blocked)
        weakref.finalize(self, _PACKED.pop, self.key, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.zooinfer.packed_linear(x, self.weight, self.bias, self.key)
        return _packed_matmul(x, self.kind, self.packed, self.weight, self.bias, self.blocked)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, packed={self.kind}{', blocked' if self.blocked else ''}")


def _pack(linear: nn.Linear, kind: str | None = None, blocked: bool = False) -> tuple[torch.Tensor, str] | None:
    """(packed weight, kind), or None when this weight cannot use it or the check fails.
    `kind` None picks panels when the kernel library is available, else MKL. `blocked`: the
    check also runs a product past PANEL_MAX_ROWS rows (the blocked panel kernel's)."""
    w = linear.weight
    if w.device.type != "cpu" or w.dtype != torch.float32 or not w.is_contiguous() or w.numel() == 0:
        return None
    b = linear.bias
    if b is not None and (b.dtype != torch.float32 or b.device.type != "cpu"):
        return None
    if kind is None:
        kind = "panel" if cpu_build.available() else "mkl" if mkl_supported() else None
    if kind is None:
        return None
    with torch.no_grad():
        w = w.detach()
        packed = gemm.pack_panels(w) if kind == "panel" else torch.ops.mkl._mkl_reorder_linear_weight(w, 64)
        gen = torch.Generator().manual_seed(0)
        for rows in _CHECK_ROWS + ((PANEL_MAX_ROWS + 37,) if blocked and kind == "panel" else ()):
            x = torch.randn(rows, w.shape[1], generator=gen)
            want = F.linear(x, w, b)
            got = _packed_matmul(x, kind, packed, w, None if b is None else b.detach(), blocked)
            tol = 1e-4 * (1.0 + want.abs().max().item())
            if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=tol):
                return None
    return packed, kind


def choose_kind(weight_bytes: int) -> str | None:
    """The packed kind for a model whose packable linear weights take `weight_bytes`: panels
    when they exceed the last-level cache (or MKL is missing, or the start-up probe measured
    panels faster than MKL on a cached weight: `gemm_choice`), else MKL (or panels when only
    the kernel library exists); None when neither is available."""
    panels, mkl = cpu_build.available(), mkl_supported()
    if panels and (weight_bytes > PANEL_MIN_WEIGHT_BYTES or not mkl or gemm_choice.choice().panels_in_cache):
        return "panel"
    return "mkl" if mkl else None


def prepack_linears(model: nn.Module, kind: str | None = None, head: str | None = "lm_head") -> int:
    """Replace every CPU float32 `nn.Linear` of `model` with a `PackedLinear`; returns how
    many were packed. `kind` None: `choose_kind` by the model's total linear weight bytes.
    The linear named `head` on `model` itself gets panels whatever the kind, when the kernel
    library is built: greedy steps take their tokens from those panels without logits
    (`linear_argmax`), and the head is the largest weight, streamed every step, where panels
    lose little to MKL even in cache; where the CPU has a screen instruction set (AMX, AVX-512 BF16, AVX2) it also gets a
    screen (`make_screen`: bf16, or int16 on AVX2).
    A no-op (0) when neither the library nor MKL exists."""
    if not supported():
        return 0
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    if kind is None:
        weights = {id(c.weight): c.weight for _, _, c in targets
                   if c.weight.device.type == "cpu" and c.weight.dtype == torch.float32}
        kind = choose_kind(sum(w.numel() * w.element_size() for w in weights.values()))
        if kind is None:
            return 0
    packed, failed = 0, []
    blocked = gemm_choice.large_rows_use_blocked()
    head_on_panels = head is not None and cpu_build.available()
    for parent, name, child in targets:
        is_head = head_on_panels and parent is model and name == head
        p = _pack(child, "panel" if is_head else kind, blocked)
        if p is None:
            if child.weight.device.type == "cpu" and child.weight.dtype == torch.float32:
                failed.append(name)
            continue
        linear = PackedLinear(child, *p, blocked=blocked)
        if is_head and lm_head.screen_isa() is not None:
            linear.screen = _checked_screen(child.weight.detach(), linear.packed)
        setattr(parent, name, linear)
        packed += 1
    if failed:
        warnings.warn(f"packed weights disagreed with F.linear for {len(failed)} linear(s) "
                      f"(e.g. {failed[0]!r}); those stay unpacked", RuntimeWarning, stacklevel=2)
    return packed
