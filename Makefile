# The two commands of the README: `make demo` (install, then run the demo) and `make test`.
VENV ?= .venv
PYTEST_ARGS ?=

.PHONY: install demo test lint bench clean

install:
	@./scripts/setup.sh

demo: install
	$(VENV)/bin/kvmesh demo

test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: install
	$(VENV)/bin/python -m benchmarks.hashing
	$(VENV)/bin/python -m benchmarks.allocator
	$(VENV)/bin/python -m benchmarks.disk
	$(VENV)/bin/python -m benchmarks.remote
	$(VENV)/bin/python -m benchmarks.codec
	$(VENV)/bin/python -m benchmarks.engine
	$(VENV)/bin/python -m benchmarks.controller
	$(VENV)/bin/python -m benchmarks.p2p
	$(VENV)/bin/python -m benchmarks.pd
	$(VENV)/bin/python -m benchmarks.load
	$(VENV)/bin/python -m benchmarks.ttft

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
