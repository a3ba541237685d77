"""Build and load the C++ CPU kernels (zooinfer_kernels/cpu/*.cpp): one library, op namespace `zooinfer_cpu`.

Every .cpp in zooinfer_kernels/cpu registers its ops into `torch.ops.zooinfer_cpu`; the wrapper
modules next to this one (`paged_attention`, `gemm`, `lm_head`, `elementwise`) call them and
say when they apply. The build is lazy: the first `available()` call compiles (tens of
seconds) or loads the cached library from `$ZOOINFER_CACHE/torch_extensions` (default
`~/.cache/zooinfer/torch_extensions`).

The library is built with `-march=native` (the cache directory is keyed by a hash of the
CPU's feature flags and the torch version, so a home directory shared between different
machines never loads code built for another CPU); if that build fails it retries with
plain `-O3`, with a RuntimeWarning naming the error (`native_build_error()`; the ISA-specific
kernel paths are then off, which would otherwise show only as a slow run; a test asserts the
native build on x86-64); if that fails too it warns once and `available()` stays False, so
callers fall back to their torch path. Under that directory each build has its own folder, named by a
digest of the sources (headers included): two checkouts with different kernels (a bench
comparing two commits, a worktree beside main) each keep their build, where one shared
folder was rebuilt on every alternation (80-140 s per server start). The `KEEP_BUILDS`
most recently used folders stay; older ones are removed when no process holds their lock. `ZOOINFER_CPU_KERNELS=0` forces the fallback without building.
The sources (headers included) ship as package data, so an installed wheel builds from
its own copy.

Builds are serialised across processes by an `flock` on `<build dir>.flock` (`build_lock`),
which the OS releases when its holder dies. torch's own baton (a `lock` file in the build
directory) is not: a process killed mid-build leaves it behind, and every later process
would wait on it forever, then load whatever library the dead build left. Under our lock no
other build can be running, so a baton found there is stale and is removed.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import threading
import time
import warnings
from pathlib import Path

import torch

SOURCES = Path(__file__).parent / "cpu"   # every *.cpp there is one library, op namespace zooinfer_cpu
KEEP_BUILDS = 6            # source-keyed build folders kept per library (most recently used)
_lock = threading.Lock()
_state: dict = {}          # "ok": bool once a build was attempted; "seconds": build/load time;
                           # "library": path of the loaded shared library


_switch = ["1", True]       # the last ZOOINFER_CPU_KERNELS value seen and what it means


_pin = threading.local()    # .value: what `enabled` answers inside `pinned()` on this thread


def enabled() -> bool:
    """False when ZOOINFER_CPU_KERNELS=0 (read on every call, so tests can toggle it; the
    parse is memoised on the raw value: the fused ops ask several times per layer per step),
    except inside `pinned()`, which reads it once."""
    pinned_value = getattr(_pin, "value", None)
    if pinned_value is not None:
        return pinned_value
    raw = os.environ.get("ZOOINFER_CPU_KERNELS", "1")
    if raw != _switch[0]:
        _switch[:] = [raw, raw.strip().lower() not in ("0", "false", "off", "no")]
    return _switch[1]


@contextlib.contextmanager
def pinned():
    """Within it (on this thread), `enabled` answers what the switch said on entry without
    reading the environment again. Why: a decode step asks ~250 times (every fused op, every
    quantized linear), and each environment read costs ~0.6 us; the model runner pins the
    switch for a step's forward, so a step sees one answer throughout."""
    prev = getattr(_pin, "value", None)
    _pin.value = None              # unpinned for this read: a nested scope reads the switch afresh
    _pin.value = enabled()
    try:
        yield
    finally:
        _pin.value = prev


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


def source_key(sources: Path = SOURCES) -> str:
    """Digest of every source and header (names and text): the build folder's name, so a
    changed kernel builds beside the old one instead of over it."""
    h = hashlib.sha1()
    for f in sorted(sources.glob("*.cpp")) + sorted(sources.glob("*.h")):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def prune_builds(root: Path, name: str, keep: int = KEEP_BUILDS) -> list[Path]:
    """Remove `name`'s build folders under `root` beyond the `keep` most recently used ones;
    a folder whose lock another process holds (building or about to load it) is left, and
    the one unkeyed folder of earlier versions goes first. Returns the folders removed."""
    builds = sorted((d for d in root.glob(f"{name}-*") if d.is_dir()), key=lambda d: d.stat().st_mtime,
                    reverse=True)
    removed = []
    for d in [root / name] * (root / name).is_dir() + builds[keep:]:
        with open(f"{d}.flock", "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            shutil.rmtree(d, ignore_errors=True)
            Path(f"{d}.flock").unlink(missing_ok=True)
            removed.append(d)
    return removed


@contextlib.contextmanager
def build_lock(build_dir: Path):
    """Hold the cross-process build lock for `build_dir`; clear a stale torch baton under it."""
    with open(f"{build_dir}.flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)      # blocks while another process builds; freed if it dies
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build() -> None:
    from torch.utils import cpp_extension
    try:   # the `ninja` wheel puts its binary next to the venv's python, which may not be on PATH
        import ninja
        if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    errors = []
    key = source_key()      # a header change (panels.h, vec_exp.h, ...) is a new folder too
    for name, arch in (("zooinfer_cpu_native", ["-march=native"]), ("zooinfer_cpu", [])):
        build_dir = _build_root() / f"{name}-{key}"
        build_dir.mkdir(parents=True, exist_ok=True)
        try:
            with build_lock(build_dir):
                cpp_extension.load(name=name, sources=sorted(str(f) for f in SOURCES.glob("*.cpp")),
                                   build_directory=str(build_dir),
                                   extra_cflags=["-O3", "-fopenmp", *arch],
                                   extra_ldflags=["-fopenmp"],
                                   is_python_module=False, verbose=False)
                os.utime(build_dir)          # most recently used: pruning keeps it
            _state["library"] = str(build_dir / f"{name}.so")
            prune_builds(build_dir.parent, name)
            if errors:      # the portable library works, but every ISA-specific kernel path is off
                _state["native_error"] = errors[0]
                warnings.warn(f"zooinfer: the -march=native kernel build failed, running the portable one "
                              f"(slower): {errors[0]}", RuntimeWarning, stacklevel=3)
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


def native_build_error() -> str | None:
    """Why the `-march=native` build failed where the portable retry was loaded (None if it did not)."""
    return _state.get("native_error")


def library_path() -> str | None:
    """The shared library `available()` loaded (its build directory holds the build.ninja
    naming the sources it came from); None before or without a successful build."""
    return _state.get("library")
