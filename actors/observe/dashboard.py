"""A cluster's GCS address, found from its Ray dashboard URL (``http://HEAD:8265``).

Ray users name a cluster by its dashboard (``ray job submit --address http://HEAD:8265``);
``erlay status`` reads through the cluster's GCS.  Ray 2.60's dashboard names the GCS
address in no endpoint, but its node summary, the one its Cluster page polls, carries each
node's raylet command line, and Ray starts every raylet with ``--gcs-address=HOST:PORT``::

    GET /api/version          {"ray_version": ...}: a Ray dashboard (Ray's job client
                              checks this first); anything else is "not a Ray dashboard"
    GET /nodes?view=summary   the head node's (raylet.isHeadNode) "cmdline"
                              -> its --gcs-address

The GCS runs on the head, as the dashboard does, so the first address to try is the GCS
port on the host the dashboard was reached at (a port-forward, a Kubernetes service
name); the second is the address as the head knows it (:func:`gcs_candidates`).

Contracts: no request waits unbounded: connecting, the answer's head and each piece of
its body time out after ``timeout_s``, and a body still arriving ``timeout_s`` after the
request began is cut off.  Every failure is one :class:`DashboardError` whose message is
one line for the user.  Token
authentication headers are the caller's to give (Ray's own helper makes them).  The
decisions (:func:`dashboard_base`, :func:`ray_version`, :func:`head_gcs_address`,
:func:`gcs_candidates`, :func:`http_failure`) are pure; :func:`locate_gcs` is the shell.

May import: erlay.supervisor.errors.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from erlay.supervisor.errors import ErlayError

VERSION_PATH = "/api/version"
NODES_PATH = "/nodes?view=summary"
GCS_FLAG = "--gcs-address="
TIMEOUT_S = 3.0                 # each step of a request, and its body as a whole
MAX_REPLY_BYTES = 64 << 20      # a node summary is ~15 kB a node
AUTH_HINT = ("set RAY_AUTH_MODE=token and the cluster's token (RAY_AUTH_TOKEN, from "
             "`ray get-auth-token` on the head)")


class DashboardError(ErlayError):
    """The dashboard at a URL led to no GCS address: it does not answer, refused the
    request, is not a Ray dashboard, or names no GCS.  The message is one line."""


def is_dashboard_url(address: str) -> bool:
    """Whether ``address`` names a dashboard (``http://``, ``https://``), not a GCS.

    >>> is_dashboard_url("http://10.0.0.5:8265"), is_dashboard_url("10.0.0.5:6379")
    (True, False)
    """
    return address.lower().startswith(("http://", "https://"))


# ======================================================================== the pure core

def dashboard_base(url: str) -> str:
    """``url`` as the base every request path is appended to: scheme, host, port and any
    path prefix (a dashboard behind a proxy), without query or trailing slash.

    >>> dashboard_base("http://10.0.0.5:8265/")
    'http://10.0.0.5:8265'

    Raises :class:`DashboardError` for a URL that names no host or a bad port."""
    parts = urlsplit(url.strip())
    try:
        port = parts.port  # ValueError for a port that is not a number
    except ValueError:
        port = -1
    if port in (-1, 0):
        raise DashboardError(f"{url} has a bad port")
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise DashboardError(f"{url} is not a dashboard URL (http://HOST:PORT)")
    return f"{parts.scheme.lower()}://{parts.netloc}{parts.path.rstrip('/')}"


def _json(reply: bytes, what: str) -> Any:
    try:
        return json.loads(reply)
    except ValueError:
        raise DashboardError(f"not a Ray dashboard: {what} answered no JSON") from None


def ray_version(reply: bytes) -> str:
    """The Ray version a ``GET /api/version`` reply names.

    >>> ray_version(b'{"version": "4", "ray_version": "2.60.0"}')
    '2.60.0'

    Raises :class:`DashboardError` when the reply is not a Ray dashboard's."""
    doc = _json(reply, f"GET {VERSION_PATH}")
    if not isinstance(doc, dict) or not isinstance(doc.get("ray_version"), str):
        raise DashboardError(f"not a Ray dashboard: GET {VERSION_PATH} names no ray_version")
    return str(doc["ray_version"])


def head_gcs_address(reply: bytes, version: str = "?") -> str:
    """The GCS ``host:port`` in the head node's raylet command line, from a
    ``GET /nodes?view=summary`` reply of a dashboard running Ray ``version``.

    Raises :class:`DashboardError` when the reply has no node summary, no head node, or
    a head whose command line (not reported yet, or hidden from the dashboard's agent)
    names no GCS."""
    doc = _json(reply, f"GET {NODES_PATH}")
    data = doc.get("data") if isinstance(doc, dict) else None
    nodes = data.get("summary") if isinstance(data, dict) else None
    if not isinstance(nodes, list):
        raise DashboardError(f"not a Ray dashboard: GET {NODES_PATH} has no node summary")
    heads = [n for n in nodes if isinstance(n, dict)
             and isinstance(n.get("raylet"), dict) and n["raylet"].get("isHeadNode") is True]
    if not heads:
        raise DashboardError(f"the Ray dashboard (Ray {version}) lists no head node")
    cmdline = heads[0].get("cmdline")
    found = [arg[len(GCS_FLAG):] for arg in (cmdline if isinstance(cmdline, list) else [])
             if isinstance(arg, str) and arg.startswith(GCS_FLAG)]
    if not found or not found[0]:
        raise DashboardError(f"the Ray dashboard (Ray {version}) does not name its GCS (no "
                             f"{GCS_FLAG[:-1]} in its head node's command line); give "
                             "--address HEAD:6379")
    return found[0]


def gcs_candidates(base: str, head_gcs: str) -> tuple[str, ...]:
    """The GCS addresses to try, best first: the GCS port on the dashboard's host, then
    ``head_gcs`` as the head knows it (the same address once, when they agree).

    >>> gcs_candidates("http://localhost:8265", "10.1.2.3:6379")
    ('localhost:6379', '10.1.2.3:6379')
    """
    host = urlsplit(base).hostname or ""
    port = head_gcs.rpartition(":")[2]
    here = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return (here,) if here == head_gcs else (here, head_gcs)


def http_failure(path: str, status: int) -> DashboardError:
    """What an HTTP error status on ``GET path`` means to the user.

    >>> str(http_failure("/api/version", 404))
    'not a Ray dashboard: GET /api/version answered HTTP 404'
    """
    if status == 401:
        return DashboardError(f"the Ray dashboard asks for a token (HTTP 401): {AUTH_HINT}")
    if status == 403:
        return DashboardError(f"the Ray dashboard refused the token (HTTP 403): {AUTH_HINT}")
    if path == VERSION_PATH:
        return DashboardError(f"not a Ray dashboard: GET {path} answered HTTP {status}")
    return DashboardError(f"the Ray dashboard answered GET {path} with HTTP {status}")


# ============================================================================ the shell

def locate_gcs(base: str, headers: Mapping[str, str],
               timeout_s: float = TIMEOUT_S) -> tuple[str, ...]:
    """The GCS addresses to try for the dashboard at ``base`` (from :func:`dashboard_base`),
    best first.  Two requests, each bounded by ``timeout_s``; raises :class:`DashboardError`.
    """
    version = ray_version(_get(base, VERSION_PATH, headers, timeout_s))
    head = head_gcs_address(_get(base, NODES_PATH, headers, timeout_s), version)
    return gcs_candidates(base, head)


def _get(base: str, path: str, headers: Mapping[str, str], timeout_s: float) -> bytes:
    """The body of ``GET base+path``; each step times out after ``timeout_s``, and a server
    that trickles its body is cut off ``timeout_s`` after the request began."""
    deadline = time.monotonic() + timeout_s
    request = urllib.request.Request(base + path, headers=dict(headers))
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            chunks, size = [], 0
            while chunk := reply.read1(1 << 16):  # what has come, not a full buffer
                chunks.append(chunk)
                size += len(chunk)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no whole answer within {timeout_s:g} s")
                if size > MAX_REPLY_BYTES:
                    raise DashboardError(f"not a Ray dashboard: GET {path} answered over "
                                         f"{MAX_REPLY_BYTES >> 20} MiB")
            return b"".join(chunks)
    except urllib.error.HTTPError as exc:
        raise http_failure(path, exc.code) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:  # refused, DNS, timeout
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        text = str(reason).strip().splitlines()
        raise DashboardError("the Ray dashboard does not answer: "
                             + (text[0] if text else type(reason).__name__)) from None
    except http.client.HTTPException as exc:  # something listens, but speaks no HTTP/1.1
        raise DashboardError(f"not a Ray dashboard: GET {path} had no HTTP answer "
                             f"({type(exc).__name__})") from None
