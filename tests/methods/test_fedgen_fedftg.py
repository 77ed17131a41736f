"""FedGen and FedFTG: each reduces to its base exactly when its distillation is switched off, the generators fit every
model of the zoo, the label weights are shares, the label counts are counted, bad parameters are refused, and the
batched clients of FedGen's regularised rounds give the sequential round."""

import pytest
import torch
import torch.nn.functional as F

from fedray.errors import ConfigError
from fedray.learning.data_free import diversity_loss, label_counts, label_shares
from fedray.methods import load_experiment
from fedray.methods.fedftg import proportional_labels
from fedray.models import MODEL_NAMES, build_model
from fedray.models.conditional import FeatureGenerator, ImageGenerator
from fedray.simulation import run_experiment
from tests.conftest import method_overrides, tiny_config
from tests.vectorized.test_vectorized import _assert_same_weights, _one_round

ROUNDS = 3


def _weights(**kw) -> dict[str, torch.Tensor]:
    return _one_round(False, rounds=ROUNDS, **kw)[0][0]


def _case(name: str, **kw) -> dict:
    return {**method_overrides(name), **kw}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def fedavg_weights():
    return _weights(algorithm__name="fedavg")


def test_fedgen_without_its_terms_trains_fedavg_exactly(fedavg_weights):
    # alpha = beta = 0: the generator is trained, sent and run on every client from round 2, its terms weighted 0;
    # its noise comes from a stream of its own, so the clients' batches and steps are FedAvg's, bit for bit
    off = _weights(**_case("fedgen", algorithm__alpha=0.0, algorithm__beta=0.0))
    assert _same(off, fedavg_weights)
    for on in ({"algorithm__alpha": 1.0, "algorithm__beta": 0.0}, {"algorithm__alpha": 0.0, "algorithm__beta": 1.0}):
        assert not _same(_weights(**_case("fedgen", **on)), fedavg_weights), on  # each term acts


def test_fedftg_without_server_iterations_is_its_base_exactly(fedavg_weights):
    assert _same(_weights(**_case("fedftg", algorithm__iterations=0)), fedavg_weights)
    assert not _same(_weights(**method_overrides("fedftg")), fedavg_weights)  # the fine-tuning moves the model
    prox = _weights(algorithm__name="fedprox", algorithm__mu=0.5)
    assert _same(_weights(**_case("fedftg", algorithm__iterations=0, algorithm__base="fedprox",
                                  algorithm__mu=0.5)), prox)


def test_fedgen_clients_use_the_generator_from_start_round_only():
    from fedray.data import build_federated_data
    from fedray.methods import resolve_experiment
    from fedray.runtime.core import data_spec

    cfg = tiny_config(**_case("fedgen", algorithm__start_round=3))
    algo = resolve_experiment(cfg).build(data_spec(build_federated_data(cfg.data, cfg.seed)))
    state = algo.init_server_state(algo.build_modules())
    assert algo.broadcast(state, 3).generator is None  # no label reported yet: nothing to draw from
    state.labels_seen[:] = True
    assert algo.broadcast(state, 2).generator is None and algo.broadcast(state, 3).generator is not None
    assert algo.weight_at(10.0, 1) == 10.0 and algo.weight_at(10.0, 2) == pytest.approx(9.8)
    assert algo.weight_at(0.0, 50) == 0.0 and algo.weight_at(10.0, 1000) == 1e-4  # the code's floor, not for 0


def test_fedgen_batched_clients_give_the_sequential_regularised_round():
    # round 2 is the first whose clients train with the generator (a StepwiseTraining); batches of 12 end a client's
    # pass on a short batch, padded in the batched step, its rows left out of the KL term's mean. (LeNet-5: with a
    # BatchNorm model FedAvg's own batched and sequential rounds drift apart by ~5e-4 over two rounds at this lr.)
    kw = _case("fedgen", federation__batch_size=12)
    seq, seq_infos = _one_round(False, rounds=2, **kw)
    vec, vec_infos = _one_round(True, rounds=2, **kw)
    _assert_same_weights(seq, vec)
    for a, b in zip(seq_infos, vec_infos):
        assert a["client"] == b["client"]
        for key in ("train/loss", "train/gen_ce", "train/gen_kl"):
            assert b[key] == pytest.approx(a[key], rel=1e-4), key


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)])
def test_generators_fit_every_model_of_the_zoo(shape):
    """Shapes only: the zoo's models are built on the meta device (no weights drawn, nothing computed)."""
    y = torch.tensor([0, 3, 9, 1])
    images = ImageGenerator(16, 10, shape, width=4)(torch.randn(4, 16), y)
    assert images.shape == (4, *shape)
    for name in MODEL_NAMES:
        with torch.device("meta"):
            model = build_model(name, shape, 10).eval()
        feats = FeatureGenerator(8, 10, model.feature_dim, hidden=16)(torch.rand(4, 8), y)
        assert feats.shape == (4, model.feature_dim), name
        # FedGen's teachers read the features with their head; FedFTG's teachers and student read the images
        assert model.head(feats.to("meta")).shape == (4, 10), name
        assert model(images.to("meta")).shape == (4, 10), name


