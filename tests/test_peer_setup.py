"""bench/peers/setup.py without building anything: the setup lock serialises two setups of one
peer (one builds, the other waits and then finds the marker), a held lock is visible to a
second open of the lock file, and llama.cpp's build gets its library-only CMAKE_ARGS."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from bench.peers import MARKER, setup


@pytest.fixture
def peers(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOOINFER_CACHE", str(tmp_path))
    return tmp_path / "peers"


def _lock_is_free(name: str) -> bool:
    with open(setup.venv_dir(name).parent / "venv.lock", "a") as f:
        free = setup._try_flock(f)
        if free:
            setup.fcntl.flock(f, setup.fcntl.LOCK_UN)
        return free


def test_two_setups_of_one_peer_build_once_and_never_together(peers, monkeypatch):
    builds, inside, most = [], [0], [0]

    def fake_build(name, venv):       # stands in for the pip steps: slow enough to overlap
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        assert not _lock_is_free(name)          # the build runs under the lock
        time.sleep(0.3)
        venv.mkdir(parents=True, exist_ok=True)
        (venv / MARKER).write_text(json.dumps({"recipe": setup.recipe_digest(name)}))
        builds.append(name)
        inside[0] -= 1

    monkeypatch.setattr(setup, "_build", fake_build)
    start = threading.Barrier(2)
    results = []

    def one():
        start.wait()
        results.append(setup.setup_peer("llamacpp"))

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert builds == ["llamacpp"] and most[0] == 1          # the second waited, then saw the marker
    assert results == [setup.venv_dir("llamacpp")] * 2
    assert _lock_is_free("llamacpp")                        # released after both
    setup.setup_peer("llamacpp", force=True)                # force rebuilds even when up to date
    assert builds == ["llamacpp"] * 2


def test_changed_recipe_rebuilds(peers, monkeypatch):
    built = []
    monkeypatch.setattr(setup, "_build", lambda name, venv: built.append(name))
    venv = setup.venv_dir("ct2")
    venv.mkdir(parents=True)
    (venv / MARKER).write_text(json.dumps({"recipe": "an-older-recipe"}))
    setup.setup_peer("ct2")
    assert built == ["ct2"]


def test_llamacpp_builds_only_the_library_for_this_cpu(peers, monkeypatch):
    calls = []

    def fake_run(cmd, **kw):
        calls.append((cmd, kw.get("env") or {}))
        if cmd[1:3] == ["-m", "venv"]:
            Path(cmd[3]).mkdir(parents=True)
    monkeypatch.setattr(setup, "run", fake_run)

    class Freeze:
        stdout = "llama-cpp-python==0.3.36\n"
    monkeypatch.setattr(setup.subprocess, "run", lambda *a, **kw: Freeze())
    setup.setup_peer("llamacpp")
    pip = [(cmd, env) for cmd, env in calls if "pip" in cmd]
    assert pip and all("llama-cpp-python==0.3.36" in cmd for cmd, _ in pip)
    flags = pip[0][1]["CMAKE_ARGS"].split()
    assert set(flags) == {"-DGGML_NATIVE=ON", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                          "-DLLAMA_BUILD_SERVER=OFF"}
    assert pip[0][1]["CMAKE_BUILD_PARALLEL_LEVEL"] == "2"
    marker = json.loads((setup.venv_dir("llamacpp") / MARKER).read_text())
    assert marker["recipe"] == setup.recipe_digest("llamacpp") and marker["env"]["CMAKE_ARGS"] == " ".join(flags)
    # the flags are part of the recipe: another set of flags is another recipe
    monkeypatch.setitem(setup.RECIPE_ENV, "llamacpp", {"CMAKE_ARGS": "-DGGML_NATIVE=OFF"})
    assert setup.recipe_digest("llamacpp") != marker["recipe"]
