"""The job's configuration: one typed pydantic model, validated once at load time.

The room: this module is the model and its loader; its sections of their own are
:mod:`.data` (``data``), :mod:`.learner` (``learner``), :mod:`.logging` (``logging``),
:mod:`.placement` (``placement``), and
:mod:`.reference` writes ``docs/configuration.md`` from the fields.

``load_config(path, overrides)`` reads YAML, applies ``key.sub=value`` overrides, validates,
and raises :class:`ConfigError` before anything starts.  The message names the key, what was
expected and what was given: an unknown key, a wrong type, a missing file, an environment or
judge class that cannot be imported.

Every option is documented on its field; ``configs/reference.yaml`` shows them all.

Example: the defaults with one override, and a typo refused by name (the message goes on:
"(given 3); did you mean 'steps'?")::

    >>> load_config(None, ["run.steps=3"]).run.steps
    3
    >>> load_config(None, ["run.stepz=3"])
    Traceback (most recent call last):
    ...
    erlay.actors.config.ConfigError: invalid configuration: run.stepz: unknown key ...

May import: erlay.supervisor, erlay.sandbox, erlay.environments, erlay.judges (the default
plug-ins are named by import path), erlay.actors.storage (which storage URLs open).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from erlay.actors.config.algorithm import AlgorithmSection
from erlay.actors.config.control import ControlSection
from erlay.actors.config.data import DataSection
from erlay.actors.config.handoff import KVHandoffSection
from erlay.actors.config.learner import LearnerSection
from erlay.actors.config.logging import LoggingSection
from erlay.actors.config.placement import PlacementSection, colocation_fits
from erlay.supervisor.errors import ErlayError
from erlay.supervisor.imports import import_path

BUILTIN_SEQ_LEN = 96


class ConfigError(ErlayError):
    """The configuration is invalid; the message names every offending key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class RunSection(Section):
    """Where the run's directory goes: exactly ``run_dir`` when set, else the auto-named
    ``<storage>/<name>-<YYYYmmdd-HHMMSS>`` (:meth:`erlay.actors.rundir.RunDir.create_for`).
    ``run_dir`` used to be the parent of auto-named run directories; that meaning is now
    ``storage``'s, and a ``run_dir`` that is not empty is refused with a pointer to it, so an
    old config fails loudly instead of mixing runs in one directory."""

    name: str = Field("erlay", description="run name; an auto-named run directory is "
                      "<storage>/<name>-<YYYYmmdd-HHMMSS>")
    storage: str | None = Field(None, description="where every auto-named run directory "
                                "goes: a local or shared-filesystem directory, or an object "
                                "store URL (s3://bucket/prefix, gs://bucket/prefix), the run "
                                "then working in a local copy under staging and uploading in "
                                "the background (null: $ERLAY_STORAGE, else ~/erlay-runs; "
                                "relative: to the working directory)")
    run_dir: str | None = Field(None, description="this run's directory, exactly, instead of "
                                "an auto-named one under storage; local; it must be new or "
                                "empty")
    staging: str | None = Field(None, description="with remote storage: the local directory "
                                "under which the run's working copy (journal, checkpoint "
                                "staging, logs) lives, named as the remote one (null: "
                                "~/erlay-runs/staging)")
    upload_every_s: float = Field(5.0, gt=0, description="with remote storage: upload what "
                                  "changed this often; a crash of a machine loses at most "
                                  "about this much of what it wrote (docs/storage.md)")
    upload_timeout_s: float = Field(300.0, gt=0, description="with remote storage: how long "
                                    "the end of a run waits for its last uploads; past it "
                                    "the run fails (exit 1) and says where the local copy is")
    seed: int = Field(0, description="seed for data order, sampling and initialisation")
    steps: int = Field(100, ge=1, description="RL steps (learner updates)")
    stall_timeout_s: float = Field(1800.0, gt=0, description="a job that reports no progress "
                                   "(no step, no warm start) for this long is stopped as "
                                   "stalled, exit code 1")

    @field_validator("storage", "run_dir", "staging")
    @classmethod
    def _path_or_url(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return value
        if not value.strip():
            raise ValueError("must be a directory path, or null for the default")
        if "://" in value:
            if info.field_name != "storage":
                raise ValueError("must be a local directory; an object store URL goes in "
                                 "run.storage")
            from erlay.actors.storage.remote import check_url
            check_url(value)
        return value


class RaySection(Section):
    address: str | None = Field(None, description="attach to this cluster (else RAY_ADDRESS, "
                                "else start a local loopback Ray)")
    num_cpus: int | None = Field(None, ge=1, description="logical CPUs of a local Ray")
    include_dashboard: bool = Field(False, description="start the dashboard with a local Ray")


class LoraSection(Section):
    """LoRA adapters (through peft) on an HF model; only they train."""

    r: int = Field(8, ge=1, description="adapter rank")
    alpha: int = Field(16, ge=1, description="scale numerator (the update is alpha / r * B A)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter's input")
    target_modules: list[str] | str = Field("all-linear", description="module names to adapt, "
                                            "or peft's 'all-linear'")


class ModelSection(Section):
    hf: str | None = Field(None, description="a Hugging Face causal LM: a local directory "
                           "(relative paths: to the config file, else the working directory) "
                           "or a hub id already in the HF cache; unset = erlay's built-in "
                           "character model (d_model ... below)")
    init: Literal["pretrained", "random"] = Field(
        "pretrained", description="hf: load the directory's weights, or initialise randomly "
        "from its config with run.seed (also what a directory without weights gets)")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32", description="hf: the serving dtype: the torch engine's weights and the "
        "weights the learner publishes; the learner's own follow learner.precision")
    trust_remote_code: bool = Field(False, description="hf: run the model's own modelling "
                                    "code (transformers' trust_remote_code)")
    lora: LoraSection | None = Field(None, description="hf: train LoRA adapters instead of "
                                     "the whole model")
    d_model: int = Field(128, ge=8, description="built-in model: width of the residual stream")
    n_layers: int = Field(2, ge=1, description="built-in model: transformer blocks")
    n_heads: int = Field(4, ge=1, description="built-in model: attention heads (divide d_model)")
    d_ff: int = Field(512, ge=8, description="built-in model: width of each block's MLP")
    max_seq_len: int | None = Field(None, ge=8, description="longest prompt + completion, in "
                                    "tokens; hf: at most the model's position limit (the "
                                    "default); built-in: default 96")
    mtp_heads: int = Field(0, ge=0, description="multi-token-prediction heads that draft "
                           "tokens for the torch engine's speculative decoding (0 = none)")

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSection:
        if self.hf is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads "
                             f"({self.n_heads})")
        if self.hf is None and self.lora is not None:
            raise ValueError("lora needs an HF model (model.hf)")
        return self

    @property
    def builtin_seq_len(self) -> int:
        return self.max_seq_len or BUILTIN_SEQ_LEN


