"""Each method's client loss, by hand, on one client's first batch at the round's starting weights: every term's
target, teacher, direction (teacher first), temperature and weight is read off the paper's equation and computed
here from the same modules and inputs the plan uses. (FedProx's and FedGKD's terms: test_fedavg_fedprox.py and
test_qffl_fedgkd.py; FedKF's generator terms: test_fedkf.py; DaFKD's adversarial ones: test_dafkd.py.)"""

import pytest
import torch
import torch.nn.functional as F

from fedray.models.base import frozen_bn_stats
from tests.conftest import METHOD_CASES
from tests.methods.plans import client_step


def _kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temp: float = 1.0) -> torch.Tensor:
    """KL(softmax(t / T) || softmax(s / T)) T^2, the mean over rows, written out."""
    p = F.softmax(teacher_logits / temp, dim=1)
    return (p * (p.log() - F.log_softmax(student_logits / temp, dim=1))).sum(1).mean() * temp**2


def _same(got: torch.Tensor, want: torch.Tensor):
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("case", ["fedavg", "qffl", "local", "feddf", "fedd3a", "fedftg"])
def test_a_plain_local_loss_is_the_cross_entropy_of_the_batch(case):
    """FedAvg's local objective, which q-FFL's, the isolated baseline's (on the client's own model), FedDF's,
    FedD3A's (homogeneous clients) and FedFTG's clients (base=fedavg) train on: CE(f(x), y), the batch mean."""
    with client_step(**{**METHOD_CASES[case], "algorithm__name": case}) as s:
        loss, _ = s.local_loss(moved=0.01)
        _same(loss, F.cross_entropy(s.plan.model(s.x), s.y))


def test_fedcds_loss_is_eq2_ce_plus_lambda_times_eq1_on_the_teacher_batch():
    """Eq. 2: CE(f(x), y) + lambda KD(f(x_shared), teacher) with Eq. 1's KD at temperature T, the teacher being last
    round's Eq. 4 ensemble of logits on the shared validation images."""
    with client_step(2, **{**METHOD_CASES["fedcd"], "algorithm__name": "fedcd", "algorithm__lambda_kd": 0.7,
                           "algorithm__temperature": 3.0}) as s:
        assert s.payload.teacher is not None
        loss, figures = s.local_loss()
        m = s.plan.model
        shared = s.rt.worker.algo.shared_images(s.ctx, s.payload.teacher_idx)
        kd = _kl(s.payload.teacher, m(shared), 3.0)
        _same(figures["train/kd_loss"], kd)
        _same(loss, F.cross_entropy(m(s.x), s.y) + 0.7 * kd)


def test_feddistills_loss_is_ce_plus_lambda_kd_to_the_global_logits_of_each_samples_label():
    """FedDistill: CE + lambda KL(softmax(z_bar[y] / T) || softmax(f(x) / T)) T^2, over the samples whose label some
    client reported (z_bar: the server's per-label mean of the uploaded logits)."""
    with client_step(2, **{**METHOD_CASES["feddistill"], "algorithm__name": "feddistill", "algorithm__lambda_kd": 0.6,
                           "algorithm__temperature": 2.0}) as s:
        table, present = s.payload.logits, s.payload.present
        assert present.any() and s.payload.logits is not None
        loss, _ = s.local_loss()
        z = s.plan.model(s.x)
        keep = present[s.y]
        kd = _kl(table[s.y][keep], z[keep], 2.0)
        _same(loss, F.cross_entropy(z, s.y) + 0.6 * kd)


def test_fedgens_client_loss_is_ce_plus_the_generated_features_ce_plus_the_latent_kl():
    """FedGen's Eq. 5-6 as the authors weigh them: CE(f(x), y) + alpha_t (B_hat / B) CE(h(G(eps, y_hat)), y_hat)
    + beta_t KL(softmax(h(G(eps', y))) || softmax(f(x))), h the client's own head, alpha_t = alpha decay^(t-1)."""
    params = {"algorithm__alpha": 3.0, "algorithm__beta": 2.0, "algorithm__decay": 0.5}
    with client_step(2, **{**METHOD_CASES["fedgen"], "algorithm__name": "fedgen", **params}) as s:
        loss, figures, inp = s.update_loss()
        model = s.plan.modules["model"]
        logits = model(s.x)
        ratio = inp["f_hat"].shape[0] / s.ctx.fed.batch_size
        gen_ce = F.cross_entropy(model.head(inp["f_hat"]), inp["y_hat"])
        kl = _kl(model.head(inp["f_real"]), logits)
        _same(figures["train/gen_ce"], gen_ce)
        _same(figures["train/gen_kl"], kl)
        _same(loss, F.cross_entropy(logits, s.y) + 3.0 * 0.5 * ratio * gen_ce + 2.0 * 0.5 * kl)


