"""KV hand-off: the KV caches of an engine's in-flight requests, saved on its node as they
decode, so that the engine taking a request over loads its cache instead of prefilling it.

**Where.**  A job's node runtime owns ``<root>/<run id>`` on every node (made before the tree
starts, removed with everything in it at the end: :mod:`erlay.actors.job.node_runtime`).
Each engine process keeps one *slab* there, ``<node id>/slab-<pid>-<ns>.kvs``: a sparse,
memory-mapped file that outlives the process (``/dev/shm`` by default, so it is node memory,
not disk).  The engine writes into its slab; another engine on the node reads it.

**Layout** (:mod:`erlay.actors.engine.kv_slab`).  A slab has one *slot* per request the
engine may decode at once (twice its ``max_batch``): the request's context tokens, each
position's keys and values (``[positions, 2, layers, heads, head_dim]``, the model's
dtype), and the hidden states of its last save points (the next token's logits follow from
them).  A table at the front names each slot's request by a digest of its *key* (the
caller's name for the work, the same on every attempt: the rollout runner's ``<rollout
id>/t<turn>``), with the policy version, the positions covered, when it was created, and
checksums.  Slots are page-aligned, so a freed slot's pages can go back to the node at once
(``MADV_REMOVE``).

**Incremental, batched.**  :meth:`HandoffStore.write` stores the positions added since the
last save of many requests in one vectorised assignment, then updates their table rows:
a decode step saves its whole batch without a Python loop per request.

**Consistency.**  The table row is written after the data it covers.  ``kv_sum`` is the sum
(mod 2^64) of the 32-bit words of the covered tokens, keys and values; ``hidden_sum`` that of
the hidden state, saved at ``hidden_at`` positions.  A reader recomputes both: a process
killed between the data and the table row (or in the middle of either) leaves a row whose
sums disagree, and the cache is *torn*: never read.  A hidden state that disagrees only
costs one position of prefill.  Beyond that nothing is trusted: the adopter checks that the
cache's tokens are a prefix of the request's context.

**Budget.**  The slabs of a node share ``budget_bytes`` (positions covered x bytes per
position).  Each engine counts what it writes; every ``budget_bytes / 16`` written it adds up
the node's tables and, past the budget, frees the oldest slots (created first) of its own and
of dead engines until the node holds 90% of it.  Those requests fall back to a re-prefill.
Between two scans the node can exceed the budget by a sixteenth per engine.

**Cleanup.**  An engine frees a request's slot when the request finishes or its caller
aborts it; an adopter frees the slot it took a cache from.  A dead engine's slab (its pid
gone) is unlinked once no slot in it is valid; slots of a version older than the one before
the newest an engine loaded are freed then too (no engine serves that version again).  The
run directory goes at the end of the run.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from erlay.actors.engine.kv_slab import (
    RING,
    Shape,
    Slab,
    digest,
    pid_alive,
    word_sums,
)

log = logging.getLogger("erlay.engine.kv")

PREFAULT_BYTES = 64 << 20   # an engine's slots mapped ahead of their first save


# Which path a resumed request took (TokenChunk.kv_handoff, counted by the rollout runner):
# its saved cache covered the whole context ("adopted") or a prefix of it ("partial", the
# rest prefilled), or it was prefilled again because no cache of it is on this node
# ("missing": saved on another node, never saved, or freed for the budget), the cache was
# for another policy version ("version"), it was torn ("torn"), or its tokens were not the
# request's ("mismatch").
ADOPTED = ("adopted", "partial")
FALLBACKS = ("missing", "version", "torn", "mismatch")
REASONS = (*ADOPTED, *FALLBACKS)


@dataclass(frozen=True)
class Found:
    """A cache found for a request: the keys and values of its first ``len(kv)`` context
    positions (``[n, 2, layers, heads, head_dim]``, raw dtype) and the hidden state of the
    last one when it was saved with them (else None: one position must be prefilled)."""

    kv: np.ndarray
    hidden: np.ndarray | None


def _found(kv: np.ndarray, hidden: np.ndarray, hidden_at: np.ndarray, hidden_ok: np.ndarray,
           usable: int, length: int) -> tuple[Found | None, str]:
    """What a checked cache gives a request whose context (``length`` tokens) agrees with its
    first ``usable`` positions: all of them with the state after the last (``adopted``),
    when one of its saved states (the last :data:`RING` save points) is at exactly that
    position; else all but what must be prefilled again to have that state (``partial``)."""
    if usable == length:
        for j in range(RING):
            if int(hidden_at[j]) == usable and bool(hidden_ok[j]):
                return Found(kv[:usable], hidden[j]), "adopted"
    keep = usable if usable < length else usable - 1
    if keep == 0:
        return None, "mismatch"
    return Found(kv[:keep], None), "partial"


class HandoffStore:
    """One engine's side of its node's saved caches (module docstring).  Not thread-safe:
    the engine calls it from one thread at a time."""

    def __init__(self, node_dir: Path, budget_bytes: int, shape: Shape, slots: int,
                 positions: int) -> None:
        self.dir = node_dir
        self.budget_bytes = int(budget_bytes)
        self.shape = shape
        self.slab = Slab.create(node_dir, slots, positions, shape)
        self._free = list(range(slots - 1, -1, -1))
        self._slot: dict[str, int] = {}         # key -> slot
        self._covered = np.zeros(slots, np.int64)
        self._sum = np.zeros(slots, np.uint64)
        self._versions = [-1] * slots   # a list: read per key, where numpy is slow
        self._resident = np.zeros(slots, np.int64)   # positions whose pages are mapped
        self._saves = np.zeros(slots, np.int64)      # saves into each slot: its ring index
        self._since_scan = 0
        self._others: dict[Path, Slab] = {}
        self.counts: Counter[str] = Counter()
        self._prefault(PREFAULT_BYTES)

    def _prefault(self, limit: int) -> None:
        """Map the pages of the first slots now, up to ``limit`` bytes: a tmpfs page costs a
        fault the first time it is written, and the first saves (an adopter's, right in a
        failover) would pay them.  Counted against the budget like any idle slot."""
        slab = self.slab
        n = min(slab.slots, max(0, limit) // slab.stride)
        if not n:
            return
        start = slab.table_bytes
        try:   # Linux 5.14+; Python 3.11's mmap does not name it yet
            slab.mm.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23), start, n * slab.stride)
        except (OSError, ValueError):   # an older kernel: touch them
            slab.tokens[:n] = 0
            slab.kv[:n] = 0
            slab.hidden[:n] = 0
        self._resident[:n] = slab.positions

    # ------------------------------------------------------------------------- writing
    def claim(self, keys: list[str], version: int) -> tuple[np.ndarray, np.ndarray]:
        """The slot of each key and the positions it covers: a new key (or one saved at
        another version, which starts afresh) claims a free slot; -1 where none is free."""
        slots = np.empty(len(keys), np.int64)
        versions, table_of = self._versions, self._slot
        fresh: list[tuple[int, str]] = []
        for i, key in enumerate(keys):
            slot = table_of.get(key)
            if slot is not None and versions[slot] != version:
                self.release(key)
                slot = None
            if slot is None:
                if not self._free:
                    self.counts["no_slot"] += 1
                    slot = -1
                else:
                    # Most recently freed first: its pages are mapped still, no page faults.
                    slot = table_of[key] = self._free.pop()
                    versions[slot] = version
                    fresh.append((slot, key))
            slots[i] = slot
        if fresh:
            new = np.array([slot for slot, _ in fresh])
            self._covered[new] = 0
            self._sum[new] = 0
            self._saves[new] = 0
            table = self.slab.table
            table["state"][new] = 0
            table["digest"][new] = np.stack([digest(key) for _, key in fresh])
            table["version"][new] = version
            table["covered"][new] = 0
            table["hidden_at"][new] = 0
            table["created_ns"][new] = time.time_ns()
        covered = np.where(slots >= 0, self._covered[np.maximum(slots, 0)], 0)
        return slots, covered

    def write(self, slots: np.ndarray, owner: np.ndarray, positions: np.ndarray,
              tokens: np.ndarray, parts: list[tuple[int, int, np.ndarray]],
              hidden: np.ndarray) -> None:
        """Save new positions of several requests at once.

        ``slots`` ``[R]`` (from :meth:`claim`; each covers up to the first of its new
        positions) and ``hidden`` ``[R, D]`` (each request's state after its last one).
        Per new position ``[M]``, grouped by request in position order: ``owner`` (its
        index into ``slots``), ``positions`` (its context position) and ``tokens``;
        ``parts`` hold their keys and values, ``(0 keys | 1 values, layer, [M, heads,
        head_dim])``."""
        if not len(slots):
            return
        at = slots[owner]
        slab = self.slab
        slab.tokens[at, positions] = tokens
        for which, layer, got in parts:
            slab.kv[at, positions, which, layer] = got
        # One read back of what was written, for its sums (cheaper than one per part).
        words = word_sums(slab.kv[at, positions]) + tokens.astype(np.uint64)
        if len(owner) == len(slots):   # one position each
            added, covered = words, positions + 1
        else:   # per request: the sums of its new positions (grouped: reduceat)
            starts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
            added = np.add.reduceat(words, starts)
            covered = np.maximum.reduceat(positions, starts) + 1
        self._sum[slots] += added
        self._covered[slots] = covered
        self._resident[slots] = np.maximum(self._resident[slots], covered)
        table = self.slab.table
        table["kv_sum"][slots] = self._sum[slots]
        # The state at each of the last RING save points, in a ring: a failed engine may
        # have saved chunks its caller never received, and a resume from any of them needs
        # no prefill either.
        ring = self._saves[slots] % RING
        self._saves[slots] += 1
        slab.hidden[slots, ring] = hidden
        table["hidden_sum"][slots, ring] = word_sums(hidden)
        table["hidden_at"][slots, ring] = covered
        table["covered"][slots] = covered
        table["state"][slots] = 1
        written = len(tokens) * (self.shape.position_bytes() + 4)
        self.counts["saved_bytes"] += written
        self.counts["saved_positions"] += len(tokens)
        self._since_scan += written
        if self._since_scan * 16 >= self.budget_bytes:
            self.enforce_budget()

    def holds(self, slots: np.ndarray, covered: np.ndarray) -> bool:
        """Each of ``slots`` is still claimed and covers exactly ``covered`` positions (no
        release, eviction or restart since the caller last saved them)."""
        return bool((self._covered[slots] == covered).all() and
                    all(self._versions[s] >= 0 for s in slots.tolist()))

    def release(self, key: str) -> None:
        """Free ``key``'s slot (it finished, or was aborted).  Its pages stay mapped for the
        next request (they count against the budget until :meth:`enforce_budget` needs
        them back): writing to fresh pages of a tmpfs costs a page fault each."""
        slot = self._slot.pop(key, None)
        if slot is not None:
            self.slab.free([slot], punch=False)
            self._versions[slot] = -1
            self._covered[slot] = -1
            self._free.append(slot)

    def keys(self) -> list[str]:
        return list(self._slot)

    def close(self, *, keep: bool = True) -> None:
        """Stop; ``keep`` leaves the slab for adopters (a shutdown with requests in it)."""
        for slab in self._others.values():
            slab.close()
        self._others.clear()
        path = self.slab.path
        self.slab.close()
        if not keep:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    # ------------------------------------------------------------------------- reading
    def _slabs(self) -> list[Slab]:
        """Every other slab on the node, mapped (new ones opened, vanished ones closed)."""
        try:
            paths = {p for p in self.dir.iterdir() if p.suffix == ".kvs"}
        except FileNotFoundError:
            paths = set()
        paths.discard(self.slab.path)
        for gone in set(self._others) - paths:
            self._others.pop(gone).close()
        for path in paths - set(self._others):
            slab = Slab.open(path)
            if slab is not None:
                self._others[path] = slab
        return list(self._others.values())

    def find(self, keys: list[str], version: int,
             contexts: list[tuple[int, ...] | list[int]]) -> list[tuple[Found | None, str]]:
        """For each of ``keys``: the cache another engine on this node saved under it, usable
        by a request at ``version`` with that ``contexts`` entry: (found, ``"adopted"`` or
        ``"partial"``), or (None, a :data:`FALLBACKS` reason; ``"missing"`` when none is
        on this node).  Every slot a cache came from is freed: the caller saves the
        request in its own slab from now on.  One look at each slab for all keys."""
        wanted: dict[tuple[int, int], list[int]] = {}
        for i, key in enumerate(keys):
            wanted.setdefault(tuple(digest(key).tolist()), []).append(i)  # type: ignore[arg-type]
        results: dict[int, list[tuple[int, Found | None, str]]] = {}
        for slab in self._slabs():
            table = slab.table
            valid = np.flatnonzero(table["state"] == 1)
            slots, owners = [], []
            for slot, pair in zip(valid.tolist(), table["digest"][valid].tolist(),
                                  strict=True):
                for i in wanted.get(tuple(pair), ()):
                    slots.append(slot)
                    owners.append(i)
            if not slots:
                continue
            for i, covered, got in zip(owners, table["covered"][slots].tolist(),
                                       self._read(slab, np.asarray(slots), version,
                                                  [contexts[i] for i in owners]),
                                       strict=True):
                results.setdefault(i, []).append((covered, *got))
            # Taken (or useless to anyone): the adopter saves these requests in its own slab.
            table["state"][slots] = 0
            if not pid_alive(slab.pid) and not (table["state"] == 1).any():
                self._drop_slab(slab)
        out: list[tuple[Found | None, str]] = []
        for i in range(len(keys)):
            tried = sorted(results.get(i, []), key=lambda r: -r[0])
            best = next(((f, why) for _, f, why in tried if f is not None), None)
            if best is None:
                whys = [why for _, _, why in tried]
                best = (None, next((w for w in ("torn", "mismatch", "version") if w in whys),
                                   "missing"))
            out.append(best)
        return out

    def _read(self, slab: Slab, slots: np.ndarray, version: int,
              contexts: list[tuple[int, ...] | list[int]]) -> list[tuple[Found | None, str]]:
        """What each of ``slab``'s ``slots`` can give a request with that ``contexts``
        entry at ``version``: checked (version, sums, token prefix) for all of them at once,
        in one copy out of the slab."""
        n = len(slots)
        rows = slab.table[slots]
        covered = rows["covered"].astype(np.int64)
        if slab.shape != self.shape or (covered <= 0).any() or \
                (covered > slab.positions).any():
            return [(None, "torn")] * n
        width = int(covered.max())
        tokens = slab.tokens[slots, :width]                       # copies
        kv = slab.kv[slots, :width]
        hidden = slab.hidden[slots]
        inside = np.arange(width)[None, :] < covered[:, None]
        per = word_sums(kv.reshape(n * width, -1)).reshape(n, width) + \
            tokens.astype(np.uint64)
        intact = np.where(inside, per, np.uint64(0)).sum(axis=1) == rows["kv_sum"]
        hidden_ok = word_sums(hidden.reshape(n * RING, -1)).reshape(n, RING) == \
            rows["hidden_sum"]
        lengths = np.array([len(c) for c in contexts])
        ctx = np.full((n, width), -1, np.int64)
        for i, c in enumerate(contexts):
            part = c[:width]
            ctx[i, :len(part)] = part
        same = (tokens == ctx) & (np.arange(width)[None, :] < np.minimum(covered, lengths)[:, None])
        usable = np.argmin(np.concatenate([same, np.zeros((n, 1), bool)], axis=1), axis=1)
        out: list[tuple[Found | None, str]] = []
        for i in range(n):
            use, length = int(usable[i]), int(lengths[i])
            if int(rows["version"][i]) != version:
                out.append((None, "version"))
            elif not intact[i]:
                out.append((None, "torn"))
            elif use == 0:
                out.append((None, "mismatch"))
            else:
                out.append(_found(kv[i], hidden[i], rows["hidden_at"][i], hidden_ok[i], use,
                                  length))
        return out

    def _drop_slab(self, slab: Slab) -> None:
        """Unlink a dead engine's slab that holds nothing valid; its memory goes back to the
        node once no process maps it."""
        path = slab.path
        self._others.pop(path, None)
        slab.close()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    # ------------------------------------------------------------------------ cleanup
    def enforce_budget(self) -> int:
        """Free the node's oldest slots (this engine's and dead engines') while the node
        holds more than its budget; returns how many were freed."""
        self._since_scan = 0
        slabs = self._slabs()
        per = self.shape.position_bytes()
        idle = [slot for slot in self._free if self._resident[slot]]
        total = self.slab.used_bytes() + sum(s.used_bytes() for s in slabs) + \
            int(self._resident[idle].sum()) * per
        if total <= self.budget_bytes:
            return 0
        for slot in idle:   # free slots' pages first: they hold nothing
            self.slab.punch(slot)
            total -= int(self._resident[slot]) * per
            self._resident[slot] = 0
        if total <= self.budget_bytes:
            return 0
        mine = {slot: key for key, slot in self._slot.items()}
        victims = []
        for slab in [self.slab, *(s for s in slabs if not pid_alive(s.pid))]:
            table = slab.table
            for slot in np.flatnonzero(table["state"] == 1).tolist():
                victims.append((int(table["created_ns"][slot]), slab, slot,
                                int(table["covered"][slot]) * per))
        victims.sort(key=lambda v: v[0])
        target = int(self.budget_bytes * 0.9)
        freed = 0
        for _, slab, slot, size in victims:
            if total <= target:
                break
            if slab is self.slab and slot in mine:
                self.release(mine[slot])
                slab.punch(slot)
                self._resident[slot] = 0
            else:
                slab.free([slot])
            total -= size
            freed += 1
        self.counts["evicted"] += freed
        return freed

    def sweep(self, oldest_kept: int) -> int:
        """Free dead engines' slots of a version below ``oldest_kept``, and unlink dead
        engines' slabs with no valid slot; returns the slots freed."""
        freed = 0
        for slab in self._slabs():
            if pid_alive(slab.pid):
                continue
            table = slab.table
            old = np.flatnonzero((table["state"] == 1) & (table["version"] < oldest_kept))
            if len(old):
                slab.free(old)
                freed += len(old)
            if not (table["state"] == 1).any():
                self._drop_slab(slab)
        return freed


# ----------------------------------------------------------------- the run's directory
OWNER = "owner.json"


def prepare_run_dir(root: Path, run_id: str, owner: dict[str, object]) -> Path:
    """Make ``<root>/<run_id>`` on this node, owned by the driver ``owner`` names (``host``,
    ``pid``, ``started``: its process's start time), and remove the directories of runs
    whose driver on this host is gone (a driver killed and never resumed): nothing else
    would.  Returns the run's directory."""
    import json
    import shutil
    import socket

    import psutil

    host = socket.gethostname()
    if root.is_dir():
        for other in root.iterdir():
            if other.name == run_id or not other.is_dir():
                continue
            try:
                who = json.loads((other / OWNER).read_text())
            except (OSError, ValueError):
                continue
            if who.get("host") != host:
                continue   # another host's driver: not ours to judge
            try:
                alive = psutil.Process(int(who["pid"])).create_time() == who.get("started")
            except (psutil.Error, KeyError, TypeError, ValueError):
                alive = False
            if not alive:
                shutil.rmtree(other, ignore_errors=True)
                log.info("removed KV hand-off caches of ended run %s", other.name)
    run = root / run_id
    run.mkdir(parents=True, exist_ok=True)
    (run / OWNER).write_text(json.dumps(owner))
    return run


def remove_run_dir(root: Path, run_id: str) -> bool:
    """Remove ``<root>/<run_id>`` and every cache in it; True if it was there."""
    import shutil
    run = root / run_id
    if not run.exists():
        return False
    shutil.rmtree(run, ignore_errors=True)
    return not run.exists()


def driver_owner() -> dict[str, object]:
    """This process as a run directory's owner (see :func:`prepare_run_dir`)."""
    import socket

    import psutil
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": psutil.Process().create_time()}
