"""Partition views: FedKF Fig. 4's client-by-label bubble plot and a per-client summary table.

FedKF (paper 001) Fig. 4: x = client id, y = class label, "the size of scattered points is proportional
to the number of training samples for a label available on the client". We plot the clients' training
splits (the 80% part), as the caption says.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedray.data.federated import FederatedData

MAX_PLOTTED_CLIENTS = 100  # beyond this the bubbles are unreadable


def _train_label_counts(fd: FederatedData, clients: int) -> np.ndarray:
    counts = np.zeros((clients, fd.num_classes), dtype=np.int64)
    for k in range(clients):
        counts[k] = np.bincount(fd.train_y[fd.client_train[k]], minlength=fd.num_classes)
    return counts


def plot_partition(fd: FederatedData, path: str | Path, title: str | None = None) -> Path:
    """Write the client-by-label bubble plot (bubble area proportional to the count) to ``path``.

    With more than 100 clients only the first 100 are drawn, and the title says so.
    """
    # The Agg canvas directly, not pyplot: no display, no global backend switch, no figure leaks.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    shown = min(fd.num_clients, MAX_PLOTTED_CLIENTS)
    counts = _train_label_counts(fd, shown)
    kk, cc = np.nonzero(counts)
    vals = counts[kk, cc]
    max_area = 400.0 if shown <= 30 else 200.0 if fd.num_classes <= 20 else 60.0
    sizes = vals / max(int(counts.max(initial=0)), 1) * max_area  # area (points^2) proportional to count

    width = min(4.0 + 0.18 * shown, 22.0)
    height = min(2.5 + 0.3 * fd.num_classes, 16.0)
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.scatter(kk, cc, s=sizes, alpha=0.6, color="tab:blue", edgecolors="navy", linewidths=0.4)
    ax.set_xlabel("client id")
    ax.set_ylabel("class label")
    ax.set_xlim(-1, shown)
    ax.set_ylim(-1, fd.num_classes)
    if shown <= 40:
        ax.set_xticks(range(shown))
    if fd.num_classes <= 20:
        ax.set_yticks(range(fd.num_classes))
    ax.grid(True, alpha=0.25)
    text = title or f"{fd.dataset}: training samples per client and label"
    if shown < fd.num_clients:
        text += f" (first {shown} of {fd.num_clients} clients)"
    ax.set_title(text, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def partition_summary(fd: FederatedData) -> list[dict]:
    """One row per client for the CLI's table.

    Keys: ``client``, ``train``, ``test`` (sample counts), ``label_counts`` (list over classes, train +
    test), ``num_labels`` (labels present), ``dominant_label`` and ``dominant_share`` (its fraction of
    the client's samples; 1/num_classes when perfectly balanced, 1.0 when a client holds one label).
    """
    counts = fd.label_counts()
    train, test = fd.client_sizes(), fd.client_test_sizes()
    rows = []
    for k in range(fd.num_clients):
        c = counts[k]
        total = int(c.sum())
        dom = int(c.argmax()) if total else -1
        rows.append(
            {
                "client": k,
                "train": int(train[k]),
                "test": int(test[k]),
                "label_counts": [int(v) for v in c],
                "num_labels": int(np.count_nonzero(c)),
                "dominant_label": dom,
                "dominant_share": float(c[dom] / total) if total else 0.0,
            }
        )
    return rows