class VllmSection(Section):
    """Settings of the ``vllm`` backend (ignored by ``torch``)."""

    model_dir: str | None = Field(None, description="serve this Hugging Face GPT-2 directory "
                                  "(the learner starts from its weights); default: erlay's "
                                  "policy, made at start")
    speculative_config: dict[str, Any] | None = Field(
        None, description="vLLM's speculative_config, passed through: {method: mtp} on "
        "models with MTP heads, {method: ngram, ...} or a draft model elsewhere")
    engine_args: dict[str, Any] = Field(default_factory=dict, description="more vLLM "
                                        "AsyncEngineArgs (dtype, gpu_memory_utilization, ...)")
    start_timeout_s: float = Field(600.0, gt=0, description="an engine start running longer "
                                   "is a start failure (counts against restart intensity)")
    rpc_timeout_s: float = Field(60.0, gt=0, description="timeout of each call into vLLM")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per engine actor (Ray resource)")

    @field_validator("engine_args")
    @classmethod
    def _not_owned(cls, value: dict[str, Any]) -> dict[str, Any]:
        owned = {"model", "skip_tokenizer_init", "worker_extension_cls", "logprobs_mode",
                 "speculative_config", "seed"}
        clash = sorted(owned & set(value))
        if clash:
            raise ValueError(f"{clash} are set by erlay (use model_dir / speculative_config "
                             "/ run.seed)")
        return value


