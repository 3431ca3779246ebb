"""One S3 API server (moto, on loopback) for the storage tests, the process pointed at it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.s3server import S3, aws_env, s3_server


@pytest.fixture(scope="session")
def s3() -> Iterator[S3]:
    with s3_server() as server, aws_env(server):
        yield server
