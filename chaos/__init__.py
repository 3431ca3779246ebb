"""Fault injection, chaos scenarios, invariant checks and reports.

- :mod:`.scenario` (with :mod:`.scenario_errors` and :mod:`.schedule`): scenarios in
  ``configs/chaos/``, validated before Ray starts, and when their faults fire;
- :mod:`.injectors`: the faults themselves (signals, ``ray.kill``, failpoints, attacks);
- :mod:`.faults`: the record of what a run did to a job;
- :mod:`.invariants`: what must hold afterwards, computed from the durable record;
- :mod:`.report` and :mod:`.runner`: running a scenario and writing its report;
- :mod:`.commands`: ``erlay chaos``.

The top floor of the house: only tests and the CLI import it.

May import: erlay.supervisor, erlay.environments, erlay.sandbox, erlay.judges, erlay.actors,
erlay.configs.
"""
