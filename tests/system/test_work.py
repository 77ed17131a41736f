"""What the simulated clock times: each method's client work (``client_samples``) and server work
(``server_samples``), by hand on tiny cases."""

from __future__ import annotations

import pytest
import torch

from fedray.learning.boundary import batch_plan_rows
from tests.conftest import method_config


def _algo(case: str, **overrides):
    from fedray.data import build_federated_data
    from fedray.runtime.server_core import ServerCore

    cfg = method_config(case, **overrides)
    return ServerCore(cfg, build_federated_data(cfg.data, cfg.seed), torch.device("cpu")).algo


class _Ctx:
    def __init__(self, n: int, cfg, round_: int = 1):
        self.num_samples, self.fed, self.round = n, cfg.federation, round_

    def num_local_steps(self) -> int:
        from fedray.learning.boundary import local_step_count

        return local_step_count(self.fed, self.num_samples)


@pytest.mark.parametrize("n, batch, steps, rows", [(100, 32, 3, 96), (100, 32, 4, 100), (100, 32, 5, 132),
                                                   (10, 32, 3, 30), (64, 32, 2, 64)])
def test_the_rows_of_a_batch_plan(n, batch, steps, rows):
    """Passes over the data in batches, each pass ending on a short one (ClientContext.batch_plan)."""
    assert batch_plan_rows(n, batch, steps) == rows


def test_the_rows_counted_are_those_the_batch_plan_draws():
    from fedray.learning.boundary import ClientContext, DataSpec

    cfg = method_config("fedavg", federation__local_steps=7, federation__batch_size=16)
    ctx = ClientContext(client_id=0, round=1, seed=3, x=torch.zeros(37, 1, 4, 4, dtype=torch.uint8),
                        y=torch.zeros(37, dtype=torch.int64), spec=DataSpec((1, 4, 4), 10, 1, (0.0,), (1.0,)), fed=cfg.federation, device=torch.device("cpu"),
                        modules=None)
    assert sum(len(i) for i in ctx.batch_plan().index) == batch_plan_rows(37, 16, 7) == 2 * 37 + 16


def test_averaging_times_only_the_batches_and_no_server_work():
    algo = _algo("fedavg")
    ctx = _Ctx(50, algo.cfg)
    assert algo.client_samples(ctx) == batch_plan_rows(50, 16, 4) and algo.server_samples(3) == 0


def test_dafkd_times_a_generated_batch_for_d_and_one_for_g_in_its_adversarial_rounds():
    algo = _algo("dafkd", algorithm__disc_train_rounds=2, algorithm__gen_train_rounds=1)
    data = batch_plan_rows(50, 16, 4)
    assert algo.client_samples(_Ctx(50, algo.cfg, 1)) == 3 * data
    assert algo.client_samples(_Ctx(50, algo.cfg, 2)) == 2 * data
    assert algo.client_samples(_Ctx(50, algo.cfg, 3)) == data
    p = algo.params  # 32 generated samples labelled by 3 uploads and the generator, 2 steps of 64
    assert algo.server_samples(3) == p.distill_samples * 4 + p.distill_steps * p.distill_batch_size == 32 * 4 + 2 * 64


def test_the_generators_of_fedkf_and_fedgen_and_fedcds_shared_batch_are_timed():
    data = batch_plan_rows(50, 16, 4)
    fedkf = _algo("fedkf", algorithm__generator_batch_size=5)
    assert fedkf.client_samples(_Ctx(50, fedkf.cfg)) == data + 4 * 5
    fedgen = _algo("fedgen")
    assert fedgen.client_samples(_Ctx(50, fedgen.cfg)) == data + 4 * 8
    assert fedgen.server_samples(2) == 3 * 16 * 3  # gen_steps x batch x (generator + 2 heads)
    fedcd = _algo("fedcd", algorithm__shared_batch=7)
    assert fedcd.client_samples(_Ctx(50, fedcd.cfg)) == batch_plan_rows(50, 17, 4) + 7


def test_server_distillation_scales_with_the_uploads_that_arrived():
    feddf = _algo("feddf", algorithm__distill_epochs=2.0)
    n = len(feddf.server_data.x)
    assert n == 100 and feddf.server_samples(3) == 2 * n * 4 and feddf.server_samples(1) == 2 * n * 2
    fedd3a = _algo("fedd3a")
    assert fedd3a.server_samples(2) == int(fedd3a.params.distill_epochs * n) * 3
    fedftg = _algo("fedftg", algorithm__batch_size=10)
    assert fedftg.server_samples(3) == 2 * 10 * (1 * 3 + 5)  # iterations x batch x (teachers + student steps)
