"""The ``data`` section of a job config: prompts from a dataset, and how they are formatted.

Kept beside :mod:`erlay.actors.config` (which includes it in :class:`JobConfig`) so that module
stays one screenful per concern.  Loading and checking the rows is :mod:`erlay.actors.data`'s
job; this module only says what the keys mean and which combinations are valid.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Keys a dataset-backed episode's metadata holds besides the metadata columns (docs/data.md).
RESERVED_METADATA = ("messages", "row", "source")


class DataSection(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    chat: bool = Field(False, description="format prompts with the tokenizer's chat template "
                       "(apply_chat_template: system prompt, messages, tool schemas)")
    system_prompt: str | None = Field(None, description="with chat: the system message "
                                      "before each prompt")
    train: str | None = Field(None, description="training prompts: a .jsonl, .json or .parquet "
                              "file, a directory of them (relative paths: to the config file), "
                              "or a hub dataset id already in the local HF cache (never "
                              "downloaded); unset = the environment generates its own")
    validation: str | None = Field(None, description="validation prompts, as data.train; "
                                   "played every data.validation_every steps, never trained on")
    subset: str | None = Field(None, description="hub ids: the dataset's config name (e.g. "
                               "'main' for openai/gsm8k)")
    split: str = Field("train", description="hub ids: the split data.train reads")
    validation_split: str = Field("test", description="hub ids: the split data.validation "
                                  "reads")
    prompt: str = Field("prompt", description="column holding the prompt text")
    messages: str | None = Field(None, description="column holding chat rows (a list of "
                                 "{role, content}) instead of data.prompt; needs data.chat")
    answer: str | None = Field("answer", description="column holding the gold answer (string "
                               "or number); null = rows have none")
    metadata: list[str] = Field(default_factory=list, description="further columns passed "
                                "through to the environment (Episode.metadata), JSON values")
    shuffle: bool = Field(True, description="shuffle rows, a new seeded order each epoch "
                          "(run.seed); false = file order")
    validation_every: int = Field(0, ge=0, description="validate after every this many RL "
                                  "steps; 0 = never")
    validation_size: int | None = Field(256, ge=1, description="validation rows played each "
                                        "time (a fixed seeded sample); null = all of them")

    @model_validator(mode="after")
    def _consistent(self) -> DataSection:
        if self.messages is not None and not self.chat:
            raise ValueError("data.messages: chat rows need data.chat: true (the tokenizer's "
                             "chat template formats them)")
        if self.validation_every and self.validation is None:
            raise ValueError("data.validation_every needs data.validation (the rows to "
                             "validate on)")
        if self.validation is not None and self.train is None:
            raise ValueError("data.validation needs data.train (the environment plays dataset "
                             "rows only when it is given training rows)")
        reserved = sorted(set(self.metadata) & set(RESERVED_METADATA))
        if reserved:
            raise ValueError(f"data.metadata: {', '.join(reserved)} is reserved (rows carry "
                             f"it already)")
        if len(set(self.metadata)) != len(self.metadata):
            raise ValueError("data.metadata: a column is named twice")
        return self
