"""bench/checkpoint.py at its smallest size (CI's smoke run), on local disk and with the run's
home in a bucket on moto's S3 server, where the learner's mirror uploads every checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.paths import REPO


@pytest.mark.parametrize("storage", ["local", "s3"])
def test_the_smallest_size_prints_a_table_then_one_json_line(storage: str) -> None:
    done = subprocess.run([sys.executable, str(REPO / "bench" / "checkpoint.py"), "--smoke",
                           "--storage", storage], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("learner state per size") and f"storage {storage}" in lines[0]
    out = json.loads(lines[-1])
    assert out["storage"] == storage and out["runs"] == 1
    assert out["exposed_ratio"]["median"] > 0 and out["sync_save_s_1M"]["median"] > 0
    if storage == "s3":
        # Every committed checkpoint (3 saves here, each about 6 MB) went up.
        assert out["uploaded_mb_1M"]["median"] > 3 * out["state_mb_1M"]
        assert out["upload_lag_s_max_1M"]["median"] >= out["upload_lag_s_p50_1M"]["median"]
    else:
        assert "uploaded_mb_1M" not in out
