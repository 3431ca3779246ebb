"""Loading datasets into checked rows: files, directories, cached hub ids, column mapping, and
one-line errors naming the file, the 1-based row and the column.  ``erlay run`` refuses a bad
dataset with exit 2 before anything starts."""

from __future__ import annotations

import glob
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from erlay.actors.config import ConfigError, load_config
from erlay.actors.config.data import DataSection
from erlay.actors.data.rows import load_rows
from erlay.actors.job.preflight import preflight
from tests.paths import REPO

GSM = REPO / "configs" / "gsm8k-tiny.yaml"


def jsonl(path: Path, rows: list[Any], blank_after: int | None = None) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    if blank_after is not None:
        lines.insert(blank_after, "")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def refused(data: DataSection, which: str = "train") -> str:
    with pytest.raises(ConfigError) as caught:
        load_rows(data, which)
    text = str(caught.value)
    assert "\n" not in text, text
    return text


# -- loading -----------------------------------------------------------------------------------
def test_jsonl_rows_with_mapped_columns(tmp_path: Path) -> None:
    file = jsonl(tmp_path / "q.jsonl", [
        {"question": "What is 2+2?", "solution": "#### 4", "level": 1, "tags": ["easy"]},
        {"question": "What is 3+4?", "solution": 7, "level": 2, "tags": []}])
    rows = load_rows(DataSection(train=str(file), prompt="question", answer="solution",
                                 metadata=["level", "tags"]))
    assert rows == [
        {"prompt": "What is 2+2?", "messages": None, "answer": "#### 4",
         "metadata": {"level": 1, "tags": ["easy"]}, "source": "q.jsonl row 1"},
        {"prompt": "What is 3+4?", "messages": None, "answer": "7",
         "metadata": {"level": 2, "tags": []}, "source": "q.jsonl row 2"}]


def test_parquet_and_a_directory_of_files_in_sorted_order(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "more").mkdir(parents=True)
    pq.write_table(pa.table({"prompt": ["p1", "p2"], "answer": [1.0, 2.5]}),
                   data / "a.parquet")
    jsonl(data / "more" / "b.jsonl", [{"prompt": "p3", "answer": "3"}])
    (data / "notes.txt").write_text("not data")
    rows = load_rows(DataSection(train=str(data)))
    assert [(r["prompt"], r["answer"], r["source"]) for r in rows] == [
        ("p1", "1", "a.parquet row 1"), ("p2", "2.5", "a.parquet row 2"),
        ("p3", "3", "b.jsonl row 1")]
    assert load_rows(DataSection(train=str(data / "a.parquet")))[1]["answer"] == "2.5"


