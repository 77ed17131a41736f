"""The cluster/ recipes: Ray cluster-launcher configs, KubeRay manifests, runtime env, Dockerfile, README.

Offline and fast: nothing here talks to a cloud, Kubernetes, docker or a Ray cluster. The launcher configs
go through Ray's own preparation and validation (the steps `ray up` runs before it calls the cloud), the
runtime env through Ray's ``RuntimeEnv`` and working-dir packaging, and every ``fedray`` command line in
cluster/README.md through fedray's CLI parser.
"""

from __future__ import annotations

import argparse
import copy
import re
import shlex
import subprocess
import zipfile
from pathlib import Path

import pytest
import yaml

import ray  # noqa: E402  (a hard dependency: never skip these checks for its absence)

from ray.autoscaler._private.util import prepare_config, validate_config  # noqa: E402
from ray.runtime_env import RuntimeEnv  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "cluster"
LAUNCHER_CONFIGS = {"aws.yaml": "aws", "gcp.yaml": "gcp"}
COMMAND_KEYS = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
                "head_start_ray_commands", "worker_start_ray_commands")
RAY_IMAGE = f"rayproject/ray:{ray.__version__}-py311-gpu"
IMAGE_WORKDIR = "/home/ray/fedray"

# Instance shapes the configs use: (vCPUs, GPUs). Declared resources are what Ray advertises to the
# autoscaler and passes to `ray start`, so they must match the machine.
AWS_SHAPES = {"m5.2xlarge": (8, 0), "g5.xlarge": (4, 1), "g5.12xlarge": (48, 4)}
GCP_A2_GPUS = {"a2-highgpu-1g": 1, "a2-highgpu-2g": 2, "a2-highgpu-4g": 4, "a2-highgpu-8g": 8}


def _load(name: str):
    return yaml.safe_load((CLUSTER / name).read_text())


# --------------------------------------------------------------------------------------------------
# Ray cluster launcher (ray up)


@pytest.fixture(params=sorted(LAUNCHER_CONFIGS))
def launcher(request):
    raw = _load(request.param)
    return request.param, raw, prepare_config(copy.deepcopy(raw))


def test_launcher_config_passes_ray_validation(launcher):
    # prepare_config merges the provider's defaults.yaml and fills per-type min/max workers;
    # validate_config applies ray-schema.json (no unknown keys anywhere but node_config/provider) plus
    # Ray's own checks (head type exists, sum of min_workers <= max_workers).
    name, raw, prepared = launcher
    validate_config(prepared)
    assert raw["provider"]["type"] == LAUNCHER_CONFIGS[name]
    for key in ("cluster_name", "max_workers", "idle_timeout_minutes", "head_node_type", "available_node_types",
                "setup_commands", "head_start_ray_commands", "worker_start_ray_commands"):
        assert key in raw, f"{name}: {key} is not set (the provider default would be used silently)"


def test_launcher_node_types(launcher):
    name, raw, prepared = launcher
    types = raw["available_node_types"]
    head = raw["head_node_type"]
    assert head in types, f"{name}: head_node_type {head!r} is not one of {sorted(types)}"
    assert prepared["available_node_types"][head]["max_workers"] == 0
    assert types[head]["resources"].get("GPU", 0) == 0, "the head is a CPU node"
    assert types[head]["resources"].get("CPU") == 0, "no Ray work scheduled on the head"
    workers = {k: v for k, v in types.items() if k != head}
    assert workers, f"{name}: no worker node types"
    for wname, wtype in workers.items():
        res = wtype["resources"]
        assert res.get("GPU", 0) >= 1 and res.get("CPU", 0) >= 1, f"{name}/{wname} must declare CPU and GPU"
        assert 0 <= wtype["min_workers"] <= wtype["max_workers"] <= raw["max_workers"], f"{name}/{wname}"
    assert sum(w["min_workers"] for w in workers.values()) >= 1, \
        "fedray sizes its pool from the GPUs up when a run starts: keep one GPU node up"


def test_aws_declared_resources_match_instances():
    raw = _load("aws.yaml")
    for tname, t in raw["available_node_types"].items():
        cfg = t["node_config"]
        assert set(cfg) <= {"InstanceType", "ImageId", "BlockDeviceMappings", "InstanceMarketOptions", "KeyName",
                            "SubnetIds", "SecurityGroupIds", "IamInstanceProfile", "TagSpecifications"}, tname
        cpus, gpus = AWS_SHAPES[cfg["InstanceType"]]
        res = t["resources"]
        if tname != raw["head_node_type"]:
            assert res == {"CPU": cpus, "GPU": gpus}, f"{tname}: {cfg['InstanceType']} has {cpus} vCPU, {gpus} GPU"
        assert isinstance(cfg["ImageId"], str) and cfg["ImageId"].startswith("ami-"), tname
    ami = {t["node_config"]["ImageId"] for t in raw["available_node_types"].values()}
    assert len(ami) == 1, "one AMI for every node type (edited once, through the YAML anchor)"


