"""``mutmut`` (same arguments) running each mutant's tests fastest first: mutmut passes them to pytest in the order of a
set, so a mutant that a 0.1 s test kills often waited on minutes of sweeps and subprocesses run before it (``-x``
stops at the first failure: only the order of the tests up to it costs time; a survivor runs them all either way).

The tests of one module stay together (a module-scoped fixture, such as the report tests' runs, is built once, not
each time the order comes back to its module): modules in the order of their fastest selected test, the tests of
each in the order of their own duration, both as mutmut recorded them in its stats. The verdicts cannot change with
the order: tests/conftest.py seeds the global generators before each test, so no test's outcome hangs on those
run before it.
"""

from __future__ import annotations

import sys


def fastest_first(tests, duration: dict[str, float]) -> list[str]:
    """``tests`` (pytest node ids) grouped by module, modules by their fastest test, tests by their own duration; a
    test with no recorded duration last within its module (ties by name, so that the order is the same each run)."""
    def seconds(test: str) -> float:
        return duration.get(test, float("inf"))

    by_module: dict[str, list[str]] = {}
    for test in tests:
        by_module.setdefault(test.split("::")[0], []).append(test)
    modules = sorted(by_module.values(), key=lambda group: (min(seconds(t) for t in group), group[0].split("::")[0]))
    return [t for group in modules for t in sorted(group, key=lambda t: (seconds(t), t))]


def main() -> int:
    from mutmut.__main__ import cli
    from mutmut.runners.harness import PytestRunner
    from mutmut.state import state

    in_mutmuts_order = PytestRunner._pytest_args_regular_run

    def in_this_order(self, tests):
        return in_mutmuts_order(self, fastest_first(tests, state().duration_by_test))

    # before mutmut forks: its children (one a mutant) inherit the patch
    PytestRunner._pytest_args_regular_run = in_this_order
    return cli()


if __name__ == "__main__":
    sys.exit(main())
