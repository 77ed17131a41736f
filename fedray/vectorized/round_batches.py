"""A vectorised round's batches (``fedray.vectorized.engine``): every client's batch of a lockstep step in one gather
from the round's data, short batches grouped or padded, and a padded step's other host inputs padded alike."""

from __future__ import annotations

import numpy as np
import torch

from fedray.learning.training import IGNORE_LABEL, StepwiseTraining
from fedray.data.federated import to_device, to_float


class RoundBatches:
    """The lockstep's batches (``StepwiseTraining.batches``), a group of clients' batches of a step in one gather.

    The clients' data are concatenated once a round, and every step's (clients, rows) index is built on the host
    up front and sent to the device in one copy, so a step's batches cost one gather and ``to_float`` instead of
    several ops per client (on a GPU each is a kernel launch the host has to issue). A step's clients are grouped
    by batch length; with ``pad``, the short batches of a step are filled up to its longest with rows labelled
    :data:`IGNORE_LABEL`, which the losses (``paddable``) leave out, so the whole step is one group; with
    ``pad_from``, so they are when more than that share of the steps would split (:attr:`padded` says which).
    """

    def __init__(self, plans: list[StepwiseTraining], device: torch.device, pad: bool, masked_from: float | None = None,
                 pad_from: float | None = None):
        data = [p.batches for p in plans]
        sizes = [len(d.y) for d in data]
        self.mean, self.std = data[0].mean, data[0].std
        self.x = torch.cat([d.x.to(device) for d in data])
        self.y = torch.cat([d.y.to(device) for d in data] + [to_device(torch.tensor([IGNORE_LABEL]), device)])
        # Built with numpy, a few calls per client and step group: host work, cheap next to one op per client
        # and step. Per step and client, the rows of its batch padded to ``width``: padded x rows repeat the
        # step's first row, padded y rows point at the IGNORE_LABEL appended to y.
        steps = np.array([p.steps for p in plans])
        width = max((len(ix) for d, p in zip(data, plans) for ix in d.index[:p.steps]), default=0)
        x_rows = np.zeros((steps.max(initial=0), len(plans), width), dtype=np.int64)
        y_rows = np.full_like(x_rows, len(self.y) - 1)
        lengths = np.zeros(x_rows.shape[:2], dtype=np.int64)
        for i, (d, k, offset) in enumerate(zip(data, steps, np.cumsum([0, *sizes[:-1]]))):
            if k == 0:
                continue
            lens = np.array([len(ix) for ix in d.index[:k]])
            src = np.append(torch.cat(d.index[:k]).numpy() + offset, offset)
            starts = np.cumsum(lens) - lens
            valid = np.arange(width) < lens[:, None]
            rows = src[np.where(valid, starts[:, None] + np.arange(width), starts[:, None])]
            x_rows[:k, i], y_rows[:k, i], lengths[:k, i] = rows, np.where(valid, rows, y_rows[:k, i]), lens
        self.groups: list[dict[int, tuple[int, list[int]]]] = []  # per step: client -> (group, its members)
        # With ``masked_from`` (a CUDA graph's rounds), when more than that share of the steps is split by batch
        # length with every client active: for each such step the block of all clients' rows at its longest
        # length, a short batch's missing rows repeating its first (a masked replay's inputs, see full_step).
        split = {s for s in range(x_rows.shape[0]) if (s < steps).all() and len(np.unique(lengths[s])) > 1}
        self.padded = pad = pad or (pad_from is not None and len(split) > pad_from * x_rows.shape[0])
        masked = not pad and masked_from is not None and len(split) > masked_from * x_rows.shape[0]
        self.full: dict[int, int] = {}
        blocks: list[np.ndarray] = []
        for s in range(x_rows.shape[0]):
            active = np.flatnonzero(s < steps)
            keys = np.zeros_like(active) if pad else lengths[s, active]
            step: dict[int, tuple[int, list[int]]] = {}
            for key in np.unique(keys):
                members = active[keys == key]
                w = int(lengths[s, members].max())
                step.update((int(i), (len(blocks), members.tolist())) for i in members)
                blocks.append(np.stack([x_rows[s, members, :w], y_rows[s, members, :w]]))
            if masked and s in split:
                # y rows as x's: real labels where a short batch repeats rows (a loss may index by the label)
                self.full[s] = len(blocks)
                blocks.append(np.stack([x_rows[s, :, :int(lengths[s].max())]] * 2))
            self.groups.append(step)
        # every step's index in one copy to the device, then a view per group
        flat = to_device(torch.from_numpy(np.concatenate([b.ravel() for b in blocks])), device) if blocks else None
        self.index = [v.view(b.shape) for v, b in zip(flat.split([b.size for b in blocks]), blocks)] if blocks else []

    def group_of(self, step: int, client: int) -> int:
        return self.groups[step][client][0]

    def inputs(self, step: int, members: list[int]) -> dict[str, torch.Tensor]:
        """``x`` (normalised) and ``y`` of ``members``' batches of ``step`` (all in one group of it), stacked."""
        group, everyone = self.groups[step][members[0]]
        index = self.index[group]
        if members != everyone:  # the group split further by the step's flags: its rows of the index
            index = index[:, to_device(torch.tensor([everyone.index(i) for i in members]), index.device)]
        return self.gather(index)

    def gather(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        """The batches of ``index`` ((2, clients, rows): x rows then y rows, as ``self.index[group]``)."""
        return {"x": to_float(self.x[index[0]], self.mean, self.std), "y": self.y[index[1]]}

    def whole_step(self, step: int, n: int) -> torch.Tensor | None:
        """The index of ``step`` when it is one group of all ``n`` clients (else None)."""
        group, everyone = self.groups[step].get(0, (None, []))
        return self.index[group] if len(everyone) == n else None

    def full_step(self, step: int) -> torch.Tensor | None:
        """The index of every client's rows at ``step``'s longest batch when the step is split by batch length
        with every client active (else None); a short batch's rows beyond its end repeat its first row."""
        return self.index[self.full[step]] if step in self.full else None

    def width(self, group: int) -> int:
        """The rows of a batch of ``group`` (a group id of :attr:`groups`)."""
        return self.index[group].shape[2]


def pad_host_inputs(step_inputs: list[tuple[dict, tuple[bool, ...]] | None]) -> list[tuple[dict, tuple[bool, ...]] | None]:
    """A padded step's host inputs (DaFKD's noise for a batch's generated samples, whose count follows the batch's):
    each zero-padded along its first dimension to the step's longest, so that the step's clients stay one group.
    A ``paddable`` loss counts the drawn rows only (it knows how many from its batch's real rows)."""
    longest: dict[str, int] = {}
    for item in step_inputs:
        for k, v in (item[0] if item is not None else {}).items():
            longest[k] = max(longest.get(k, 0), v.shape[0] if v.dim() else 0)
    return [None if item is None else
            ({k: v if not v.dim() or v.shape[0] == longest[k]
              else torch.cat([v, v.new_zeros((longest[k] - v.shape[0], *v.shape[1:]))]) for k, v in item[0].items()},
             item[1]) for item in step_inputs]
