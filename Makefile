VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv sysdeps demo test lint unit clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

sysdeps:
	bash scripts/system_deps.sh

demo: $(STAMP) sysdeps
	$(VENV)/bin/kvmesh demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .

unit: $(STAMP)
	$(PY) -m pytest -q -m "not integration and not vllm and not mesh"

test: $(STAMP) sysdeps
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -ra -p no:cacheprovider

clean:
	rm -rf $(VENV) .pytest_cache
