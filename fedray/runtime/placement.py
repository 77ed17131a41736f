"""How client work is placed on the Ray pool: the pool's size from the cluster's resources, and which
worker trains which client. Pure functions of numbers, so they are tested without a cluster."""

from __future__ import annotations

import math

from fedray.config import ExperimentConfig
from fedray.errors import ResourceError


def client_costs(cfg: ExperimentConfig, input_shape: tuple[int, int, int], num_classes: int,
                 client_sizes) -> list[float]:
    """Each client's estimated work per round: forward FLOPs of its architecture x its local steps. With one
    architecture only the steps tell clients apart, and the FLOPs (whose counter imports torch's compiler
    stack, ~1 s of the driver's start-up) are left out: the costs are the steps."""
    from fedray.learning.boundary import local_step_count
    from fedray.models import forward_flops

    archs = cfg.model.architectures()
    flops = {a: forward_flops(a, input_shape, num_classes) for a in archs} if len(archs) > 1 else {archs[0]: 1}
    return [float(flops[cfg.model.client_architecture(c)] * local_step_count(cfg.federation, int(n)))
            for c, n in enumerate(client_sizes)]


def plan_pool(cfg: ExperimentConfig, resources: dict[str, float], node_resources: list[dict[str, float]]) -> int:
    """Number of client workers: ``runtime.num_workers`` or what the cluster's CPUs/GPUs allow."""
    rt = cfg.runtime
    cpus, gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
    if rt.num_gpus_per_worker > 0 and gpus == 0:
        raise ResourceError("runtime.num_gpus_per_worker", f"is {rt.num_gpus_per_worker} but the Ray cluster "
                            "has no GPU; set runtime.num_gpus_per_worker=0 or add GPU nodes")
    if rt.server_num_gpus > gpus:
        raise ResourceError("runtime.server_num_gpus", f"is {rt.server_num_gpus} but the Ray cluster has "
                            f"{gpus:g} GPU(s); allowed: 0..{gpus:g}")
    biggest = max((n.get("CPU", 0.0) for n in node_resources), default=cpus)
    if rt.num_cpus_per_worker > biggest:
        raise ResourceError("runtime.num_cpus_per_worker", f"is {rt.num_cpus_per_worker:g} but the largest "
                            f"node has {biggest:g} CPUs; allowed: at most {biggest:g}")
    capacity = math.floor((cpus - rt.server_num_cpus) / rt.num_cpus_per_worker + 1e-9)
    if rt.num_gpus_per_worker > 0:
        capacity = min(capacity, math.floor((gpus - rt.server_num_gpus) / rt.num_gpus_per_worker + 1e-9))
    # the server's reservation is part of why workers do not fit: say so, or the arithmetic looks wrong
    server = "".join(f", {v:g} {unit} of them for the server (runtime.server_num_{unit.lower()}s)"
                     for v, unit in ((rt.server_num_cpus, "CPU"), (rt.server_num_gpus, "GPU")) if v > 0)
    if rt.num_workers is not None:
        if rt.num_workers > capacity:
            raise ResourceError("runtime.num_workers", f"{rt.num_workers} workers with "
                                f"{rt.num_cpus_per_worker:g} CPU / {rt.num_gpus_per_worker:g} GPU each do not fit "
                                f"in the cluster ({cpus:g} CPUs, {gpus:g} GPUs{server}); allowed: at most {capacity}, "
                                "or lower runtime.num_cpus_per_worker")
        return rt.num_workers
    if capacity < 1:
        raise ResourceError("runtime.num_cpus_per_worker", f"no client worker fits in the cluster ({cpus:g} CPUs, "
                            f"{gpus:g} GPUs{server}); lower runtime.num_cpus_per_worker / runtime.num_gpus_per_worker")
    return max(1, min(capacity, cfg.federation.clients_per_round))


def deal(client_ids: list[int], cost, num_workers: int) -> list[tuple[int, int]]:
    """(client, worker) in submission order: longest estimated ``cost[client]`` first, each to the
    least-loaded worker (ties: the lower index), so equal costs give client-id order round-robin."""
    load = [0.0] * num_workers
    out = []
    for cid in sorted(client_ids, key=lambda c: (-cost[c], c)):
        w = min(range(num_workers), key=lambda i: (load[i], i))
        load[w] += cost[cid]
        out.append((cid, w))
    return out


def eval_tasks(client_ids: list[int], num_workers: int, max_clients: int) -> list[list[int]]:
    """``client_ids`` cut into evaluation tasks of at most ``max_clients``, a multiple of ``num_workers`` of
    them (when there are enough clients) with sizes differing by at most one, so that dealt round-robin
    every worker gets the same share: 20 clients on 2 workers are 10 + 10, not 16 + 4."""
    n = len(client_ids)
    tasks = num_workers * max(1, -(-n // (num_workers * max_clients)))
    size, extra = divmod(n, tasks)
    out, start = [], 0
    for k in range(tasks):
        stop = start + size + (k < extra)
        if stop > start:
            out.append(list(client_ids[start:stop]))
        start = stop
    return out
