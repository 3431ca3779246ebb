"""Where the learner ranks meet: rank 0's address, handed to the other ranks through Ray.

A data-parallel or sharded learner forms one ``torch.distributed`` group, and every rank must
know rank 0's address and a port free on rank 0's node.  The driver cannot know either: Ray
places the ranks, possibly on other nodes.  So rank 0, in its constructor, takes its node's
address (as Ray sees it) and a free port there and stores them under the job's key in Ray's
internal key-value store; the other ranks read that key when they form the group.

Contracts:

- **Fresh by construction.** The supervisor starts a learner's ranks one at a time, rank 0
  first, and a ``one_for_all`` restart restarts them all in that order, so rank 0's
  constructor has overwritten the key before any other rank of the same incarnation
  starts.  A rank never reads a previous incarnation's address.
- **Bounded.** Every call to Ray's store has a timeout (an unbounded call still pending at
  shutdown takes the process down 60 s later); :func:`lookup_master` waits for the key at most
  ``timeout_s`` and then raises ``TimeoutError`` naming the key, so a rank whose rank 0
  never announced fails (and is restarted) instead of hanging.
- **The right interface.** Gloo binds the interface the host name resolves to unless told
  otherwise; :func:`interface_of` names the interface that holds this node's address, so the
  group's traffic goes where Ray's does (``lo`` for a loopback cluster).

May import: erlay.supervisor.
"""

from __future__ import annotations

import socket
import time

import psutil

NAMESPACE = "erlay"
TIMEOUT_S = 10.0     # one call into Ray's store
POLL_S = 0.05


def _client():
    from ray.experimental import internal_kv
    client = internal_kv.internal_kv_get_gcs_client()
    if client is None:
        raise RuntimeError("Ray is not initialised in this process: the learner ranks meet "
                           "through Ray's key-value store")
    return client


def node_address() -> str:
    """This node's address as Ray sees it (127.0.0.1 on a loopback cluster)."""
    import ray
    return ray.util.get_node_ip_address()


def free_port(address: str) -> int:
    """A TCP port free on ``address`` now (the OS's choice; it may be taken again before use,
    which fails the group's formation and restarts the ranks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def parse_master(value: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; ValueError on anything else."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"not a host:port learner address: {value!r}")
    return host, int(port)


def announce_master(key: str) -> tuple[str, int]:
    """Rank 0: pick this node's address and a free port, store them under ``key``, return
    them."""
    address = node_address()
    port = free_port(address)
    _client().internal_kv_put(key.encode(), f"{address}:{port}".encode(), True,
                              NAMESPACE.encode(), timeout=TIMEOUT_S)
    return address, port


def lookup_master(key: str, timeout_s: float) -> tuple[str, int]:
    """Ranks 1..N-1: rank 0's ``(address, port)`` under ``key``, waiting up to ``timeout_s``
    for it to appear."""
    deadline = time.monotonic() + timeout_s
    client = _client()
    while True:
        raw = client.internal_kv_get(key.encode(), NAMESPACE.encode(), timeout=TIMEOUT_S)
        if raw:
            return parse_master(raw.decode())
        if time.monotonic() >= deadline:
            raise TimeoutError(f"learner rank 0 never announced its address under {key!r} "
                               f"within {timeout_s:.0f} s")
        time.sleep(POLL_S)


def interface_of(address: str) -> str | None:
    """The network interface holding ``address`` on this machine, or None."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    return None
