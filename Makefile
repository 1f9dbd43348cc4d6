# The two commands: `make demo` and `make test`. Both create .venv on first use.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test setup docs clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,tensorboard,ssh,fleet,detection,privacy,secure-aggregation,docs]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/edgetrain train --devices 2

test: $(STAMP)
	$(BIN)/python -m pytest -q

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

clean:
	rm -rf $(VENV) runs .pytest_cache site
