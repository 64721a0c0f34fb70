# make lab   - install what the labs need into .venv and open JupyterLab on labs/
# make book  - install the book tools, execute every page and build book/_build/html strictly
# make test  - install everything, lint, then run labkit's tests, nbval on every lab and the book build
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Jupyter refuses to start as root without this flag (containers, CI machines).
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: lab book test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# One stamp per set of extras, so `make lab` never pulls the test-only reference stack.
$(VENV)/.installed-%: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[$(subst +,$(comma),$*)]"
	touch $@

comma := ,

lab: $(VENV)/.installed-lab
	$(BIN)/jupyter lab $(ROOT_FLAG) labs/

book: $(VENV)/.installed-book
	$(BIN)/jupyter-book build -W -n --keep-going book

test: $(VENV)/.installed-lab+book+test+ref
	$(BIN)/ruff check labkit tests
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) book/_build .pytest_cache .hypothesis
