#!/usr/bin/env bash
# The suite installed beside another torch minor version than the pinned one: a fresh venv gets
# torch $OTHER_TORCH and the torchvision built for it (with what those two need, e.g. their CUDA
# libraries), every other dependency at its pinned version, and the suite with --no-deps (as into a
# researcher's environment with their own torch). Then every method is imported and the method and
# metric tests run (each method builds, trains a step and encodes; the metrics' golden values).
# Not part of .ci/run: it downloads a second torch (several GB for PyPI's CUDA builds) and takes
# about 40 minutes here. torch and torchvision must come from the same build family: a CPU torch
# beside PyPI's CUDA torchvision fails with "operator torchvision::nms does not exist";
# OTHER_TORCH_INDEX points pip at another wheel index (e.g. PyTorch's CPU one). Run it once per
# dependency change:  bash .ci/other-torch.sh   (torch 2.12.0 + torchvision 0.27.0 from PyPI)
set -euo pipefail
cd "$(dirname "$0")/.."
OTHER_TORCH=${OTHER_TORCH:-2.12.0}
OTHER_TORCHVISION=${OTHER_TORCHVISION:-0.27.0}
VENV=${OTHER_TORCH_VENV:-$(mktemp -d)/venv}
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet)
"${PIP[@]}" ${OTHER_TORCH_INDEX:+--index-url "$OTHER_TORCH_INDEX"} \
  "torch==$OTHER_TORCH" "torchvision==$OTHER_TORCHVISION"
# Everything else at the pinned versions, minus torch/torchvision and the CUDA wheels of the
# pinned torch build.
grep -v -E '^(#|torch==|torchvision==|nvidia-|triton==)' requirements/constraints.txt > "$VENV/pins.txt"
"${PIP[@]}" --no-deps -r "$VENV/pins.txt"
"${PIP[@]}" --no-deps -e .
"$VENV/bin/python" - <<'PY'
import torch

import ccr.experiments.eval_zoo, ccr.experiments.external, ccr.experiments.train  # noqa: F401 - the entry points
from ccr import methods

for name in methods.names():
    methods.get(name)
print(f"torch {torch.__version__}: the suite and its methods ({', '.join(methods.names())}) import")
PY
"$VENV/bin/python" -m pytest -q -p no:xdist -m "not slow" tests/test_clip.py tests/test_ccrk_module.py \
  tests/test_cl2cm_module.py tests/test_mclip_method.py tests/test_rc3_module.py \
  tests/test_covlr_module.py tests/test_metrics_golden.py