def test_gcp_gpu_nodes_are_well_formed():
    raw = _load("gcp.yaml")
    for tname, t in raw["available_node_types"].items():
        cfg = t["node_config"]
        machine = cfg["machineType"]
        res = t["resources"]
        accel = sum(a["acceleratorCount"] for a in cfg.get("guestAccelerators", []))
        if machine.startswith("a2-"):
            assert not accel, f"{tname}: A2 machine types come with their A100s attached"
            gpus = GCP_A2_GPUS[machine]
        else:
            m = re.fullmatch(r"n1-(?:standard|highmem|highcpu)-(\d+)", machine)
            assert m, f"{tname}: unexpected machine type {machine}"
            gpus = accel
            if tname != raw["head_node_type"]:
                assert res["CPU"] == int(m.group(1)), f"{tname}: {machine} has {m.group(1)} vCPUs"
        assert res.get("GPU", 0) == gpus, f"{tname}: declares {res.get('GPU', 0)} GPUs, the machine has {gpus}"
        if gpus:
            # GPU VMs cannot live-migrate; the Compute API takes `scheduling` as an object.
            assert cfg["scheduling"]["onHostMaintenance"] == "TERMINATE", tname
        image = cfg["disks"][0]["initializeParams"]["sourceImage"]
        assert image.startswith("projects/deeplearning-platform-release/global/images/family/"), tname
    assert raw["provider"]["project_id"], "project_id must be set (a placeholder to edit is fine)"


def test_launcher_commands(launcher):
    name, raw, prepared = launcher
    for key in COMMAND_KEYS:
        for cmd in prepared.get(key, []):
            res = subprocess.run(["bash", "-n", "-c", cmd], capture_output=True, text=True)
            assert res.returncode == 0, f"{name} {key}: bash cannot parse {cmd!r}: {res.stderr}"
    head = " ".join(raw["head_start_ray_commands"])
    assert re.search(r"ray start --head\b", head)
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in head
    hosts = re.findall(r"--dashboard-host[= ](\S+)", head)
    assert hosts == ["127.0.0.1"], f"{name}: the dashboard must bind to 127.0.0.1 only, got {hosts}"
    every = " ".join(c for k in COMMAND_KEYS for c in raw.get(k, []))
    assert "0.0.0.0" not in every, f"{name}: a start or setup command binds to 0.0.0.0"
    assert "$RAY_HEAD_IP:6379" in " ".join(raw["worker_start_ray_commands"])
    setup = " ".join(raw["setup_commands"])
    assert "git clone" in setup and "FEDRAY_REPO=" in setup, "fedray is cloned from the user's fork"
    assert "pip install --quiet -e ~/fedray" in setup and re.search(r"pip install .*\btorch\b", setup)
    assert raw["docker"]["image"] == RAY_IMAGE, f"the container's Ray must be this repo's Ray ({ray.__version__})"
    provider_lib = {"aws": "boto3", "gcp": "google-api-python-client"}[LAUNCHER_CONFIGS[name]]
    assert provider_lib in " ".join(raw["head_setup_commands"]), "the head's autoscaler needs the cloud SDK"


# --------------------------------------------------------------------------------------------------
# KubeRay


def _containers(template):
    return template["spec"]["containers"]


def _check_cluster_spec(spec, where: str, dashboard_host: str) -> None:
    assert spec["rayVersion"] == ray.__version__, f"{where}: rayVersion must match the image's Ray"
    head = spec["headGroupSpec"]
    params = head["rayStartParams"]
    assert all(isinstance(v, str) for v in params.values()), f"{where}: rayStartParams values must be strings"
    assert params.get("dashboard-host") == dashboard_host, where
    assert head.get("serviceType", "ClusterIP") == "ClusterIP", f"{where}: the head Service must stay internal"
    head_c = _containers(head["template"])
    images = {head_c[0]["image"]}
    assert head_c[0]["image"] and head_c[0].get("workingDir") == IMAGE_WORKDIR, where
    assert spec["workerGroupSpecs"], f"{where}: no worker group"
    for group in spec["workerGroupSpecs"]:
        for key in ("groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams", "template"):
            assert key in group, f"{where}: worker group lacks {key}"
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], where
        assert all(isinstance(v, str) for v in group["rayStartParams"].values()), where
        c = _containers(group["template"])[0]
        images.add(c["image"])
        limits, requests = c["resources"]["limits"], c["resources"]["requests"]
        assert int(limits["nvidia.com/gpu"]) >= 1, f"{where}: worker group {group['groupName']} has no GPU limit"
        assert requests.get("nvidia.com/gpu", limits["nvidia.com/gpu"]) == limits["nvidia.com/gpu"], \
            "Kubernetes requires GPU requests == limits"
    assert len(images) == 1, f"{where}: head and workers must run the same image, got {images}"