class EngineSection(Section):
    backend: Literal["torch", "vllm"] = Field("torch", description="generation backend")
    num_engines: int = Field(1, ge=1, description="generation engine actors")
    max_batch: int = Field(256, ge=1, description="requests decoded together")
    torch_threads: int = Field(1, ge=1, description="torch threads per engine process")
    max_new_tokens: int = Field(8, ge=1, description="tokens per turn")
    stop: list[str] = Field(default_factory=list, description="stop strings: a turn ends "
                            "at the token that completes the first one in its decoded text "
                            "(later tokens are dropped; the environment sees the text before "
                            "it); the tokenizer's EOS always stops")
    temperature: float = Field(1.0, ge=0.0, description="sampling temperature (0 = greedy)")
    chunk_tokens: int = Field(8, ge=1, description="stream a chunk at least this often")
    decode_deadline_s: float = Field(30.0, gt=0, description="hang deadline of a decode step; "
                                     "a generation stream silent for twice this long fails "
                                     "over to another engine")
    update_timeout_s: float = Field(300.0, gt=0, description="deadline of one weight update "
                                    "call into an engine")
    restart_delay_s: float = Field(2.0, ge=0, allow_inf_nan=False, description="seconds "
                                   "from an engine's failure to the start of a new engine "
                                   "process, in a job of more than one engine: its rollouts "
                                   "fail over first, without the start-up taking the node's "
                                   "CPUs.  With spares, a restart adopts a spare at once and "
                                   "this delays the new spare instead "
                                   "(0 = at once; one engine restarts at once)")
    spares: int | None = Field(None, ge=0, description="warm spare engines, built and ready "
                               "beside the generation domain (one pool for all engines): a "
                               "failed engine's restart adopts one instead of starting a new "
                               "process, and a new spare is built after restart_delay_s.  "
                               "null: 1 for the torch engine, 0 for vllm (a spare vLLM engine "
                               "holds its own memory and GPUs)")
    spare_start_delay_s: float = Field(0.0, ge=0, allow_inf_nan=False, description="seconds "
                                       "from the engines' first start to the first spare's "
                                       "(0 = at once); more lets the job's boot have the "
                                       "node's CPUs first, and a failure before the spare is "
                                       "ready restarts as without one")
    spec_k: int = Field(0, ge=0, description="torch engine: tokens drafted per step by the MTP "
                        "heads and verified in one pass (0 = no speculation)")
    spec_max_concurrency: int = Field(0, ge=0, description="speculate only while at most "
                                      "this many requests run, i.e. in the batch's long tail "
                                      "(0 = always)")
    spec_verify: Literal["coupled", "rejection"] = Field(
        "coupled", description="draft verification: coupled (token-identical to plain "
        "decoding, keeps replay exact) or rejection (speculative sampling)")
    spec_draft: Literal["argmax", "sample"] = Field(
        "argmax", description="how the MTP heads propose drafts: argmax (each head's most "
        "likely token) or sample (a draw from the head); either way the output is what "
        "spec_verify makes it, only the acceptance rate differs")
    vllm: VllmSection = VllmSection()
    kv_handoff: KVHandoffSection = KVHandoffSection()


class WarmStartSection(Section):
    steps: int = Field(30, ge=0, description="supervised steps on generated demonstrations "
                       "(kept short on purpose: RL must carry the reward)")
    batch_size: int = Field(64, ge=1, description="demonstrations per warm-start step")
    examples: int = Field(512, ge=1, description="demonstration episodes to draw from")
    lr: float = Field(1e-3, gt=0, description="warm-start learning rate (Adam)")


