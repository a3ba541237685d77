"""The C++ kernels' build folders (zooinfer_kernels/cpu_build): the cross-process build lock (a torch
baton left by a process killed mid-build is cleared instead of blocking every later start;
the lock is exclusive across processes while held), one folder per source digest, and the
pruning of old folders."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from zooinfer_kernels import cpu_build
from zooinfer_kernels.cpu_build import build_lock, prune_builds, source_key


def _try_lock_from_another_process(lock_file) -> bool:
    """Whether a separate process can take the flock without waiting."""
    code = ("import fcntl, sys\n"
            "f = open(sys.argv[1], 'a')\n"
            "try:\n    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n    sys.exit(3)\n")
    return subprocess.run([sys.executable, "-c", code, str(lock_file)], timeout=60).returncode == 0


def test_stale_torch_baton_is_removed_under_the_lock(tmp_path):
    build_dir = tmp_path / "zooinfer_cpu_native"
    build_dir.mkdir()
    (build_dir / "lock").touch()          # what torch's FileBaton leaves when its builder is killed
    (build_dir / "kept.o").touch()
    with build_lock(build_dir):
        assert not (build_dir / "lock").exists()
        assert (build_dir / "kept.o").exists()      # nothing else in the build directory is touched


def test_lock_is_exclusive_across_processes_and_released(tmp_path):
    build_dir = tmp_path / "b"
    build_dir.mkdir()
    lock_file = tmp_path / "b.flock"
    with build_lock(build_dir):
        assert not _try_lock_from_another_process(lock_file)
    assert _try_lock_from_another_process(lock_file)


def _sources(folder, **files):
    folder.mkdir(exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def test_build_folder_is_named_by_every_source_and_header(tmp_path):
    """Two checkouts with different kernels get two folders (no rebuild on alternation); the
    same text anywhere gets the same folder, and a header change alone is a new one."""
    a = source_key(_sources(tmp_path / "a", **{"x.cpp": "int f();", "p.h": "#define A 1"}))
    assert source_key(_sources(tmp_path / "b", **{"x.cpp": "int f();", "p.h": "#define A 1"})) == a
    assert source_key(_sources(tmp_path / "c", **{"x.cpp": "int f();", "p.h": "#define A 2"})) != a
    assert source_key(_sources(tmp_path / "d", **{"x.cpp": "int g();", "p.h": "#define A 1"})) != a
    assert source_key(_sources(tmp_path / "e", **{"y.cpp": "int f();", "p.h": "#define A 1"})) != a


def test_prune_keeps_the_most_recently_used_and_any_folder_in_use(tmp_path):
    builds = []
    for i in range(5):
        d = tmp_path / f"zooinfer_cpu_native-{i:012x}"
        d.mkdir()
        (d / "zooinfer_cpu_native.so").touch()
        os.utime(d, (1000 + i, 1000 + i))       # folder 4 is the most recently used
        builds.append(d)
    (tmp_path / "zooinfer_cpu-000000000000").mkdir()       # the other library: not counted
    (tmp_path / "zooinfer_cpu_native").mkdir()              # an earlier version's unkeyed folder
    with build_lock(builds[0]):                 # held, as by a process building or loading it
        removed = prune_builds(tmp_path, "zooinfer_cpu_native", keep=2)
    assert set(removed) == {builds[1], builds[2], tmp_path / "zooinfer_cpu_native"}
    assert [d.exists() for d in builds] == [True, False, False, True, True]
    assert not Path(f"{builds[1]}.flock").exists() and Path(f"{builds[0]}.flock").exists()
    assert (tmp_path / "zooinfer_cpu-000000000000").exists()
    assert prune_builds(tmp_path, "zooinfer_cpu_native", keep=2) == [builds[0]]   # free now: oldest goes


def test_pinned_switch_reads_the_environment_once_per_scope(monkeypatch):
    """Inside `pinned()` the switch keeps its value at entry (a step sees one answer); a nested
    scope reads it afresh; leaving restores the outer pin, then the environment decides again."""
    monkeypatch.setenv("ZOOINFER_CPU_KERNELS", "1")
    with cpu_build.pinned():
        monkeypatch.setenv("ZOOINFER_CPU_KERNELS", "0")
        assert cpu_build.enabled()
        with cpu_build.pinned():
            assert not cpu_build.enabled()
        assert cpu_build.enabled()
    assert not cpu_build.enabled()
    monkeypatch.setenv("ZOOINFER_CPU_KERNELS", "1")
    assert cpu_build.enabled()
    seen = []                              # another thread is not pinned by this one's scope
    with cpu_build.pinned():
        monkeypatch.setenv("ZOOINFER_CPU_KERNELS", "0")
        t = threading.Thread(target=lambda: seen.append(cpu_build.enabled()))
        t.start()
        t.join()
        assert cpu_build.enabled()
    assert seen == [False]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not cpu_build.available(),
                    reason="the native build is checked on x86-64 with the kernels built")
def test_the_native_build_is_the_one_loaded():
    """On x86-64 with GCC every kernel compiles under -march=native; a compile error on this CPU's
    ISA would otherwise only fall back to the portable library, visible as a slow run."""
    assert cpu_build.native_build_error() is None, cpu_build.native_build_error()
    assert "zooinfer_cpu_native" in Path(cpu_build.library_path()).name
