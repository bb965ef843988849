# Two commands do all the set-up on a fresh machine: `make tune` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
# The torch to install when the venv has none (here: the CPU build; on a GPU box, any CUDA build).
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python

.PHONY: tune test venv-tune venv-dev bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

venv-tune: $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[tune,postgres]"

venv-dev: $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[tune,postgres,dev]"

tune: venv-tune
	$(VENV)/bin/opsadv-tune --device cpu --ops gemm,attention

test: venv-dev
	$(PY) -m pytest $(PYTEST_ARGS)

bench: venv-tune
	$(PY) benchmarks/dispatch_overhead.py

clean:
	rm -rf $(VENV) build *.egg-info
