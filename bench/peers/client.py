"""The parent side of the peer protocol: one long-lived runner subprocess per peer.

``PeerProcess`` writes the workload file, starts ``<venv python> run_<peer>.py`` in its own
process group, waits for READY, then runs one round per ``run()`` call. Between its rounds the
whole process group is stopped (SIGSTOP) and resumed (SIGCONT) just before the next, so an
idle peer's spinning OpenMP threads or engine loop cannot steal the CPU while another engine
is being timed. The runner's stderr goes to a log file whose tail is shown on failure.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.peers import HERE, RUNNERS, venv_python


class PeerError(RuntimeError):
    pass


class PeerProcess:
    def __init__(self, name: str, workload: dict, env: dict[str, str], python: str | None = None,
                 timeout_s: float = 1800.0, freeze_idle: bool = True, script: Path | None = None):
        self.name = name
        self.timeout_s = timeout_s
        self.freeze_idle = freeze_idle
        py = python or str(venv_python(name))
        if not Path(py).exists():
            raise PeerError(f"{name}: no python at {py}; run `python -m bench.peers.setup {name}`")
        self.dir = Path(tempfile.mkdtemp(prefix=f"zooinfer-peer-{name}-"))
        wl_path = self.dir / "workload.json"
        wl_path.write_text(json.dumps(workload))
        self.log_path = self.dir / "stderr.log"
        self._log = open(self.log_path, "w")
        full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        full_env.pop("PYTHONPATH", None)   # the peer venv must not see the project's packages
        script = script or HERE / RUNNERS[name]
        self.proc = subprocess.Popen([py, str(script), str(wl_path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, env=full_env,
                                     cwd=str(self.dir), start_new_session=True)
        self.ready = self._expect("READY")
        self._freeze()

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def _freeze(self) -> None:
        if self.freeze_idle:
            self._signal(signal.SIGSTOP)

    def _thaw(self) -> None:
        if self.freeze_idle:
            self._signal(signal.SIGCONT)
            time.sleep(0.05)   # let stopped threads get scheduled again before the clock starts

    def log_tail(self, lines: int = 25) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def _expect(self, kind: str) -> dict:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                rc = self.proc.wait(timeout=30)
                raise PeerError(f"{self.name}: runner exited (rc {rc}) before {kind}; "
                                f"log {self.log_path}:\n{self.log_tail()}")
            head, _, body = line.partition(" ")
            if head == kind:
                return json.loads(body)
            if head == "ERROR":
                raise PeerError(f"{self.name}: {json.loads(body)['error']}; log {self.log_path}:\n{self.log_tail()}")
        raise PeerError(f"{self.name}: no {kind} within {self.timeout_s:.0f} s")

    def run(self) -> dict:
        """One round of the whole workload: {"seconds", "outputs"} as the runner measured it."""
        self._thaw()
        try:
            self.proc.stdin.write("run\n")
            self.proc.stdin.flush()
            return self._expect("RESULT")
        finally:
            self._freeze()

    def close(self) -> None:
        self._signal(signal.SIGCONT)
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
        except (BrokenPipeError, subprocess.TimeoutExpired, OSError):
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
        self._log.close()
        if self.proc.returncode == 0:   # keep the folder (and its log) only when something went wrong
            shutil.rmtree(self.dir, ignore_errors=True)


def peer_python_version(py: str) -> str:
    return subprocess.run([py, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True,
                          text=True).stdout.strip() or "?"


if __name__ == "__main__":
    print("library module; use python -m bench.throughput --peers ...", file=sys.stderr)
