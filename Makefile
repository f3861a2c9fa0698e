# Two entry points (see README): `make run` reproduces, `make test` tests.
# Both create .venv on first use with the tested route: pip + venv, Python >= 3.10, the
# package with every extra (`pip install adaptiveload` alone is the light core).
PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
CORES  ?= all
# pytest processes: the suite is mostly subprocesses (Snakemake, torchrun, CLI runs) that
# leave a core idle while they start; a test file runs in one process (its fixtures once),
# the longest files first (tests/support/suite_order.py: LONGEST_FIRST)
WORKERS ?= 2
PYTEST  := $(VENV)/bin/python -m pytest -q -n $(WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: setup run test check lint clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -e '.[all,dev]'
	rm -f $(VENV)/.installed-* && touch $@

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/snakemake --profile workflow/profiles/default --cores $(CORES)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PYTEST)

# the developer's fast lane: ruff and every module's unit tests, without the end-to-end tests
# (`slow`: Snakemake, torchrun, installs, subprocess-heavy CLI runs) and the CUDA-only ones
check: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PYTEST) -m "not slow and not cuda"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/snakemake --lint

# what the pipeline writes (every results/<experiment>/, the default's tables and figures, the
# MLflow store, logs, job benchmarks); the committed results/benchmarks/ and results/reference/
# stay, and so does build/ (the kernel build: `rm -rf build` to redo it)
clean:
	find results -mindepth 1 -maxdepth 1 ! -name benchmarks ! -name reference -exec rm -rf {} +
	rm -rf logs benchmarks .snakemake
