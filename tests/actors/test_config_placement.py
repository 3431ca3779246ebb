"""The ``placement`` section: what a colocated job needs, refused in one line before anything
starts (ConfigError, exit 2), and the placement group's bundles it asks Ray for."""

from __future__ import annotations

import pytest

from erlay.actors.config import ConfigError, load_config
from erlay.actors.job.placement import SPREAD_OUT, bundles, reserve, vllm_engine_args

COLOCATE = "placement.colocate=true"
VLLM_GPU = ["engine.backend=vllm", "model.d_model=128", "engine.vllm.num_gpus=0.5",
            "learner.num_gpus=0.5", "learner.device=cuda"]


def refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, [COLOCATE, *overrides])
    message = str(info.value)
    assert "\n" not in message
    return message


def test_colocation_is_off_by_default_and_places_nothing() -> None:
    cfg = load_config(None)
    assert not cfg.placement.colocate
    assert reserve(cfg) is SPREAD_OUT and SPREAD_OUT.engine(0, {"x": 1}) == {"x": 1}


def test_colocation_pairs_engine_i_with_rank_i_so_the_counts_must_match() -> None:
    assert "engine.num_engines (2) must equal learner.num_ranks (1)" in refused(
        "engine.num_engines=2")
    assert load_config(None, [COLOCATE, "engine.num_engines=2", "learner.num_ranks=2"])


def test_a_colocated_job_has_no_spare_engines() -> None:
    assert "engine.spares (1) must be 0" in refused("engine.spares=1")


def test_vllm_colocated_on_a_cpu_only_config_is_refused() -> None:
    assert "vLLM's sleep mode runs on CUDA only" in refused("engine.backend=vllm",
                                                            "model.d_model=128")


def test_the_pair_may_not_ask_for_more_than_one_device() -> None:
    message = refused(*VLLM_GPU, "learner.num_gpus=0.7")
    assert "learner.num_gpus (0.7) + engine.vllm.num_gpus (0.5) must be at most 1" in message


def test_sleep_level_2_is_refused_beside_a_draft_model_no_refit_reaches() -> None:
    assert "use sleep_level 1" in refused(*VLLM_GPU,
                                          "engine.vllm.speculative_config={method: ngram}")
    assert load_config(None, [COLOCATE, *VLLM_GPU, "placement.sleep_level=1",
                              "engine.vllm.speculative_config={method: ngram}"])


def test_each_pair_gets_one_bundle_with_both_childrens_gpus() -> None:
    cfg = load_config(None, [COLOCATE, *VLLM_GPU, "engine.num_engines=2",
                             "learner.num_ranks=2", "placement.bundle_cpus=2"])
    assert bundles(cfg) == [{"CPU": 2.0, "GPU": 1.0}] * 2
    assert vllm_engine_args(cfg)["enable_sleep_mode"] is True
    assert "enable_sleep_mode" not in vllm_engine_args(load_config(None))