def test_label_shares_sum_to_one_for_every_held_label():
    counts = torch.tensor([[5, 0, 1, 0], [5, 3, 0, 0], [0, 1, 3, 0]])
    shares, held = label_shares(counts)
    assert held.tolist() == [True, True, True, False]
    torch.testing.assert_close(shares.sum(0), torch.tensor([1.0, 1.0, 1.0, 0.0]))
    torch.testing.assert_close(shares[:, 1], torch.tensor([0.0, 0.75, 0.25]))
    assert label_counts(torch.tensor([2, 2, 0]), 4).tolist() == [1, 0, 2, 0]


def test_proportional_labels_follow_the_class_totals():
    labels = proportional_labels(torch.tensor([30, 0, 10, 60]), 50, torch.Generator().manual_seed(0))
    assert torch.bincount(labels, minlength=4).tolist() == [15, 0, 5, 30]


def test_diversity_falls_as_outputs_spread():
    noise = torch.randn(8, 4)
    assert float(diversity_loss(noise, torch.zeros(8, 3))) == pytest.approx(1.0)
    assert float(diversity_loss(noise, noise.repeat(1, 2))) < 0.5


@pytest.mark.parametrize("name", ["fedgen", "fedftg"])
def test_label_counts_go_up_and_are_counted(name):
    rounds = 2
    base = run_experiment(tiny_config(federation__rounds=rounds, tracking__enabled=False), progress=False)
    own = run_experiment(tiny_config(**method_overrides(name), federation__rounds=rounds, tracking__enabled=False),
                         progress=False)
    clients, classes = 3, 10  # tiny_config: 3 clients a round, 10 classes
    extra = own.summary["comm/bytes_up"] - base.summary["comm/bytes_up"]
    assert extra == rounds * clients * classes * 8  # an int64 count per class, per client and round


@pytest.mark.parametrize("key,value", [("algorithm.gen_server_batch_size", 1), ("algorithm.noise", "laplace"),
                                       ("algorithm.decay", 1.5), ("algorithm.gen_steps", -1)])
def test_fedgen_refuses_bad_parameters_naming_the_key(key, value):
    with pytest.raises(ConfigError) as err:
        load_experiment("fedgen_fmnist", {key: value})
    assert key in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("key,value", [("algorithm.base", "scaffold"), ("algorithm.iterations", -1),
                                       ("algorithm.student_lr", 0), ("algorithm.lr_decay", 2.0)])
def test_fedftg_refuses_bad_parameters_naming_the_key(key, value):
    with pytest.raises(ConfigError) as err:
        load_experiment("fedftg_fmnist", {key: value})
    assert key in str(err.value) and "\n" not in str(err.value)



def test_fedgen_counts_the_round_batches_labels_when_asked():
    from fedray.learning.boundary import ClientContext, DataSpec
    from fedray.methods.fedgen import counted_upload

    fed = tiny_config(federation__local_steps=3, federation__batch_size=4).federation
    y = torch.tensor([0] * 10 + [1] * 30)
    ctx = ClientContext(client_id=0, round=1, seed=0, x=torch.zeros(40, 1, 16, 16, dtype=torch.uint8), y=y,
                        spec=DataSpec((1, 16, 16), 3, 1, (0.5,), (0.25,)), fed=fed, device=torch.device("cpu"),
                        modules=None)
    assert counted_upload(ctx, {}, 3).label_counts.tolist() == [10, 30, 0]  # the paper: the client's data
    drawn = y[torch.cat(ctx.batch_plan().index)]
    by_batches = counted_upload(ctx, {}, 3, of_batches=True).label_counts
    assert by_batches.sum() == 12 and by_batches.tolist() == torch.bincount(drawn, minlength=3).tolist()


