#!/usr/bin/env bash
# Download, here, the wheels the GPU lane installs on the device machine (Python 3.12,
# x86_64, no network there): the list `bench/gpu/lane.py --print-wheels` prints (lane.py's
# WHEELS, with the reason for each) plus megatron-core (below), as cp312 or pure-Python
# wheels, no dependencies resolved.  They go to bench/gpu/wheels/ (gitignored: a device run carries it,
# run(carry=["bench/gpu/wheels"])).  Fails when the wheels and the tracked tree together
# exceed the 64 MiB a device run may carry.
#
#     bash bench/gpu/fetch_wheels.sh            # then: run bash bench/gpu/run.sh on the device
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEST=bench/gpu/wheels
LIMIT_MIB=64

mapfile -t wheels < <("$PY" bench/gpu/lane.py --print-wheels)
# Beside the lane's: megatron-core for bench/gpu/megatron_parity.py (the megatron learner
# backend; about 2.6 MB, a cp312 manylinux wheel; it needs only torch, numpy and packaging,
# which the device machine has).  Pinned as pyproject.toml's `megatron` extra pins it.
wheels+=("megatron-core==0.16.1")
rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d "$DEST" "${wheels[@]}"

count=$(find "$DEST" -name '*.whl' | wc -l)
if [ "$count" -ne "${#wheels[@]}" ]; then
    echo "fetch_wheels: expected ${#wheels[@]} wheels, got $count in $DEST" >&2
    exit 1
fi
"$PY" - "$DEST" "$LIMIT_MIB" <<'EOF'
import os, subprocess, sys
dest, limit = sys.argv[1], float(sys.argv[2])
wheels = sum(os.path.getsize(os.path.join(dest, f)) for f in os.listdir(dest))
tracked = subprocess.run(["git", "ls-files", "-z"], capture_output=True, text=True,
                         check=True).stdout.split("\0")
tree = sum(os.path.getsize(f) for f in tracked if f and os.path.isfile(f))
total = (wheels + tree) / 2**20
print(f"fetch_wheels: {len(os.listdir(dest))} wheels, {wheels / 2**20:.1f} MiB; with the "
      f"tracked tree {total:.1f} MiB of the {limit:g} MiB a device run carries")
for name in sorted(os.listdir(dest)):
    print(f"  {name}  {os.path.getsize(os.path.join(dest, name)) / 2**20:.2f} MiB")
sys.exit(0 if total <= limit else 1)
EOF
