"""How Ray is started, and starting it while the caller's own start-up goes on.

Imports ray only for a run on Ray (an in-process ``fedray run`` never pays for it), and never torch:
``fedray run`` calls :func:`start_ray_during` before it imports torch, the methods and MLflow, so that those
imports (in a thread) overlap ``ray.init``, which mostly waits on Ray's own processes starting. It says whether it
started Ray, and the caller hands that to the runtime it builds (``make_runtime(..., owns_ray=...)``), which then
shuts that Ray down when it closes. On the 2-core overhead workload round 1 begins ~1.5 s sooner
(``benchmarks/README.md``).
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any, Callable, TypeVar

from fedray.config import ExperimentConfig
from fedray.errors import ConfigError

T = TypeVar("T")

# Ray's own connection retries, for a local cluster started here: the raylet connects to its object store,
# a worker or driver to its raylet, retrying every `raylet_client_connect_timeout_milliseconds`. The raylet's
# first try often comes before its store listens (2 of 10 starts here), and Ray's 1,000 ms between tries
# then holds up `ray.init` by a whole second. Retrying every 50 ms, 200 times, keeps Ray's 10 s budget.
LOCAL_SYSTEM_CONFIG = {"raylet_client_connect_timeout_milliseconds": 50, "raylet_client_num_connect_attempts": 200}


def start_ray(cfg: ExperimentConfig, address_key: str = "runtime.address") -> bool:
    """Connect to ``runtime.address`` (or ``$RAY_ADDRESS``, as inside a Ray job) or start a local Ray; True if
    it was started or connected here (the caller owns it and shuts it down), False if Ray was up already.
    ``address_key``: what an unreachable address is blamed on (the option the user gave it as)."""
    import ray

    if ray.is_initialized():
        return False
    address = cfg.runtime.address or os.environ.get("RAY_ADDRESS") or None
    kwargs: dict[str, Any] = {"logging_level": "ERROR", "configure_logging": True}
    if address is None:
        # A new local cluster of our own ("local": never silently join a `ray start` cluster of this
        # machine), with no dashboard: nothing listens beyond what Ray itself needs.
        address = "local"
        reap_orphaned_ray_agents()
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        kwargs.update(include_dashboard=False, num_cpus=os.cpu_count(), _system_config=LOCAL_SYSTEM_CONFIG)
    try:
        _check_listening(address)
        ray.init(address=address, **kwargs)
    except (ConnectionError, ValueError) as exc:  # no cluster there, a malformed address, ray:// without ray[client]
        if address == "local":
            raise
        raise ConfigError(address_key if cfg.runtime.address else "RAY_ADDRESS",
                          f"cannot connect to Ray at {address!r} ({exc}); start that cluster, fix the address, or "
                          "leave it unset for a Ray of the run's own") from None
    return True


#: The processes a raylet starts that outlive it when it dies with a SIGKILLed driver (they do not watch it)
RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def orphaned_ray_agents() -> list:
    """This user's running Ray agents whose raylet is gone (psutil processes): what a SIGKILLed driver's Ray leaves.
    An agent whose parent is a raylet belongs to a live cluster (another run's, a ``ray start`` one); a stopped
    one that lingers as a zombie is not counted."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline", "uids", "status"]):
        try:
            cmdline = proc.info["cmdline"] or []
            if (not cmdline or cmdline[0] not in RAY_AGENTS or proc.info["uids"].real != os.getuid()
                    or proc.info["status"] == psutil.STATUS_ZOMBIE):
                continue
            parent = proc.parent()
            if parent is None or "raylet" not in (parent.cmdline() or [""])[0]:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def reap_orphaned_ray_agents() -> list[int]:
    """Stop :func:`orphaned_ray_agents`, and return their pids.

    A local Ray dies with its driver, but for two of its processes: a driver killed by SIGKILL (an out-of-memory
    killer, ``kill -9``, a cluster's preemption) leaves Ray's DashboardAgent and RuntimeEnvAgent running, orphaned,
    ~150 MB each, for good. Every local Ray that fedray starts first stops the orphans left by earlier ones."""
    import psutil

    reaped = []
    for proc in orphaned_ray_agents():
        try:
            proc.kill()
            reaped.append(proc.pid)
        except psutil.NoSuchProcess:
            continue
    return reaped


def _check_listening(address: str, timeout_s: float = 5.0) -> None:
    """For a ``host:port`` address, raise ConnectionError unless something accepts connections there: ray.init
    would wait minutes for a cluster at an address where none listens (a wrong port, a stopped head node)."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return  # auto, local, ray://: Ray's own checks answer at once
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(f"nothing accepts connections there: {exc}") from None


def start_ray_during(cfg: ExperimentConfig, work: Callable[[], T]) -> tuple[T, bool]:
    """``work()`` (imports, checks) in a thread while Ray starts in this one, when ``cfg`` runs on Ray and no
    Ray is up; just ``work()`` otherwise. Returns what ``work`` returns and whether Ray was started here: the
    caller owns that Ray, hands it to its runtime (``owns_ray``) or shuts it down with :func:`shutdown_ray`. If
    either fails, Ray is shut down again and the error raised (``work``'s first: a bad config is the user's to fix
    before anything else)."""
    if cfg.runtime.backend != "ray":
        return work(), False
    import ray  # before the thread starts: ray.init's processes start sooner than if the imports shared the GIL

    if ray.is_initialized():
        return work(), False
    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["value"] = work()
        except BaseException as exc:  # re-raised in the caller's thread
            done["error"] = exc

    thread = threading.Thread(target=run, name="fedray-start-up", daemon=True)
    thread.start()
    owned = False
    try:
        owned = start_ray(cfg)
    finally:
        thread.join()  # also when ray.init failed or was interrupted: work's error may be the one to report
        if "error" in done:
            shutdown_ray(owned)
            raise done["error"]
    return done["value"], owned


def shutdown_ray(owned: bool) -> None:
    """Shut down a Ray this process started (``owned``) and gave to no runtime; a Ray it joined is left up."""
    if owned:
        import ray

        if ray.is_initialized():
            ray.shutdown()
