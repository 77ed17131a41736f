"""FedKF's AMP / FM / WLP and rounds-to-target, on small examples whose figures are worked out by hand."""

import math

import numpy as np
import pytest

from fedray.evaluation import client_metrics, rounds_to_target


def _metrics(correct, total):
    return client_metrics(np.asarray(correct), np.asarray(total))


def test_amp_fm_wlp_of_three_clients():
    # accuracies 3/4 = 0.75, 1/2 = 0.5, 4/8 = 0.5
    m = _metrics([3, 1, 4], [4, 2, 8])
    # AMP = total correct / total samples = (3 + 1 + 4) / (4 + 2 + 8) = 8/14, not the mean accuracy 7/12
    assert m["eval/amp"] == pytest.approx(8 / 14)
    # FM = population variance: mean 7/12; deviations 1/6, -1/12, -1/12; squares 4/144 + 1/144 + 1/144
    # = 6/144 = 1/24; divided by 3 clients (not 2) = 1/72
    assert m["eval/fm"] == pytest.approx(1 / 72)
    assert m["eval/fm"] != pytest.approx(1 / 48)  # the sample variance (ddof=1) would be 1/24 / 2
    assert m["eval/wlp"] == 0.5


def test_fedkf_table_ii_example():
    # FedKF's example: accuracies 0.6 / 0.7 / 0.8 give FM = (0.01 + 0 + 0.01) / 3 = 0.00667
    m = _metrics([6, 7, 8], [10, 10, 10])
    assert m["eval/amp"] == pytest.approx(21 / 30)
    assert m["eval/fm"] == pytest.approx(0.02 / 3)
    assert m["eval/wlp"] == pytest.approx(0.6)


def test_unequal_client_sizes_weight_amp_by_samples():
    # client 0: 1/1 = 1.0 on one sample; client 1: 0/9 = 0.0 on nine
    m = _metrics([1, 0], [1, 9])
    assert m["eval/amp"] == pytest.approx(1 / 10)  # the mean accuracy would be 0.5
    assert m["eval/fm"] == pytest.approx(0.25)  # mean 0.5, squared deviations 0.25 and 0.25
    assert m["eval/wlp"] == 0.0


def test_a_client_without_test_samples_counts_for_amp_only():
    # client 1 has no test sample: no accuracy, so it is neither the worst client nor part of the spread
    m = _metrics([3, 0, 1], [4, 0, 2])
    assert m["eval/amp"] == pytest.approx(4 / 6)
    # accuracies 0.75 and 0.5: mean 0.625, squared deviations 1/64 each, population variance 1/64
    assert m["eval/fm"] == pytest.approx(1 / 64)
    assert m["eval/wlp"] == 0.5  # not 0 from the empty client


def test_counts_as_floats_give_the_same_figures():
    # The evaluator counts correct predictions with a weighted bincount, i.e. as floats.
    assert _metrics([3.0, 1.0, 4.0], [4, 2, 8]) == pytest.approx(_metrics([3, 1, 4], [4, 2, 8]))


def test_one_client_has_no_spread():
    m = _metrics([2], [5])
    assert m == pytest.approx({"eval/amp": 0.4, "eval/fm": 0.0, "eval/wlp": 0.4})


def test_no_client_with_test_samples_has_no_fm_or_wlp():
    m = _metrics([0, 0], [0, 0])
    assert math.isnan(m["eval/fm"]) and math.isnan(m["eval/wlp"])


def test_rounds_to_target():
    rounds = [1, 2, 3, 4, 5]
    values = [None, 0.4, math.nan, 0.8, 0.9]  # round 1 not evaluated, round 3 undefined
    assert rounds_to_target(rounds, values, 0.5) == 4
    assert rounds_to_target(rounds, values, 0.4) == 2  # reaching the target counts
    assert rounds_to_target(rounds, values, 0.85) == 5
    assert rounds_to_target(rounds, values, 0.95) is None  # never reached
    assert rounds_to_target([2, 4], [np.float64("nan"), np.float64(0.6)], 0.5) == 4
    assert rounds_to_target([], [], 0.5) is None


