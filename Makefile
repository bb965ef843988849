# Two commands do all the set-up on a fresh machine: `make tune` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
# The torch (and the torchvision built for it) to install when the venv has none. A torchvision
# built for another torch fails to import, so the two travel together.
TORCH       ?= torch==2.14.1
TORCHVISION ?= torchvision==0.29.1
# The oldest transformers pyproject admits: `make test` installs it beside the venv's own (newest) one,
# and tests/test_compile_families.py runs the converted families under both.
TRANSFORMERS_LOW ?= transformers==5.17.0
LOW    := $(VENV)/low-transformers
PY     := $(VENV)/bin/python

.PHONY: tune test venv-tune venv-dev bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

venv-tune: $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[tune,postgres]"

venv-dev: $(PY)
	$(PY) -c "import torch, torchvision" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)" "$(TORCHVISION)"
	$(PY) -m pip install -q -e ".[tune,postgres,dev]"
	test -d $(LOW) || $(PY) -m pip install -q --target $(LOW) "$(TRANSFORMERS_LOW)"

tune: venv-tune
	$(VENV)/bin/opsadv-tune --device cpu --ops gemm,attention

test: venv-dev
	$(PY) -m pytest $(PYTEST_ARGS)

bench: venv-tune
	$(PY) benchmarks/dispatch_overhead.py

clean:
	rm -rf $(VENV) build *.egg-info
