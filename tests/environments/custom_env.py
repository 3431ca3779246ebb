"""A user environment that lives outside erlay, loaded as "tests.environments.custom_env:MyEnv".

It implements the Environment interface structurally (no base class), as a user's would.
"""

from __future__ import annotations

from dataclasses import replace

from erlay.environments.base import Episode, EpisodeStatus, StepResult


class MyEnv:
    """Echo the word in the prompt; judge-free, so the reward is set directly."""

    max_turns = 1

    def __init__(self, word: str = "hello") -> None:
        self.name = "echo"
        self.word = word

    def reset(self, index: int, seed: int) -> Episode:
        return Episode(f"echo/{seed}/{index}", f"say {self.word}:", answer="")

    def step(self, episode: Episode, completion: str) -> tuple[Episode, StepResult]:
        done = replace(episode, turn=episode.turn + 1, status=EpisodeStatus.DONE)
        return done, StepResult(done=True, reward=float(completion.strip() == self.word))

    def observe(self, episode: Episode, tool_output: str,
                ok: bool = True) -> tuple[Episode, str]:
        raise NotImplementedError

    def demonstration(self, episode: Episode) -> list[tuple[str, str]]:
        return [(episode.prompt, self.word)]


class OnlyReset:
    """Missing step, observe and demonstration."""

    name = "partial"
    max_turns = 1

    def reset(self, index: int, seed: int) -> Episode:
        return Episode("p", "p", "")


class NoTurns(MyEnv):
    """Has every method but a bad max_turns."""

    max_turns = 0


NOT_A_CLASS = 42