def test_evaluator_reports_each_domains_accuracy_on_multi_domain_data():
    """eval/acc_<domain>: the global model on each client domain's share of the global test set; their
    size-weighted mean is eval/accuracy. A model that predicts class 0 is right exactly on the 0 labels."""
    import torch

    from fedray.data.federated import FederatedData
    from fedray.evaluation import Evaluator

    class Zero(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.b = torch.nn.Parameter(torch.tensor([1.0, 0.0]))

        def forward(self, x):
            return self.b.expand(x.shape[0], 2)

    test_y = np.array([0, 0, 1, 1, 0, 1, 1, 1, 1, 1])  # domain "a": 4 images (2 zeros); "c": 6 (1 zero)
    data = FederatedData(
        dataset="toy", train_x=np.zeros((4, 1, 2, 2), np.uint8), train_y=np.array([0, 1, 0, 1]),
        test_x=np.zeros((10, 1, 2, 2), np.uint8), test_y=test_y, client_train=[np.array([0, 1]), np.array([2, 3])],
        client_test=[np.array([0]), np.array([2])], num_classes=2, mean=(0.5,), std=(0.5,),
        domains=("a", "b", "c"), test_domain=np.array([0] * 4 + [2] * 6))
    model = Zero()
    m = Evaluator(data, model, torch.device("cpu"), batch_size=3).evaluate(model.state_dict())
    assert m["eval/acc_a"] == 0.5 and m["eval/acc_c"] == 1 / 6 and "eval/acc_b" not in m  # b: the server's
    assert m["eval/accuracy"] == pytest.approx((4 * 0.5 + 6 / 6) / 10)


def _plain_eval(model, data):
    """The straightforward computation: every image through ``model`` one at a time, accuracy by hand."""
    import torch

    from fedray.data.federated import to_float

    def preds(x):
        with torch.no_grad():
            return np.array([int(model(to_float(torch.from_numpy(xi[None]), data.mean, data.std)).argmax(1))
                             for xi in x])

    glob = preds(data.test_x) == data.test_y
    correct, total = [], []
    for idx in data.client_test:
        ok = preds(data.train_x[idx]) == data.train_y[idx]
        correct.append(ok.sum())
        total.append(len(idx))
    acc = np.array(correct) / np.array(total)
    want = {"eval/accuracy": glob.mean(), "eval/amp": sum(correct) / sum(total), "eval/fm": acc.var(),
            "eval/wlp": acc.min()}
    if data.num_val:
        want["val/accuracy"] = (preds(data.val_x) == data.val_y).mean()
    return glob, want


@pytest.mark.parametrize("batch_size,cache_bytes,val", [(1024, 1 << 30, 0), (37, 1 << 30, 0), (64, 0, 0),
                                                        (64, 20_000, 0), (37, 1 << 30, 7)])
def test_evaluator_gives_the_figures_of_the_straightforward_computation(tiny, batch_size, cache_bytes, val):
    """Cached float batches, the CPU batch cap and the fixed batches change no prediction: the figures equal
    those of scoring each image alone; with the cache off, partly filled or full, and twice in a row; with a
    validation set (data.val_per_class), val/accuracy is scored on it alone."""
    import torch

    from fedray.data import build_federated_data
    from fedray.evaluation import Evaluator
    from fedray.models import build_model

    cfg = tiny(data__num_clients=5, data__val_per_class=val)
    data = build_federated_data(cfg.data, cfg.seed)
    torch.manual_seed(0)
    model = build_model("lenet5", data.input_shape, data.num_classes).eval()
    _, want = _plain_eval(model, data)
    ev = Evaluator(data, build_model("lenet5", data.input_shape, data.num_classes), torch.device("cpu"), batch_size,
                   cache_bytes=cache_bytes)
    for _ in range(2):
        got = ev.evaluate(model.state_dict())
        assert got == pytest.approx(want, rel=1e-12, abs=0)
    assert ev._cached <= cache_bytes


@pytest.mark.parametrize("val", [0, 5])
def test_spread_evaluation_and_personal_counts_match_the_whole_pass(tiny, val):
    """The Ray runtime's split of a global evaluation (worker k of n scores every n-th fixed batch) puts
    together the per-sample results (correctness, cross-entropy) of the in-process pass, so the per-client
    figures are the same floats; a personalised row counts the same images and sums the same losses."""
    import torch

    from fedray.data import build_federated_data
    from fedray.evaluation import EvalIndex, Evaluator
    from fedray.models import build_model

    cfg = tiny(data__num_clients=4, data__val_per_class=val)
    data = build_federated_data(cfg.data, cfg.seed)
    torch.manual_seed(1)
    model = build_model("lenet5", data.input_shape, data.num_classes).eval()
    ev = Evaluator(data, model, torch.device("cpu"), 50)
    whole = np.concatenate(ev.correct(model, ev.chunks()))
    whole_loss = np.concatenate([ce for _, ce in ev.score(model, ev.chunks())])
    index = EvalIndex(data)
    _, in_process = ev.evaluation(model.state_dict())
    for parts in (1, 2, 3):
        ok, loss = np.zeros(index.size, bool), np.zeros(index.size, np.float32)
        for k in range(parts):
            ranges = ev.chunks()[k::parts]
            for (s, e), (o, ce) in zip(ranges, ev.score(model, ranges)):
                ok[s:e], loss[s:e] = o, ce
        assert (ok == whole).all() and index.metrics(ok) == ev.evaluate(model.state_dict())
        spread = index.client_scores(ok, loss)
        for field in ("client", "correct", "samples", "loss_sum"):
            assert np.array_equal(getattr(spread, field), getattr(in_process, field)), field
    glob, want = _plain_eval(model, data)
    assert index.metrics(whole).get("val/accuracy") == want.get("val/accuracy")
    for cid, idx in enumerate(data.client_test):
        (own_c, own_n, glob_c, glob_n, val_c, val_n), own_loss = ev.personal_scores(model, cid)
        lo = index.local_start[cid]
        assert (own_c, own_n) == (int(whole[lo : lo + len(idx)].sum()), len(idx))
        # batched otherwise (its own split alone): the same losses to float rounding
        assert own_loss == pytest.approx(in_process.loss_sum[cid], rel=1e-6)
        assert own_loss == pytest.approx(whole_loss[lo : lo + len(idx)].astype(np.float64).sum(), rel=1e-6)
        assert (glob_c, glob_n) == (int(glob.sum()), len(glob))
        assert (val_c, val_n) == (int(whole[index.num_test : index.val_stop].sum()), 10 * val)


def test_the_workers_parts_of_an_evaluation_merged_give_the_servers_figures(tiny):
    """What the Ray runtime does, in process: the server's models to score (the global one, OCA, and ACA,
    which differs), worker k of 2 scoring every 2nd fixed batch of each (ClientWorkerCore.evaluate_global), the parts
    merged (EvalIndex.merged): the same eval/* and per-client figures as the server scoring them itself."""
    import torch

    from fedray.data import build_federated_data
    from fedray.runtime.local import LocalRuntime
    from fedray.runtime.server_core import report_eval

    cfg = tiny(data__num_clients=4, algorithm__report_model="oca", federation__eval_batch_size=64)
    rt = LocalRuntime(cfg, build_federated_data(cfg.data, cfg.seed))
    try:
        torch.manual_seed(2)
        state = rt.server.state
        state.weights = {k: v + 0.3 * torch.randn_like(v) if v.is_floating_point() else v
                         for k, v in state.weights.items()}
        models, report = rt.server.eval_models()
        assert sorted(models) == ["", "aca"]  # the global model is OCA (reported): scored once
        parts = [rt.worker.evaluate_global(models, k, 2) for k in range(2)]
        chunks = rt.server.evaluator.chunks()
        assert len(chunks) > 4 and [len(p[""]) for p in parts] == [len(chunks[0::2]), len(chunks[1::2])]
        assert all(ce is None for p in parts for *_, ce in p["aca"]) and all(ce is not None for p in parts
                                                                                for *_, ce in p[""])
        scored, clients = rt.server.evaluator.index.merged(parts)
        want, want_clients = rt.server.evaluation()
        assert report_eval(scored, report) == want and scored["aca"] != scored[""]
        for field in ("client", "correct", "samples", "loss_sum"):
            assert np.array_equal(getattr(clients, field), getattr(want_clients, field)), field
    finally:
        rt.close()


@pytest.mark.parametrize("name,channels_last", [("lenet5", True), ("resnet8_bn", True), ("resnet8", False),
                                                ("mlp", False)])
def test_evaluation_models_take_the_faster_layout_on_a_cpu_and_predict_the_same(tiny, name, channels_last):
    """``eval_layout``: channels-last on a CPU for convolutional models without GroupNorm, kept through
    ``load_state_dict``; the figures are those of the model as built, scored image by image; a GPU's
    evaluation model stays as built."""
    import torch

    from fedray.data import build_federated_data
    from fedray.evaluation import Evaluator, eval_layout
    from fedray.models import build_model

    def last_conv(m):  # one whose layouts differ (a 1x1 or one-channel kernel is both)
        return [p for p in m.parameters() if p.dim() == 4 and p.shape[1] > 1 and p.shape[2] > 1][-1:]

    cfg = tiny(data__num_clients=4)
    data = build_federated_data(cfg.data, cfg.seed)
    torch.manual_seed(2)
    model = build_model(name, data.input_shape, data.num_classes).eval()
    for bn in (m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)):  # statistics that matter
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
    fast = eval_layout(build_model(name, data.input_shape, data.num_classes), torch.device("cpu"))
    _, want = _plain_eval(model, data)
    assert Evaluator(data, fast, torch.device("cpu"), 64).evaluate(model.state_dict()) == pytest.approx(want)
    assert [w.is_contiguous(memory_format=torch.channels_last) for w in last_conv(fast)] == [channels_last] * len(
        last_conv(fast))
    assert len(last_conv(fast)) == (name != "mlp")
    built = build_model(name, data.input_shape, data.num_classes)
    assert eval_layout(built, torch.device("cuda")) is built
    assert all(p.is_contiguous() for p in built.parameters())
