"""The ``data`` section of a job config: prompts from a dataset, and how they are formatted.

Kept beside :mod:`erlay.actors.config` (which includes it in :class:`JobConfig`) so that module
stays one screenful per concern.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class DataSection(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    chat: bool = Field(False, description="format prompts with the tokenizer's chat template "
                       "(apply_chat_template: system prompt, messages, tool schemas)")
    system_prompt: str | None = Field(None, description="with chat: the system message "
                                      "before each prompt")
