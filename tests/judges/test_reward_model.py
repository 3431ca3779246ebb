"""RewardModelJudge on a tiny Qwen2 sequence classifier made here (random weights, one
output, the shipped tiny-qwen2 tokenizer): its rewards are the model's outputs, batched or
not; bad kwargs and bad models are one line at construction, and ``erlay run`` exit code 2;
a NaN output is undecided; the episode's prompt reaches it through the judge server; and a
real job's every sample is judged by it, as its journal shows."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

from erlay.actors.config import load_config
from erlay.actors.job.driver import Job
from erlay.actors.job.judge_client import JudgeClient
from erlay.actors.journal.transitions import TransitionKind
from erlay.actors.model.tokens import load_hf_tokenizer
from erlay.actors.rundir import RunDir
from erlay.chaos.evidence import read_journal
from erlay.environments.arithmetic import ArithmeticEnv
from erlay.environments.base import Episode, EpisodeStatus, StepResult
from erlay.judges.base import Judgement
from erlay.judges.reward_model import REASON, RewardInput, RewardModelJudge
from erlay.judges.server import JudgeServer
from erlay.supervisor.cli import main
from erlay.supervisor.worker_process import CallOutcome, WorkerCall
from tests.paths import REPO

TOKENIZER = REPO / "configs" / "models" / "tiny-qwen2"
CONFIG = REPO / "configs" / "judge-reward-model.yaml"
JUDGE = "erlay.judges.reward_model:RewardModelJudge"


def make_reward_model(path: Path, *, num_labels: int = 1, nan: bool = False) -> Path:
    """A random one-layer Qwen2 classifier with the shipped tokenizer, saved at ``path``
    (the recipe in configs/judge-reward-model.yaml's header)."""
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         num_labels=num_labels, pad_token_id=tok.pad_token_id)
    model = Qwen2ForSequenceClassification(config)
    if nan:
        with torch.no_grad():
            model.score.weight.fill_(math.nan)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_reward_model(tmp_path_factory.mktemp("rm") / "tiny-rm")


@pytest.fixture(scope="module")
def judge(model_dir: Path) -> RewardModelJudge:
    return RewardModelJudge(str(model_dir))


