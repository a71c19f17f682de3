"""What the configuration's modules share without importing one another (``config`` composes
with the ``zoo``'s entries, and the zoo reads its own files): where the config files live and the
error a bad configuration raises."""

from __future__ import annotations

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


class ConfigError(ValueError):
    """A one-line, user-facing configuration problem."""
