"""The CPU presets' ``world`` encoders exist only on the synthetic world: a run that names them on
other data is refused from its configuration alone, before any data is read.

``world`` (an encoder's ``name``, or a seq2seq backbone's ``pretrained``) stands for the synthetic
world's own pretrained backbones (``data.backbones``). Every such key of the method section is
named in one line with the fix: the method's paper preset (``METHOD=<method>_paper``), whose
encoders are real models that load from local folders, or real encoder names.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, ListConfig

from experiments.config import CONFIG_DIR, ConfigError

WORLD = "world"
WORLD_FIELDS = ("name", "pretrained")  # encoders: name=world; seq2seq backbones: pretrained=world


def world_keys(section: Any, prefix: str = "method") -> Iterator[str]:
    """Dotted keys under ``section`` whose value names the world's backbones."""
    if isinstance(section, DictConfig):
        for key, value in section.items():
            if key in WORLD_FIELDS and value == WORLD:
                yield f"{prefix}.{key}"
            elif isinstance(value, (DictConfig, ListConfig)):
                yield from world_keys(value, f"{prefix}.{key}")
    elif isinstance(section, ListConfig):
        for index, item in enumerate(section):
            yield from world_keys(item, f"{prefix}[{index}]")


def unbuilt_sections(cfg: DictConfig) -> tuple[str, ...]:
    """Method sections this run never builds, whatever they name: RC3's grid regions when the data
    ships ROI features or the visual input is patches only (``methods/rc3.py``), mCLIP's trained
    teacher when ``teacher`` is not among its stages (``methods/mclip.py``)."""
    method = cfg.method
    if method.get("name") == "rc3" and (cfg.data.get("roi_features") is not None
                                        or method.visual.strict_input == "patch"):
        return ("method.visual.regions",)
    if method.get("name") == "mclip" and "teacher" not in method.stages:
        return ("method.teacher.clip",)
    return ()


def check_world_encoders(cfg: DictConfig) -> None:
    """Refuse ``world`` backbones on data that does not provide them, naming the keys and the fix."""
    if cfg.data.name == "synthetic" and cfg.data.get("backbones") is not None:
        return
    unbuilt = unbuilt_sections(cfg)
    keys = [key for key in world_keys(cfg.method) if not key.startswith(tuple(f"{u}." for u in unbuilt))]
    if not keys:
        return
    preset, data = cfg.preset.method, cfg.preset.data
    paper = f"{preset}_paper"
    use_paper = (f"use METHOD={paper} (the paper's real encoders, loaded from local folders named "
                 "on the command line: docs/datasets.md) or "
                 if (CONFIG_DIR / "method" / f"{paper}.yaml").exists() else "")
    raise ConfigError(
        f"{', '.join(f'{k}={WORLD}' for k in keys)}: the synthetic world's pretrained backbones, "
        f"which data={data} does not provide (only data=synthetic with data.backbones set); "
        f"{use_paper}set each key to a real model (timm:<model>, hf:<local folder>, "
        "open_clip:<model>) or tiny (random init)")
