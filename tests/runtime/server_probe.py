"""A test-only method that reports what server data it sees on the server and on the clients."""

from fedray.methods import register_algorithm
from fedray.learning.training import run_update
from fedray.methods.api import ClientResult
from fedray.methods.fedavg import FedAvg


@register_algorithm
class ServerDataProbe(FedAvg):
    name = "test_server_probe"

    def client_update(self, ctx, payload, state) -> ClientResult:
        result = run_update(ctx, super().client_update(ctx, payload, state))
        return ClientResult(result.upload, None, {**result.metrics,
                                                  "test/client_sees_server_data": float(self.server_data is not None)})

    def server_update(self, state, uploads, ctx):
        new, metrics = super().server_update(state, uploads, ctx)
        sd = self.server_data
        return new, {**metrics, "server/data_size": float(len(sd)) if sd is not None else -1.0,
                     "server/has_labels": float(sd is not None and sd.y is not None),
                     "server/label_sum": float(sd.y.sum()) if sd is not None and sd.y is not None else -1.0}
