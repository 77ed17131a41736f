import os

import pytest

from fedray.methods import algorithm_params, validate_experiment
from fedray.config import ExperimentConfig
from fedray.load import load_config, preset_names
from fedray.data.plot import partition_label
from fedray.errors import ConfigError
from fedray.overrides import apply_overrides, parse_override


def test_presets_load_and_quickstart_matches_the_issue():
    assert {"quickstart", "synthetic"} <= set(preset_names())
    cfg = load_config("quickstart")
    assert cfg.algorithm.name == "fedavg" and cfg.data.dataset == "fashion_mnist"
    assert (cfg.data.partition, cfg.data.alpha, cfg.data.num_clients) == ("dirichlet", 0.1, 20)
    assert (cfg.federation.clients_per_round, cfg.federation.local_steps, cfg.federation.batch_size) == (8, 20, 32)
    assert cfg.federation.rounds >= 30 and cfg.model.name == "lenet5"


def test_dotted_overrides_are_parsed_as_yaml_scalars():
    cfg = load_config("quickstart", ["data.alpha=0.5", "federation.rounds=3", "algorithm.name=fedprox",
                                     "algorithm.mu=0.1", "tracking.enabled=false", "runtime.num_workers=4"])
    assert cfg.data.alpha == 0.5 and cfg.federation.rounds == 3
    assert cfg.algorithm.name == "fedprox" and algorithm_params(cfg).mu == 0.1
    assert cfg.runtime.num_workers == 4 and cfg.tracking.enabled is False


