#!/usr/bin/env bash
# GPU check: what a machine with a CUDA GPU runs for cw_lens, in two steps.
#
#   1. `make bench`: the benchmarks of the benchmarks page (contribution weights / forward pass,
#      long context, the widget). They pin the model to the CPU, so on this machine they
#      measure its CPU next to the records made elsewhere.
#   2. `pytest -m device`: the device and dtype tests (tests/test_device.py). Everywhere they
#      check, on the CPU, that every tensor an analysis creates names its device and that the
#      arithmetic is float32 whatever the model's dtype; with CUDA present they also run every
#      analysis on the GPU (a tensor on the wrong device raises there) and compare the results
#      with the CPU's. On a machine without CUDA that last test is reported as skipped.
#
# Usage: bash benchmarks/gpu_check.sh [pytest arguments]
# It creates .venv when missing (`make install`; pass TORCH=... to make for a CUDA build of torch
# that matches the driver) and stops, before running anything, when torch sees no CUDA device.
set -euo pipefail
cd "$(dirname "$0")/.."
make install
PY="${VENV:-.venv}/bin/python"
"$PY" - <<'PYTHON'
import sys

import torch

print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s)")
if not torch.cuda.is_available():
    sys.exit("torch sees no CUDA device: install a CUDA build of torch (make install TORCH=...)")
print("device 0:", torch.cuda.get_device_name(0))
PYTHON
make bench
HF_HUB_OFFLINE=1 "$PY" -m pytest -m device -rs "$@" tests/
