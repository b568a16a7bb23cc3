# Two commands on a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3.11
VENV ?= .venv
BIN = $(VENV)/bin

.PHONY: demo test test-fast test-deps install os-deps lint bench clean

install: $(VENV)/.installed os-deps

# The template sandbox's jail is bubblewrap (Debian); without it template calls fail closed.
os-deps:
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; } || { echo "veribus needs bubblewrap (apt-get install bubblewrap)"; exit 1; }

# A registry download can stall mid-file (seen in CI: chdb-core's 181 MB wheel stopped at 103 MB
# through pip's five resumes), so each install is tried three times, 30 s apart, before make fails.
EXTRAS = test,embedding,otel
RETRY = for i in 1 2 3; do $(1) && break; [ $$i = 3 ] && exit 1; echo "install failed (attempt $$i of 3); retrying in 30 s" >&2; sleep 30; done

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(call RETRY,$(BIN)/pip install -q --upgrade pip)
	$(call RETRY,$(BIN)/pip install -q --resume-retries 20 torch==2.13.0)
	$(call RETRY,$(BIN)/pip install -q --resume-retries 20 -e '.[$(EXTRAS)]')
	touch $@

demo: install
	$(BIN)/veribus run examples/example.yaml --simulate --mode template_and_rubric --run-name demo --output out/demo

# Browser tests drive Debian's Chromium through Playwright (never `playwright install`).
test-deps:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || { echo "the browser tests need Debian's chromium (apt-get install chromium)"; exit 1; }

# every tier: tests/unit, tests/integration (real nats-server, real chdb), tests/e2e (full stacks)
test: install test-deps
	$(BIN)/pytest -q -p no:cacheprovider

# the fast tier: the unit tests and one small full-stack run (marker `smoke`), in two processes
# (pytest-xdist; a test file stays in one process, so its module fixtures are made once)
test-fast: install
	$(BIN)/pytest -q -p no:cacheprovider -m "unit or smoke" -n 2 --dist loadfile

lint: install
	$(BIN)/ruff check .

bench: install
	$(BIN)/veribus bench

clean:
	rm -rf out .veribus
