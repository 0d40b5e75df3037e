#!/usr/bin/env bash
# The documentation site, built the one way: `make docs` runs this script, and so does
# tests/test_docs_build.py (on a copy of the docs with broken links), so the two cannot drift.
#
#   docs/build_site.sh [CONFIG [SITE_DIR]]     (defaults: mkdocs.yml, site)
#
# --strict fails the build on any warning: a broken link or anchor, a missing page, an
# unresolved API reference, a docstring griffe cannot read. mkdocs's INFO lines are dropped (not
# with --quiet, which also hides the warnings and so lets them pass); warnings and errors are
# shown, and the exit status is mkdocs's (pipefail). $MKDOCS is the mkdocs command (default:
# mkdocs on the PATH).
set -euo pipefail

config=${1:-mkdocs.yml}
site=${2:-site}

NO_MKDOCS_2_WARNING=1 "${MKDOCS:-mkdocs}" build --strict --config-file "$config" \
  --site-dir "$site" 2>&1 | { grep -v '^INFO ' || true; }
echo "[docs] built $site/ from $config with no warnings"
