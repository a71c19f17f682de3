#!/usr/bin/env bash
# The suite installed beside another torch minor version than the pinned one: a fresh venv gets
# torch $OTHER_TORCH (CPU) and its torchvision, every other dependency at its pinned version, and the
# suite with --no-deps (as into a researcher's environment with their own torch); then every method
# is imported. Not part of .ci/run: it installs a second torch (~200 MB) and needs a torchvision built
# for that same torch (a CPU torch needs a CPU torchvision: PyPI's torchvision wheels are CUDA builds,
# which fail to load beside a CPU torch with "operator torchvision::nms does not exist"). Point
# OTHER_TORCH_INDEX at PyTorch's CPU wheel index where it is reachable. Run it once per dependency
# change:  OTHER_TORCH_INDEX=<index url> bash .ci/other-torch.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OTHER_TORCH=${OTHER_TORCH:-2.13.0+cpu}
OTHER_TORCHVISION=${OTHER_TORCHVISION:-0.28.0+cpu}
VENV=${OTHER_TORCH_VENV:-$(mktemp -d)/venv}
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet)
"${PIP[@]}" --no-deps ${OTHER_TORCH_INDEX:+--index-url "$OTHER_TORCH_INDEX"} \
  "torch==$OTHER_TORCH" "torchvision==$OTHER_TORCHVISION"
# Torch's own requirements, then everything else at the pinned versions, minus torch/torchvision
# and the CUDA wheels that only the pinned GPU build of torch needs.
"${PIP[@]}" filelock typing-extensions sympy networkx jinja2 fsspec "setuptools>=77"
grep -v -E '^(#|torch==|torchvision==|nvidia-|triton==)' requirements/constraints.txt > "$VENV/pins.txt"
"${PIP[@]}" --no-deps -r "$VENV/pins.txt"
"${PIP[@]}" --no-deps -e .
"$VENV/bin/python" - <<'PY'
import torch

import experiments.eval_zoo, experiments.external, experiments.train  # noqa: F401 - the entry points
import methods

for name in methods.names():
    methods.get(name)
print(f"torch {torch.__version__}: the suite and its methods ({', '.join(methods.names())}) import")
PY