def test_fedd3as_heterogeneous_client_loss_is_ce_plus_kl_from_the_global_teacher():
    """FedD3A's heterogeneous clients (Fig. 6): CE(own(x), y) + w KL(softmax(global(x) / T) || softmax(own(x) / T))
    T^2, the received global model the teacher, in eval mode."""
    case = {**METHOD_CASES["fedd3a-heterogeneous"], "algorithm__name": "fedd3a",
            "algorithm__hetero_kd_weight": 0.4, "algorithm__temperature": 2.0}
    with client_step(**case) as s:
        loss, _ = s.local_loss()
        teacher = s.ctx.modules.model
        teacher.load_state_dict(s.payload.weights)
        teacher.eval()
        own = s.plan.model
        with torch.no_grad():
            t = teacher(s.x)
        _same(loss, F.cross_entropy(own(s.x), s.y) + 0.4 * _kl(t, own(s.x), 2.0))


def test_fedkfs_student_loss_is_ce_plus_gamma_kl_from_the_cached_teacher_on_generated_samples():
    """FedKF Eq. 6-8: CE(w_k; x, y) + gamma KL(h(w_hat; x_hat) || h(w_k; x_hat)), x_hat = g(theta_k; z), the teacher
    w_hat the OCA model sent down."""
    with client_step(2, algorithm__name="fedkf", algorithm__gamma=0.8, federation__local_steps=2) as s:
        loss, figures, inp = s.update_loss(0)
        mods = s.plan.modules
        teacher = s.ctx.modules.teacher
        teacher.load_state_dict(s.payload.teacher)
        teacher.eval()
        with torch.no_grad(), frozen_bn_stats(mods["generator"]):
            x_hat = mods["generator"](inp["z"])
            t = teacher(x_hat)
        kl = _kl(t, mods["model"](x_hat))
        _same(figures["train/kl"], kl)
        _same(loss, F.cross_entropy(mods["model"](s.x), s.y) + 0.8 * kl)


def test_dafkds_classifier_and_discriminator_loss_is_eq9_ce_plus_eq2():
    """Eq. 9: CE(w; x, y) + Eq. 2's BCE over the real batch (target 1) and as many generated samples (target 0),
    the discriminator the head on the classifier's features, the generator not trained by it."""
    with client_step(**{**METHOD_CASES["dafkd"], "algorithm__name": "dafkd"}) as s:
        loss, figures, inp = s.update_loss(0)
        mods = s.plan.modules
        feats = mods["model"].features(s.x)
        with torch.no_grad():
            fake = mods["generator"](inp["z_fake"], inp.get("labels_fake"))
        with frozen_bn_stats(mods["model"]):
            d_fake = mods["disc"](mods["model"].features(fake)).squeeze(1)
        d_real = mods["disc"](feats).squeeze(1)
        bce = -(F.logsigmoid(d_real).sum() + F.logsigmoid(-d_fake).sum()) / (len(d_real) + len(d_fake))
        _same(figures["adv"], bce)
        _same(loss, F.cross_entropy(mods["model"].head(feats), s.y) + bce)
        loss.backward()
        assert all(p.grad is None for p in mods["generator"].parameters())  # Eq. 9 does not train G


def test_fedgens_client_loss_on_a_padded_batch_is_the_loss_on_its_real_rows():
    """A BatchNorm model's batch padded with rows labelled IGNORE_LABEL (the batched runtime's short batches): every
    term, and the BatchNorm statistics the logits come from, read the real rows only (BatchNorm made row-aware, as
    the batched runtime makes it)."""
    from fedray.learning.training import IGNORE_LABEL
    from fedray.models.base import row_masked_batchnorm

    case = {**METHOD_CASES["fedgen"], "algorithm__name": "fedgen", "model__name": "resnet8_bn"}
    with client_step(2, **case) as s:
        real, _, inp = s.update_loss()
        pad = 5
        padded = {**inp, "x": torch.cat([inp["x"], torch.randn(pad, *inp["x"].shape[1:])]),
                  "y": torch.cat([inp["y"], torch.full((pad,), IGNORE_LABEL)]),
                  "f_real": torch.cat([inp["f_real"], torch.randn(pad, inp["f_real"].shape[1])])}
        for name, weights in s.plan.start.items():
            s.plan.modules[name].load_state_dict(weights)
        with row_masked_batchnorm(s.plan.modules["model"]):
            loss, _ = s.plan.updates[0].loss(s.plan.modules, padded, s.plan.inputs(0)[1])
        _same(loss, real)
