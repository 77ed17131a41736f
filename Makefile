# Two commands for a newcomer: `make run` (the default experiment) and `make test` (the whole suite).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.fedray-installed
export RAY_AUTH_MODE ?= disabled

.PHONY: run test install data bytecode site-bytecode mutation clean

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

# The installed packages' bytecode, on every core (pip compiles them one file at a time: 40 s of a 90 s install
# here). A file that does not compile on this Python (torch's Python 3.12 test snippets) is left without one, as
# pip leaves it.
site-bytecode:
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib || true

# Real Fashion-MNIST: Debian's package where we may install it; otherwise fedray downloads it through
# torchvision on first use (into $$FEDRAY_DATA_DIR or ~/.cache/fedray/data).
data:
	@if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  (apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 || \
	   (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist >/dev/null)) && \
	  echo "installed Debian's dataset-fashion-mnist"; \
	fi

# fedray's own bytecode, written once here: where PYTHONDONTWRITEBYTECODE is set (this project's machines, many
# container images) every process of a run, each Ray actor too, would compile fedray's modules again (~0.15 s
# of CPU a process). compileall skips what is up to date.
bytecode: install
	$(BIN)/python -m compileall -q fedray

run: install data bytecode
	$(BIN)/fedray run quickstart federation.optimizer=adam federation.lr=0.001 federation.weight_decay=0.001 \
	  data.min_samples=100 federation.rounds=30 --output-dir runs/make_run/fedavg
	$(BIN)/fedray run dafkd_fmnist federation.rounds=30 --output-dir runs/make_run/dafkd
	$(BIN)/fedray report runs/make_run/fedavg runs/make_run/dafkd --target 0.6 --plot runs/make_run/curves.png

# Two test processes (pytest-xdist): much of the suite waits on Ray, subprocesses and sweeps rather than computing,
# so two share this 2-core machine well. Work stealing with the slow tests first (tests/conftest.py) keeps both
# busy to the end. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: install bytecode
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

# Mutation testing of fedray/methods/ and fedray/learning/ against the fast tests (outside `make test` and CI: hours
# on a 2-core CPU; a stopped run resumes): the record is benchmarks/results/mutation.md.
mutation: install bytecode
	$(BIN)/python -m pip install --quiet -e '.[test,mutation]'
	$(BIN)/python benchmarks/quality/mutation.py

clean:
	rm -rf $(VENV) runs .pytest_cache mutants