class RolloutSection(Section):
    prompts_per_step: int = Field(16, ge=1, description="GRPO groups per step")
    group_size: int = Field(8, ge=2, description="rollouts per prompt")
    max_staleness: int = Field(1, ge=0, description="max policy-version age of a trained "
                               "trajectory; 0 = synchronous, 1 = one-step off-policy")


class EnvironmentSection(Section):
    cls: str = Field("erlay.environments.arithmetic:ArithmeticEnv", alias="class",
                     description="environment as module:Class")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="environment arguments")
    workers_per_node: int = Field(2, ge=1, description="environment worker processes in each "
                                  "node's environment host; each runs one call at a time, "
                                  "so a call that freezes its process costs that worker only")

    @field_validator("cls")
    @classmethod
    def _importable(cls, value: str) -> str:
        return _check_import_path(value)


class SandboxSection(Section):
    workers_per_node: int = Field(2, ge=1, description="sandbox workers in each node's host")
    limits: dict[str, Any] = Field(default_factory=dict, description="sandbox.SandboxLimits "
                                   "fields (wall_timeout_s, memory_mb, ...)")
    max_attempts: int = Field(3, ge=1, description="tries of one tool call before its result "
                              "is an error observation")
    call_timeout_s: float = Field(300.0, gt=0, description="deadline of one tool call into a "
                                  "sandbox host, queueing included; a frozen host is found "
                                  "sooner by its heartbeat")

    @field_validator("limits")
    @classmethod
    def _valid_limits(cls, value: dict[str, Any]) -> dict[str, Any]:
        from erlay.sandbox.limits import SandboxLimits
        try:
            SandboxLimits(**value)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                                 for e in exc.errors())
            raise ValueError(f"invalid sandbox limits ({problems})") from None
        return value


class JudgeBreakerSection(Section):
    """One circuit breaker per judge worker (erlay.judges.budget.CircuitBreaker)."""

    failure_threshold: int = Field(10, ge=1, description="failures in a row that open a "
                                   "worker's breaker")
    window: int = Field(20, ge=1, description="calls over which the error rate is measured")
    min_calls: int = Field(10, ge=1, description="calls before the error rate counts")
    open_rate: float = Field(0.5, gt=0, le=1, description="an error rate above this opens "
                             "the breaker")
    cool_down_s: float = Field(5.0, gt=0, description="how long an open breaker refuses work "
                               "before one probe call is let through")

    @model_validator(mode="after")
    def _min_calls_fit(self) -> JudgeBreakerSection:
        if self.min_calls > self.window:
            raise ValueError(f"min_calls ({self.min_calls}) must be <= window ({self.window})")
        return self


class JudgeSection(Section):
    cls: str = Field("erlay.judges.math:MathJudge", alias="class",
                     description="judge as module:Class")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="judge arguments")
    workers_per_node: int = Field(1, ge=1, description="judge workers in each node's host")
    timeout_s: float = Field(5.0, gt=0, description="budget of one judgement")
    retries: int = Field(2, ge=0, description="retries of a failed judgement, on another "
                         "worker when there is one")
    breaker: JudgeBreakerSection = JudgeBreakerSection()

    @field_validator("cls")
    @classmethod
    def _importable(cls, value: str) -> str:
        return _check_import_path(value)


class PluginsSection(Section):
    """User code (the environment, the judge) as a fault domain of its own."""

    timeout_s: float = Field(10.0, gt=0, description="deadline of one environment call "
                             "(reset, step, observe); past it that sample fails as timeout")
    window: int = Field(40, ge=1, description="calls of one plug-in method over which its "
                        "failure rate is measured")
    max_failure_rate: float = Field(0.75, gt=0, le=1, description="a method failing more than "
                                    "this share of its window stops the job (exit code 1)")
    min_calls: int = Field(16, ge=1, description="calls before the failure rate counts")
    build_timeout_s: float = Field(60.0, gt=0, description="deadline of building the "
                                   "environment and the judge once, in a subprocess, before "
                                   "anything starts (erlay run's preflight); a constructor "
                                   "that raises or runs past it is exit code 2")

    @model_validator(mode="after")
    def _min_calls_fit(self) -> PluginsSection:
        if self.min_calls > self.window:
            raise ValueError(f"min_calls ({self.min_calls}) must be <= window ({self.window})")
        return self


