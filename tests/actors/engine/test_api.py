"""The engine protocol's plain data: round trips, validation, and errors that cross processes."""

from __future__ import annotations

import json
import pickle

import pytest

from erlay.actors.engine.api import (
    ContextTooLong,
    EngineProtocol,
    FinishReason,
    GenerationRequest,
    InvalidRequest,
    TokenChunk,
)
from erlay.actors.engine.torch_engine import TorchEngine


def test_request_round_trips_through_json() -> None:
    req = GenerationRequest("r-000123/t0", (1, 5, 6), 8, 42, temperature=0.5, prefix_ids=(9,),
                            stop_ids=(2, 3), chunk_tokens=2)
    assert GenerationRequest.from_dict(json.loads(json.dumps(req.to_dict()))) == req


def test_request_defaults_match_the_spec() -> None:
    req = GenerationRequest.from_dict({"request_id": "r", "prompt_ids": [1, 4],
                                       "max_new_tokens": 3, "seed": 0})
    assert (req.temperature, req.prefix_ids, req.stop_ids, req.chunk_tokens) == \
        (1.0, (), (2,), 8)


def test_unknown_request_field_is_refused_by_name() -> None:
    with pytest.raises(InvalidRequest, match="max_tokens"):
        GenerationRequest.from_dict({"request_id": "r", "prompt_ids": [1], "max_tokens": 3,
                                     "max_new_tokens": 3, "seed": 0})


@pytest.mark.parametrize("bad", [{"max_new_tokens": 0}, {"temperature": -1.0},
                                 {"chunk_tokens": 0}, {"prompt_ids": []}, {"request_id": ""}])
def test_malformed_requests_are_refused(bad: dict[str, object]) -> None:
    fields = {"request_id": "r", "prompt_ids": [1], "max_new_tokens": 3, "seed": 0, **bad}
    with pytest.raises(InvalidRequest):
        GenerationRequest.from_dict(fields)


def test_chunk_round_trips_and_keeps_finish_reason_a_plain_string() -> None:
    chunk = TokenChunk("r", 3, (5, 6), (-1.0, -2.0), 7, True, FinishReason.ABORT)
    data = chunk.to_dict()
    assert data["finish_reason"] == "abort" and type(data["finish_reason"]) is str
    assert TokenChunk.from_dict(json.loads(json.dumps(data))) == chunk
    assert chunk.end == 5


def test_chunk_prefill_travels_on_the_wire_but_two_chunks_of_equal_tokens_are_equal() -> None:
    chunk = TokenChunk("r", 0, (5,), (-1.0,), 0, prefill_tokens=12)
    assert TokenChunk.from_dict(json.loads(json.dumps(chunk.to_dict()))).prefill_tokens == 12
    assert chunk == TokenChunk("r", 0, (5,), (-1.0,), 0)


def test_chunk_with_mismatched_logprobs_is_refused() -> None:
    with pytest.raises(ValueError, match="logprobs"):
        TokenChunk("r", 0, (5, 6), (-1.0,), 0)


def test_context_too_long_survives_pickling_with_its_fields() -> None:
    err = pickle.loads(pickle.dumps(ContextTooLong("r", 90, 10, 96)))
    assert isinstance(err, ContextTooLong) and isinstance(err, ValueError)
    assert err.context_len == 90 and "96" in str(err)


def test_torch_engine_satisfies_the_engine_protocol() -> None:
    assert issubclass(TorchEngine, EngineProtocol)
