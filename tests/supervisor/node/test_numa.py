"""NUMA binding: CPU lists, the binding plan, and a real child bound at spawn."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from erlay.supervisor.errors import NumaBindError
from erlay.supervisor.node.numa import (
    Binding,
    MemPolicy,
    bind_to_gpu,
    bound_argv,
    format_cpu_list,
    parse_cpu_list,
    plan_binding,
    visible_gpu,
)

# Prints the affinity and the first memory policy the child sees, then its child's affinity.
REPORT = ("import os, subprocess, sys\n"
          "print(sorted(os.sched_getaffinity(0)))\n"
          "print(open('/proc/self/numa_maps').readline().split()[1], flush=True)\n"
          "subprocess.run([sys.executable, '-S', '-c',"
          " 'import os; print(sorted(os.sched_getaffinity(0)))'])\n")


def test_cpu_list_parses_ranges_and_singles_and_formats_back() -> None:
    assert parse_cpu_list("0-3,8") == {0, 1, 2, 3, 8}
    assert parse_cpu_list("0-55,112-167") == set(range(56)) | set(range(112, 168))
    assert parse_cpu_list("") == set()
    assert format_cpu_list({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"


@pytest.mark.parametrize("text", ["0-", "a", "3-1", "1,,x"])
def test_malformed_cpu_list_is_an_error_naming_it(text: str) -> None:
    with pytest.raises(ValueError, match="not a CPU list"):
        parse_cpu_list(text)


def test_plan_drops_cpus_this_machine_lacks() -> None:
    plan = plan_binding(1, {"1": {"cpus": "0-3,8-11", "numa": "1"}}, available={0, 1, 2, 3})
    assert plan == Binding(1, frozenset({0, 1, 2, 3}), 1, frozenset({8, 9, 10, 11}),
                           memory="preferred:1")


def test_plan_with_no_available_cpu_names_both_sets() -> None:
    with pytest.raises(NumaBindError, match=r"CPUs 8-11 .*allowed: 0-3"):
        plan_binding(0, {0: {"cpus": "8-11", "numa": 0}}, available=range(4))


def test_gpu_missing_from_a_map_is_an_error_not_a_silent_no_op() -> None:
    with pytest.raises(NumaBindError, match="GPU 3 is not in the affinity map"):
        plan_binding(3, {0: {"cpus": "0", "numa": 0}}, available={0})


def test_visible_gpu_is_the_first_cuda_visible_device() -> None:
    assert visible_gpu({"CUDA_VISIBLE_DEVICES": "3,1"}) == 3
    assert visible_gpu({}) is None
    assert visible_gpu({"CUDA_VISIBLE_DEVICES": ""}) is None
    assert visible_gpu({"CUDA_VISIBLE_DEVICES": "GPU-5d1b3e"}) is None


def test_no_gpu_is_a_logged_no_op(caplog: pytest.LogCaptureFixture) -> None:
    before = os.sched_getaffinity(0)
    with caplog.at_level(logging.INFO, logger="erlay.supervisor.numa"):
        binding = bind_to_gpu(None, {})
        empty_map = bind_to_gpu(0, {})
    assert not binding.bound and binding.note == "no GPU visible to this process"
    assert not empty_map.bound and "empty affinity map" in empty_map.note
    assert os.sched_getaffinity(0) == before
    assert "NUMA binding skipped" in caplog.text


def test_no_gpu_leaves_the_command_unwrapped() -> None:
    argv, binding = bound_argv(["true"], None, {})
    assert argv == ["true"] and not binding.bound


def test_child_bound_at_spawn_and_its_child_see_only_cpu_0() -> None:
    fake_map = {0: {"cpus": "0", "numa": 0}, 1: {"cpus": "1", "numa": 0}}
    argv, binding = bound_argv([sys.executable, "-S", "-c", REPORT], 0, fake_map)
    assert binding.cpus == {0} and binding.memory == "preferred:0"
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    affinity, policy, grandchild = done.stdout.splitlines()
    assert affinity == grandchild == "[0]"
    if "memory not set" not in done.stderr:  # a seccomp profile may refuse set_mempolicy
        assert policy == "prefer:0"


def test_running_child_is_bound_on_every_thread_without_memory() -> None:
    child = subprocess.Popen([sys.executable, "-S", "-c",
                              "import threading, time\n"
                              "threading.Thread(target=time.sleep, args=(60,)).start()\n"
                              "print('up', flush=True); time.sleep(60)\n"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "up\n"
        binding = bind_to_gpu(0, {0: {"cpus": "0", "numa": 0}}, pid=child.pid,
                              policy=MemPolicy.BIND)
        threads = os.listdir(f"/proc/{child.pid}/task")
        assert len(threads) == 2
        assert all(os.sched_getaffinity(int(t)) == {0} for t in threads)
        assert binding.memory.startswith("not set")
    finally:
        child.kill()
        child.wait()
