# Two commands for a newcomer: `make run` (the default experiment) and `make test` (the whole suite).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.fedray-installed
export RAY_AUTH_MODE ?= disabled
# bytecode written on first import by every process make starts (Ray's workers included), whatever the machine sets
export PYTHONDONTWRITEBYTECODE :=

.PHONY: run test install data site-bytecode mutation clean

install: $(STAMP)

# torch is capped at 2.14.1 by this machine's pip constraint; elsewhere pip takes the newest torch>=2.4.
# The packages go in with uv (parallel downloads and unpacking: 24 s here against pip's 63 s), told pip's own
# indexes, find-links and constraints (tools/uv_flags.py) and pip's choice among them (unsafe-best-match: the best
# version on any index, as pip); pip installs them wherever uv cannot.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet uv || true
	$(BIN)/uv pip install --quiet --python $(BIN)/python --index-strategy unsafe-best-match \
	  $$($(BIN)/python tools/uv_flags.py) -e '.[test]' \
	  || $(BIN)/python -m pip install --quiet --no-compile -e '.[test]'
	$(MAKE) --no-print-directory site-bytecode
	touch $(STAMP)

# The bytecode of what fedray's processes import (tools/warm_bytecode.py: ~4,900 of the ~18,000 installed modules,
# where compiling them all took ~33 s here). Make's commands write any other module's as they first import it.
site-bytecode:
	$(BIN)/python tools/warm_bytecode.py

# Real Fashion-MNIST: Debian's package where we may install it; otherwise fedray downloads it through
# torchvision on first use (into $$FEDRAY_DATA_DIR or ~/.cache/fedray/data).
data:
	@if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  (apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 || \
	   (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist >/dev/null)) && \
	  echo "installed Debian's dataset-fashion-mnist"; \
	fi

run: install data
	$(BIN)/fedray run quickstart federation.optimizer=adam federation.lr=0.001 federation.weight_decay=0.001 \
	  data.min_samples=100 federation.rounds=30 --output-dir runs/make_run/fedavg
	$(BIN)/fedray run dafkd_fmnist federation.rounds=30 --output-dir runs/make_run/dafkd
	$(BIN)/fedray report runs/make_run/fedavg runs/make_run/dafkd --target 0.6 --plot runs/make_run/curves.png

# Three test processes (pytest-xdist): much of the suite waits on Ray, subprocesses and sweeps rather than computing
# (with two, the 2-core machine was busy 1.2 cores on average): the suite took 509 s with three, 559 s with two and
# 548 s with four on this 2-core Intel Xeon. Work stealing with the slow tests first (tests/conftest.py) keeps them
# busy to the end; the 15 slowest are listed at the end of every run (what to make cheaper first). TEST_WORKERS=0:
# one process.
TEST_WORKERS ?= 3
test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=15 $(PYTEST_ARGS)

# Mutation testing of the engine (the methods, the learning helpers, the system, the channel and its stages, the
# simulation loop, the evaluation, the in-process runtime: [tool.mutmut] in pyproject.toml) against the fast tests
# (outside `make test` and CI: hours on a 2-core CPU; a stopped run resumes): the record is
# benchmarks/results/mutation.md.
mutation: install
	$(BIN)/python -m pip install --quiet -e '.[test,mutation]'
	$(BIN)/python benchmarks/quality/mutation.py

clean:
	rm -rf $(VENV) runs .pytest_cache mutants
