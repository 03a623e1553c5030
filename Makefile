# `make demo` and `make test` each bootstrap .venv on a fresh machine.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pip's config on these machines names local indexes that may be absent: hide that noise only.
QUIET := 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }

.PHONY: demo test venv clean

$(STAMP): requirements-test.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-test.txt $(QUIET)
	sed -n 's/^# no-deps: //p' requirements-test.txt | xargs -r $(PY) -m pip install -q --no-deps $(QUIET)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e . $(QUIET)
	$(PY) -c "import torch, lightning, keras, tensorflow, keras_hub, mp_callbacks"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m mp_callbacks demo

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup

clean:
	rm -rf $(VENV) build *.egg-info
