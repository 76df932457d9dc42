# Single entry point: CI calls these targets unchanged.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PYTHON := $(BIN)/python
INSTALLED := $(VENV)/.installed
# Every package `make venv` installs, pinned with hashes (pip-tools; `make lock` regenerates it).
LOCK := requirements.lock
PROTOS := $(shell find protos -name '*.proto')
GEN_STAMP := gen/.generated
export TEST_POSTGRES_DSN ?= postgresql://127.0.0.1:5432/test
# Everything talks over loopback; never send it through a proxy set in the environment.
export NO_PROXY := 127.0.0.1,localhost,$(NO_PROXY)
export no_proxy := 127.0.0.1,localhost,$(no_proxy)
PYTEST_ARGS ?=
# Test processes (pytest-xdist): most tests wait on the services they start, so two share the
# two cores well (a whole run about 8 minutes instead of 14 here). 0: one process, no workers.
TEST_WORKERS ?= 2

.PHONY: help venv lock protos check-protos run test test-fast bench lint typecheck fmt clean

help:
	@echo "make run [SAY='帮助']   run the whole stack and chat as a player (SAY: one message, then exit)"
	@echo "                       MODEL=offline: with a local scripted model instead of none"
	@echo "make test              run every test (unit, in-process services, end-to-end)"
	@echo "make bench             run the benchmarks and record results under bench/results/"
	@echo "make protos            regenerate Python stubs in gen/ from protos/"
	@echo "make check-protos      fail when gen/ does not match protos/"
	@echo "make lint / make fmt   check style with ruff and types with mypy / fix style with ruff"
	@echo "make lock              re-resolve requirements.lock from pyproject.toml (after editing dependencies)"
	@echo "make java-client       build clients/java (javac, Debian's jars) and run its example against a stack"

$(INSTALLED): pyproject.toml $(LOCK)
	$(PY) -m venv $(VENV)
	@# Exactly the locked versions (hash-checked), then the project itself without resolving again.
	$(BIN)/pip install --quiet --require-hashes -r $(LOCK)
	$(BIN)/pip install --quiet --no-deps -e .
	@# gen/ holds generated stubs whose imports start at `system.`; put it on the venv's path.
	$(PYTHON) -c 'import sysconfig, pathlib; pathlib.Path(sysconfig.get_paths()["purelib"], "system_protos.pth").write_text("$(CURDIR)/gen\n")'
	touch $@

venv: $(INSTALLED)

# Resolves pyproject.toml's dependencies and the dev and bench extras again, keeping the versions
# already locked where they still fit (`make lock UPGRADE=1` takes the newest allowed instead).
# requirements-runtime.lock: the runtime packages alone at the same versions, for the image.
PIP_COMPILE = $(BIN)/pip-compile --quiet --generate-hashes --strip-extras --allow-unsafe \
	--no-emit-index-url --no-emit-find-links
lock: $(INSTALLED)
	$(PIP_COMPILE) --extra dev --extra bench $(if $(UPGRADE),--upgrade) --output-file $(LOCK) \
		pyproject.toml
	$(PIP_COMPILE) --constraint $(LOCK) --output-file requirements-runtime.lock pyproject.toml

$(GEN_STAMP): $(INSTALLED) $(PROTOS) scripts/gen_protos.py
	$(PYTHON) scripts/gen_protos.py
	touch $@

protos: $(GEN_STAMP)

check-protos: $(INSTALLED)
	$(PYTHON) scripts/gen_protos.py --check

run: $(GEN_STAMP)
	$(PYTHON) -m services.stack $(if $(SAY),--say '$(SAY)') $(if $(filter offline,$(MODEL)),--offline-model)

test: $(GEN_STAMP)
	$(PYTHON) -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

test-fast: $(GEN_STAMP)
	$(PYTHON) -m pytest -n $(TEST_WORKERS) -m 'not e2e' $(PYTEST_ARGS)

bench: $(GEN_STAMP)
	$(PYTHON) -m bench.skeleton
	$(PYTHON) -m bench.storage
	$(PYTHON) -m bench.ledgers
	$(PYTHON) -m bench.router
	$(PYTHON) -m bench.model_gateway
	$(PYTHON) -m bench.engine --tasks 2999 --rounds 5
	$(PYTHON) -m bench.tls
	$(PYTHON) -m bench.intent_cache
	$(PYTHON) -m bench.scaleout
	$(PYTHON) -m bench.edge
	$(PYTHON) -m bench.java_client
	$(PYTHON) -m bench.keepalive
	$(PYTHON) -m bench.shop

.PHONY: java-client
java-client: $(GEN_STAMP)
	$(PYTHON) scripts/java_client_check.py

lint: $(GEN_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# mypy alone ([tool.mypy] in pyproject.toml: strict on the four service packages).
typecheck: $(GEN_STAMP)
	$(BIN)/mypy

fmt: $(INSTALLED)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) gen data .pytest_cache .hypothesis
