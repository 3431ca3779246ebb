"""The RL components as supervised children, the job that wires them, and the `erlay` CLI."""

import warnings as _warnings

ERLAY_PACKAGE = "actors"  # marker checked by `erlay` to detect a shadowing distribution

# nvidia-resiliency-ext (async checkpoints) installs pynvml; torch then warns at import, in
# every process, that pynvml is deprecated.  erlay never uses pynvml itself.
_warnings.filterwarnings("ignore", message="The pynvml package is deprecated",
                         category=FutureWarning)
