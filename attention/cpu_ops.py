"""C++ CPU kernels (attention/cpu_kernels/), JIT-built once per machine and torch version.

`paged_decode` is the CPU decode path of the torch backend: it reads each page of a request
once, token-major, with the query heads of a GQA group sharing each K/V row (see the .cpp
header for why that beats the sparse `sampled_addmm` path). `paged_prefill` is its path for
everything else (prefill chunks, several tokens after a preemption): varlen causal attention
straight from the pages, no padding to the longest chunk and no masked upper triangle
(per layer, ~3x faster than the padded SDPA on fresh 64-256-token prompts, ~2x after a
512-token prefix: `python -m bench.cpu_attention --prefill`). The build is lazy: the first
`available()` call compiles (tens of seconds) or loads the cached library from
`$ZOOINFER_CACHE/torch_extensions` (default `~/.cache/zooinfer/torch_extensions`).

The library is built with `-march=native` (the cache directory is keyed by a hash of the
CPU's feature flags and the torch version, so a home directory shared between different
machines never loads code built for another CPU); if that build fails it retries with
plain `-O3`; if that fails too it warns once and `available()` stays False, so callers fall
back to their torch path. `ZOOINFER_CPU_KERNELS=0` forces the fallback without building.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import threading
import time
import warnings
from pathlib import Path

import torch

_SOURCES = Path(__file__).parent / "cpu_kernels"   # every *.cpp there is one library, op namespace zooinfer_cpu
_lock = threading.Lock()
_state: dict = {}          # "ok": bool once a build was attempted; "seconds": build/load time


def enabled() -> bool:
    """False when ZOOINFER_CPU_KERNELS=0 (read on every call, so tests can toggle it)."""
    return os.environ.get("ZOOINFER_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "off", "no")


def _cpu_key() -> str:
    """Hash of the CPU's feature flags: code built with -march=native runs only where they match."""
    flags = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags += line
                break
    except OSError:
        pass
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def _build_root() -> Path:
    root = os.environ.get("ZOOINFER_CACHE") or Path.home() / ".cache" / "zooinfer"
    return Path(root) / "torch_extensions" / f"torch{torch.__version__.replace('+', '_')}-{_cpu_key()}"


def _build() -> None:
    from torch.utils import cpp_extension
    try:   # the `ninja` wheel puts its binary next to the venv's python, which may not be on PATH
        import ninja
        if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    errors = []
    # torch rebuilds when a source's text or the flags change; the headers' digest is a flag,
    # so a change to a shared header (panels.h, vec_exp.h, ...) rebuilds too.
    headers = hashlib.sha1(b"".join(h.read_bytes() for h in sorted(_SOURCES.glob("*.h")))).hexdigest()[:12]
    for name, arch in (("zooinfer_cpu_native", ["-march=native"]), ("zooinfer_cpu", [])):
        build_dir = _build_root() / name
        build_dir.mkdir(parents=True, exist_ok=True)
        try:
            cpp_extension.load(name=name, sources=sorted(str(f) for f in _SOURCES.glob("*.cpp")),
                               build_directory=str(build_dir),
                               extra_cflags=["-O3", "-fopenmp", *arch, f"-DZOOINFER_HEADERS={headers}"],
                               extra_ldflags=["-fopenmp"],
                               is_python_module=False, verbose=False)
            return
        except Exception as e:   # noqa: BLE001 - any build failure means "use the fallback"
            errors.append(f"{' '.join(arch) or 'plain -O3'}: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}")
    raise RuntimeError("; ".join(errors))


def available() -> bool:
    """Whether the kernels can be used now (env switch on, library built or loaded)."""
    if not enabled():
        return False
    if "ok" not in _state:
        with _lock:
            if "ok" not in _state:
                t0 = time.perf_counter()
                try:
                    if shutil.which(os.environ.get("CXX", "c++")) is None:
                        raise RuntimeError("no C++ compiler found (set CXX)")
                    _build()
                    _state["ok"] = True
                except Exception as e:   # noqa: BLE001
                    warnings.warn(f"zooinfer C++ CPU kernels unavailable, using the torch fallback: {e}",
                                  RuntimeWarning, stacklevel=2)
                    _state["ok"] = False
                _state["seconds"] = time.perf_counter() - t0
    return _state["ok"]


