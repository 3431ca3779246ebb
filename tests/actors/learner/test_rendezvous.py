"""Learner ranks meet at rank 0's announced address (erlay.actors.learner.rendezvous), read
back through Ray's key-value store; a missing or malformed announcement fails by deadline
with the key named, never hangs."""

from __future__ import annotations

import pytest

from erlay.actors.learner.rendezvous import (
    announce_master,
    free_port,
    interface_of,
    lookup_master,
    parse_master,
)


def test_a_host_port_parses_and_anything_else_is_refused() -> None:
    assert parse_master("10.0.0.7:29500") == ("10.0.0.7", 29500)
    for bad in ("10.0.0.7", ":29500", "10.0.0.7:", "10.0.0.7:port"):
        with pytest.raises(ValueError, match="host:port"):
            parse_master(bad)


def test_the_loopback_address_is_on_lo_and_an_unknown_one_on_no_interface() -> None:
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.77") is None   # TEST-NET-1: on no interface here


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_rank_0_announces_and_the_others_read_its_address() -> None:
    key = f"test-rendezvous-{free_port('127.0.0.1')}"
    address, port = announce_master(key)
    assert address == "127.0.0.1"   # the tests' Ray runs on loopback
    assert lookup_master(key, timeout_s=5.0) == (address, port)
    again = announce_master(key)    # a restarted rank 0 overwrites: the newest wins
    assert lookup_master(key, timeout_s=5.0) == again


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_a_rank_whose_rank_0_never_announced_fails_by_deadline() -> None:
    with pytest.raises(TimeoutError, match="never-announced"):
        lookup_master("never-announced", timeout_s=0.3)
