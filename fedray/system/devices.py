"""Each client's device and network as arrays: training samples per second, bandwidth up and down, latency."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedray.seeding import derive_rng
from fedray.system.config import SystemConfig
from fedray.system.fedscale import read_fedscale_devices
from fedray.system.traces import read_device_trace

#: The heterogeneous profile: per quantity, the median and the standard deviation of its natural logarithm (a
#: lognormal across clients, each quantity drawn independently). Sources (docs/system.md has the reasoning):
#: compute, FLASH's on-phone training times of a FEMNIST CNN (Yang et al., WWW 2021: 6, 17 and 56 samples/s on a
#: low-, mid- and high-end phone); bandwidth, FLASH's per-client network speeds (medians 5.2 Mbit/s down and
#: 3.1 up, log spreads 0.48 and 0.70); latency, LTE's ~70 ms median round trip (Huang et al., MobiSys 2012).
HETEROGENEOUS = {
    "compute_sps": (17.0, 0.9),
    "up_mbps": (3.1, 0.70),
    "down_mbps": (5.2, 0.48),
    "latency_ms": (35.0, 0.5),
}


@dataclass
class Devices:
    """Per client (index = client id): samples/s, bytes/s up and down, one-way latency in seconds."""

    compute_sps: np.ndarray
    up_bps: np.ndarray  # bytes per second: Mbit/s x 10^6 / 8
    down_bps: np.ndarray
    latency_s: np.ndarray
    speed_sigma: float = 0.0  # system.speed_sigma: per-round lognormal factors of compute and network speed
    seed: int = 0

    @classmethod
    def build(cls, cfg: SystemConfig, num_clients: int, seed: int) -> "Devices":
        if cfg.devices == "uniform":
            cols = {"compute_sps": cfg.compute_sps, "up_mbps": cfg.up_mbps, "down_mbps": cfg.down_mbps,
                    "latency_ms": cfg.latency_ms}
            cols = {k: np.full(num_clients, float(v)) for k, v in cols.items()}
        elif cfg.devices == "heterogeneous":
            cols = {}
            for name, (median, sigma) in HETEROGENEOUS.items():  # one stream per quantity: adding one moves no other
                cols[name] = median * np.exp(sigma * derive_rng(seed, "devices", name).standard_normal(num_clients))
        elif cfg.devices == "trace":
            cols = read_device_trace("system.trace", cfg.trace, num_clients)
        elif cfg.devices == "fedscale":  # FedScale's profiles converted to these columns (fedscale.py says how)
            cols = read_fedscale_devices("system.trace", cfg.trace, num_clients)
        else:
            raise ValueError(f"no devices to build for system.devices={cfg.devices}")
        return cls(compute_sps=np.asarray(cols["compute_sps"], dtype=np.float64),
                   up_bps=np.asarray(cols["up_mbps"], dtype=np.float64) * 1e6 / 8,
                   down_bps=np.asarray(cols["down_mbps"], dtype=np.float64) * 1e6 / 8,
                   latency_s=np.asarray(cols["latency_ms"], dtype=np.float64) / 1e3,
                   speed_sigma=cfg.speed_sigma, seed=seed)

    def client_time(self, ids: np.ndarray, samples: np.ndarray, bytes_down: np.ndarray,
                    bytes_up: np.ndarray, round_: int | None = None) -> np.ndarray:
        """t_k = latency + bytes_down / down + samples / compute + latency + bytes_up / up, in seconds."""
        p = self.time_parts(ids, samples, bytes_down, bytes_up, round_)
        return p["latency_s"] + p["download_s"] + p["compute_s"] + p["upload_s"]

    def time_parts(self, ids: np.ndarray, samples: np.ndarray, bytes_down: np.ndarray,
                   bytes_up: np.ndarray, round_: int | None = None) -> dict[str, np.ndarray]:
        """t_k's parts: both latencies, the download, the local work, the upload (seconds). With
        ``system.speed_sigma`` the speeds of ``round_`` (:meth:`factors`)."""
        compute, network = self.factors(ids, round_)
        return {"latency_s": 2 * self.latency_s[ids], "download_s": bytes_down / (self.down_bps[ids] * network),
                "compute_s": samples / (self.compute_sps[ids] * compute),
                "upload_s": bytes_up / (self.up_bps[ids] * network)}

    def factors(self, ids: np.ndarray, round_: int | None) -> tuple[np.ndarray | float, np.ndarray | float]:
        """This round's factors of each client's compute and network speed (the network's scales up and down
        alike): exp(sigma z), z ~ N(0, 1) from a stream per (run seed, round, quantity, client), so a client's draw
        does not depend on who else was selected, and a resumed run draws the same. 1 with ``speed_sigma=0``."""
        if not self.speed_sigma or round_ is None:
            return 1.0, 1.0
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        z = np.array([[derive_rng(self.seed, "speeds", int(round_), what, int(c)).standard_normal()
                       for c in ids] for what in ("compute", "network")])
        return tuple(np.exp(self.speed_sigma * z).reshape(2, *np.shape(ids)))
