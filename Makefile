# `make demo` and `make test` each bootstrap .venv on a fresh machine.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# --no-compile: pip would byte-compile every installed file (~100 s of CPU for torch, TF, JAX); Python compiles
# only what is imported, on first import, and keeps it in $(VENV)/pycache: also where PYTHONDONTWRITEBYTECODE is
# set (as on these machines), else every process the tests start (ddp_spawn and torchrun ranks, TF workers, CLI
# runs, pytest on the other Keras backends) compiles torch's, Lightning's and TF's sources again: ~25 s of CPU
# for a process importing the three (tests that start processes: ~40% faster with the cache).
unexport PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX := $(CURDIR)/$(VENV)/pycache
# pip's config on these machines names local indexes that may be absent: hide that noise only.
QUIET := 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }

.PHONY: demo test lint venv clean docs docs-serve docs-check

$(STAMP): requirements-test.txt requirements-nodeps.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile -r requirements-test.txt $(QUIET)
	$(PY) -m pip install -q --no-compile --no-deps -r requirements-nodeps.txt $(QUIET)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e . $(QUIET)
	$(PY) -c "import torch, lightning, keras, tensorflow, keras_hub, mp_callbacks"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m mp_callbacks demo

# ruff (pyflakes, pycodestyle, import order, PEP 604 hints) and import-linter's contracts (pyproject.toml):
# a layer breach or an import circle fails here, before the tests.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

test: lint
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=30

# The documentation site (mkdocs.yml; guides in docs/guides, API pages from the docstrings in docs/api).
# --strict: a broken link or anchor, an unresolved reference or an unparsable docstring fails the build.
# `make test` runs the same strict build (tests/docs/test_site.py) and every code block of the docs.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir build/site

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve --strict --dev-addr 127.0.0.1:8000

# The site and the mpx compare HTML report in headless Chromium (Debian's chromium, installed here when
# absent: ~50 s on a fresh machine, which is why `make test` only uses a browser already there).
# Screenshots: build/screenshots (SCREENSHOTS=DIR to move them).
SCREENSHOTS ?= build/screenshots
docs-check: $(STAMP)
	command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }
	MP_REQUIRE_CHROMIUM=1 MP_SCREENSHOTS=$(abspath $(SCREENSHOTS)) $(PY) -m pytest -q \
		tests/docs/test_browser.py tests/cli/test_html_report.py
	@echo "screenshots: $(SCREENSHOTS)"

clean:
	rm -rf $(VENV) build *.egg-info
