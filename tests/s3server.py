"""A real S3 API server on loopback for the tests and benchmarks: moto's server
(``moto[server]``), started as its own process, with IAM authentication on, so that refused
credentials are refused as AWS refuses them.

:func:`s3_server` starts one, creates an IAM user with full rights and its access key (the
first few calls are let through unauthenticated to do that, ``INITIAL_NO_AUTH_ACTION_COUNT``)
and a bucket, and yields an :class:`S3` whose :meth:`S3.env` is what a process needs to use
it (the standard AWS variables).  The server stops on exit, and dies with the process that
started it even when that one is SIGKILLed (a parent-death signal), so no test leaves one
behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class S3:
    endpoint: str           # http://127.0.0.1:PORT
    bucket: str
    access_key: str
    secret_key: str

    def env(self) -> dict[str, str]:
        """The AWS variables a process reads to reach this server as the user."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true"}

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{self.bucket}", *parts])


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL it when the process that started it dies (Linux's
    PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # 1: PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def s3_server(bucket: str = "erlay-test", timeout_s: float = 30.0) -> Iterator[S3]:
    port = _free_port()
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "4"}
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's S3 server did not start on {endpoint}") from None
                time.sleep(0.1)
        import boto3
        anon = {"endpoint_url": endpoint, "region_name": "us-east-1",
                "aws_access_key_id": "bootstrap", "aws_secret_access_key": "bootstrap"}
        iam = boto3.client("iam", **anon)
        iam.create_user(UserName="erlay")
        key = iam.create_access_key(UserName="erlay")["AccessKey"]
        iam.put_user_policy(UserName="erlay", PolicyName="all", PolicyDocument=json.dumps({
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        server = S3(endpoint, bucket, key["AccessKeyId"], key["SecretAccessKey"])
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                     aws_access_key_id=server.access_key,
                     aws_secret_access_key=server.secret_key).create_bucket(Bucket=bucket)
        yield server
    finally:
        proc.kill()
        proc.wait(timeout=10)


@contextlib.contextmanager
def aws_env(server: S3) -> Iterator[None]:
    """This process's environment pointed at ``server``, restored on exit."""
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
