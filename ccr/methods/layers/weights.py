"""Reading local weight files (torch or safetensors) with errors that name the file and say why:
what the encoders, the pretrained dual encoders and a run's checkpoints all load through."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor


def load_torch_file(path: str | Path) -> object:
    """``torch.load`` of a local file, weights only; a file torch cannot read (foreign, truncated)
    is a ``ValueError`` saying why in one line, for the caller to name the file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    # torch raises UnpicklingError, RuntimeError, EOFError... for foreign files
    except Exception as err:
        reason = " ".join(str(err).split())[:160]
        raise ValueError(f"{type(err).__name__}: {reason}") from None


def load_state_dict_file(path: str | Path) -> dict[str, Tensor]:
    """Tensors of a local torch/safetensors checkpoint, unwrapping ``state_dict``/``model``; a file
    that is unreadable or holds anything but named tensors is an error naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: pretrained checkpoint not found")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except SafetensorError as err:
            raise ValueError(
                f"{path}: not a readable safetensors file ({err}); is it truncated?"
            ) from None
    try:
        state = load_torch_file(path)
    except ValueError as err:
        raise ValueError(f"{path}: not a readable torch checkpoint ({err})") from None
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    check_state_dict(state, path)
    return state


def check_state_dict(state: Any, path: str | Path) -> None:
    """``state`` must map parameter names to tensors (what ``load_state_dict`` takes)."""
    if not isinstance(state, dict):
        raise ValueError(f"{path}: not a state dict (it holds a {type(state).__name__})")
    for key, value in state.items():
        if not isinstance(key, str) or not isinstance(value, Tensor):
            raise ValueError(
                f"{path}: not a state dict (entry {key!r} is {type(value).__name__}, not a tensor)"
            )
