"""The limits of one sandbox run: one typed, validated model, usually built from the job
config's ``sandbox.limits`` mapping.

Every limit applies to each run separately, except ``max_processes``: RLIMIT_NPROC counts
every process of the run's uid, so runs that share a worker slot (and so a uid) share it.
Without root there is no slot uid and it counts every process of the current user; see
:mod:`erlay.sandbox.isolation`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

# How much output a run may write, counting both streams, before it is killed: a multiple of
# the cap kept per stream, so a chatty program is stopped long before it costs anything.
OUTPUT_HARD_CAP_FACTOR = 8


class SandboxLimits(BaseModel):
    """Resource limits and switches for sandbox runs.  Unknown fields are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    wall_timeout_s: float = Field(default=5.0, gt=0, le=3600,
                                  description="wall-clock seconds before the run's process "
                                  "group is killed (outcome timeout)")
    cpu_seconds: int = Field(default=5, ge=1, le=3600,
                             description="RLIMIT_CPU of each process, in CPU seconds "
                             "(outcome timeout, detail 'cpu limit')")
    memory_mb: int = Field(default=512, ge=32,
                           description="RLIMIT_AS of each process, in MiB (outcome memory); "
                           "the interpreter alone needs ~20 MiB")
    max_processes: int = Field(default=32, ge=1,
                               description="RLIMIT_NPROC for the run's uid (a fork bomb hits it)")
    max_file_mb: int = Field(default=16, ge=0,
                             description="RLIMIT_FSIZE: the largest file a run may write, in "
                             "MiB (outcome file_size)")
    max_open_files: int = Field(default=64, ge=16, description="RLIMIT_NOFILE of each process")
    output_cap_bytes: int = Field(default=16384, ge=1,
                                  description="bytes of stdout and of stderr kept in the result; "
                                  f"{OUTPUT_HARD_CAP_FACTOR}x this in total kills the run "
                                  "(outcome output_limit)")
    network: bool = Field(default=False, description="True runs the code in the host's network "
                          "namespace; by default it gets its own, with no interfaces up")
    python: str | None = Field(default=None, min_length=1,
                               description="interpreter for the code; default sys.executable, "
                               "or a system python3 when the slot uid cannot reach it")

    @property
    def output_hard_cap_bytes(self) -> int:
        """Total output (both streams) past which the run is killed."""
        return self.output_cap_bytes * OUTPUT_HARD_CAP_FACTOR
