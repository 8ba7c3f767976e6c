# Two commands on a fresh machine:  `make demo` (install + run the local demo swarm)  and  `make test` (install + run all tests).
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
ARGS   ?=

.PHONY: setup setup-test demo test test-fast lint bench browser clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

demo: setup
	$(PY) -m node demo $(ARGS)

# Debian's chromium drives the dashboard test; installed only when missing (needs root, as on CI).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Debian chromium for the dashboard test"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	  || echo "warning: could not install chromium; the browser test will be skipped"; }

test: lint browser
	$(PY) -m pytest -q --durations=15 $(ARGS)

test-fast: setup-test
	$(PY) -m pytest -q tests/unit $(ARGS)

# Lint and types run before the suite (CI calls `make test`): ruff's rules and format, mypy (config in pyproject).
lint: setup-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) runs tests/artifacts
