#!/usr/bin/env bash
# The GPU lane, one prepared script for the device machine (one GPU; Python 3.12, torch with
# CUDA, transformers; no Ray, no vLLM, no network).  Installs the carried wheels
# (bench/gpu/wheels/, from bench/gpu/fetch_wheels.sh) with --no-deps into a directory that
# bench/gpu/lane.py appends to sys.path (the machine's own packages win), then runs the lane
# under one deadline, after the megatron parity check (below).  The lane writes one JSON file
# of figures ($OUT/gpu_lane.json when $OUT is set) and prints the same JSON as its last stdout
# line; the exit status is the lane's (1 when a phase failed: its figures are null and its
# error is in the JSON), or the parity check's when the lane passed.  On a machine where torch
# sees no CUDA device both say so, print {"gpu": false} and exit 0: nothing was measured, and
# nothing failed (tests/test_bench_gpu_lane.py runs it so here).
#
#     bash bench/gpu/run.sh                                  # on the device machine
#     bash bench/gpu/run.sh --device cpu --size tiny         # the same wiring, here
#
# Arguments go to lane.py.  LANE_TIMEOUT_S (default 290) bounds the install and the lane (the
# parity check's time not counted); the lane's own deadline (--deadline-s, 270 s) ends it
# first, with its JSON.
set -uo pipefail
cd "$(dirname "$0")/../.."
started=$(date +%s)
PY=${PYTHON:-python3}
WHEELS=bench/gpu/wheels
SITE=${ERLAY_LANE_SITE:-${TMPDIR:-/tmp}/erlay-lane-site}

if compgen -G "$WHEELS/*.whl" >/dev/null; then
    mkdir -p "$SITE"
    if "$PY" -m pip --version >/dev/null 2>&1; then
        # The tags are the device machine's, so the same command also works in a CPU check
        # on another Python (the lane's own copies of those packages then win).
        "$PY" -m pip install --quiet --disable-pip-version-check --no-deps --no-index \
            --upgrade --only-binary=:all: --python-version 3.12 --implementation cp \
            --abi cp312 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --platform any --target "$SITE" "$WHEELS"/*.whl || exit 3
    else
        # Without pip: a wheel is a zip laid out as site-packages wants it.
        for wheel in "$WHEELS"/*.whl; do "$PY" -m zipfile -e "$wheel" "$SITE" || exit 3; done
    fi
    echo "run.sh: installed $(ls "$WHEELS"/*.whl | wc -l) wheels into $SITE" >&2
else
    echo "run.sh: no wheels in $WHEELS (bench/gpu/fetch_wheels.sh fetches them); the lane" \
         "uses what this Python has" >&2
fi
export ERLAY_LANE_SITE="$SITE"

# The megatron backend's parity check first (bench/gpu/megatron_parity.py: megatron-core,
# from the wheels, against the HF model), under its own limit (MEGATRON_TIMEOUT_S, default
# 200 s; MEGATRON_PARITY=0 skips it); without CUDA it prints {"gpu": false} and exits 0.  Its
# table and JSON line go to stdout (and $OUT/megatron_parity.txt); the lane's JSON stays the
# last line.
parity_rc=0
parity_started=$(date +%s)
if [ "${MEGATRON_PARITY:-1}" != 0 ]; then
    timeout --kill-after=5 "${MEGATRON_TIMEOUT_S:-200}" "$PY" bench/gpu/megatron_parity.py \
        | tee "${OUT:-${TMPDIR:-/tmp}}/megatron_parity.txt"
    parity_rc=${PIPESTATUS[0]}
    if [ "$parity_rc" -ne 0 ]; then
        echo "run.sh: megatron_parity.py exited $parity_rc" >&2
    fi
fi
parity_s=$(( $(date +%s) - parity_started ))

left=$(( ${LANE_TIMEOUT_S:-290} + parity_s - ($(date +%s) - started) ))
timeout --kill-after=5 "$left" "$PY" bench/gpu/lane.py "$@"
rc=$?
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "run.sh: the lane ran past ${LANE_TIMEOUT_S:-290} s and was stopped" >&2
fi
# The lane's status, or the parity check's when the lane passed.
if [ "$rc" -eq 0 ]; then rc=$parity_rc; fi
exit "$rc"
