"""The KubeRay manifests, configs/kuberay/rayjob-*.yaml: RayJobs that KubeRay accepts, and erlay
jobs that can start.

Three checks, each a function of a parsed manifest, so the planted tests at the end can run
them on a copy that breaks one rule:

- :func:`schema_errors`: the v1 ``openAPIV3Schema`` of KubeRay's RayJob CRD (vendored in
  configs/kuberay/crd/, its header names the release), read as ``kubectl apply
  --validate=strict`` reads it.  A structural schema does not refuse an unknown field, the API
  server prunes it; strict validation reports it, so here every object whose schema lists
  ``properties`` (and neither ``additionalProperties`` nor
  ``x-kubernetes-preserve-unknown-fields``) refuses other keys.  ``x-kubernetes-int-or-string``
  is an integer or a string; ``format: int32``/``int64`` are range checks; the other
  ``x-kubernetes-*`` keys (list types, CEL rules) are not checked.  The top-level
  ``metadata`` is the API server's ObjectMeta, open in the CRD; :func:`operator_errors`
  checks its name.
- :func:`operator_errors`: what KubeRay's operator refuses that its schema cannot say
  (ray-operator/controllers/ray/utils/validation.go at the vendored release).
- :func:`erlay_errors`: erlay's facts.  The entrypoint is ``erlay run`` on a config of the
  checkout the image installs (loaded, overrides and all, by erlay's own loader), with the run
  in object storage; the head serves the dashboard; no literal secret; no whole-job retry;
  the pods hold the GPUs the config asks for, and none is assumed where it asks for none.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft7Validator, FormatChecker
from packaging.requirements import Requirement

from erlay.actors.config import ConfigError, JobConfig, load_config
from tests.paths import REPO

KUBERAY = REPO / "configs" / "kuberay"
CRD = KUBERAY / "crd" / "ray.io_rayjobs.yaml"
DOCKERFILE = KUBERAY / "Dockerfile"
CPU, GPU = "rayjob-cpu.yaml", "rayjob-qwen2.5-0.5b.yaml"
MANIFESTS = (CPU, GPU)

# The 1.4 MB CRD parses in a fraction of a second with libyaml, ten times slower without.
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_yaml(path: Path) -> Any:
    return yaml.load(path.read_text(encoding="utf-8"), Loader=LOADER)


@functools.cache
def manifests() -> dict[str, dict[str, Any]]:
    """The shipped manifests, parsed once; planted tests change deep copies."""
    return {name: read_yaml(KUBERAY / name) for name in MANIFESTS}


@functools.cache
def erlay_home() -> str:
    """Where the Dockerfile puts the checkout in the image (its ``ENV ERLAY_HOME``)."""
    match = re.search(r"^ENV ERLAY_HOME=(\S+)$", DOCKERFILE.read_text(), re.M)
    assert match, "configs/kuberay/Dockerfile sets no ERLAY_HOME"
    return match.group(1).rstrip("/")


# -- the schema ------------------------------------------------------------------------------
def json_schema(node: dict[str, Any], strict: bool = True) -> dict[str, Any]:
    """A Kubernetes structural schema as JSON Schema (Draft 7).  ``strict``: unknown fields
    are errors where the API server would prune them, as ``--validate=strict`` reports."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key in ("nullable", "default"):
            continue
        if key == "properties":
            out[key] = {name: json_schema(sub, strict) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = json_schema(value, strict)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [json_schema(sub, strict) for sub in value]
        else:
            out[key] = value
    if node.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if (strict and "properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


K8S_FORMATS = FormatChecker(formats=())


@K8S_FORMATS.checks("int32")
def _int32(value: object) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@K8S_FORMATS.checks("int64")
def _int64(value: object) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


@functools.cache
def crd_v1_schema() -> dict[str, Any]:
    crd = read_yaml(CRD)
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


@functools.cache
def rayjob_validator(strict: bool = True) -> Draft7Validator:
    return Draft7Validator(json_schema(crd_v1_schema(), strict), format_checker=K8S_FORMATS)


def schema_errors(manifest: dict[str, Any], strict: bool = True) -> list[str]:
    """Every place ``manifest`` breaks the vendored RayJob v1 schema, as ``path: message``."""
    return sorted(f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
                  for e in rayjob_validator(strict).iter_errors(manifest))


# -- KubeRay's operator ----------------------------------------------------------------------
DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
MAX_RAYJOB_NAME = 47  # utils.MaxRayJobNameLength: 53 for a RayCluster, less 6 for its suffix


def operator_errors(manifest: dict[str, Any]) -> list[str]:
    """What KubeRay's ValidateRayJobMetadata, ValidateRayJobSpec and ValidateRayClusterSpec
    refuse in a manifest the schema accepts (the subset these manifests can meet)."""
    problems = []
    name = manifest["metadata"].get("name", "")
    if len(name) > MAX_RAYJOB_NAME:
        problems.append(f"metadata.name: {name!r} is longer than {MAX_RAYJOB_NAME}")
    if not DNS_1035_LABEL.fullmatch(name):
        problems.append(f"metadata.name: {name!r} is not a DNS-1035 label")
    spec = manifest["spec"]
    if spec.get("ttlSecondsAfterFinished", 0) > 0 and not spec.get("shutdownAfterJobFinishes"):
        problems.append("spec.ttlSecondsAfterFinished needs spec.shutdownAfterJobFinishes")
    for key in ("activeDeadlineSeconds", "preRunningDeadlineSeconds"):
        if key in spec and spec[key] <= 0:
            problems.append(f"spec.{key} must be positive")
    if spec.get("backoffLimit", 0) < 0:
        problems.append("spec.backoffLimit must not be negative")
    for group in spec["rayClusterSpec"].get("workerGroupSpecs", []):
        if group["minReplicas"] > group["maxReplicas"]:
            problems.append(f"worker group {group['groupName']}: minReplicas > maxReplicas")
    try:
        yaml.safe_load(spec.get("runtimeEnvYAML", ""))
    except yaml.YAMLError:
        problems.append("spec.runtimeEnvYAML is not YAML")
    return problems


# -- erlay's facts ---------------------------------------------------------------------------
CREDENTIAL_NAME = re.compile(r"^AWS_|SECRET|TOKEN|PASSWORD|ACCESS_KEY|CREDENTIAL")
AWS_KEY_ID = re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b")
S3_SECRET = "erlay-s3"


def groups(manifest: dict[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
    """(name, group spec, pods) for the head and each worker group."""
    cluster = manifest["spec"]["rayClusterSpec"]
    return [("head", cluster["headGroupSpec"], 1),
            *((g["groupName"], g, g.get("replicas", g["minReplicas"]))
              for g in cluster.get("workerGroupSpecs", []))]


def ray_container(group: dict[str, Any]) -> dict[str, Any]:
    return group["template"]["spec"]["containers"][0]  # KubeRay's RayContainerIndex


def all_containers(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    pods = [g["template"]["spec"] for _, g, _ in groups(manifest)]
    if "submitterPodTemplate" in manifest["spec"]:
        pods.append(manifest["spec"]["submitterPodTemplate"]["spec"])
    return [c for pod in pods for c in [*pod.get("initContainers", []), *pod["containers"]]]


def gpus(group: dict[str, Any]) -> float:
    resources = ray_container(group).get("resources", {})
    return max(float(resources.get(kind, {}).get("nvidia.com/gpu", 0))
               for kind in ("requests", "limits"))


def gpus_needed(cfg: JobConfig) -> float:
    """GPUs the job's actors ask Ray for: the learner ranks and the vLLM engines."""
    engines = cfg.engine.num_engines * cfg.engine.vllm.num_gpus
    return (cfg.learner.num_ranks * cfg.learner.num_gpus
            + (engines if cfg.engine.backend == "vllm" else 0.0))


def entrypoint_errors(entrypoint: str, home: str) -> tuple[list[str], JobConfig | None]:
    """The entrypoint is ``erlay run HOME/configs/X.yaml --no-progress ...
    run.storage=s3://...``, and erlay's loader takes the config with its overrides."""
    words = shlex.split(entrypoint)
    if words[:2] != ["erlay", "run"]:
        return [f"entrypoint {entrypoint!r} does not start with `erlay run`"], None
    problems = []
    if "--no-progress" not in words:
        problems.append("entrypoint: no --no-progress (a progress bar in a job log)")
    positional = [w for w in words[2:] if not w.startswith("-")]
    if not positional or "=" in positional[0]:
        return [*problems, "entrypoint names no config"], None
    config, overrides = positional[0], positional[1:]
    storage = [o for o in overrides if o.startswith("run.storage=")]
    if len(storage) != 1 or not storage[0].startswith("run.storage=s3://"):
        problems.append("entrypoint: the run is not put in object storage "
                        "(run.storage=s3://BUCKET/PREFIX)")
    if not config.startswith(home + "/"):
        return [*problems, f"entrypoint: {config} is not under the image's {home}"], None
    path = REPO / config.removeprefix(home + "/")
    if not path.is_file():
        return [*problems, f"entrypoint: no such config in the checkout: {config}"], None
    try:
        return problems, load_config(path, overrides)
    except ConfigError as exc:
        return [*problems, f"entrypoint: erlay refuses it: {exc}"], None


def erlay_errors(manifest: dict[str, Any], home: str) -> list[str]:
    """Every erlay fact ``manifest`` breaks (module docstring); ``home`` is the image's
    checkout."""
    spec = manifest["spec"]
    problems, cfg = entrypoint_errors(spec.get("entrypoint", ""), home)
    if spec.get("backoffLimit") != 0:
        problems.append("spec.backoffLimit is not 0: a retry starts the run over; resume")
    if spec.get("shutdownAfterJobFinishes") is not True or not spec.get("ttlSecondsAfterFinished"):
        problems.append("the cluster outlives the job (shutdownAfterJobFinishes, "
                        "ttlSecondsAfterFinished)")
    if "activeDeadlineSeconds" not in spec:
        problems.append("no spec.activeDeadlineSeconds: a hung job holds its pods forever")
    head = spec["rayClusterSpec"]["headGroupSpec"]
    params = head.get("rayStartParams", {})
    ports = {p.get("containerPort") for p in ray_container(head).get("ports", [])}
    if (params.get("include-dashboard") != "true" or params.get("dashboard-host") != "0.0.0.0"
            or 8265 not in ports):
        problems.append("the head does not serve the dashboard on 0.0.0.0:8265")
    auth = spec["rayClusterSpec"].get("authOptions", {})
    if auth.get("mode") != "token" or not auth.get("secretName"):
        problems.append("no Ray token authentication from a Secret (authOptions)")
    problems += secret_errors(manifest)
    images = {ray_container(g)["image"] for _, g, _ in groups(manifest)}
    if len(images) != 1:
        problems.append(f"the Ray containers run different images: {sorted(images)}")
    if cfg is not None:
        problems += gpu_errors(manifest, gpus_needed(cfg))
    return problems


def secret_errors(manifest: dict[str, Any]) -> list[str]:
    """Credentials come from Secrets: every Ray container takes the S3 one whole (envFrom), and
    no credential is written in the manifest."""
    problems = []
    for name, group, _ in groups(manifest):
        refs = [e.get("secretRef", {}).get("name") for e in ray_container(group).get("envFrom", [])]
        if S3_SECRET not in refs:
            problems.append(f"{name}: the Ray container does not take Secret {S3_SECRET}")
    literal = [e["name"] for c in all_containers(manifest) for e in c.get("env", [])
               if CREDENTIAL_NAME.search(e["name"]) and "value" in e]
    env_vars = (yaml.safe_load(manifest["spec"].get("runtimeEnvYAML", "")) or {}).get(
        "env_vars", {})
    literal += [k for k in env_vars if CREDENTIAL_NAME.search(k)]
    if literal:
        problems.append(f"literal credentials in the manifest: {sorted(literal)}")
    if AWS_KEY_ID.search(json.dumps(manifest)):
        problems.append("an AWS access key id is written in the manifest")
    return problems


def gpu_errors(manifest: dict[str, Any], needed: float) -> list[str]:
    """The pods hold the GPUs the config asks for; where it asks for none, no pod asks for a
    GPU and Ray is told it has none."""
    if needed == 0:
        return [f"{name}: a CPU job's pods {why}" for name, group, _ in groups(manifest)
                for why, bad in (("request nvidia.com/gpu", gpus(group) > 0),
                                 ("leave num-gpus to Ray's detection",
                                  group.get("rayStartParams", {}).get("num-gpus") != "0"))
                if bad]
    have = sum(pods * gpus(group) for _, group, pods in groups(manifest))
    if have < needed:
        return [f"the config needs {needed:g} GPUs; the pods hold {have:g}"]
    return []


# -- the shipped manifests -------------------------------------------------------------------
@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_is_a_valid_rayjob_by_the_vendored_crd(name: str) -> None:
    manifest = manifests()[name]
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayJob")
    assert schema_errors(manifest) == []


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_passes_the_kuberay_operators_own_checks(name: str) -> None:
    assert operator_errors(manifests()[name]) == []


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_runs_an_erlay_job_that_can_start(name: str) -> None:
    assert erlay_errors(manifests()[name], erlay_home()) == []


def test_the_cpu_manifest_runs_the_cpu_default_and_the_gpu_one_the_qwen_config() -> None:
    configs = {name: shlex.split(m["spec"]["entrypoint"])[2] for name, m in manifests().items()}
    assert configs == {CPU: f"{erlay_home()}/configs/cpu.yaml",
                       GPU: f"{erlay_home()}/configs/qwen2.5-0.5b-gsm8k-split.yaml"}


def test_the_crd_header_names_the_kuberay_release_and_the_docs_state_it() -> None:
    header = CRD.read_text(encoding="utf-8")[:2000]
    match = re.search(r"KubeRay (v\d+\.\d+\.\d+)", header)
    assert match and "ray-operator/config/crd/bases/ray.io_rayjobs.yaml" in header
    docs = (REPO / "docs" / "cluster.md").read_text(encoding="utf-8")
    assert f"KubeRay {match.group(1)}" in docs


def test_the_image_installs_every_package_and_the_pinned_ray() -> None:
    text = DOCKERFILE.read_text(encoding="utf-8")
    copied = {word for line in re.findall(r"^COPY (.*)$", text, re.M)
              for word in line.split()[:-1] if not word.startswith("--")}
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    assert folders | {"pyproject.toml", "README.md"} <= copied
    base = re.search(r"^ARG BASE_IMAGE=rayproject/ray:(\d+\.\d+\.\d+)-py311$", text, re.M)
    assert base, "the base image is not a rayproject/ray py311 release"
    (ray,) = [Requirement(r) for r in pyproject["project"]["dependencies"]
              if Requirement(r).name == "ray"]
    assert ray.specifier.contains(base.group(1))
    for manifest in manifests().values():
        assert manifest["spec"]["rayClusterSpec"]["rayVersion"] == base.group(1)


def test_the_docs_build_the_images_the_manifests_name() -> None:
    docs = (REPO / "docs" / "cluster.md").read_text(encoding="utf-8")
    for manifest in manifests().values():
        (image,) = {ray_container(g)["image"] for _, g, _ in groups(manifest)}
        assert f"-t {image} " in docs


def test_plain_crd_schema_lets_a_misspelt_field_through_and_strict_refuses_it() -> None:
    manifest = planted(CPU, ("spec", "entrypointt"), "erlay run")
    assert schema_errors(manifest, strict=False) == []
    assert schema_errors(manifest) == ["spec: Additional properties are not allowed "
                                       "('entrypointt' was unexpected)"]


def test_the_strict_schema_is_valid_json_schema() -> None:
    Draft7Validator.check_schema(json_schema(crd_v1_schema()))


# -- each check catches a planted violation --------------------------------------------------
DROP = object()
HEAD = ("spec", "rayClusterSpec", "headGroupSpec")
WORKER = ("spec", "rayClusterSpec", "workerGroupSpecs", 0)
HEAD_RAY = (*HEAD, "template", "spec", "containers", 0)
WORKER_RAY = (*WORKER, "template", "spec", "containers", 0)
STORAGE = "run.storage=s3://BUCKET/erlay-runs"
HOME = erlay_home()


def planted(name: str, path: tuple[str | int, ...], value: object) -> dict[str, Any]:
    """A copy of shipped manifest ``name`` with ``value`` at ``path`` (DROP: removed)."""
    manifest = copy.deepcopy(manifests()[name])
    *parents, last = path
    node: Any = manifest
    for key in parents:
        node = node[key]
    if value is DROP:
        del node[last]
    else:
        node[last] = value
    return manifest


@pytest.mark.parametrize("name, path, value, expected", [
    (CPU, ("spec", "entrypointt"), "erlay run", "'entrypointt' was unexpected"),
    (CPU, (*HEAD_RAY, "resources", "limit"), {"cpu": "2"}, "'limit' was unexpected"),
    (CPU, ("spec", "backoffLimit"), "zero", "'zero' is not of type 'integer'"),
    (CPU, (*HEAD, "template"), DROP, "'template' is a required property"),
    (GPU, (*WORKER, "groupName"), DROP, "'groupName' is a required property"),
    (CPU, ("spec", "activeDeadlineSeconds"), 2**31, "is not a 'int32'"),
    (CPU, ("spec", "rayClusterSpec", "authOptions", "mode"), "Token", "'Token' is not one of"),
    (CPU, (*HEAD_RAY, "resources", "limits", "memory"), "6 GB", "'6 GB' does not match"),
    (CPU, (*HEAD, "rayStartParams", "num-gpus"), 0, "0 is not of type 'string'"),
], ids=["misspelt-spec-field", "misspelt-container-field", "wrong-type", "missing-template",
        "missing-group-name", "int32-overflow", "unknown-auth-mode", "bad-quantity",
        "unquoted-start-param"])
def test_planted_schema_violation_is_refused(name: str, path: tuple[str | int, ...],
                                             value: object, expected: str) -> None:
    errors = schema_errors(planted(name, path, value))
    assert any(expected in e for e in errors), errors


@pytest.mark.parametrize("path, value, expected", [
    (("metadata", "name"), "erlay-qwen2.5", "not a DNS-1035 label"),
    (("metadata", "name"), "e" * 48, "longer than 47"),
    (("spec", "shutdownAfterJobFinishes"), False, "needs spec.shutdownAfterJobFinishes"),
    (("spec", "activeDeadlineSeconds"), 0, "activeDeadlineSeconds must be positive"),
    (("spec", "backoffLimit"), -1, "backoffLimit must not be negative"),
    ((*WORKER, "minReplicas"), 2, "minReplicas > maxReplicas"),
    (("spec", "runtimeEnvYAML"), "env_vars: [", "runtimeEnvYAML is not YAML"),
], ids=["dotted-name", "long-name", "ttl-without-shutdown", "zero-deadline",
        "negative-backoff", "min-over-max", "runtime-env-not-yaml"])
def test_planted_operator_refusal_is_caught(path: tuple[str | int, ...], value: object,
                                            expected: str) -> None:
    errors = operator_errors(planted(CPU, path, value))
    assert any(expected in e for e in errors), errors


@pytest.mark.parametrize("words, expected", [
    (f"python -m erlay.supervisor.cli run {HOME}/configs/cpu.yaml {STORAGE}",
     "does not start with `erlay run`"),
    (f"erlay run {HOME}/configs/cpu-gone.yaml --no-progress {STORAGE}",
     "no such config in the checkout"),
    (f"erlay run configs/cpu.yaml --no-progress {STORAGE}", "is not under the image's"),
    (f"erlay run {HOME}/configs/cpu.yaml --no-progress learner.lrr=1 {STORAGE}",
     "learner.lrr: unknown key"),
    (f"erlay run {HOME}/configs/cpu.yaml --no-progress", "not put in object storage"),
    (f"erlay run {HOME}/configs/cpu.yaml --no-progress run.storage=/tmp/runs",
     "not put in object storage"),
    (f"erlay run {HOME}/configs/cpu.yaml {STORAGE}", "no --no-progress"),
], ids=["not-erlay-run", "missing-config", "config-outside-the-image", "bad-override",
        "no-storage", "local-storage", "progress-bar"])
def test_planted_entrypoint_fault_is_caught(words: str, expected: str) -> None:
    errors = erlay_errors(planted(CPU, ("spec", "entrypoint"), words), erlay_home())
    assert any(expected in e for e in errors), errors


@pytest.mark.parametrize("name, path, value, expected", [
    (CPU, ("spec", "backoffLimit"), 2, "backoffLimit is not 0"),
    (CPU, ("spec", "shutdownAfterJobFinishes"), False, "the cluster outlives the job"),
    (CPU, ("spec", "activeDeadlineSeconds"), DROP, "no spec.activeDeadlineSeconds"),
    (CPU, (*HEAD, "rayStartParams", "include-dashboard"), "false",
     "does not serve the dashboard"),
    (GPU, (*HEAD_RAY, "ports"), [], "dashboard on 0.0.0.0:8265"),
    (CPU, ("spec", "rayClusterSpec", "authOptions"), DROP, "no Ray token authentication"),
    (CPU, (*WORKER_RAY, "envFrom"), DROP, "cpu: the Ray container does not take Secret"),
    (CPU, (*WORKER_RAY, "env"), [{"name": "AWS_SECRET_ACCESS_KEY", "value": "wJalrXUtnFEMI"}],
     "literal credentials"),
    (GPU, (*HEAD_RAY, "env", 0), {"name": "AWS_ACCESS_KEY_ID", "value": "AKIAIOSFODNN7EXAMPLE"},
     "an AWS access key id"),
    (CPU, ("spec", "runtimeEnvYAML"), "env_vars: {AWS_SECRET_ACCESS_KEY: abc}",
     "literal credentials"),
    (GPU, (*WORKER_RAY, "image"), "REGISTRY/erlay:cpu", "different images"),
    (CPU, (*WORKER_RAY, "resources", "limits", "nvidia.com/gpu"), 1,
     "cpu: a CPU job's pods request nvidia.com/gpu"),
    (CPU, (*HEAD, "rayStartParams"), {}, "head: a CPU job's pods leave num-gpus"),
    (GPU, (*WORKER, "replicas"), 2, "the config needs 3 GPUs; the pods hold 2"),
], ids=["retried", "cluster-kept", "no-deadline", "dashboard-off", "no-dashboard-port",
        "no-token-auth", "no-s3-secret", "literal-secret", "literal-key-id",
        "secret-in-runtime-env", "mixed-images", "gpu-on-cpu-job", "gpus-detected-on-cpu-job",
        "too-few-gpus"])
def test_planted_erlay_fact_violation_is_caught(name: str, path: tuple[str | int, ...],
                                                value: object, expected: str) -> None:
    errors = erlay_errors(planted(name, path, value), erlay_home())
    assert any(expected in e for e in errors), errors
