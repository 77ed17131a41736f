"""Test-only methods that misbehave on purpose: non-finite uploads and slow clients."""

import math
import time

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


@register_algorithm
class SlowRound2(FedAvg):
    """Every client of round 2 idles 2 s before training, so a fault injected then lands mid-task
    rather than racing the round's end."""

    name = "test_slow_round_2"

    def client_update(self, ctx, payload, state):
        if ctx.round == 2:
            time.sleep(2)
        return super().client_update(ctx, payload, state)


@register_algorithm
class SlowPlanRound2(FedAvg):
    """SlowRound2 for vectorised clients: the delay comes before the plan is returned, so the worker still batches
    its clients of the round (1 s each) and a fault lands mid-task."""

    name = "test_slow_plan_round_2"

    def client_update(self, ctx, payload, state):
        if ctx.round == 2:
            time.sleep(1)
        return super().client_update(ctx, payload, state)
