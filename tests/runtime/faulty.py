"""Test-only methods that misbehave on purpose: non-finite uploads, a straggler, clients held while a test
injects a fault."""

import math
import os
import time
from pathlib import Path

import torch

from fedray.methods import register_algorithm
from fedray.learning.training import run_update
from fedray.methods.api import ClientResult
from fedray.methods.fedavg import FedAvg, ModelUpload


@register_algorithm
class NaNClient(FedAvg):
    """Client 1 uploads NaN weights in round 2 (`nan_all`: every client does)."""

    name = "test_nan_client"
    nan_all = False

    def client_update(self, ctx, payload, state) -> ClientResult:
        result = run_update(ctx, super().client_update(ctx, payload, state))
        if ctx.round == 2 and (self.nan_all or ctx.client_id == 1):
            weights = {k: torch.full_like(v, math.nan) if torch.is_floating_point(v) else v
                       for k, v in result.upload.weights.items()}
            result.upload = ModelUpload(weights, result.upload.num_samples)
        return result

    def server_samples(self, uploads: int) -> int:
        """10 examples an upload: the server's simulated work counts only the uploads it kept."""
        return 10 * uploads


@register_algorithm
class NaNEveryone(NaNClient):
    name = "test_nan_everyone"
    nan_all = True


@register_algorithm
class SlowClient0(FedAvg):
    """Client 0 takes 120 s longer than everyone else: a straggler."""

    name = "test_slow_client_0"

    def client_update(self, ctx, payload, state):
        if ctx.client_id == 0:
            time.sleep(120)
        return super().client_update(ctx, payload, state)


GATES_ENV = "FEDRAY_TEST_GATES"  # a folder tests/conftest.py makes before Ray starts: every worker inherits it


class Gate:
    """Holds the clients of round ``round_`` of the ``test_held_*`` methods until the test releases them, so that a
    fault it injects lands while the workers hold those clients, however loaded the machine (no timed sleep).

    Files in ``$FEDRAY_TEST_GATES``: ``hold`` (the round held), ``started-<pid>-<client>`` (a client of that round
    began, in that process), ``release``. A client rerun after the fault finds ``release`` and goes on."""

    def __init__(self, round_: int):
        self.folder = Path(os.environ[GATES_ENV])
        self.close()
        (self.folder / "hold").write_text(str(round_))

    def started_pids(self) -> set[int]:
        return {int(f.name.split("-")[1]) for f in self.folder.glob("started-*")}

    def wait_started(self, pids=(), count: int = 1, timeout: float = 120.0) -> None:
        """Until every process in ``pids``, and at least ``count`` processes, hold a client of the round."""
        deadline = time.monotonic() + timeout
        while not (set(pids) <= self.started_pids() and len(self.started_pids()) >= count):
            if time.monotonic() > deadline:
                raise TimeoutError(f"held clients in processes {self.started_pids()} after {timeout} s; wanted "
                                   f"{count} and every one of {set(pids)}")
            time.sleep(0.01)

    def release(self) -> None:
        (self.folder / "release").touch()

    def close(self) -> None:
        for f in self.folder.glob("*"):
            f.unlink()


def held(ctx) -> None:
    """In a worker: a client of the held round says it started, then waits for the test's release."""
    folder = Path(os.environ[GATES_ENV])
    hold = folder / "hold"
    if not hold.exists() or hold.read_text() != str(ctx.round):
        return
    (folder / f"started-{os.getpid()}-{ctx.client_id}").touch()
    deadline = time.monotonic() + 300
    while not (folder / "release").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"round {ctx.round}'s client {ctx.client_id} was never released")
        time.sleep(0.01)


@register_algorithm
class HeldRound(FedAvg):
    """FedAvg whose clients of the round a :class:`Gate` holds wait for its release before training."""

    name = "test_held_round"

    def client_update(self, ctx, payload, state):
        held(ctx)
        return super().client_update(ctx, payload, state)


@register_algorithm
class HeldPlan(FedAvg):
    """HeldRound for vectorised clients: held before the plan is returned, so the worker still batches its clients
    of the round once released."""

    name = "test_held_plan"

    def client_update(self, ctx, payload, state):
        held(ctx)
        return super().client_update(ctx, payload, state)


@register_algorithm
class WallOrderReversed(FedAvg):
    """FedAvg whose clients take wall time in the reverse order of their simulated time on the run's devices
    (``system.*``): the client fastest on the simulated clock sleeps longest, so on Ray results come back in
    the opposite order to the simulated events."""

    name = "test_wall_order_reversed"
    asynchronous = True

    def client_update(self, ctx, payload, state):
        from fedray.system.devices import Devices

        speed = Devices.build(self.cfg.system, ctx.spec.num_clients, self.cfg.seed).compute_sps
        time.sleep(0.15 * int((speed < speed[ctx.client_id]).sum()))  # the faster in simulation, the slower here
        return super().client_update(ctx, payload, state)


@register_algorithm
class SlowFirstAttempt(FedAvg):
    """FedAvg whose clients sleep 60 s on their first attempt only (a marker file per client in
    ``$FEDRAY_TEST_GATES``): a test kills the worker meanwhile, and the rerun goes through at once."""

    name = "test_slow_first_attempt"
    asynchronous = True

    def client_update(self, ctx, payload, state):
        marker = Path(os.environ[GATES_ENV]) / f"slow-first-{os.getpid()}-{ctx.client_id}"
        if not list(Path(os.environ[GATES_ENV]).glob(f"slow-first-*-{ctx.client_id}")):
            marker.touch()
            time.sleep(60)
        return super().client_update(ctx, payload, state)
