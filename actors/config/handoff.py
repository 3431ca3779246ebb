"""The ``engine.kv_handoff`` section of a job config: KV hand-off between engines.

Kept beside :mod:`erlay.actors.config` (which includes it in its ``engine`` section), as
:mod:`erlay.actors.config.control` is.  What an engine does with it is
:mod:`erlay.actors.engine.kv_handoff`'s; this module only says what the keys mean.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class KVHandoffSection(BaseModel):
    """Save each in-flight request's KV cache on its node, so that the engine taking over a
    failed engine's rollouts loads it instead of prefilling their contexts again."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    enabled: bool = Field(True, description="torch engine: save in-flight KV caches at each "
                          "chunk and adopt them on failover (the vllm backend does not "
                          "support it and ignores this)")
    node_budget_mb: int = Field(2048, ge=1, description="node memory the saved caches of a "
                                "node may hold; past it the oldest are dropped and their "
                                "rollouts re-prefill on failover")
    root: str = Field("/dev/shm/erlay-kv", min_length=1, description="node-local directory "
                      "the caches live under (a tmpfs: node memory, not disk); each run "
                      "gets its own directory, removed when the run ends")
