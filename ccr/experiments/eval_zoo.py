"""``make eval-zoo DATA=<data>`` (``python -m ccr.experiments.eval_zoo``): score every zoo entry
(ccr/experiments/zoo.py) whose weights are already in the local cache, one external leaderboard row
each, and list the others with the reason they were skipped."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from ccr.experiments import cli, external, zoo
from ccr.experiments.config_base import ConfigError


def eval_zoo(
    overrides: Sequence[str], device: str = "auto"
) -> tuple[list[Path], list[tuple[str, str]]]:
    """Score every locally available zoo entry; return the run folders and the skipped entries
    with their reasons (a model that fails to load or score is listed with its error)."""
    scored, skipped = [], []
    for zoo_entry in zoo.entries():
        reason = zoo.skip_reason(zoo_entry)
        if reason is None:
            try:
                scored.append(
                    external.score_external(
                        external.ModelSpec.from_zoo(zoo_entry), overrides, device
                    )
                )
                continue
            except (ConfigError, ValueError, OSError, RuntimeError) as err:
                reason = "failed: " + " ".join(str(err).split())[:300]
        skipped.append((zoo_entry.name, reason))
    print(
        f"zoo: scored {len(scored)} of {len(scored) + len(skipped)} models; skipped {len(skipped)}:"
    )
    for name, reason in skipped:
        print(f"  {name}: {reason}")
    return scored, skipped


def _main(args: list[str]) -> None:
    device = "auto"
    rest = []
    for arg in args:
        key, _, value = arg.partition("=")
        if key == "device":
            device = value
        else:
            rest.append(arg)
    _, skipped = eval_zoo(rest, device)
    if any(reason.startswith("failed:") for _, reason in skipped):
        sys.exit(1)


def main(argv: Sequence[str] | None = None) -> None:
    cli.run(_main, argv)


if __name__ == "__main__":
    main()
