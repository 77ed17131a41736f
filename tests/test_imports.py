"""Which fedray modules may import which: checked on the source, so function-local imports count too."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import fedray
from tests.conftest import built_in_methods

PACKAGE = Path(fedray.__file__).parent


def _imported(module: str) -> set[str]:
    """Every module named by an import anywhere in ``fedray.<module>`` (top level or inside functions)."""
    path = PACKAGE.joinpath(*module.split(".")).with_suffix(".py")
    if not path.exists():  # a package: its __init__
        path = PACKAGE.joinpath(*module.split("."), "__init__.py")
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # from fedray import tracking
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"fedray.{module} uses a relative import; the checks below need absolute ones")
    return names


def _imports_any(module: str, forbidden: str) -> bool:
    return any(name == forbidden or name.startswith(forbidden + ".") for name in _imported(module))


def test_the_helper_sees_local_imports():
    # cli imports fedray.simulation only inside its commands
    assert _imports_any("cli", "fedray.simulation")


@pytest.mark.parametrize(("module", "forbidden"), [
    ("record.tracking", "fedray.simulation"),  # MLflow only; the run directory is fedray.record.run_dir
    ("simulation", "fedray.record.tracking"),  # the round loop reaches MLflow only through hooks
    ("record.run_dir", "fedray.record.tracking"),
    ("record.run_dir", "fedray.simulation"),
    ("record.console", "fedray.record.tracking"),
    ("record.console", "fedray.simulation"),
    # DaFKD's client and server steps read the method through a Protocol (types.DaFKDMethod) and its losses from
    # losses.py: no circle through method.py, not even under TYPE_CHECKING (which this check counts)
    ("methods.dafkd.client", "fedray.methods.dafkd.method"),
    ("methods.dafkd.server", "fedray.methods.dafkd.method"),
    ("methods.dafkd.losses", "fedray.methods.dafkd.method"),
    ("config", "fedray.methods"),  # loading a config builds no method or model
    ("config", "fedray.models"),
])
def test_module_does_not_import(module, forbidden):
    assert not _imports_any(module, forbidden), f"fedray.{module} imports {forbidden}"


def _modules_under(package: str) -> list[str]:
    base = PACKAGE.joinpath(*package.split("."))
    if base.with_suffix(".py").exists():
        return [package]
    return [f"{package}.{p.relative_to(base).with_suffix('').as_posix().replace('/', '.')}".removesuffix(".__init__")
            for p in sorted(base.rglob("*.py"))]


@pytest.mark.parametrize("package", ["runtime", "simulation", "record", "evaluation", "methods", "learning"])
def test_running_and_recording_a_run_import_nothing_of_the_report(package):
    """``fedray report``'s tables and plots (fedray.report) read finished runs; nothing that runs or records one
    imports them, so loading a checkpoint or starting an actor leaves the report's code out."""
    importers = [m for m in _modules_under(package) if _imports_any(m, "fedray.report")]
    assert not importers, f"{importers} import fedray.report"


@pytest.mark.parametrize("method", [m for m in _modules_under("methods") if m not in ("methods", "methods.registry")])
def test_a_method_imports_nothing_of_where_it_runs(method):
    """A method is plain PyTorch on the contract (fedray.methods.api) and the learning helpers: never the runtime,
    the vectorised engine, the round loop, the run's record, the evaluation or the report."""
    where = ["fedray.runtime", "fedray.vectorized", "fedray.simulation", "fedray.record", "fedray.evaluation",
             "fedray.report", "fedray.sweep", "fedray.cli", "ray"]
    assert not [w for w in where if _imports_any(method, w)], f"fedray.{method} imports {where}"


def test_scaffold_needs_the_contract_module_alone():
    """Everything a method needs of the contract comes from fedray.methods.api: SCAFFOLD, built on FedAvg, imports
    that and its base class, nothing else of fedray."""
    ours = {n for n in _imported("methods.scaffold") if n.startswith("fedray.")}
    assert {n.rsplit(".", 1)[0] if n.rsplit(".", 1)[0] in ("fedray.methods.api", "fedray.methods.fedavg") else n
            for n in ours} == {"fedray.methods.api", "fedray.methods.fedavg"}, ours


