"""``mutmut`` (same arguments) giving each mutant's tests to pytest in an order that finds a kill soonest: mutmut
passes them in the order of a set, so a mutant that one 0.1 s test kills often waited on minutes of sweeps and
subprocesses run before it (``-x`` stops at the first failure: only the tests up to it cost time; a survivor runs
them all whatever the order).

First the tests that killed another mutant of the same function (the latest first): a function's mutants mostly fall
to the same few tests. They are kept in ``mutants/mutmut-killers/<function>`` (one failing test id a line), which
each mutant's process appends to. Then the rest, the tests of one module together (a module-scoped fixture, such as
the report tests' runs, is built once, not each time the order comes back to its module): modules in the order of
their fastest test, each module's tests in the order of their own duration, as mutmut recorded them in its stats.
The verdicts cannot change with the order: tests/conftest.py seeds the global generators before each test, so no
test's outcome hangs on those run before it.
"""

from __future__ import annotations

import sys
from pathlib import Path

KILLERS = Path(__file__).resolve().parents[2] / "mutants" / "mutmut-killers"


def fastest_first(tests, duration: dict[str, float], killers: list[str] = ()) -> list[str]:
    """``tests`` (pytest node ids): those in ``killers`` first, latest first, then the others grouped by module,
    modules by their fastest test, tests by their own duration; a test with no recorded duration last within its
    module (ties by name, so that the order is the same each run)."""
    tests = set(tests)
    first = list(dict.fromkeys(t for t in reversed(killers) if t in tests))

    def seconds(test: str) -> float:
        return duration.get(test, float("inf"))

    by_module: dict[str, list[str]] = {}
    for test in sorted(tests - set(first)):
        by_module.setdefault(test.split("::")[0], []).append(test)
    modules = sorted(by_module.values(), key=lambda group: (min(seconds(t) for t in group), group[0].split("::")[0]))
    return first + [t for group in modules for t in sorted(group, key=lambda t: (seconds(t), t))]


def function_of(mutant_name: str) -> str:
    """``fedray.runtime.core.x_build_method__mutmut_7`` -> ``fedray.runtime.core.x_build_method``."""
    return mutant_name.rsplit("__mutmut_", 1)[0]


class _RecordKillers:
    """pytest plugin: the id of a test that fails, appended to its function's killers file."""

    def __init__(self, path: Path):
        self.path = path

    def pytest_runtest_logreport(self, report) -> None:
        if report.failed:
            self.path.parent.mkdir(exist_ok=True)
            with self.path.open("a") as f:
                f.write(report.nodeid + "\n")


def main() -> int:
    from mutmut.__main__ import cli
    from mutmut.runners.harness import PytestRunner
    from mutmut.state import state
    from mutmut.utils.file_utils import change_cwd

    def run_tests(self, *, mutant_name, tests):
        if not mutant_name:  # the clean run, the forced fail: mutmut's own
            return in_mutmuts_order(self, mutant_name=mutant_name, tests=tests)
        path = KILLERS / function_of(mutant_name)
        killers = path.read_text().split() if path.exists() else []
        with change_cwd("mutants"):
            return int(self.execute_pytest(self._pytest_args_regular_run(
                fastest_first(tests, state().duration_by_test, killers)), plugins=[_RecordKillers(path)]))

    in_mutmuts_order = PytestRunner.run_tests
    # before mutmut forks: its children (one a mutant) inherit the patch
    PytestRunner.run_tests = run_tests
    return cli()


if __name__ == "__main__":
    sys.exit(main())
