"""What a client reports about its data beside its upload: Oort's statistical utility (Lai et al., OSDI 2021, Sec. 4.2)

    U(i) = |B_i| sqrt(1/|B_i| sum_{k in B_i} Loss(k)^2)

over the client's training samples B_i, with Loss(k) the cross-entropy of sample k. It is computed where the client
runs, from the model its local training starts from (the plan's starting weights: the received global model, or the
client's own for personalised methods), in one pass without gradients before it trains: the losses its first epoch
starts from. The paper and FedScale read them off the training steps themselves (FedScale: the last mini-batch's);
a pass of their own keeps every method's training loop as it is, at the cost of one forward pass over the client's
data, and makes U(i) the same whether clients train alone or batched.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.func import functional_call

from fedray.data.federated import to_float
from fedray.learning.training import ClientUpdate, LocalTraining, StepwiseTraining


def statistical_utility(update: ClientUpdate, x: torch.Tensor, y: torch.Tensor, mean, std,
                        batch_size: int) -> float | None:
    """U(i) of a client whose ``client_update`` returned ``update``, over its training images ``x`` (uint8) and
    labels ``y``; None when the update is a finished result (no starting model to read)."""
    if isinstance(update, LocalTraining):
        model, start = update.model, update.start
    elif isinstance(update, StepwiseTraining) and "model" in update.modules:
        model, start = update.modules["model"], update.start["model"]
    else:
        return None
    n = int(y.shape[0])
    if n == 0:
        return 0.0
    was_training = model.training
    model.eval()  # the losses of the model as it stands: BatchNorm reads its running statistics, nothing updates
    squares = 0.0
    try:
        with torch.no_grad():
            for s in range(0, n, batch_size):
                logits = functional_call(model, dict(start), (to_float(x[s : s + batch_size], mean, std),))
                squares += float(F.cross_entropy(logits.float(), y[s : s + batch_size], reduction="none")
                                 .square().sum())
    finally:
        model.train(was_training)
    return n * math.sqrt(squares / n)