def test_chat_rows_from_a_messages_column(tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 2+2?"}]
    file = jsonl(tmp_path / "chat.jsonl", [{"conversation": messages, "answer": "4"}])
    (row,) = load_rows(DataSection(train=str(file), chat=True, messages="conversation"))
    assert row["messages"] == messages and row["prompt"] is None


def fake_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``someone/tiny`` in a private HF datasets cache, laid out as a download leaves it."""
    import datasets
    cache = tmp_path / "hf"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}),
                   tmp_path / "t.parquet")
    datasets.load_dataset("parquet", data_files={"train": str(tmp_path / "t.parquet")},
                          cache_dir=str(cache))
    (built,) = [Path(p) for p in glob.glob(str(cache / "parquet" / "*" / "*" / "*"))
                if Path(p).is_dir()]
    target = cache / "someone___tiny" / "default" / built.parts[-2] / built.parts[-1]
    shutil.copytree(built, target)
    (target / "parquet-train.arrow").rename(target / "tiny-train.arrow")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)


def test_a_hub_id_loads_from_the_local_cache_and_never_downloads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_hub_cache(tmp_path, monkeypatch)
    rows = load_rows(DataSection(train="someone/tiny"))
    assert [r["prompt"] for r in rows] == ["a", "b"]
    assert rows[0]["source"] == "someone/tiny (split train) row 1"
    text = refused(DataSection(train="someone/absent"))
    assert "not in the local HF cache" in text and "OfflineModeIsEnabled" in text
    assert "split 'test'" in refused(DataSection(train="someone/tiny", split="test"))


# -- refusals ----------------------------------------------------------------------------------
def test_a_row_missing_its_answer_is_named_by_row_and_line(tmp_path: Path) -> None:
    file = jsonl(tmp_path / "t.jsonl", [{"prompt": "a", "answer": "1"},
                                        {"prompt": "b", "answer": "2"},
                                        {"prompt": "c"}], blank_after=1)
    assert refused(DataSection(train=str(file))) == (
        f"data.train: {file} row 3 (line 4): column 'answer' (data.answer) is missing")


def test_rows_of_mixed_number_and_string_answers_load(tmp_path: Path) -> None:
    file = jsonl(tmp_path / "t.jsonl", [{"prompt": "a", "answer": "1"},
                                        {"prompt": "b", "answer": 2}])
    assert [r["answer"] for r in load_rows(DataSection(train=str(file)))] == ["1", "2"]


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "a", "answer": "1"}, {"prompt": "", "answer": "2"}],
     "row 2 (line 2): column 'prompt' (data.prompt) is empty"),
    ([{"prompt": "a", "answer": "1"}, {"prompt": 5, "answer": "2"}],
     "row 2 (line 2): column 'prompt' (data.prompt) must be a string, got int 5"),
    ([{"prompt": "a", "answer": "1"}, {"prompt": ["b"], "answer": "2"}],
     "row 2 (line 2): column 'prompt' (data.prompt) must be a string, got list ['b']"),
    ([{"prompt": "a", "answer": True}], "row 1 (line 1): column 'answer' (data.answer) must be "
                                        "a string or a finite number, got bool True"),
    ([{"prompt": "a", "answer": "1"}, '{"prompt": "b", '],
     "row 2 (line 2): not valid JSON"),
    ([{"prompt": "a", "answer": "1"}, [1, 2]], "row 2 (line 2): expected a JSON object"),
])
def test_a_mistyped_or_malformed_row_is_named(tmp_path: Path, rows: list[Any],
                                              message: str) -> None:
    file = jsonl(tmp_path / "t.jsonl", rows)
    text = refused(DataSection(train=str(file)))
    assert text.startswith(f"data.train: {file} row") and message in text, text


def test_a_bad_chat_row_names_the_message(tmp_path: Path) -> None:
    file = jsonl(tmp_path / "c.jsonl", [
        {"messages": [{"role": "user", "content": "hi"}], "answer": "1"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": None}],
         "answer": "1"}])
    assert refused(DataSection(train=str(file), chat=True, messages="messages")).endswith(
        "row 2 (line 2): column 'messages' (data.messages) item 2 has no 'content' string "
        "(got NoneType None)")


def test_a_missing_column_an_empty_file_or_no_file_is_one_line(tmp_path: Path) -> None:
    file = jsonl(tmp_path / "t.jsonl", [{"question": "a", "answer": "1"}])
    assert refused(DataSection(train=str(file))) == (
        f"data.train: {file} has no column 'prompt' (data.prompt); its columns: question, "
        "answer")
    assert "no column 'kind' (data.metadata)" in refused(
        DataSection(train=str(file), prompt="question", metadata=["kind"]))
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()),
                             "answer": pa.array([], pa.string())}), tmp_path / "e.parquet")
    assert refused(DataSection(train=str(tmp_path / "e.parquet"))).endswith("holds no rows")
    (tmp_path / "e.jsonl").write_text("\n\n")
    assert refused(DataSection(train=str(tmp_path / "e.jsonl"))).endswith("holds no rows")
    assert refused(DataSection(train=str(tmp_path / "nope.jsonl"))).endswith("does not exist")
    (tmp_path / "empty").mkdir()
    assert "holds no .jsonl, .json or .parquet file" in refused(
        DataSection(train=str(tmp_path / "empty")))


def test_validation_rows_are_checked_under_their_own_key(tmp_path: Path) -> None:
    good = jsonl(tmp_path / "g.jsonl", [{"prompt": "a", "answer": "1"}])
    bad = jsonl(tmp_path / "b.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    data = DataSection(train=str(good), validation=str(bad), validation_every=1)
    assert refused(data, "validation").startswith(f"data.validation: {bad} row 2")


@pytest.mark.parametrize("keys, message", [
    ({"messages": "m"}, "chat rows need data.chat: true"),
    ({"validation_every": 3}, "needs data.validation"),
    ({"metadata": ["row"]}, "row is reserved"),
])
def test_inconsistent_data_keys_are_refused_by_the_config(keys: dict, message: str) -> None:
    overrides = [f"data.{k}={json.dumps(v)}" for k, v in keys.items()]
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["data.train=x.jsonl", *overrides])


# -- before anything starts --------------------------------------------------------------------
def test_preflight_checks_the_dataset_and_the_environment_that_plays_it(tmp_path: Path) -> None:
    preflight(load_config(GSM))   # the environment is built on the 48 rows and resets them
    long = jsonl(tmp_path / "long.jsonl", [{"question": "What is 1+1?", "answer": "2"}] * 3
                 + [{"question": "x" * 60, "answer": "2"}])
    with pytest.raises(ConfigError, match=r"model.max_seq_len: long.jsonl row 4's prompt is "
                                          r"61 tokens"):
        preflight(load_config(GSM, [f"data.train={long}", "data.metadata=[]"]))
    with pytest.raises(ConfigError, match="ArithmeticEnv takes no dataset rows"):
        preflight(load_config(GSM, ["environment.class=erlay.environments.arithmetic:"
                                    "ArithmeticEnv", "environment.kwargs={}"]))


def test_erlay_run_with_a_bad_row_exits_2_with_one_line_and_starts_nothing(
        tmp_path: Path) -> None:
    bad = jsonl(tmp_path / "bad.jsonl", [{"question": "What is 1+1?", "answer": "2"},
                                         {"question": "What is 2+2?"}])
    runs = tmp_path / "runs"
    result = subprocess.run(
        [sys.executable, "-m", "erlay.supervisor.cli", "run", str(GSM), f"data.train={bad}",
         "data.metadata=[]", f"run.storage={runs}", "--no-progress"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"erlay: data.train: {bad} row 2 (line 2): column 'answer' (data.answer) is missing"]
    assert not runs.exists(), "no run directory before the checks pass"
