"""The C++ kernels' cross-process build lock (kernels/cpu_build.build_lock): a torch baton left
by a process killed mid-build is cleared instead of blocking every later start, and the lock
is exclusive across processes while held."""
from __future__ import annotations

import subprocess
import sys

from kernels.cpu_build import build_lock


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