class JournalSection(Section):
    fsync: Literal["batch", "always", "never"] = Field(
        "batch", description="when the rollout journal fsyncs: every record, in batches, or "
        "never (records still reach the OS at once, so a process crash loses nothing)")
    fsync_every_records: int = Field(256, ge=1, description="batch: fsync after this many "
                                     "records")
    fsync_every_s: float = Field(0.05, gt=0, description="batch: or after this long")
    segment_mb: float = Field(8.0, gt=0, description="roll to a new segment file at this size")
    snapshot_every: int = Field(20000, ge=1, description="snapshot and compact after this "
                                "many records, so recovery reads one snapshot and a short tail")


class CheckpointSection(Section):
    every_steps: int = Field(10, ge=1, description="save learner state + a journal snapshot "
                             "every this many RL steps (asynchronously)")
    keep: int = Field(3, ge=1, description="checkpoints kept on disk")
    deadline_s: float = Field(300.0, gt=0, description="a checkpoint writer that makes no "
                              "progress for this long (SIGSTOPped, stuck in D state, a hung "
                              "filesystem) is killed and replaced; that save is recorded as "
                              "failed, the previous committed checkpoint stays, training "
                              "goes on")


class TelemetrySection(Section):
    exporter: Literal["file", "console", "otlp", "none"] = Field(
        "file", description="where spans and metrics go: file (JSONL under RUN_DIR/telemetry/, "
        "one file per process), console (stdout), otlp (OTLP/HTTP to otlp_endpoint) or none")
    otlp_endpoint: str | None = Field(None, description="otlp: the collector's base URL, e.g. "
                                      "http://127.0.0.1:4318 (default: "
                                      "OTEL_EXPORTER_OTLP_ENDPOINT)")
    export_interval_s: float = Field(5.0, gt=0, description="how often metrics are exported")
    rollout_sample_ratio: float = Field(
        0.02, ge=0, le=1, description="share of rollouts traced end to end (by a stable hash "
        "of the rollout id); steps, checkpoints and restarts are always traced")
    ray_metrics: bool = Field(True, description="also publish the key metrics as Ray "
                              "application metrics (the dashboard, Prometheus)")

    @model_validator(mode="after")
    def _endpoint(self) -> TelemetrySection:
        if self.exporter == "otlp" and not (self.otlp_endpoint
                                            or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
            raise ValueError("exporter otlp needs otlp_endpoint (or "
                             "OTEL_EXPORTER_OTLP_ENDPOINT), e.g. http://127.0.0.1:4318")
        return self


class JitCacheSection(Section):
    archive_dir: str | None = Field(None, description="shared storage (the same path on every "
                                    "node) holding the JIT-cache archive; null: no seeding and "
                                    "no archiving")
    local_dir: str = Field("/tmp/erlay-jit", description="node-local directory of the "
                           "Inductor, Triton, vLLM and FlashInfer caches")


class NodeSection(Section):
    env: dict[str, str] = Field(default_factory=dict, description="environment variables "
                                "every process of the job gets, and whatever they spawn")
    env_passthrough: list[str] = Field(
        default_factory=lambda: ["LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_DEVICE_ORDER",
                                 "NCCL_*", "TORCH_*", "VLLM_*"],
        description="names (or globs) copied from the driver's environment, when set")
    numa_bind: bool = Field(True, description="bind each GPU worker to its GPU's local CPUs "
                            "and memory (a no-op without GPUs)")
    check_versions: bool = Field(True, description="fail before any work starts when nodes "
                                 "report different stack versions (Python, torch, Ray, ...)")
    jit_cache: JitCacheSection = JitCacheSection()


class DomainFlags(Section):
    intensity: int = Field(5, ge=0, description="restarts allowed within period before the "
                           "domain gives up and escalates (OTP's intensity)")
    period: float = Field(30.0, gt=0, description="seconds of the intensity window (OTP's "
                          "period)")
    heartbeat_s: float = Field(5.0, gt=0, description="how often the domain's supervisor "
                               "asks each child (actor, host, subprocess) for a heartbeat")
    heartbeat_misses: int = Field(3, ge=1, description="the heartbeat periods a child may stay "
                                  "silent, counted from its last answer, before it is hung "
                                  "(killed and restarted): a frozen child is found more than "
                                  "heartbeat_s x (heartbeat_misses - 1) and at most "
                                  "heartbeat_s x (heartbeat_misses + 1) after it froze")


class SupervisionSection(Section):
    mode: Literal["local", "job_restart"] = Field(
        "local", description="local: each fault domain recovers alone (erlay); job_restart: "
        "any failure restarts the whole job from its last checkpoint, discarding rollouts in "
        "flight (how most RL stacks recover; the chaos suite's baseline)")
    boot_ahead: bool = Field(
        True, description="at the job's start, create the learner, engine and host actors "
        "at once, so their processes load side by side; they are still started (ready, "
        "reported) in the tree's order.  false: create each after the one before it is up")
    root: DomainFlags = DomainFlags(intensity=3, period=60)
    learner: DomainFlags = DomainFlags()
    generation: DomainFlags = DomainFlags()
    sandbox: DomainFlags = DomainFlags()
    judge: DomainFlags = DomainFlags()
    environment: DomainFlags = DomainFlags()
    rollout: DomainFlags = DomainFlags()


class JobConfig(Section):
    """The whole job.  Sections mirror the fault domains."""

    run: RunSection = RunSection()
    ray: RaySection = RaySection()
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    engine: EngineSection = EngineSection()
    learner: LearnerSection = LearnerSection()
    algorithm: AlgorithmSection = AlgorithmSection()
    warm_start: WarmStartSection = WarmStartSection()
    rollout: RolloutSection = RolloutSection()
    environment: EnvironmentSection = EnvironmentSection()
    sandbox: SandboxSection = SandboxSection()
    judge: JudgeSection = JudgeSection()
    journal: JournalSection = JournalSection()
    checkpoint: CheckpointSection = CheckpointSection()
    supervision: SupervisionSection = SupervisionSection()
    plugins: PluginsSection = PluginsSection()
    control: ControlSection = ControlSection()
    telemetry: TelemetrySection = TelemetrySection()
    logging: LoggingSection = LoggingSection()
    node: NodeSection = NodeSection()
    placement: PlacementSection = PlacementSection()
    _colocation = model_validator(mode="after")(colocation_fits)   # config/placement.py

    @model_validator(mode="after")
    def _speculation(self) -> JobConfig:
        if self.engine.spec_k > self.model.mtp_heads:
            raise ValueError(f"engine.spec_k {self.engine.spec_k} needs at least that many "
                             f"MTP heads; model.mtp_heads is {self.model.mtp_heads}")
        return self

    @model_validator(mode="after")
    def _objective_on_megatron(self) -> JobConfig:
        if self.learner.backend == "megatron" and self.algorithm.name != "grpo":
            raise ValueError(f"algorithm.name {self.algorithm.name!r} is not wired into "
                             "learner.backend megatron (its pipeline schedule computes the "
                             "GRPO loss itself); use backend replicated or fsdp2, or grpo")
        return self

    @model_validator(mode="after")
    def _learner_outwaits_its_checkpoint_writer(self) -> JobConfig:
        # A save waits out a stuck writer for up to checkpoint.deadline_s; a learner call
        # with a shorter deadline would be presumed hung meanwhile and its rank restarted.
        if self.learner.call_timeout_s <= self.checkpoint.deadline_s:
            raise ValueError(f"learner.call_timeout_s ({self.learner.call_timeout_s:g}) must "
                             f"be longer than checkpoint.deadline_s "
                             f"({self.checkpoint.deadline_s:g}): a save may wait that long "
                             "for a stuck writer to be given up")
        return self

    @model_validator(mode="after")
    def _vllm_head_size(self) -> JobConfig:
        # vLLM's attention kernels refuse small heads, but only ~30 s into an engine start,
        # deep in a worker's log: say it before anything starts.
        head = self.model.d_model // self.model.n_heads
        if self.engine.backend == "vllm" and self.engine.vllm.model_dir is None \
                and self.model.hf is None and head < 32:
            raise ValueError(f"engine.backend vllm needs a head size (model.d_model / "
                             f"model.n_heads) of at least 32 (vLLM's CPU attention supports "
                             f"32, 64, 80, 96, 112, 128, ...); got {head}")
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(by_alias=True, mode="json"), sort_keys=False)