def model_output(model_dir: Path, text: str) -> float:
    """The saved model's output for ``text``, computed here without the judge."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = Qwen2ForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return float(model(**tok(text, return_tensors="pt")).logits[0, 0])


def test_the_reward_is_the_models_output_on_prompt_and_answer(
        judge: RewardModelJudge, model_dir: Path) -> None:
    verdict = judge.score("132", "132", prompt="47+85=", key="r0/judge")
    assert verdict.ok and verdict.reason == REASON and verdict.kind == ""
    assert verdict.reward == pytest.approx(model_output(model_dir, "47+85=\n132"), abs=1e-6)


def test_a_batch_scores_as_one_by_one(judge: RewardModelJudge) -> None:
    inputs = [RewardInput("47+85=", "132"), RewardInput("1+1=", "2, or so I am told by many"),
              RewardInput("", "7"), RewardInput("9+9=", ""), RewardInput("3+4=", "7 7 7")]
    batched = RewardModelJudge(judge.model_name, batch_size=2).score_batch(inputs)
    one_by_one = [judge.score(i.response, i.reference, prompt=i.prompt) for i in inputs]
    assert [v.reward for v in batched] == pytest.approx([v.reward for v in one_by_one],
                                                         abs=1e-5)
    assert all(v.ok and v.reason == REASON for v in batched)
    assert len({round(v.reward, 6) for v in batched}) == len(inputs)   # inputs tell apart


def test_sigmoid_scale_and_shift_map_the_output(judge: RewardModelJudge) -> None:
    raw = judge.score("132", "", prompt="47+85=").reward
    mapped = RewardModelJudge(judge.model_name, sigmoid=True, scale=2.0, shift=-1.0)
    assert mapped.score("132", "", prompt="47+85=").reward == pytest.approx(
        2.0 / (1.0 + math.exp(-raw)) - 1.0, abs=1e-6)


def test_the_template_joins_prompt_response_and_reference(
        judge: RewardModelJudge, model_dir: Path) -> None:
    templated = RewardModelJudge(str(model_dir), template="Q: {prompt} A: {response} ({reference})")
    assert templated.score("7", "8", prompt="3+4=").reward == pytest.approx(
        model_output(model_dir, "Q: 3+4= A: 7 (8)"), abs=1e-6)
    chat = RewardModelJudge(str(model_dir), template="chat")
    text = chat.tokenizer.apply_chat_template(
        [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"}],
        tokenize=False)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = Qwen2ForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        expected = float(model(**tok(text, return_tensors="pt", add_special_tokens=False)
                               ).logits[0, 0])
    assert chat.score("7", "8", prompt="3+4=").reward == pytest.approx(expected, abs=1e-6)


def test_an_empty_model_input_is_undecided(model_dir: Path) -> None:
    verdict = RewardModelJudge(str(model_dir), template="{response}").score("", "1")
    assert not verdict.ok and verdict.kind == "undecided"


@pytest.mark.parametrize("kwargs, message", [
    ({"batch_size": 0}, "batch_size: expected an int >= 1, got 0"),
    ({"max_length": "long"}, "max_length: expected an int >= 1, got 'long'"),
    ({"scale": math.inf}, "scale: expected a finite number other than 0, got inf"),
    ({"shift": "1"}, "shift: expected a finite number, got '1'"),
    ({"sigmoid": "yes"}, "sigmoid: expected true or false, got 'yes'"),
    ({"dtype": "float8"}, "dtype: expected one of float32, bfloat16, float16, got 'float8'"),
    ({"template": "{prompt}"}, "template: expected 'chat', or a format string with {response}"),
    ({"template": "{response} {gold}"}, "template: expected 'chat', or a format string"),
    ({"device": "tpu"}, "device: expected 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
])
def test_a_bad_kwarg_fails_construction_with_one_line(model_dir: Path, kwargs: dict[str, Any],
                                                      message: str) -> None:
    with pytest.raises(ValueError) as caught:
        RewardModelJudge(str(model_dir), **kwargs)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_a_model_with_two_outputs_is_refused(tmp_path: Path) -> None:
    Qwen2Config(num_labels=2).save_pretrained(tmp_path)   # refused before any weight loads
    with pytest.raises(ValueError, match=r"has 2 outputs \(num_labels=2\); a reward model "
                                         r"has exactly one"):
        RewardModelJudge(str(tmp_path))


def test_a_missing_model_is_refused_and_nothing_is_downloaded(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is neither a directory nor a model in the local "
                                         "Hugging Face cache"):
        RewardModelJudge(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="is neither a directory"):
        RewardModelJudge("erlay-tests/no-such-reward-model")   # a hub id, not in the cache


def test_a_directory_without_weights_is_refused_in_one_line(tmp_path: Path) -> None:
    Qwen2Config(num_labels=1).save_pretrained(tmp_path)
    with pytest.raises(ValueError) as caught:
        RewardModelJudge(str(tmp_path))
    assert "does not load as a sequence-classification model" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_nan_output_is_undecided_bad_return_never_zero(tmp_path: Path) -> None:
    nan_judge = RewardModelJudge(str(make_reward_model(tmp_path / "nan", nan=True)))
    verdict = nan_judge.score("132", "132", prompt="47+85=")
    assert not verdict.ok and verdict.kind == "bad_return" and verdict.reason.startswith(REASON)
    assert [v.kind for v in nan_judge.score_batch([RewardInput("a", "b")] * 3)] == \
        ["bad_return"] * 3


def test_the_prompt_reaches_the_judge_through_server_and_client(
        judge: RewardModelJudge, model_dir: Path) -> None:
    server = JudgeServer(JUDGE, {"model": str(model_dir)}, cache_size=0)
    sent: list[WorkerCall] = []

    async def transport(call: WorkerCall) -> CallOutcome:
        sent.append(call)
        return CallOutcome("ok", await getattr(server, call.method)(*call.args, **call.kwargs))

    client = JudgeClient(transport, JUDGE, retries=0, timeout_s=5.0)
    verdict = asyncio.run(client.score("r0/judge", "132", "132", prompt="47+85="))
    assert sent[0].kwargs == {"prompt": "47+85="}
    assert verdict == judge.score("132", "132", prompt="47+85=").to_dict()
    without = asyncio.run(server.score("132", "132", "r1/judge"))
    assert without.reward != verdict["reward"]   # the prompt counted


def test_erlay_run_with_a_missing_model_dir_exits_2_with_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import ray
    runs = tmp_path / "runs"
    code = main(["run", str(CONFIG), f"judge.kwargs.model={tmp_path / 'no-model'}",
                 f"run.storage={runs}", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert err.startswith(f"erlay: judge: {JUDGE}(**") and "is neither a directory" in err
    assert not runs.exists() and not ray.is_initialized()


class EveryAnswerJudged(ArithmeticEnv):
    """The arithmetic task, but every completion goes to the judge as it is (the plain
    task gives malformed ones reward 0.0 without judging them)."""

    def step(self, episode: Episode, completion: str) -> tuple[Episode, StepResult]:
        done = replace(episode, turn=episode.turn + 1, status=EpisodeStatus.DONE)
        return done, StepResult(done=True, judge_input=completion)


@pytest.mark.ray
def test_a_job_judged_by_the_reward_model_scores_every_sample_with_it(
        tmp_path: Path, model_dir: Path, judge: RewardModelJudge, fresh_ray: None) -> None:
    cfg = load_config(CONFIG, [
        f"judge.kwargs.model={model_dir}", "run.steps=2", "warm_start.steps=0",
        "rollout.prompts_per_step=4", "rollout.group_size=2", "ray.num_cpus=4",
        "environment.workers_per_node=1", "checkpoint.every_steps=10",
        "environment.class=tests.judges.test_reward_model:EveryAnswerJudged",
        f"run.storage={tmp_path}"])
    job = Job(cfg, RunDir.create(tmp_path, "reward-model"))
    result = job.run(progress=False)
    assert result.status == "finished", result.reason
    journal = read_journal(job.run_dir.journal)
    assert journal is not None
    by_kind: dict[TransitionKind, list[Any]] = {k: [] for k in TransitionKind}
    for t in journal.stream:
        by_kind[t.kind].append(t)
    samples = {t.rollout_id for t in by_kind[TransitionKind.COMPLETED]}
    judged = {t.rollout_id: Judgement.from_dict(t.data["judgement"])
              for t in by_kind[TransitionKind.JUDGED]}
    assert len(samples) >= 2 * 4 * 2 and set(judged) == samples
    assert all(j.ok and j.reason == REASON for j in judged.values())
    assert len(by_kind[TransitionKind.JUDGED]) == len(samples)   # each judged once
    # Each reward is the model's score of the episode's prompt and the policy's completion,
    # both read back from the journal: the prompt reached the judge in the job.
    tok = load_hf_tokenizer(cfg.model.hf)
    episodes = {t.rollout_id: Episode.from_dict(t.data["episode"])
                for t in by_kind[TransitionKind.DISPATCHED]}
    tokens: dict[str, list[int]] = {}
    for t in sorted(by_kind[TransitionKind.CHUNK], key=lambda t: t.data["start"]):
        tokens.setdefault(t.rollout_id, []).extend(t.data["token_ids"])
    for rid, verdict in judged.items():
        text = tok.decode(i for i in tokens.get(rid, []) if i not in tok.stop_ids)
        expected = judge.score(text, episodes[rid].answer, prompt=episodes[rid].prompt)
        assert verdict.reward == pytest.approx(expected.reward, abs=1e-5), rid
    steps = job.run_dir.rl_steps()
    assert [m["step"] for m in steps] == [0, 1] and sum(m["judge_failed"] for m in steps) == 0
