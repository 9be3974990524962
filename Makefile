# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch lies on local disk; an unpinned torch pulls a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: demo test test-all lint format clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e ".[test,notebooks]"
	touch $@

# The demo samples (min-p): greedy decoding from the small shipped model falls into indentation runs.
demo: $(VENV)/.installed
	$(PY) -m decoding "def fibonacci(n):" --max-new-tokens 200 --temperature 1.0 --min-p 0.1

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed-test
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: lint
	$(PY) -m pytest -n 2 -m "not slow" -q

test-all: lint
	$(PY) -m pytest -n 2 -q

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
