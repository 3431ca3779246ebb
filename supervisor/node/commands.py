"""``erlay topology``, registered through the ``erlay.commands`` entry points.

Prints this node's GPUs, NVLink domain and CPU/NUMA affinity, and the ``ray start``
arguments that register them as Ray resources and labels (:mod:`erlay.supervisor.node`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class TopologyCommand:
    """``erlay topology``: 0 shown (no GPUs is not an error), 2 when discovery fails."""

    name: str = "topology"
    help: str = ("this node's GPUs, NVLink domain, CPU/NUMA affinity, and the `ray start` "
                 "arguments that register them")
    takes_overrides: bool = False

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--ray-start-args", action="store_true", help="print only the "
                            "arguments to add to `ray start` (shell-quoted)")

    def run(self, args: argparse.Namespace) -> int:
        from erlay.supervisor.node.topology import (
            TopologyError,
            affinity_map,
            discover,
            ray_start_args,
        )
        try:
            topology = discover()
        except TopologyError as exc:
            print(f"erlay: {exc}", file=sys.stderr)
            return 2
        if args.ray_start_args:
            print(shlex.join(ray_start_args(topology)))
            return 0
        print(f"host {topology.hostname}: {len(topology.gpus)} GPU(s), NVLink domain "
              f"{topology.nvlink_domain or '-'}, topology address {topology.topo_addr}")
        for gpu, entry in affinity_map(topology).items():
            print(f"  GPU {gpu}: {json.dumps(entry)}")
        print("ray start " + shlex.join(ray_start_args(topology)))
        return 0


TOPOLOGY = TopologyCommand()
