"""Config errors name the key, what was expected and what was given, before anything starts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from erlay.actors.config import ConfigError, JobConfig, load_config
from tests.paths import REPO

CONFIGS = REPO / "configs"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_unknown_key_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"learner\.lrr: unknown key .*did you mean 'lr'"):
        load_config(write(tmp_path, "learner:\n  lrr: 0.1\n"))


def test_wrong_type_names_key_and_given_value(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"run\.steps: .*integer.*given 'many'"):
        load_config(write(tmp_path, "run:\n  steps: many\n"))


def test_out_of_range_value_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"rollout\.group_size: .*greater than or equal to 2"):
        load_config(write(tmp_path, "rollout:\n  group_size: 1\n"))


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config file not found: .*nope\.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_unimportable_environment_class_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"environment\.class: cannot import class module "
                                          r"'no_such_pkg\.envs' .*No module named"):
        load_config(write(tmp_path, "environment:\n  class: no_such_pkg.envs:Env\n"))


def test_missing_attribute_of_environment_module_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="has no attribute 'Nope'"):
        load_config(write(tmp_path, "environment:\n  class: erlay.environments.base:Nope\n"))


def test_not_a_mapping_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(write(tmp_path, "- just\n- a list\n"))


def test_overrides_set_nested_keys_with_yaml_values() -> None:
    cfg = load_config(None, ["learner.lr=3e-4", "rollout.max_staleness=0", "run.name=x y"])
    assert cfg.learner.lr == 3e-4 and cfg.rollout.max_staleness == 0 and cfg.run.name == "x y"


def test_malformed_override_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"expected key\.sub=value"):
        load_config(None, ["learner.lr"])


def test_override_of_an_unknown_key_is_named() -> None:
    with pytest.raises(ConfigError, match=r"engine\.turbo: unknown key"):
        load_config(None, ["engine.turbo=true"])


def test_indivisible_heads_are_explained() -> None:
    with pytest.raises(ConfigError, match="divisible by n_heads"):
        load_config(None, ["model.d_model=100", "model.n_heads=3"])


def test_vllm_backend_refuses_heads_its_attention_cannot_run() -> None:
    with pytest.raises(ConfigError, match=r"head size .* at least 32"):
        load_config(None, ["engine.backend=vllm", "model.d_model=96", "model.n_heads=4"])
    assert load_config(None, ["engine.backend=vllm", "model.d_model=128", "model.n_heads=4"])


def test_vllm_engine_args_cannot_override_what_erlay_owns() -> None:
    with pytest.raises(ConfigError, match="set by erlay"):
        load_config(None, ["engine.backend=vllm", "engine.vllm.engine_args={seed: 3}"])


def test_shipped_configs_validate() -> None:
    for name in ("cpu.yaml", "tool_use.yaml", "reference.yaml", "vllm.yaml"):
        assert isinstance(load_config(CONFIGS / name), JobConfig)


def test_reference_config_documents_every_option() -> None:
    import yaml
    reference = yaml.safe_load((CONFIGS / "reference.yaml").read_text())
    defaults = JobConfig().model_dump(by_alias=True)

    def keys(tree: dict, prefix: str = "") -> set[str]:
        out = set()
        for k, v in tree.items():
            out.add(prefix + k)
            if isinstance(v, dict) and k not in ("kwargs", "limits"):
                out |= keys(v, prefix + k + ".")
        return out
    assert keys(defaults) <= keys(reference)


def test_resolved_config_round_trips_through_yaml(tmp_path: Path) -> None:
    cfg = load_config(None, ["run.steps=7"])
    again = load_config(write(tmp_path, cfg.to_yaml()))
    assert again == cfg


def test_the_configuration_page_is_generated_from_the_models() -> None:
    """docs/configuration.md is what `python -m erlay.actors.config.reference` writes."""
    from erlay.actors.config.reference import render
    page = (CONFIGS.parent / "docs" / "configuration.md").read_text()
    assert page == render(), ("docs/configuration.md is stale: regenerate it with "
                              "python -m erlay.actors.config.reference > docs/configuration.md")


def test_every_option_is_described_in_the_configuration_page() -> None:
    from erlay.actors.config.reference import render
    undescribed = [line for line in render().splitlines() if line.endswith("|  |")]
    assert undescribed == []


def test_a_learner_call_deadline_shorter_than_the_checkpoint_writers_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"learner\.call_timeout_s \(200\) must be longer "
                                          r"than checkpoint\.deadline_s \(300\)"):
        load_config(None, ["learner.call_timeout_s=200"])
    assert load_config(None, ["learner.call_timeout_s=200", "checkpoint.deadline_s=100"])


def test_the_algorithm_section_picks_an_objective_with_its_own_knobs() -> None:
    from erlay.actors.config.algorithm import objective
    cfg = load_config(None, ["algorithm.name=dapo", "algorithm.dapo.clip_high=0.3",
                             "engine.max_new_tokens=10"])
    got = objective(cfg.algorithm, cfg.engine.max_new_tokens)
    assert (got.name, got.clip_low, got.clip_high) == ("dapo", 0.2, 0.3)
    assert (got.overlong_max, got.overlong_buffer) == (10, 2) and cfg.algorithm.dynamic_sampling
    dr = load_config(None, ["algorithm.name=dr_grpo", "engine.max_new_tokens=7"])
    assert objective(dr.algorithm, 7).max_tokens == 7
    assert not load_config(None, ["algorithm.name=gspo"]).algorithm.dynamic_sampling


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.name=ppo"], "algorithm.name"),
    (["algorithm.gspo.clip_low=0.1"], "algorithm.gspo is set but algorithm.name is 'grpo'"),
    (["algorithm.name=dapo", "algorithm.dapo.clip_low=1.5"], "algorithm.dapo.clip_low"),
    (["algorithm.name=rloo", "learner.backend=megatron", "learner.device=cuda"],
     "not wired into learner.backend megatron"),
])
def test_a_bad_algorithm_section_is_one_clear_error(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)
