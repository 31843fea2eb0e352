# Quick start: `make demo` (install + a real 2-process training run) and `make test` (install + tests);
# `make docs` builds the documentation site into site/.
#
# The install creates .venv and puts torch in it first. TORCH_SPEC defaults to the CPU build
# torch==2.13.0 where a local wheel of it is offered to pip (as on our CPU machines); if .venv
# already has a torch (e.g. a CUDA build you installed), it is left alone. To choose another,
# install it into .venv before `make`, or pass pip arguments: make demo TORCH_SPEC="torch==2.9.1"

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.commsched-installed
DEV_STAMP := $(VENV)/.commsched-dev-installed

.PHONY: install install-dev demo lint test test-quick test-gpu bench docs clean

# what the demo needs: the library and the lab (the bench it runs); install-dev adds the test and docs tools
install: $(STAMP)

install-dev: $(DEV_STAMP)

$(STAMP): pyproject.toml src/commsched/__init__.py  # the version lives in __init__
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install $(TORCH_SPEC)
	$(PY) -m pip install -e ".[lab]"
	touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install -e ".[dev]"
	touch $(DEV_STAMP)

# e.g. make demo DEMO_ARGS="--steps 20 --rounds 3"  (python -m commsched.bench.demo --help lists them)
DEMO_ARGS ?=
demo: install
	$(PY) -m commsched.bench.demo $(DEMO_ARGS)

# ruff: the formatter and the linter at 120 columns (pyproject.toml); `ruff format .` fixes what it can
lint: install-dev
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest

# the tests that start no worker process (1-3 minutes; `make test` runs everything, as CI does)
test-quick: install-dev
	$(PY) -m pytest -m quick

# the GPU suite alone (CUDA + NCCL; install a CUDA build of torch into .venv first, see above)
test-gpu: install-dev
	$(PY) -m pytest -m gpu tests/gpu

# e.g. make bench BENCH_ARGS="link.rate=1gbit models=[small_cnn,resnet18]"  (a slow link needs root)
BENCH_ARGS ?=
bench: install
	$(VENV)/bin/commsched-bench $(BENCH_ARGS)

# the documentation site (mkdocs.yml, docs/) into site/; --strict: a broken link or a missing page fails
docs: install-dev
	$(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) .pytest_cache site