@pytest.mark.parametrize("name,key", [("fedgen", "algorithm.gen_server_batch_size"),
                                      ("fedftg", "algorithm.batch_size")])
def test_a_one_sample_generator_batch_is_refused_naming_the_key(name, key):
    with pytest.raises(ConfigError) as err:
        load_experiment(f"{name}_fmnist", {"federation.batch_size": 1})
    assert err.value.key == key
    load_experiment(f"{name}_fmnist", {"federation.batch_size": 1, key: 16})  # its own batch: fine


# --- each generator term by hand, and moved by alone ----------------------------------------------------------


def _server(name: str, **params):
    """A method's server side on tiny_config's data: (algorithm, its modules, its initial state)."""
    from fedray.data import build_federated_data
    from fedray.methods import resolve_experiment
    from fedray.runtime.core import data_spec

    cfg = tiny_config(**_case(name, **params))
    algo = resolve_experiment(cfg).build(data_spec(build_federated_data(cfg.data, cfg.seed)))
    modules = algo.build_modules()
    return algo, modules, algo.init_server_state(modules)


def _uploads(modules, counts: list[list[int]], zero_heads: bool = False, model_name: str = "lenet5"):
    """One upload per row of ``counts`` (label counts over 10 classes), each a differently drawn model."""
    from fedray.learning.weights import clone_weights
    from fedray.methods.fedgen import LabelCountUpload

    ups = []
    for k, row in enumerate(counts):
        torch.manual_seed(100 + k)
        model = build_model(model_name, (1, 16, 16), 10)
        if zero_heads:
            with torch.no_grad():
                model.head.weight.zero_()
        ups.append(LabelCountUpload(weights=clone_weights(model), num_samples=10 + 5 * k,
                                    label_counts=torch.tensor(row, dtype=torch.int64)))
    return ups


def _first_inputs(module: torch.nn.Module) -> tuple[list, object]:
    """Records the inputs of ``module``'s forward calls (the generator's: the step's noise and labels)."""
    calls: list = []
    return calls, module.register_forward_hook(lambda mod, args, out: calls.append(tuple(a.detach() for a in args)))


def _params(weights: dict, module: torch.nn.Module) -> dict:
    """The trainable parameters' entries of ``weights`` (a generator's BatchNorm buffers move with any forward)."""
    return {n: weights[n] for n, _ in module.named_parameters()}