def test_kuberay_raycluster():
    doc = _load("kuberay-raycluster.yaml")
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayCluster" and doc["metadata"]["name"]
    _check_cluster_spec(doc["spec"], "RayCluster", dashboard_host="127.0.0.1")


def test_kuberay_rayjob_structure():
    doc = _load("kuberay-rayjob.yaml")
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayJob" and doc["metadata"]["name"]
    spec = doc["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    # The operator reaches the job API through the (ClusterIP) head Service: 127.0.0.1 would hang the job.
    _check_cluster_spec(spec["rayClusterSpec"], "RayJob", dashboard_host="0.0.0.0")
    # Otherwise the same cluster as kuberay-raycluster.yaml.
    embedded = copy.deepcopy(spec["rayClusterSpec"])
    embedded["headGroupSpec"]["rayStartParams"]["dashboard-host"] = "127.0.0.1"
    assert embedded == _load("kuberay-raycluster.yaml")["spec"], "rayClusterSpec drifted from the RayCluster"
    env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert set(env) <= RuntimeEnv.known_fields
    RuntimeEnv(**env)
    assert env["env_vars"]["MLFLOW_TRACKING_URI"].startswith("http://")


def test_kuberay_rayjob_entrypoint_parses():
    argv = shlex.split(_load("kuberay-rayjob.yaml")["spec"]["entrypoint"])
    assert argv[:2] == ["fedray", "tune"], "the RayJob runs a fedray sweep"
    assert "--address" in argv, "inside a Ray job fedray must join the job's cluster (--address auto)"
    _check_fedray_command(argv[1:], "RayJob entrypoint")


def test_kuberay_rayjob_spec_file_exists():
    # Relative to the image's working directory, which holds a copy of this repository.
    argv = shlex.split(_load("kuberay-rayjob.yaml")["spec"]["entrypoint"])
    spec = argv[2]
    assert spec.startswith("tune_configs/"), spec
    assert (REPO / spec).is_file(), f"the RayJob runs {spec}, which is not in this repository"


def test_dockerfile():
    text = (CLUSTER / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert f"ARG RAY_IMAGE={RAY_IMAGE}" in lines and "FROM ${RAY_IMAGE}" in lines
    assert f"WORKDIR {IMAGE_WORKDIR}" in lines
    assert any(ln.startswith("COPY ") and ln.endswith(f". {IMAGE_WORKDIR}") for ln in lines)
    assert re.search(r"pip install [^\n]*\btorch\b", text) and re.search(r"pip install --no-cache-dir \.", text)
    ignored = {ln.strip() for ln in (CLUSTER / "Dockerfile.dockerignore").read_text().splitlines()}
    assert {".git", ".venv", "runs", "mlflow.db"} <= ignored
    for manifest in ("kuberay-raycluster.yaml", "kuberay-rayjob.yaml"):
        for c in re.findall(r"workingDir: (\S+)", (CLUSTER / manifest).read_text()):
            assert c == IMAGE_WORKDIR, manifest


# --------------------------------------------------------------------------------------------------
# runtime_env.yaml (ray job submit --runtime-env)


def test_runtime_env_is_a_valid_ray_runtime_env(monkeypatch):
    env = _load("runtime_env.yaml")
    unknown = set(env) - RuntimeEnv.known_fields
    assert not unknown, f"not runtime_env fields (Ray would treat them as plugins): {unknown}"
    monkeypatch.chdir(REPO)  # `ray job submit` is run from the repository root; working_dir "." must exist
    RuntimeEnv(**env)
    assert env["working_dir"] == "."
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in env["env_vars"].items())
    assert env["env_vars"].get("PYTHONUNBUFFERED") == "1"
    assert not {"RAY_AUTH_MODE", "RAY_ADDRESS"} & set(env["env_vars"])


def test_runtime_env_excludes_what_must_not_be_uploaded(tmp_path):
    from ray._private.runtime_env.packaging import create_package

    excludes = _load("runtime_env.yaml")["excludes"]
    tree = tmp_path / "repo"
    keep = ["fedray/cli.py", "tune_configs/spec.yaml", "cluster/runtime_env.yaml", "pyproject.toml"]
    drop = [".venv/lib/x.py", ".git/HEAD", "runs/a/summary.json", "outputs/x", "mlflow.db", "mlruns/0/m",
            "mlartifacts/1/a", "fedray/__pycache__/cli.cpython-311.pyc", "fedray.egg-info/PKG-INFO",
            ".pytest_cache/v", "build/lib/x.py", "benchmarks/results/overhead.json", ".gpu/whl/ray.whl",
            "mutants/fedray/cli.py"]
    for rel in keep + drop:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text("x")
    pkg = tmp_path / "pkg.zip"
    create_package(str(tree), pkg, include_gitignore=False, excludes=excludes)  # what Ray uploads
    files = {n for n in zipfile.ZipFile(pkg).namelist() if not n.endswith("/")}
    assert files == set(keep)

    real = tmp_path / "real.zip"
    create_package(str(REPO), real, include_gitignore=False, excludes=excludes)
    names = zipfile.ZipFile(real).namelist()
    assert "fedray/cli.py" in names and "pyproject.toml" in names
    # ~1.5 MB of code and docs; the recorded results (~14 MB) or a GPU bundle (~45 MB) would show here
    assert real.stat().st_size < 5 * 2**20, "the uploaded working dir should be small"


# --------------------------------------------------------------------------------------------------
# cluster/README.md


def _subcommands() -> dict:
    from fedray.cli import build_parser

    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _check_fedray_command(argv: list[str], where: str) -> None:
    """Parse ``fedray ARGV...`` with fedray's own CLI (as main() does) and check what it names."""
    subs = _subcommands()
    cmd, rest = argv[0], argv[1:]
    if cmd not in subs:
        pytest.fail(f"{where}: 'fedray {cmd}' is not a fedray command ({sorted(subs)})")
    if "-h" in rest or "--help" in rest:
        return
    try:
        args = subs[cmd].parse_intermixed_args(rest)
    except SystemExit as e:  # fedray's parser prints one line and exits 2
        pytest.fail(f"{where}: fedray {shlex.join(argv)} does not parse (exit {e.code})")
    if cmd in ("run", "partition"):
        from fedray.load import load_config

        load_config(args.config, list(args.overrides))  # every override key and value is valid
    if cmd == "tune":
        assert (REPO / args.spec).is_file(), f"{where}: {args.spec} is not in this repository"
        from fedray.sweep.spec import load_spec

        load_spec(str(REPO / args.spec))


def _readme_fedray_commands() -> list[list[str]]:
    text = (CLUSTER / "README.md").read_text()
    commands = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            try:
                tokens = shlex.split(line, comments=True)
            except ValueError:
                continue
            for i, tok in enumerate(tokens):
                at_command_start = i == 0 or tokens[i - 1] in ("--", "&&", ";", "|") or "=" in tokens[i - 1]
                if (tok == "fedray" or tok.endswith("/bin/fedray")) and at_command_start and i + 1 < len(tokens):
                    end = next((j for j in range(i + 1, len(tokens)) if tokens[j] in ("&&", ";", "|")), len(tokens))
                    commands.append(tokens[i + 1:end])
    for span in re.findall(r"`(fedray [^`]+)`", text):
        argv = shlex.split(span)[1:]
        if len(argv) > 1:  # `fedray run` alone names the command; anything longer is a command line
            commands.append(argv)
    return commands


def test_readme_quotes_fedray_commands():
    cmds = _readme_fedray_commands()
    assert any(c[0] == "run" for c in cmds) and any(c[0] == "tune" for c in cmds)


@pytest.mark.parametrize("argv", _readme_fedray_commands(), ids=lambda a: " ".join(a)[:60])
def test_readme_fedray_command_parses(argv):
    _check_fedray_command(argv, "cluster/README.md")


def test_readme_names_existing_files():
    text = (CLUSTER / "README.md").read_text()
    for rel in set(re.findall(r"\bcluster/[\w.-]+", text)):
        assert (REPO / rel).exists(), f"cluster/README.md mentions {rel}, which does not exist"


def test_readme_talks_to_the_dashboard_through_the_tunnel_only():
    text = (CLUSTER / "README.md").read_text()
    code = "\n".join(re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)).replace("\\\n", " ")
    submits = re.findall(r"ray job submit ([^\n]*)", code)
    assert submits
    for rest in submits:
        assert "--address http://127.0.0.1:8265" in rest, f"ray job submit {rest}"
        assert "--runtime-env cluster/runtime_env.yaml" in rest, f"ray job submit {rest}"
    for addr in re.findall(r"--address (http://\S+)", text):
        assert addr.startswith("http://127.0.0.1:"), addr
