# Two entry points (see README): `make demo` runs the whole job on the bundled corpus,
# `make test` runs the test suite. Both create .venv and install what they need.
PYTHON ?= python3
# torch first and pinned: an unpinned torch pulls whatever build the index offers first
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
DEMO := examples/demo
DEMO_STORE ?= demo.zarr

.PHONY: demo test install clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip "setuptools>=68"  # the packaging test builds the wheel with it
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

demo: install
	$(BIN)/lazyrag index $(DEMO)/corpus.jsonl --store $(DEMO_STORE)
	$(BIN)/lazyrag answer $(DEMO)/queries.jsonl --store $(DEMO_STORE) --out demo-answers.jsonl
	$(BIN)/lazyrag stats --store $(DEMO_STORE)

test: install
	$(BIN)/python -m pytest -q -ra

clean:
	rm -rf $(VENV) $(DEMO_STORE) demo-answers.jsonl