def _by_hand_diversity(noise: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """FedGen's L_div / FedFTG's L_dis: exp(-mean_ij mean_d (noise_i - noise_j)^2 * mean_d |out_i - out_j|)."""
    n, o = noise.flatten(1), out.flatten(1)
    total = sum(float(((n[i] - n[j]) ** 2).mean()) * float((o[i] - o[j]).abs().mean())
                for i in range(len(n)) for j in range(len(n)))
    return torch.exp(torch.tensor(-total / len(n) ** 2))


COUNTS = [[6, 2, 0, 0, 1, 0, 0, 0, 0, 0], [0, 3, 5, 0, 0, 0, 0, 0, 0, 4]]


@pytest.mark.parametrize("term", ["teacher", "diversity"])
def test_fedgens_generator_is_moved_by_each_term_alone_down_that_term(term):
    """L_G = sum_k mean_b w_{k,y_b} CE(head_k(G(eps_b, y_b)), y_b) + eta L_div (FedGen's Eq. 7 with its label
    weights), one Adam step: each term by hand on the step's own noise and labels equals the logged figure, and the
    step driven by that term alone (eta = 0; or heads of zero weight, which make the teacher term flat) lowers it."""
    from fedray.learning.data_free import label_shares
    from fedray.methods.api import ServerContext

    algo, modules, state = _server("fedgen", algorithm__gen_steps=1, algorithm__gen_weight_decay=0.0,
                                   algorithm__gen_lr=1e-3, algorithm__diversity_weight=1.0 if term == "diversity" else 0.0)
    uploads = _uploads(modules, COUNTS, zero_heads=term == "diversity")
    gen = modules.generator
    calls, hook = _first_inputs(gen)
    new, metrics = algo.server_update(state, uploads, ServerContext(1, 0, torch.device("cpu"), modules))
    hook.remove()
    eps, y = calls[0]
    shares = label_shares(torch.stack([u.label_counts for u in uploads]))[0]

    def value(weights):
        gen.load_state_dict(weights)
        gen.train()
        with torch.no_grad():
            out = gen(eps, y)
            if term == "diversity":
                return _by_hand_diversity(eps, out)
            return sum((shares[k, y] * F.cross_entropy(out @ u.weights["head.weight"].T + u.weights["head.bias"], y,
                                                       reduction="none")).mean() for k, u in enumerate(uploads))

    before, after = value(state.generator), value(new.generator)
    logged = metrics["server/gen_diversity" if term == "diversity" else "server/gen_teacher_loss"]
    assert logged == pytest.approx(float(before), rel=1e-4)
    assert float(after) < float(before)


@pytest.mark.parametrize("term", ["hard", "cls", "diversity"])
def test_fedftgs_generator_is_moved_by_each_term_alone_down_that_term(term):
    """FedFTG's generator loss for teacher k: hard_weight L_md + cls_weight L_cls + diversity_weight L_dis / K, with
    L_md = -mean_i alpha_k^{y_i} mean_c |s(x_i) - t_k(x_i)| (the student, the uploads' average, in eval mode; the
    teacher's logits detached, so the step lowers L_md with them held where they were), L_cls = mean_i alpha_k^{y_i}
    CE(t_k(x_i), y_i), x_i = G(z_i, y_i). Two teachers, the second holding no label (alpha = 0: its step moves the
    generator only by Adam's momentum, the same way), one iteration and no student step. Each term by hand at the
    first step equals its logged figure, and the steps driven by it alone lower it."""
    from fedray.learning.data_free import label_shares
    from fedray.learning.weights import weighted_average
    from fedray.methods.api import ServerContext
    from torch.func import functional_call

    weights = {f"algorithm__{t}_weight": 1.0 if t == term else 0.0 for t in ("hard", "cls", "diversity")}
    algo, modules, state = _server("fedftg", algorithm__iterations=1, algorithm__student_steps=0,
                                   algorithm__gen_lr=1e-3, **weights)
    uploads = _uploads(modules, [COUNTS[0], [0] * 10])
    gen = modules.generator
    calls, hook = _first_inputs(gen)
    new, metrics = algo.server_update(state, uploads, ServerContext(1, 0, torch.device("cpu"), modules))
    hook.remove()
    z, y = calls[0]
    alpha = label_shares(torch.stack([u.label_counts for u in uploads]))[0][0, y]  # teacher 0's weights
    student = modules.model
    student.load_state_dict(weighted_average([u.weights for u in uploads], [u.num_samples for u in uploads]))
    student.eval()
    modules.teacher.eval()

    gen.load_state_dict(state.generator)
    gen.train()
    with torch.no_grad():  # the teacher's logits at the first step's images, which L_md's gradient holds fixed
        held = functional_call(modules.teacher, uploads[0].weights, (gen(z, y),))

    def value(gen_weights):
        gen.load_state_dict(gen_weights)
        gen.train()
        with torch.no_grad():
            x = gen(z, y)
            t = functional_call(modules.teacher, uploads[0].weights, (x,))
            if term == "hard":
                return -((student(x) - held).abs().mean(1) * alpha).mean()
            if term == "cls":
                return (F.cross_entropy(t, y, reduction="none") * alpha).mean()
            return _by_hand_diversity(z, x)

    before, after = value(state.generator), value(new.generator)
    if term != "diversity":  # the second teacher's term is 0 (alpha = 0): the logged mean over 2 steps is half
        assert metrics[f"server/ft_{term}"] == pytest.approx(float(before) / 2, rel=1e-4, abs=1e-7)
    assert float(after) < float(before)


def test_fedftgs_student_step_is_one_sgd_step_on_the_label_weighted_teachers_soft_labels():
    """The student's fine-tuning (after the generator's step): target(x) = sum_k alpha_k^y softmax(t_k(x)), x = G(z, y)
    from the updated generator in eval mode; L = -mean over rows and classes of target * log softmax(s(x)) (the
    authors' reduction); one SGD step of lr student_lr from the uploads' average."""
    from fedray.learning.data_free import label_shares
    from fedray.learning.weights import weighted_average
    from fedray.methods.api import ServerContext
    from torch.func import functional_call

    algo, modules, state = _server("fedftg", algorithm__iterations=1, algorithm__student_steps=1,
                                   algorithm__student_lr=0.3, algorithm__student_weight_decay=0.0)
    uploads = _uploads(modules, COUNTS)
    calls, hook = _first_inputs(modules.generator)
    new, metrics = algo.server_update(state, uploads, ServerContext(1, 0, torch.device("cpu"), modules))
    hook.remove()
    z, y = calls[0]
    shares = label_shares(torch.stack([u.label_counts for u in uploads]))[0][:, y]  # (K, B)
    gen = modules.generator
    gen.load_state_dict(new.generator)
    gen.eval()
    with torch.no_grad():
        x = gen(z, y)
        target = sum(F.softmax(functional_call(modules.teacher, u.weights, (x,)), dim=1) * shares[k].unsqueeze(1)
                     for k, u in enumerate(uploads))
    student = modules.model
    average = weighted_average([u.weights for u in uploads], [u.num_samples for u in uploads])
    student.load_state_dict(average)
    student.train()
    student.zero_grad(set_to_none=True)  # the method's own step left its gradients there
    kd = -(F.log_softmax(student(x), dim=1) * target).mean()
    kd.backward()
    assert metrics["server/ft_kd"] == pytest.approx(float(kd.detach()), rel=1e-5)
    for name, p in student.named_parameters():
        torch.testing.assert_close(new.weights[name], average[name] - 0.3 * p.grad, rtol=1e-5, atol=1e-7)


def test_a_label_held_by_a_single_sample_gets_its_holder_all_the_weight():
    shares, held = label_shares(torch.tensor([[1, 0, 2], [0, 0, 2]]))
    assert held.tolist() == [True, False, True]
    assert shares.tolist() == [[1.0, 0.0, 0.5], [0.0, 0.0, 0.5]]


@pytest.mark.parametrize("counts", ["data", "batches"])
def test_fedgens_uploaded_label_counts_follow_the_config(counts):
    """algorithm.label_counts=data (the paper): the counts of the client's data; batches (the authors' code): of the
    labels its round's batches drew."""
    from fedray.learning.training import run_update
    from tests.methods.plans import client_step

    with client_step(**method_overrides("fedgen"), algorithm__label_counts=counts) as step:
        got = run_update(step.ctx, step.plan).upload.label_counts
        y = step.ctx.y if counts == "data" else step.ctx.y[torch.cat(step.ctx.batch_plan().index)]
        assert got.tolist() == torch.bincount(y.cpu(), minlength=10).tolist()


@pytest.mark.parametrize("noise", ["normal", "uniform"])
def test_fedgens_generator_noise_is_the_configured_distribution(noise):
    """noise=normal (the paper): N(0, I); uniform (the authors' code): U[0, 1)."""
    from fedray.methods import resolve_experiment

    cfg = tiny_config(**method_overrides("fedgen"), algorithm__noise=noise)
    algo = resolve_experiment(cfg).build(type("S", (), {"input_shape": (1, 16, 16), "num_classes": 10})())
    z = algo.draw_noise(4000, torch.Generator().manual_seed(0))
    if noise == "uniform":
        assert z.min() >= 0 and z.max() < 1 and abs(float(z.mean()) - 0.5) < 0.01
    else:
        assert z.min() < -2 and abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1) < 0.01


