# Two commands on a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3.11
VENV ?= .venv
BIN = $(VENV)/bin

.PHONY: demo test install lint bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,embedding]'
	touch $@

demo: install
	$(BIN)/veribus run examples/example.yaml --simulate --mode template_and_rubric --run-name demo --output out/demo

test: install
	$(BIN)/pytest -q -p no:cacheprovider

lint: install
	$(BIN)/ruff check .

bench: install
	$(BIN)/veribus bench

clean:
	rm -rf out .veribus
