"""Partition views: FedKF Fig. 4's client-by-label bubble plot and a per-client summary table.

FedKF (paper 001) Fig. 4: x = client id, y = class label, "the size of scattered points is proportional
to the number of training samples for a label available on the client". We plot the clients' training
splits (the 80% part), as the caption says.

For a multi-domain dataset (FedD3A's cross-silo and cross-device settings, Sec. 4) the plot also shows
where each client's data comes from: a band above the bubbles stacks each client's share of training
samples per domain, bubbles take the colour of the client's domain (grey when it holds several), and a
legend names the domains. Single-domain data gets the plain plot.
"""

from __future__ import annotations

import textwrap

from pathlib import Path

import numpy as np

from fedray.config import DataConfig
from fedray.data.federated import FederatedData

MAX_PLOTTED_CLIENTS = 100  # beyond this the bubbles are unreadable


def partition_label(data: DataConfig) -> str:
    """The partition with the settings it uses, for titles: alpha only where a Dirichlet draw reads it."""
    if data.partition == "dirichlet":
        return f"dirichlet (alpha={data.alpha:g})"
    if data.partition == "domain_dirichlet":
        return f"domain_dirichlet (alpha={data.alpha:g}, {data.clients_per_domain} clients per domain)"
    if data.partition == "shards":
        return f"shards ({data.shards_per_client} per client)"
    return data.partition


def _train_label_counts(fd: FederatedData, clients: int) -> np.ndarray:
    counts = np.zeros((clients, fd.num_classes), dtype=np.int64)
    for k in range(clients):
        counts[k] = np.bincount(fd.train_y[fd.client_train[k]], minlength=fd.num_classes)
    return counts


def _domain_shares(fd: FederatedData, clients: int) -> np.ndarray:
    """(clients, num_domains) fraction of each client's training samples from each domain."""
    shares = np.zeros((clients, len(fd.domains)))
    for k in range(clients):
        c = np.bincount(fd.train_domain[fd.client_train[k]], minlength=len(fd.domains))
        shares[k] = c / max(int(c.sum()), 1)
    return shares


def plot_partition(fd: FederatedData, path: str | Path, title: str | None = None) -> Path:
    """Write the client-by-label bubble plot (bubble area proportional to the count) to ``path``.

    With more than 100 clients only the first 100 are drawn, and the title says so. Multi-domain data
    adds the domain band, domain colours and legend (module docstring).
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
    has_domains = bool(fd.domains) and fd.train_domain is not None and fd.client_domain is not None
    # Constrained layout keeps the domain legend (outside the axes) in the picture; tight_layout cannot.
    fig = Figure(figsize=(width + (1.6 if has_domains else 0.0), height + (0.8 if has_domains else 0.0)),
                 dpi=100, layout="constrained" if has_domains else None)
    FigureCanvasAgg(fig)
    if has_domains:
        from matplotlib.patches import Patch

        band, ax = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [1, 7]})
        palette = [_domain_color(i) for i in range(len(fd.domains))]
        shares = _domain_shares(fd, shown)
        bottom = np.zeros(shown)
        for d, name in enumerate(fd.domains):
            if shares[:, d].any():
                band.bar(range(shown), shares[:, d], bottom=bottom, width=1.0, color=palette[d], label=name)
            bottom += shares[:, d]
        band.set_ylim(0, 1)
        band.set_yticks([])
        band.set_ylabel("domain", fontsize=8, rotation=0, ha="right", va="center")
        handles, _ = band.get_legend_handles_labels()
        if fd.server is not None and fd.server.domain in fd.domains:
            d = fd.domains.index(fd.server.domain)
            handles.append(Patch(facecolor=palette[d], hatch="//", label=f"{fd.server.domain} (server)"))
        if (fd.client_domain[:shown] < 0).any():
            handles.append(Patch(facecolor="tab:gray", label="mixed clients"))
        band.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        band.tick_params(axis="x", labelbottom=False)
        owner = fd.client_domain[:shown]
        colors = [palette[owner[k]] if owner[k] >= 0 else "tab:gray" for k in kk]
        ax.scatter(kk, cc, s=sizes, alpha=0.6, color=colors, edgecolors="black", linewidths=0.3)
        if (owner >= 0).all():
            # Domain-major clients (domain partitions): a line between consecutive domains' groups.
            for k in np.flatnonzero(owner[1:] != owner[:-1]):
                ax.axvline(k + 0.5, color="0.6", linewidth=0.6, linestyle="--")
        title_ax = band
    else:
        ax = fig.add_subplot(1, 1, 1)
        ax.scatter(kk, cc, s=sizes, alpha=0.6, color="tab:blue", edgecolors="navy", linewidths=0.4)
        title_ax = ax
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
    # Long titles (server data, domains) are wrapped to the figure's width rather than clipped.
    text = textwrap.fill(text, width=max(40, int(fig.get_figwidth() * 13)))
    if has_domains:  # a figure title: the band's axes title would be clipped by the legend column
        fig.suptitle(text, fontsize=10)
    else:
        title_ax.set_title(text, fontsize=10)
    if not has_domains:
        fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def _domain_color(i: int):
    """The i-th domain colour (matplotlib's tab10 cycle)."""
    from matplotlib import colormaps

    return colormaps["tab10"](i % 10)


def partition_summary(fd: FederatedData) -> list[dict]:
    """One row per client for the CLI's table.

    Keys: ``client``, ``train``, ``test`` (sample counts), ``label_counts`` (list over classes, train +
    test), ``num_labels`` (labels present), ``dominant_label`` and ``dominant_share`` (its fraction of
    the client's samples; 1/num_classes when perfectly balanced, 1.0 when a client holds one label),
    ``domain`` (the client's domain name, "mixed" when its samples span domains, None for single-domain
    data).
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
                "domain": fd.client_domain_name(k),
            }
        )
    return rows
