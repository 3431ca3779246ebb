"""Starting or joining Ray the way erlay needs it.

On these machines Ray 2.60 binds the machine's eth0 address unless
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is set before Ray starts; with it every server stays
on 127.0.0.1.  A local Ray is for one user's job, so it stays on loopback.  Ray is imported
here only after the variable is set.
"""

from __future__ import annotations

import logging
import os
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray
from ray._private import ray_constants

# Ray reads the variable once, when it is first imported; a program that imported Ray
# before erlay (erlay's own CLI does, through its plug-ins) would keep the eth0 default, and
# its driver would then rewrite a 127.0.0.1 cluster address to eth0's and never connect.
ray_constants.ENABLE_RAY_CLUSTER = ray_constants.env_bool(
    ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, True)

log = logging.getLogger("erlay.ray")

LOOPBACK = "127.0.0.1"


def ensure_ray(address: str | None = None, *, num_cpus: int | None = None,
               namespace: str = "erlay", include_dashboard: bool | None = None,
               system_config: dict[str, Any] | None = None,
               log_to_driver: bool = False, metadata: dict[str, str] | None = None,
               **kwargs: Any) -> dict[str, Any]:
    """Start a loopback-only local Ray, or attach to ``address`` (or ``RAY_ADDRESS``).

    ``metadata`` becomes this driver's Ray job metadata (``ray job list`` shows it); under
    ``ray job submit`` Ray merges the submission's metadata over it.  Does nothing if Ray is
    already initialised in this process (the metadata is then not applied).  Returns Ray's
    context info.
    """
    quiet_worker_death_notices()
    if ray.is_initialized():
        return {"address": ray.get_runtime_context().gcs_address, "started": False}
    if metadata:
        job_config = kwargs.get("job_config") or ray.job_config.JobConfig()
        for key, value in metadata.items():
            job_config.set_metadata(key, value)
        kwargs["job_config"] = job_config
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        if _on_loopback(address):
            # Without it the driver takes this machine's first interface address as its
            # own, finds no raylet there and waits for one forever.
            kwargs.setdefault("_node_ip_address", LOOPBACK)
        info = ray.init(address=address, namespace=namespace, log_to_driver=log_to_driver,
                        **kwargs)
        log.info("attached to Ray at %s", address)
        return {"address": info.address_info.get("gcs_address"), "started": False}
    # address="local" always starts a new instance: a bare ray.init() would attach to
    # whatever cluster this machine started last (/tmp/ray/ray_current_cluster), which
    # is another user's job, or a test's, and then rejects num_cpus.
    init_kwargs: dict[str, Any] = dict(address="local", num_cpus=num_cpus,
                                       namespace=namespace,
                                       _node_ip_address=LOOPBACK, log_to_driver=log_to_driver,
                                       include_dashboard=include_dashboard, **kwargs)
    if system_config:
        init_kwargs["_system_config"] = system_config
    info = ray.init(**init_kwargs)
    log.info("started a local Ray on loopback (%s)", info.address_info.get("gcs_address"))
    return {"address": info.address_info.get("gcs_address"), "started": True}


def _on_loopback(address: str) -> bool:
    """Whether ``address`` (a GCS ``host:port``) names a cluster on this machine's
    loopback.  Ray Client addresses (``ray://``) and ``auto`` are left to Ray."""
    if "://" in address:
        return False
    return address.rsplit(":", 1)[0] in (LOOPBACK, "localhost")


def shutdown_ray(grace_s: float = 5.0) -> list[int]:
    """``ray.shutdown()``, then make sure the local Ray this process started is really gone.

    Ray 2.60's shutdown can leave the raylet's agents (``ray::DashboardAgent``,
    ``ray::RuntimeEnvAgent``) running, re-parented to init, after a run in which workers
    were killed.  They are descendants of this process (it started the raylet), so they are
    collected before the shutdown and any survivor is SIGKILLed after ``grace_s``.  Attached
    clusters are left alone: their processes are not ours.  Returns the pids killed.
    """
    import psutil
    ours = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if "ray" in " ".join(proc.cmdline()):  # raylet, gcs_server, ray::*, agents
                ours.append(proc)
        except psutil.Error:
            continue
    ray.shutdown()
    _gone, alive = psutil.wait_procs(ours, timeout=grace_s)
    killed = []
    for proc in alive:
        try:
            proc.kill()
            killed.append(proc.pid)
        except psutil.Error:
            continue
    if killed:
        log.warning("killed %d Ray process(es) that outlived ray.shutdown(): %s", len(killed),
                    killed)
    return killed


def quiet_worker_death_notices() -> None:
    """Send Ray's "(raylet) A worker died..." notices to the log instead of stdout.

    erlay reports every child death as a structured event; Ray's driver-side notice repeats
    it as a paragraph on stdout.  The notice printer is a private Ray function, so the patch
    is applied only when it exists and is otherwise skipped.
    """
    try:
        import ray._private.worker as ray_worker
    except ImportError:
        return
    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None or getattr(original, "_erlay_quiet", False):
        return

    def printer(data: dict[str, Any], ignore_prefix: bool) -> None:
        if data.get("pid") == "raylet":
            for line in data.get("lines", []):
                log.debug("raylet: %s", line)
            return
        original(data, ignore_prefix)

    printer._erlay_quiet = True  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = printer


def local_node_id() -> str:
    return ray.get_runtime_context().get_node_id()


def alive_nodes() -> list[dict[str, Any]]:
    """Ray's alive nodes, each with NodeID, NodeManagerAddress and Resources."""
    return [n for n in ray.nodes() if n.get("Alive")]