def test_no_module_imports_another_modules_private_names():
    """A name starting with ``_`` is its module's own: another module importing it would break when it changes."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fedray"):
                found += [f"{path.relative_to(PACKAGE.parent)}: {a.name} from {node.module}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert not found, "\n".join(found)


def _loaded_after(imports: str, *modules: str) -> list[str]:
    """Which of ``modules`` a fresh interpreter has loaded after ``import <imports>``."""
    code = f"import sys, {imports}; print(','.join(m for m in {modules!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return [m for m in out.stdout.strip().split(",") if m]


def test_start_up_imports_stay_light():
    """What every Ray actor and the driver import before round 1 (all methods, the runtime, the round loop)
    leaves out scipy.optimize (~0.25 s, FedCD's server only), torch's compiler stack (~1 s) and MLflow:
    every process pays for these on a start-up that is CPU-bound on a small machine."""
    assert _loaded_after("fedray.runtime.actors, fedray.simulation", "scipy.optimize", "torch._dynamo", "mlflow") == []


def test_the_ray_actors_module_imports_no_torch_at_its_top():
    """A Ray worker process imports ``fedray.runtime.actors`` when it receives an actor's class, before the
    actor's ``__init__`` pauses the garbage collector for torch's, pydantic's and fedray's imports."""
    assert _loaded_after("ray, fedray.runtime.actors", "torch", "pydantic", "fedray.runtime.core",
                         "fedray.runtime.server_core") == []


def test_the_command_line_imports_no_torch_before_it_starts_ray():
    """``fedray run`` starts Ray before it imports torch and the methods (they load in a thread meanwhile,
    :func:`fedray.runtime.ray_start.start_ray_during`): what it imports up to there leaves torch out, and an
    in-process run's leaves ray out too."""
    assert _loaded_after("fedray.cli, fedray.config, fedray.runtime, fedray.runtime.ray_start", "torch", "ray") == []


def test_a_method_module_is_imported_when_its_name_is_looked_up():
    """Every Ray actor imports fedray.methods: it loads the method a run names, not all of them (~0.1 s of
    CPU each on a CPU-bound start-up), yet lists every built-in and still refuses a clashing registration."""
    code = """
import sys
import fedray.runtime.actors
from fedray.methods import ALGORITHMS, get_algorithm, register_algorithm
loaded = lambda: sorted(n for n in ALGORITHMS if f"fedray.methods.{n}" in sys.modules)
before = loaded()
get_algorithm("fedprox")
after = loaded()
class Clash(get_algorithm("fedavg")):
    name = "dafkd"
try:
    register_algorithm(Clash)
    refused = False
except ValueError:
    refused = True
print(before, after, len(ALGORITHMS), "fedd3a" in ALGORITHMS, refused)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[0] == f"[] ['fedavg', 'fedprox'] {len(built_in_methods())} True True"


def test_training_never_imports_torchs_compiler_stack():
    """Local and server-side optimizers (fedray.learning.optim) step without torch.optim.Optimizer, whose methods
    import torch._dynamo on first use (~1 s and ~150 MB in every process that trains): a round of FedAvg, DaFKD
    (GAN steps, server distillation), FedKF (generator Adam) and FedDF (proxy distillation), one by one and
    batched, leaves it out."""
    code = """
import sys
from fedray.simulation import run_experiment
from tests.conftest import method_overrides, tiny_config
for vec in (False, True):
    for kw in map(method_overrides, ("fedavg", "dafkd", "fedkf", "feddf")):
        run_experiment(tiny_config(federation__rounds=1, runtime__vectorize=vec, **kw), progress=False)
print("torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent)
    assert out.stdout.strip().splitlines()[-1] == "False"
