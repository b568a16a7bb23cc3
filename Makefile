# Two commands on a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3.11
VENV ?= .venv
BIN = $(VENV)/bin

.PHONY: demo test test-fast install lint bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,embedding]'
	touch $@

demo: install
	$(BIN)/veribus run examples/example.yaml --mode template_and_rubric --run-name demo --output out/demo

# every tier: tests/unit, tests/integration (real nats-server, real chdb), tests/e2e (full stacks)
test: install
	$(BIN)/pytest -q -p no:cacheprovider

# the fast tier: the unit tests and one small full-stack run (marker `smoke`)
test-fast: install
	$(BIN)/pytest -q -p no:cacheprovider -m "unit or smoke"

lint: install
	$(BIN)/ruff check .

bench: install
	$(BIN)/veribus bench

clean:
	rm -rf out .veribus
