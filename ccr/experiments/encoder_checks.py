"""Checks of a method's encoders against the data that need only the configuration, so that a
run that could not be right stops before any data is read.

* ``world`` (an encoder's ``name``, or a seq2seq backbone's ``pretrained``) stands for the
  synthetic world's own pretrained backbones (``data.backbones``); on other data every such key
  is named in one line with the fix: the method's paper preset (``METHOD=<method>_paper``), whose
  encoders are real models that load from local folders, or real encoder names.
* A pretrained Hugging Face text encoder reads the ids of its own tokenizer; with the suite's
  offline BPE (``data.tokenizer.name=offline``) it would train on ids that mean other tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, ListConfig

from ccr.experiments.config import CONFIG_DIR, ConfigError

WORLD = "world"
WORLD_FIELDS = ("name", "pretrained")  # encoders: name=world; seq2seq backbones: pretrained=world


def world_keys(section: Any, prefix: str = "method") -> Iterator[str]:
    """Dotted keys under ``section`` whose value names the world's backbones."""
    if isinstance(section, DictConfig):
        for key, value in section.items():
            if key in WORLD_FIELDS and value == WORLD:
                yield f"{prefix}.{str(key)}"
            elif isinstance(value, (DictConfig, ListConfig)):
                yield from world_keys(value, f"{prefix}.{str(key)}")
    elif isinstance(section, ListConfig):
        for index, item in enumerate(section):
            yield from world_keys(item, f"{prefix}[{index}]")


def unbuilt_sections(cfg: DictConfig) -> tuple[str, ...]:
    """Method sections this run never builds, whatever they name: RC3's grid regions when the data
    ships ROI features or the visual input is patches only (``ccr/methods/rc3/module.py``), mCLIP's trained
    teacher when ``teacher`` is not among its stages (``ccr/methods/mclip/module.py``)."""
    method = cfg.method
    if method.get("name") == "rc3" and (
        cfg.data.get("roi_features") is not None or method.visual.strict_input == "patch"
    ):
        return ("method.visual.regions",)
    if method.get("name") == "mclip" and "teacher" not in method.stages:
        return ("method.teacher.clip",)
    return ()


def check_encoders(cfg: DictConfig) -> None:
    """Every check of this module, in order."""
    check_world_encoders(cfg)
    check_text_tokenizer(cfg)


def check_world_encoders(cfg: DictConfig) -> None:
    """Refuse ``world`` backbones on data that does not provide them, naming the keys and the fix."""
    if cfg.data.name == "synthetic" and cfg.data.get("backbones") is not None:
        return
    unbuilt = unbuilt_sections(cfg)
    keys = [
        key for key in world_keys(cfg.method) if not key.startswith(tuple(f"{u}." for u in unbuilt))
    ]
    if not keys:
        return
    preset, data = cfg.preset.method, cfg.preset.data
    paper = f"{preset}_paper"
    use_paper = (
        f"use METHOD={paper} (the paper's real encoders, loaded from local folders named "
        "on the command line: docs/datasets.md) or "
        if (CONFIG_DIR / "method" / f"{paper}.yaml").exists()
        else ""
    )
    raise ConfigError(
        f"{', '.join(f'{k}={WORLD}' for k in keys)}: the synthetic world's pretrained backbones, "
        f"which data={data} does not provide (only data=synthetic with data.backbones set); "
        f"{use_paper}set each key to a real model (timm:<model>, hf:<local folder>, "
        "open_clip:<model>) or tiny (random init)"
    )


def pretrained_hf_sections(section: Any, prefix: str = "method") -> Iterator[tuple[str, str]]:
    """(dotted key of ``name``, model) of every ``hf:<model>`` section that loads pretrained
    weights: no in-code ``config`` and ``pretrained`` other than false (``HFText``)."""
    if not isinstance(section, DictConfig):
        return
    name = section.get("name")
    if (
        isinstance(name, str)
        and name.startswith("hf:")
        and section.get("config") is None
        and section.get("pretrained") is not False
    ):
        yield f"{prefix}.name", name.removeprefix("hf:")
    for key, value in section.items():
        yield from pretrained_hf_sections(value, f"{prefix}.{str(key)}")


def check_text_tokenizer(cfg: DictConfig) -> None:
    """A pretrained Hugging Face text encoder needs its own tokenizer, not the offline BPE."""
    if cfg.data.tokenizer.name != "offline":
        return
    unbuilt = tuple(f"{u}." for u in unbuilt_sections(cfg))
    for key, model in pretrained_hf_sections(cfg.method):
        if not key.startswith(unbuilt):
            raise ConfigError(
                f"{key}=hf:{model} reads the token ids of its own tokenizer, but "
                "data.tokenizer.name=offline (the suite's BPE); set "
                f"data.tokenizer.name={model} (or its local folder)"
            )
