"""The learner: GRPO updates, the rank actor, and asynchronous checkpoints.

- :mod:`.grpo`: GRPO's arithmetic as pure torch functions;
- :mod:`.batch`: :class:`TrainBatch` and the batch arithmetic (schedule, staleness, shards);
- :mod:`.core`: :class:`LearnerCore`, the learner's state and update rules, without Ray;
- :mod:`.fsdp`: ``backend: fsdp2``, the policy sharded with FSDP2 over the ranks (the check
  that the sharded step equals one whole learner's is a harness, ``bench/fsdp_parity.py``);
- :mod:`.rank`: :class:`Learner`, a rank as a supervised actor child (weights through the
  Ray object store);
- :mod:`.checkpoint`: the checkpoint room: async checkpoints on nvidia-resiliency-ext's
  persistent worker (its ``__init__``), the on-disk format and verification
  (:mod:`.checkpoint.format`), the atomic commit, the snapshot into shared memory, the
  worker, and sharded (fsdp2) saves and loads;

Contract: each trajectory is trained by exactly one step; a restarted rank reloads the last
committed checkpoint, and a checkpoint that is not complete is never loaded.

May import: erlay.supervisor, erlay.actors.model.
"""
