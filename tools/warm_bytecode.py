"""Write the bytecode of what fedray's processes import, by importing it (``make install``'s last step).

Compiling every installed file (``compileall``, ~18,000 modules) took ~33 s on both cores of a 2-core machine;
a run, a Ray worker and the tests import ~4,900 of them. Importing them with bytecode writing on compiles exactly
those: torch's side and Ray's and MLflow's side in two processes at once, then every fedray module (what is left of
their imports). Where PYTHONDONTWRITEBYTECODE is set (this project's machines, many container images) a process
would otherwise compile each of them again at every start (~3 s of CPU for torch alone, in every Ray worker).
A module none of these imports is compiled by the first make command that imports it (the Makefile clears
PYTHONDONTWRITEBYTECODE for its commands).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys

SIDES = ("import torch, torchvision",
         "import ray, ray.tune, mlflow, optuna, pandas, pyarrow.parquet, matplotlib.pyplot, dp_accounting")


def main() -> int:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": ""}
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):  # this process too must write what it imports
        return subprocess.call([sys.executable, __file__], env=env)
    sides = [subprocess.Popen([sys.executable, "-c", side], env=env) for side in SIDES]
    failed = [side for side, proc in zip(SIDES, sides) if proc.wait() != 0]
    import fedray

    for module in pkgutil.walk_packages(fedray.__path__, "fedray."):
        importlib.import_module(module.name)
    if failed:
        print(f"warm_bytecode: {failed} failed (left to compile on first import)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
