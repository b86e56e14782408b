# The README's two commands: `make book` and `make test`. Each sets itself up first
# (a .venv with the project and its extras), idempotently: a second run installs nothing.
#
# TORCH names the torch to install when the venv has none. Left empty, a Linux machine without an
# NVIDIA GPU gets the CPU build (PyTorch's CPU index; if that is unreachable, torch==$(TORCH_CPU_FALLBACK),
# whose CPU build these project machines keep on disk), and anything else gets "torch>=2.5".
# CI sets TORCH=torch==2.13.0.
#
# `make test` runs the unit tests and, under nbval, every notebook of the chapters book.yml marks
# written (`python -m minillm.book notebooks` lists them).
#
# `make book` runs copies of the chapters and solutions in _build/ and builds the web book from them;
# the notebooks in chapters/ and solutions/ are only read, so a clone stays clean. Runs are cached in
# _build/.cache/executed/: a notebook runs again only when its code cells or the engine's files
# (minillm/, kernels/, results/) change. `python -m minillm.book.site --no-execute` builds from the
# committed outputs instead.
#
# `make notebooks` is for authors: it re-runs the chapters and solutions in place and saves their
# outputs into the notebooks, to be committed (one notebook:
# `python -m minillm.book.site --execute-sources chapters/01_decoding.ipynb`). It builds no site.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  ?=
TORCH_CPU_FALLBACK := 2.13.0
JOBS   ?= 2
# torch threads per test worker (and per notebook kernel). JOBS workers with 2 threads each on 2 cores
# oversubscribe them, and an OpenMP thread waiting for a busy core stalls a whole matmul: measured 20-50x
# slower on this book's 2-core machine, enough to time out a notebook cell. One thread each avoids it.
TEST_THREADS ?= 1

.PHONY: setup test book notebooks lab lint bench clean

setup: $(VENV)/.installed

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.torch: | $(PY)
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "torch already in $(VENV): $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif [ -n "$(TORCH)" ]; then \
		$(PIP) install "$(TORCH)"; \
	elif [ "$$(uname -s)" = Linux ] && ! nvidia-smi >/dev/null 2>&1; then \
		echo "No NVIDIA GPU: installing the CPU build of torch"; \
		$(PIP) install --retries 1 --timeout 15 torch --index-url https://download.pytorch.org/whl/cpu \
		|| $(PIP) install "torch==$(TORCH_CPU_FALLBACK)"; \
	else \
		$(PIP) install "torch>=2.5"; \
	fi
	@touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(PIP) install -e ".[dev,book]"
	@touch $@

test: setup
	$(VENV)/bin/ruff check .
	OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -n $(JOBS) --dist loadfile tests --nbval-lax $$($(PY) -m minillm.book notebooks)

book: setup
	$(PY) -m minillm.book.site

notebooks: setup
	$(PY) -m minillm.book.site --execute-sources

lab: setup
	$(VENV)/bin/jupyter lab chapters/

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(PY) benchmarks/decode_batch1.py

clean:
	rm -rf $(VENV) _build .pytest_cache .ruff_cache *.egg-info
