"""Learning curves: the validation mean recall of every validation a run makes, recorded while it
trains, stored in ``metrics.json`` and read by the leaderboard.

A stage's points are written to ``curve.json`` in its checkpoint folder after each validation, so
an interrupted run keeps them: a resumed stage keeps the points up to the step it resumes from (the
later ones are validated again) and a stage finished before the interruption keeps them all.
``metrics.json`` holds ``learning_curve = {"metric": "val/mR", "points": [{"stage", "step",
"value"}, ...]}`` with run-level steps (a later stage's steps count on from the earlier stages').

A row is *still rising* when its validation mR rose by more than ``RISING_MARGIN`` over the last
fifth of its final stage: from the last validation at or before 80 % of that stage's steps to its
last validation (mean over the row's seeds).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from ccr.experiments.runs import write_atomic

CURVE_METRIC = "mR"
CURVE_FILE = "curve.json"
RISING_MARGIN = 1.0  # mR points over the last fifth of training
LAST_SHARE = 0.2  # the last fifth


class ValidationCurve(Callback):
    """Appends ``(step, val/mR)`` after every validation and writes the stage's ``curve.json``.

    ``resumed_at``: the step a resumed stage restarts from (its earlier points are kept), or None
    for a stage that starts from scratch (any earlier file is replaced)."""

    def __init__(self, folder: Path, resumed_at: int | None = None) -> None:
        self.path = Path(folder) / CURVE_FILE
        self.points = []
        if resumed_at is not None:
            self.points = [p for p in read_stage_curve(Path(folder)) if p["step"] <= resumed_at]

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        value = trainer.callback_metrics.get(f"val/{CURVE_METRIC}")
        if value is None:
            return
        step = int(trainer.global_step)
        self.points = [p for p in self.points if p["step"] != step]
        self.points.append({"step": step, "value": round(float(value), 4)})
        write_atomic(self.path, json.dumps(self.points) + "\n")


def read_stage_curve(folder: Path) -> list[dict]:
    """The points a stage's ``curve.json`` holds (none when the stage never validated)."""
    path = Path(folder) / CURVE_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else []


def run_curve(stage_folders: Sequence[tuple[str, Path]], stage_steps: Mapping[str, int]) -> dict:
    """The run's ``learning_curve`` from its stages' files, steps counted over the whole run."""
    points, offset = [], 0
    for name, folder in stage_folders:
        points += [
            {"stage": name, "step": offset + p["step"], "value": p["value"]}
            for p in read_stage_curve(folder)
        ]
        offset += int(stage_steps.get(name, 0))
    return {"metric": f"val/{CURVE_METRIC}", "points": points}


def check_curve(result: Mapping, path: str) -> None:
    """A ``learning_curve`` present in a metrics.json must be well formed (old files have none)."""
    curve = result.get("learning_curve")
    if curve is None:
        return
    points = curve.get("points") if isinstance(curve, Mapping) else None
    if not isinstance(points, list):  # a malformed file is bad input like any other: ValueError
        raise ValueError(f"{path}: learning_curve has no 'points' list")  # noqa: TRY004
    for i, point in enumerate(points):
        if not (
            isinstance(point, Mapping)
            and isinstance(point.get("step"), int)
            and isinstance(point.get("value"), (int, float))
            and math.isfinite(point["value"])
        ):
            raise ValueError(
                f"{path}: learning_curve.points[{i}] needs an integer 'step' and a finite "
                f"'value', got {point!r}"
            )


def last_fifth_rise(result: Mapping) -> float | None:
    """How much the run's validation mR rose over the last fifth of its final stage; None when the
    run has no curve or no validation on both sides of that boundary."""
    points = (result.get("learning_curve") or {}).get("points") or []
    stage_steps = result.get("stage_steps") or {}
    if not points:
        return None
    names, steps = list(stage_steps), list(stage_steps.values())
    final = names[-1] if names else points[-1].get("stage")
    if final in stage_steps:
        index = names.index(final)
        start, length = sum(steps[:index]), stage_steps[final]
    else:  # a curve without stage names: the whole run
        start, length = 0, result.get("train_steps") or points[-1]["step"]
    boundary = start + (1 - LAST_SHARE) * length
    final_points = [p for p in points if p.get("stage") == final and p["step"] >= start]
    before = [p for p in final_points if p["step"] <= boundary]
    if not before or final_points[-1]["step"] <= boundary:
        return None
    return final_points[-1]["value"] - before[-1]["value"]


def row_rise(members: Sequence[Mapping]) -> tuple[float | None, int]:
    """Mean rise over a row's seeds that have one, and how many seeds have none."""
    rises = [last_fifth_rise(m) for m in members]
    known = [r for r in rises if r is not None]
    return (statistics.fmean(known) if known else None), len(rises) - len(known)


def mean_curve(members: Sequence[Mapping]) -> tuple[list[int], list[float], list[float]] | None:
    """Steps every seed validated at, with the mean and population std of val mR there."""
    curves = [
        {p["step"]: p["value"] for p in (m.get("learning_curve") or {}).get("points") or []}
        for m in members
    ]
    curves = [c for c in curves if c]
    if not curves:
        return None
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    if not steps:
        return None
    means = [statistics.fmean(c[s] for c in curves) for s in steps]
    stds = [statistics.pstdev([c[s] for c in curves]) for s in steps]
    return steps, means, stds
