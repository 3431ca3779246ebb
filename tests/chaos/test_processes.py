"""The orphan check counts the run's processes only: what its descendants were, and what
lives in the sessions and process groups they created; never other work on the machine."""

from __future__ import annotations

import subprocess
import sys
import time

from erlay.chaos.processes import ProcessWatch

ESCAPES = ("import os, subprocess, sys, time\n"
           # a grandchild in a new session that outlives its parent: reparented away
           "subprocess.Popen([sys.executable, '-c', 'import os, time; os.setsid(); "
           "time.sleep(60)'])\n"
           "time.sleep(1.5)\n")


def test_an_escaped_grandchild_is_an_orphan_and_unrelated_work_is_not() -> None:
    unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 start_new_session=True)  # started before the run
    watch = ProcessWatch(sample_s=0.1).start()
    try:
        run = subprocess.Popen([sys.executable, "-c", ESCAPES])
        time.sleep(1.0)      # the watch sees the grandchild while its parent lives
        run.wait(10)
        orphans = watch.orphans(grace_s=1.0)
        assert len(orphans) == 1 and "setsid" in orphans[0]["cmdline"]
        assert unrelated.pid not in {o["pid"] for o in orphans}
    finally:
        unrelated.kill()
        for o in watch.orphans(grace_s=0.0):
            subprocess.run(["kill", "-9", str(o["pid"])], check=False)


def test_a_run_that_cleans_up_leaves_no_orphan() -> None:
    watch = ProcessWatch(sample_s=0.1).start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    child.wait(10)
    assert watch.orphans(grace_s=1.0) == []
