"""model.init: a run starts its global model (and clients' models of that architecture) from given weights,
checked for shape before any work; torchvision's weight names map onto the zoo's torchvision models."""

import json

import pytest
import torch

from fedray.cli import main
from fedray.data import build_federated_data
from fedray.errors import ConfigError
from fedray.methods import resolve_experiment
from fedray.models import build_model
from fedray.models.init import initial_weights
from fedray.runtime import make_runtime
from tests.conftest import tiny_config
from tests.test_cli import TINY_ARGS


@pytest.fixture
def lenet_file(tmp_path):
    torch.manual_seed(123)
    state = build_model("lenet5", (1, 16, 16), 10).state_dict()
    torch.save(state, tmp_path / "init.pt")
    return tmp_path / "init.pt", state


def test_the_global_model_starts_from_the_file(lenet_file):
    path, state = lenet_file
    cfg = tiny_config(model__init=str(path))
    data = build_federated_data(cfg.data, cfg.seed)
    with make_runtime(cfg, data) as rt:
        start = rt.global_weights()
    assert all(torch.equal(start[k], state[k]) for k in state)
    with make_runtime(tiny_config(), data) as rt:  # without it: the seeded draw
        assert not all(torch.equal(rt.global_weights()[k], state[k]) for k in state)


def test_a_personalised_clients_model_of_the_global_architecture_starts_from_it(lenet_file):
    path, state = lenet_file
    cfg = tiny_config(algorithm__name="local", model__client_models=["lenet5", "resnet8_bn"], model__init=str(path))
    algo = resolve_experiment(cfg).build(__import__("fedray.runtime.core", fromlist=["data_spec"]).data_spec(
        build_federated_data(cfg.data, cfg.seed)))
    own, other = algo.init_personal_model(0), algo.init_personal_model(1)
    assert own.architecture == "lenet5" and all(torch.equal(own.weights[k], state[k]) for k in state)
    assert other.architecture == "resnet8_bn"  # another architecture keeps its seeded draw


def test_a_state_dict_of_another_shape_exits_2_naming_the_key_before_any_work(tmp_path, capsys):
    torch.save(build_model("lenet5", (1, 28, 28), 10).state_dict(), tmp_path / "mnist.pt")  # 28x28, not 16x16
    out = tmp_path / "run"
    assert main(["run", *TINY_ARGS, f"model.init={tmp_path / 'mnist.pt'}", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model.init:") and "given" in err and "wanted" in err
    assert not out.exists()  # nothing ran, nothing was written


@pytest.mark.parametrize("make, fragment", [
    (lambda p: None, "does not exist"),
    (lambda p: p.write_text("not a torch file"), "is not a state dict"),
    (lambda p: torch.save(build_model("mlp", (1, 16, 16), 10).state_dict(), p), "does not fit"),
    (lambda p: torch.save({k: v for k, v in build_model("lenet5", (1, 16, 16), 10).state_dict().items()
                           if not k.startswith("head.")}, p), "head.weight missing"),
    (lambda p: torch.save({0: build_model("lenet5", (1, 16, 16), 10).state_dict()}, p), "personalised"),
])
def test_files_that_are_not_this_models_weights_are_refused(tmp_path, make, fragment):
    path = tmp_path / "w.pt"
    make(path)
    with pytest.raises(ConfigError) as e:
        resolve_experiment(tiny_config(model__init=str(path)))
    assert e.value.key == "model.init" and fragment in e.value.message


def test_torchvision_weights_load_into_the_zoos_resnet18_but_its_adapted_stem_and_head(monkeypatch):
    """Offline stand-in for a download: torchvision's own ResNet-18 state dict under a weights name."""
    from torchvision.models import resnet18
    import torchvision.models

    imagenet = resnet18(num_classes=1000).state_dict()

    class Weights:
        url = "https://download.pytorch.org/models/resnet18-f37072fd.pth"

        def get_state_dict(self, progress=False):
            return imagenet

    def get_weight(name):
        if name != "R18.X":
            raise ValueError(name)  # as torchvision does for an unknown name
        return Weights()

    monkeypatch.setattr(torchvision.models, "get_weight", get_weight)
    initial_weights.cache_clear()
    state = initial_weights("torchvision:R18.X", "resnet18", (3, 32, 32), 10)
    assert torch.equal(state["layer4.1.conv2.weight"], imagenet["layer4.1.conv2.weight"])
    assert torch.equal(state["bn1.running_var"], imagenet["bn1.running_var"])
    assert state["conv1.weight"].shape == (64, 3, 3, 3) and state["head.weight"].shape == (10, 512)
    with pytest.raises(ConfigError) as e:  # another architecture's weights
        initial_weights("torchvision:R18.X", "resnet50", (3, 32, 32), 10)
    assert e.value.key == "model.init" and "does not fit" in e.value.message
    with pytest.raises(ConfigError) as e:
        initial_weights("torchvision:Nope", "resnet18", (3, 32, 32), 10)
    assert "no weights 'Nope'" in e.value.message
    initial_weights.cache_clear()