def test_fedftgs_eval_average_scores_the_average_before_fine_tuning():
    """algorithm.eval_average=true: eval/*_avg score the clients' plain average before fine-tuning as well; false:
    no such figures; the model reported is the fine-tuned one either way."""
    base = {**method_overrides("fedftg"), "federation__rounds": 1}
    with_avg = run_experiment(tiny_config(**base, algorithm__eval_average=True), progress=False).history[-1]
    plain = run_experiment(tiny_config(**base, algorithm__eval_average=False), progress=False).history[-1]
    assert "eval/accuracy_avg" in with_avg and not any(k.endswith("_avg") for k in plain)
    assert with_avg["eval/accuracy"] == plain["eval/accuracy"]  # the same fine-tuned model is reported


def test_fedftgs_generator_loss_takes_each_configured_weight():
    """hard_weight x L_md + cls_weight x L_cls + diversity_weight x L_dis / K: with all three 0 the generator's
    gradient is 0 and Adam leaves it where it was; any one of them alone moves it."""
    from tests.methods.test_dafkd import _run_rounds

    zero = {"algorithm__hard_weight": 0.0, "algorithm__cls_weight": 0.0, "algorithm__diversity_weight": 0.0}

    def moved(**weights) -> bool:
        cfg = tiny_config(**method_overrides("fedftg"), federation__rounds=1, **weights)
        start, after = _run_rounds(cfg, 0)[2].generator, _run_rounds(cfg, 1)[2].generator
        params = [k for k in start if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
        return not all(torch.equal(start[k], after[k]) for k in params)  # BatchNorm's statistics move anyway
    assert not moved(**zero)
    for key in zero:
        assert moved(**{**zero, key: 1.0}), key


def test_fedgens_generator_step_takes_the_configured_batch_and_decayed_lr():
    """gen_server_batch_size=6: each generator step draws 6 labels (not federation.batch_size); gen_lr_decay=0.5 at
    round 3: Adam's first step moves each parameter by at most gen_lr x 0.5^2, the largest by that itself."""
    from fedray.methods.api import ServerContext

    algo, modules, state = _server("fedgen", algorithm__gen_steps=1, algorithm__gen_server_batch_size=6,
                                   algorithm__gen_lr=1e-2, algorithm__gen_lr_decay=0.5,
                                   algorithm__gen_weight_decay=0.0)
    calls, hook = _first_inputs(modules.generator)
    new, _ = algo.server_update(state, _uploads(modules, COUNTS), ServerContext(3, 0, torch.device("cpu"), modules))
    hook.remove()
    assert len(calls[0][1]) == 6
    start, end = _params(state.generator, modules.generator), _params(new.generator, modules.generator)
    moved = max(float((end[k] - start[k]).abs().max()) for k in start)
    assert moved == pytest.approx(1e-2 * 0.25, rel=1e-3) and moved <= 1e-2 * 0.25 + 1e-6  # float32 parameters


def test_fedftgs_generator_steps_follow_gen_steps_per_teacher_and_the_decayed_lr():
    """One teacher, one iteration, no student step: gen_steps_per_teacher=2 runs the generator's step twice (one more
    forward call than with 1); lr_decay=0.5 at round 3: its first Adam step moves each parameter by at most
    gen_lr x 0.5^2, the largest by that itself."""
    from fedray.methods.api import ServerContext

    def server_round(steps: int, round_: int):
        algo, modules, state = _server("fedftg", algorithm__iterations=1, algorithm__student_steps=0,
                                       algorithm__gen_lr=1e-2, algorithm__lr_decay=0.5,
                                       algorithm__gen_steps_per_teacher=steps)
        calls, hook = _first_inputs(modules.generator)
        new, _ = algo.server_update(state, _uploads(modules, [COUNTS[0]]),
                                    ServerContext(round_, 0, torch.device("cpu"), modules))
        hook.remove()
        start, end = _params(state.generator, modules.generator), _params(new.generator, modules.generator)
        return len(calls), max(float((end[k] - start[k]).abs().max()) for k in start)

    (calls_1, moved), (calls_2, _) = server_round(1, 3), server_round(2, 3)
    assert calls_2 - calls_1 == 1
    assert moved == pytest.approx(1e-2 * 0.25, rel=1e-3) and moved <= 1e-2 * 0.25 + 1e-6  # float32 parameters


@pytest.mark.parametrize("freeze", [True, False])
def test_fedftgs_student_keeps_its_batchnorm_statistics_when_frozen(freeze):
    """freeze_student_bn=true: fine-tuning on generated images leaves the student's BatchNorm running statistics
    those of the clients' average (real data); false: the generated batches move them."""
    from fedray.learning.weights import weighted_average
    from fedray.methods.api import ServerContext

    algo, modules, state = _server("fedftg", model__name="resnet8_bn", algorithm__iterations=1,
                                   algorithm__student_steps=1, algorithm__freeze_student_bn=freeze)
    uploads = _uploads(modules, COUNTS, model_name="resnet8_bn")
    new, _ = algo.server_update(state, uploads, ServerContext(1, 0, torch.device("cpu"), modules))
    average = weighted_average([u.weights for u in uploads], [u.num_samples for u in uploads])
    stats = [k for k in average if k.endswith(("running_mean", "running_var"))]
    assert stats and all(torch.equal(new.weights[k], average[k]) for k in stats) == freeze
