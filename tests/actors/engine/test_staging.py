"""The sweep of vLLM staging directories left by engines that died without cleaning up."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from erlay.actors.engine import staging


def test_stale_picks_only_dead_owners_of_this_host() -> None:
    names = ["erlay-vllm-101@node-a-x1y2z3", "erlay-vllm-102@node-a-abc_de",
             "erlay-vllm-101@node-b-x1y2z3",          # another host's: never ours to judge
             "erlay-vllm-q8w7e6r5",                   # the old unowned form: left alone
             "erlay-vllm-abc@node-a-x1y2z3", "psm_0125ecef", "erlay-vllm-103@node-a.lan-k9"]
    dead = {101, 103}
    assert staging.stale(names, "node-a", lambda pid: pid not in dead) == [
        "erlay-vllm-101@node-a-x1y2z3"]
    assert staging.stale(names, "node-a.lan", lambda pid: pid not in dead) == [
        "erlay-vllm-103@node-a.lan-k9"]
    assert staging.stale(names, "node-a", lambda pid: True) == []


def test_owner_prefix_round_trips_through_mkdtemp(tmp_path) -> None:
    path = tempfile.mkdtemp(prefix=staging.owner_prefix(4242, "h-1.example"), dir=tmp_path)
    name = os.path.basename(path)
    assert staging.stale([name], "h-1.example", lambda pid: pid != 4242) == [name]
    assert staging.stale([name], "h-1.example", lambda pid: pid == 4242) == []


def test_sweep_removes_a_dead_engines_directory_and_keeps_a_live_ones(tmp_path) -> None:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    dead_pid = int(child.stdout)   # exited and reaped: no process has it (unless reused)
    dead = tempfile.mkdtemp(prefix=staging.owner_prefix(dead_pid), dir=tmp_path)
    with open(os.path.join(dead, "model.safetensors"), "wb") as f:
        f.write(b"\0" * 4096)
    live = tempfile.mkdtemp(prefix=staging.owner_prefix(), dir=tmp_path)
    other = tmp_path / "erlay-vllm-unowned"
    other.mkdir()
    removed = staging.sweep(str(tmp_path))
    if staging._pid_alive(dead_pid):   # the pid was reused at once: kept, by design
        assert removed == [] and os.path.isdir(dead)
    else:
        assert removed == [dead] and not os.path.exists(dead)
    assert os.path.isdir(live) and other.is_dir()


def test_sweep_of_a_missing_root_removes_nothing(tmp_path) -> None:
    assert staging.sweep(str(tmp_path / "absent")) == []