def _check_import_path(value: str) -> str:
    """``value`` if it resolves (:func:`erlay.supervisor.imports.import_path`); else a
    ValueError whose message is the resolver's one line (an old bare erlay path included)."""
    try:
        import_path(value, "class")
    except (ValueError, ImportError, AttributeError) as exc:
        raise ValueError(str(exc)) from None
    return value


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply one ``key.sub=value`` override in place; the value is parsed as YAML."""
    key, sep, raw = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {override!r}: expected key.sub=value")
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {part!r} is not a section")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {override!r}: value is not valid YAML ({exc})") from None


def _describe(error: dict[str, Any]) -> str:
    key = ".".join(str(p) for p in error["loc"]) or "<top level>"
    given = error.get("input")
    if error["type"] == "extra_forbidden":
        return f"{key}: unknown key (given {given!r}){_did_you_mean(error['loc'])}"
    if error["type"] == "missing":
        return f"{key}: required key is missing"
    text = str(error["msg"]).removeprefix("Value error, ")
    return f"{key}: {text} (given {given!r})"


def _did_you_mean(loc: tuple[Any, ...]) -> str:
    """A ``; did you mean 'lr'?`` hint from the known fields of the unknown key's parent."""
    model: Any = JobConfig
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        model = field.annotation if field is not None else None
        if not isinstance(model, type) or not issubclass(model, BaseModel):
            return ""
    names = [f.alias or n for n, f in model.model_fields.items()]
    close = difflib.get_close_matches(str(loc[-1]), names, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def validate_config(data: dict[str, Any]) -> JobConfig:
    try:
        return JobConfig.model_validate(data)
    except ValidationError as exc:
        lines = [_describe(err) for err in exc.errors()]
        if len(lines) == 1:  # the common case reads as one line
            raise ConfigError(f"invalid configuration: {lines[0]}") from None
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None


# Keys whose relative paths, written in a config file, mean "next to the config file".
PATH_KEYS = (("model", "hf"), ("data", "train"), ("data", "validation"))


def anchor_paths(data: dict[str, Any], base: Path) -> None:
    """Make each relative path of :data:`PATH_KEYS` in ``data`` absolute against ``base``
    when it exists there (a shipped config names its model directory beside itself); any
    other value, a hub id included, is left as written."""
    for section, key in PATH_KEYS:
        node = data.get(section)
        value = node.get(key) if isinstance(node, dict) else None
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            candidate = base / value
            if candidate.exists():
                node[key] = str(candidate.resolve())


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Read, override and validate a job config.  ``path=None`` means all defaults."""
    data: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"config file not found: {file}")
        try:
            loaded = yaml.safe_load(file.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise ConfigError(f"{file}: not valid YAML ({exc})") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{file}: expected a mapping of sections, got "
                              f"{type(loaded).__name__}")
        data = loaded or {}
        anchor_paths(data, file.parent)
    for override in overrides:
        apply_override(data, override)
    return validate_config(data)