def test_yaml_file(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("seed: 7\ndata: {dataset: synthetic, num_clients: 5}\nfederation: {clients_per_round: 5}\n")
    cfg = load_config(str(path), ["seed=8"])
    assert cfg.seed == 8 and cfg.data.num_clients == 5


@pytest.mark.parametrize(
    "override, key, fragment",
    [
        ("data.alpha=0", "data.alpha", "greater than 0"),
        ("data.alpha=-1", "data.alpha", "greater than 0"),
        ("data.alpha=abc", "data.alpha", "valid number"),
        ("data.partition=random", "data.partition", "'dirichlet', 'iid', 'shards', 'domain', 'domain_dirichlet', 'central' or 'on_demand'"),
        ("data.dataset=imagenet", "data.dataset", "fashion_mnist"),
        ("model.name=vgg", "model.name", "lenet5"),
        ("algorithm.name=fedfoo", "algorithm.name", "allowed: "),
        ("algorithm.mu=0.1", "algorithm.mu", "not a parameter of 'fedavg'"),
        ("federation.clients_per_round=21", "federation.clients_per_round", "1..20"),
        ("federation.rounds=0", "federation.rounds", "greater than or equal to 1"),
        ("data.alpah=0.1", "data.alpah", "allowed keys here: dataset"),
        ("runtime.backend=spark", "runtime.backend", "'local' or 'ray'"),
        ("runtime.precision=fp16", "runtime.precision", "'float32' or 'bf16'"),
        ("runtime.vectorize=maybe", "runtime.vectorize", "'auto' or a valid boolean (got 'maybe')"),
        ("runtime.num_workers=50", "runtime.num_workers", "1..20"),
        ("federation.lr=fast", "federation.lr", "valid number"),
        ("name=../elsewhere", "name", "is not a folder name"),  # it would put runs/NAME-TIME outside runs/
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(override, key, fragment):
    with pytest.raises(ConfigError) as e:
        validate_experiment(load_config("quickstart", [override]))
    assert e.value.key == key
    assert fragment in e.value.message


def test_a_server_in_the_driver_reserves_nothing():
    with pytest.raises(ConfigError) as e:
        load_config("quickstart", ["runtime.server_in_driver=true", "runtime.server_num_gpus=0.25"])
    assert e.value.key == "runtime.server_in_driver" and "server_num_gpus=0.25" in e.value.message
    assert load_config("quickstart", ["runtime.server_in_driver=false", "runtime.server_num_gpus=0.25"])


def test_fedprox_mu_is_validated():
    with pytest.raises(ConfigError) as e:
        validate_experiment(load_config("quickstart", ["algorithm.name=fedprox", "algorithm.mu=-1"]))
    assert e.value.key == "algorithm.mu"


def test_malformed_override_and_unknown_preset():
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("data.alpha")
    with pytest.raises(ConfigError, match="presets: .*quickstart"):
        load_config("no_such_preset")
    with pytest.raises(ConfigError, match="is a value, not a section"):
        apply_overrides({"seed": 1}, ["seed.x=2"])


def test_flat_view_and_yaml_round_trip(tmp_path):
    cfg = load_config("quickstart", ["algorithm.name=fedprox", "algorithm.mu=0.3"])
    flat = cfg.flat()
    assert flat["data.alpha"] == 0.1 and flat["algorithm.mu"] == 0.3
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(str(path)) == cfg
    assert isinstance(cfg, ExperimentConfig)


def test_switching_the_method_drops_the_presets_method_options():
    cfg = load_config("fedcd_fmnist", ["algorithm.lambda_kd=3", "algorithm.name=feddistill"])
    assert cfg.algorithm.name == "feddistill" and cfg.algorithm.params() == {"lambda_kd": 3}
    validate_experiment(load_config("fedcd_fmnist", ["algorithm.name=local"]))
    same = load_config("fedcd_fmnist", ["algorithm.name=fedcd"])  # the same method keeps its options
    assert same.algorithm.params()["shared_batch"] == 64


def test_overriding_local_steps_unsets_the_presets_epochs():
    """fedkf_fmnist trains 10 epochs; ``local_steps=5`` alone used to be ignored without a word."""
    assert load_config("fedkf_fmnist").federation.local_epochs == 10
    fed = load_config("fedkf_fmnist", ["federation.local_steps=5"]).federation
    assert (fed.local_steps, fed.local_epochs) == (5, None)
    fed = load_config("fedkf_fmnist", {"federation.local_steps": 5, "federation.local_epochs": None}).federation
    assert (fed.local_steps, fed.local_epochs) == (5, None)
    fed = load_config("fedkf_fmnist", ["federation.local_epochs=2"]).federation  # epochs alone: as before
    assert fed.local_epochs == 2
    fed = load_config("fedkf_fmnist", ["federation.local_steps=5", "federation.local_epochs=2"]).federation
    assert (fed.local_steps, fed.local_epochs) == (5, 2)  # both given: the epochs decide, as documented


def test_a_cosine_schedule_that_would_raise_the_lr_is_refused():
    with pytest.raises(ConfigError, match="allowed: 0..lr") as e:
        load_config("quickstart", ["federation.lr_schedule=cosine", "federation.lr=0.01", "federation.lr_min=0.1"])
    assert e.value.key == "federation.lr_min"
    fed = load_config("quickstart", ["federation.lr_schedule=cosine", "federation.lr=0.1", "federation.lr_min=0.01"])
    assert fed.federation.lr_at(1) == 0.1 and abs(fed.federation.lr_at(fed.federation.rounds) - 0.01) < 1e-12
    mid = fed.federation.rounds // 2 + 1
    assert 0.01 < fed.federation.lr_at(mid) < 0.1
    flat = load_config("quickstart", ["federation.lr_schedule=constant", "federation.lr=0.1", "federation.lr_min=0.01"])
    assert {flat.federation.lr_at(r) for r in (1, mid, flat.federation.rounds)} == {0.1}  # lr_min is not read


@pytest.mark.parametrize("overrides, text", [
    ([], "dirichlet (alpha=0.1)"),
    (["data.partition=shards", "data.shards_per_client=3"], "shards (3 per client)"),
    (["data.partition=iid"], "iid"),
])
def test_a_partitions_title_names_only_the_settings_it_uses(overrides, text):
    # `fedray partition` and a run's partition plot printed "(alpha=0.1)" for iid, shards and domain
    # partitions too, where no Dirichlet draw reads it.
    assert partition_label(load_config("quickstart", overrides).data) == text


def test_a_domain_partitions_title_has_no_alpha():
    data = load_config("fedd3a_fmnist_domains").data
    assert partition_label(data) == "domain"
    cross_device = load_config("fedd3a_fmnist_domains", ["data.partition=domain_dirichlet",
                                                         "data.clients_per_domain=5", "data.alpha=0.2"]).data
    assert partition_label(cross_device) == "domain_dirichlet (alpha=0.2, 5 clients per domain)"


def test_folders_are_recorded_as_absolute_paths(tmp_path, monkeypatch):
    # A relative data.data_dir meant another folder once a run was resumed from elsewhere
    monkeypatch.chdir(tmp_path)
    data = load_config("quickstart", ["data.data_dir=d", "data.cache_dir=~/c"]).data
    # ~ stays for each process to expand: its own home folder, on whichever node it runs
    assert data.data_dir == str(tmp_path / "d") and data.cache_dir == "~/c"
    assert load_config("quickstart").data.data_dir is None


def test_the_cli_makes_relative_data_folders_in_the_environment_absolute(tmp_path, monkeypatch):
    # A sweep's trials (each run in a folder of its own) inherit the environment: a relative folder there
    # was another, empty one
    from fedray.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDRAY_DATA_DIR", "data")
    monkeypatch.setenv("FEDRAY_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["models", "synthetic"]) == 0
    assert os.environ["FEDRAY_DATA_DIR"] == str(tmp_path / "data")
    assert os.environ["FEDRAY_CACHE_DIR"] == str(tmp_path / "cache")
