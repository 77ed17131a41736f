"""A test-only method with private client state: each client counts its own participations."""

from dataclasses import dataclass

from fedray.methods import register_algorithm
from fedray.learning.training import run_update
from fedray.methods.api import ClientResult
from fedray.methods.fedavg import FedAvg


@dataclass
class Counter:
    client_id: int
    count: int


@register_algorithm
class CountingFedAvg(FedAvg):
    name = "test_counting"

    def init_client_state(self, client_id: int) -> Counter:
        return Counter(client_id, 0)

    def client_update(self, ctx, payload, state: Counter) -> ClientResult:
        assert state.client_id == ctx.client_id, "a client received another client's state"
        result = run_update(ctx, super().client_update(ctx, payload, state))
        new = Counter(ctx.client_id, state.count + 1)
        return ClientResult(result.upload, new, {**result.metrics, "test/count": float(new.count)})
