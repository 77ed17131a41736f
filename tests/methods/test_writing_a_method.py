"""docs/writing-a-method.md runs as written: its Python blocks, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

from fedray.methods import ALGORITHMS

DOC = Path(__file__).resolve().parents[2] / "docs" / "writing-a-method.md"
ADDED = ("myprox", "myscaffold", "mydf", "counting")


def test_the_walkthrough_runs_and_each_method_trains(capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 5, "the walkthrough lost its code"
    namespace: dict = {}
    try:
        for block in blocks:
            exec(compile(block, str(DOC), "exec"), namespace)
        prox, df, run = namespace["prox"], namespace["df"], namespace["run"]
        assert len(prox.history) == 2 and 0 <= prox.summary["eval/accuracy"] <= 1
        assert df.history[-1]["server/kd_loss"] > 0  # the server distilled
        assert [row["server/clients"] for row in run.history] == [4.0, 4.0]
        # the refused config printed its one line naming the key
        assert "data.server_data.kind: mydf distils on data held by the server" in capsys.readouterr().out
    finally:
        for name in ADDED:
            ALGORITHMS.pop(name, None)


def test_the_files_a_new_method_touches_are_the_ones_listed():
    text = DOC.read_text()
    for path in ("fedray/methods/registry.py", "tests/conftest.py", "METHOD_CASES", "README", "docs/methods.md",
                 "docs/configuration.md", "fedray.methods.api"):
        assert path in text


def test_every_declaration_and_hook_of_the_contract_is_on_the_page():
    """Every public name of Algorithm, PersonalisedAlgorithm and FedAvg (the local-SGD family's hooks) is given in
    backticks on docs/writing-a-method.md: nothing a method may declare or override is undocumented."""
    from fedray.methods.api import Algorithm, PersonalisedAlgorithm
    from fedray.methods.fedavg import FedAvg

    ticked = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", " ".join(re.findall(r"`([^`\n]+)`", DOC.read_text()))))
    instance = {"cfg", "spec", "params", "server_data", "client_label_counts"}  # set by Algorithm.__init__
    # (mutmut's copies of each method, `xǁAlgorithmǁcaches__mutmut_1`, are not the contract: `make mutation`)
    missing = {cls.__name__: sorted(n for n in {*dir(cls), *instance}
                                    if not n.startswith("_") and n not in ticked and "__mutmut_" not in n)
               for cls in (Algorithm, PersonalisedAlgorithm, FedAvg)}
    assert not any(missing.values()), f"not on docs/writing-a-method.md: {missing}"
