"""What a chaos run did to a job: one :class:`FaultRecord` per injected fault.

The runner's injectors create the records, the invariants (:mod:`erlay.chaos.invariants`) judge the
run against them and the report (:mod:`erlay.chaos.report`) lists them, so the shape is fixed here
and validated at construction: a record with an unknown kind, domain or expectation is a bug
in the scenario or the injector, and it fails at once with :class:`InvalidFaultRecord` rather
than quietly matching nothing later.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from erlay.supervisor.errors import ErlayError

KINDS = ("sigkill", "sigstop", "sigterm", "ray_kill", "node_loss", "failpoint",
         "sandbox_attack", "judge_fault", "slow_checkpoint", "driver_kill", "delay",
         "user_error", "partial")
DOMAINS = ("learner", "generation", "sandbox", "judge", "environment", "rollout", "node",
           "driver")
# restart:    the target's supervisor must see an exit or hang of the target and restart it;
# absorbed:   no restart is expected (hostile sandbox code, a judge returning garbage, a delay);
# escalation: the domain must give up (restart intensity exceeded) and escalate.
EXPECTS = ("restart", "absorbed", "escalation")


class InvalidFaultRecord(ErlayError, ValueError):
    """A fault record is malformed.  ``field`` names the offending field, ``value`` what was
    given and ``expected`` what would have been accepted.

    A ``ValueError`` too, so callers that validate plain data can catch the usual type.
    """

    def __init__(self, field: str, value: object, expected: str) -> None:
        self.field = field
        self.value = value
        self.expected = expected
        super().__init__(f"fault record {field}: expected {expected}, got {value!r}")


@dataclass(frozen=True)
class FaultRecord:
    """One injected fault, stamped with the unix time the injector acted (``at``).

    ``target`` is the tree path of the child hit (``erlay/generation/engine-1``), a glob over
    tree paths when several children were armed at once (``erlay/judge/host@*``), or
    ``driver``.  ``domain`` is the fault domain the failure must be attributed to.
    ``detail`` is free text: the signal's pid, the attack kind, the failpoint spec.
    """

    id: int
    kind: str
    target: str
    domain: str
    at: float
    expect: str
    detail: str = ""

    def __post_init__(self) -> None:
        # bool is an int to Python; a True id or time is always a slip, never intended.
        if not isinstance(self.id, int) or isinstance(self.id, bool) or self.id < 0:
            raise InvalidFaultRecord("id", self.id, "an int >= 0")
        if self.kind not in KINDS:
            raise InvalidFaultRecord("kind", self.kind, f"one of {', '.join(KINDS)}")
        if not isinstance(self.target, str) or not self.target:
            raise InvalidFaultRecord("target", self.target, "a non-empty tree path or 'driver'")
        if self.domain not in DOMAINS:
            raise InvalidFaultRecord("domain", self.domain, f"one of {', '.join(DOMAINS)}")
        if not isinstance(self.at, int | float) or isinstance(self.at, bool) or self.at < 0:
            raise InvalidFaultRecord("at", self.at, "a unix time in seconds (float >= 0)")
        if self.expect not in EXPECTS:
            raise InvalidFaultRecord("expect", self.expect, f"one of {', '.join(EXPECTS)}")
        if not isinstance(self.detail, str):
            raise InvalidFaultRecord("detail", self.detail, "a string")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data; :meth:`from_dict` reads it back to an equal record."""
        return asdict(self)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> FaultRecord:
        """The record in ``data``.  Missing required keys and unknown keys both raise
        :class:`InvalidFaultRecord`: an unknown key is most likely a misspelt known one."""
        known = {f.name for f in fields(FaultRecord)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidFaultRecord(unknown[0], data[unknown[0]],
                                     f"only the keys {', '.join(sorted(known))}")
        for name in ("id", "kind", "target", "domain", "at", "expect"):
            if name not in data:
                raise InvalidFaultRecord(name, None, "a value (the key is missing)")
        return FaultRecord(**data)


def domain_of(path: str) -> str:
    """The fault domain of a tree path: ``erlay/<domain>/...`` -> ``<domain>``.

    The root itself (a path with one segment, ``erlay``) is ``root``: its events concern the
    whole tree, not one domain.  Anything else that is not a tree path is ``driver``.
    """
    parts = path.split("/")
    if len(parts) == 1:
        return "root" if parts[0] == "erlay" else "driver"
    return parts[1]