def amx_available() -> bool:
    """Whether the library was built with AMX tiles and the OS lets this process use them
    (`screened_argmax` needs both; otherwise it runs the fp32 `linear_argmax`)."""
    return available() and bool(torch.ops.zooinfer_cpu.amx_available())


def build_seconds() -> float | None:
    """Seconds the first `available()` spent building or loading the library (None before)."""
    return _state.get("seconds")


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, rows: torch.Tensor,
                 token_index: torch.Tensor, seq_lens: torch.Tensor, window: int | None, scale: float,
                 out: torch.Tensor) -> None:
    """Decode attention written into `out[token_index]`.

    q, out: float32 `[num_tokens, heads, head_dim]` (any strides, last dim contiguous);
    kv_cache: one layer's contiguous `[blocks, 2, block_size, kv_heads, head_dim]` float32;
    block_table: int32 `[num_reqs, max_blocks]`; rows, token_index, seq_lens: int64 `[n]`
    (block table row, query token and context length incl. the new token of each decode);
    window: sliding window (keys at positions > seq_len - 1 - window) or None.
    """
    if q.stride(-1) != 1:
        q = q.contiguous()
    torch.ops.zooinfer_cpu.paged_decode(q, kv_cache, block_table, rows, token_index, seq_lens,
                                        0 if window is None else int(window), float(scale), out)


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, rows: torch.Tensor,
                  query_start: torch.Tensor, query_lens: torch.Tensor, seq_lens: torch.Tensor, window: int | None,
                  scale: float, out: torch.Tensor) -> None:
    """Causal attention of several query tokens per request, written into `out` at their rows.

    q, out: float32 `[num_tokens, heads, head_dim]` (any strides, last dim contiguous; head_dim
    <= 256); kv_cache: one layer's contiguous `[blocks, 2, block_size, kv_heads, head_dim]`
    float32 holding every key the queries see (this step's included); block_table: int32
    `[num_reqs, max_blocks]`; rows, query_start, query_lens, seq_lens: int64 `[n]` (block table
    row, first query token, number of query tokens and context length after this step of each
    request). Request i's queries sit at positions seq_len - query_len ... seq_len - 1 and see
    the keys at positions <= their own (and > their own - window when window is set).
    """
    if q.stride(-1) != 1:
        q = q.contiguous()
    torch.ops.zooinfer_cpu.paged_prefill(q, kv_cache, block_table, rows, query_start, query_lens, seq_lens,
                                         0 if window is None else int(window), float(scale), out)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> bool:
    """Store k[t], v[t] (`[tokens, kv_heads, head_dim]`, the cache's dtype) at cache slot
    slots[t] (int64, block * block_size + offset) of one layer's contiguous CPU cache
    `[blocks, 2, block_size, kv_heads, head_dim]`, in one pass. k and v may be strided views
    (e.g. of the qkv projection) as long as each token's row is contiguous. Returns False,
    writing nothing, when the kernel does not apply (library off or missing, other layouts);
    the caller then writes with torch."""
    def rows_ok(x: torch.Tensor) -> bool:
        return (x.dim() == 3 and x.dtype == kv_cache.dtype and x.device.type == "cpu" and x.stride(2) == 1
                and (x.shape[1] == 1 or x.stride(1) == x.shape[2]))
    if not (kv_cache.device.type == "cpu" and kv_cache.is_contiguous() and slots.dtype == torch.int64
            and rows_ok(k) and rows_ok(v) and available()):
        return False
    torch.ops.zooinfer_cpu.write_kv(kv_cache, k, v, slots)
    return True
