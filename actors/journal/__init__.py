"""The rollout journal: every rollout transition, durable and replayable.

- :mod:`.transitions`: the transition kinds the coordinator records, and the sink protocol;
- :mod:`.store`: :class:`~erlay.actors.journal.store.Journal`, the append-only, CRC-framed,
  batched-fsync log with snapshots and compaction;
- :mod:`.format`: the on-disk format, and recovery of a journal directory (a torn tail is
  truncated and reported; corruption elsewhere is :class:`JournalCorrupt`);
- :mod:`.state`: the pure fold of transitions into per-rollout state;
- :mod:`.inspection`: text views for ``erlay journal inspect``.

Contract: a transition is durable once the fsync policy says so, and recovery rebuilds every
in-flight rollout from what was recorded.  No Ray.

May import: erlay.supervisor.
"""
