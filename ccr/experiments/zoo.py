"""The model zoo: one YAML per public multilingual dual encoder under ``ccr/experiments/configs/zoo/``.

Each entry names its ``loader`` (open_clip | hf_clip | hf_metaclip2 | hf_remote | mclip), the
``model`` (open_clip arch or Hugging Face name), the open_clip ``pretrained`` tag, the hub
``revision`` (a 40-hex commit; required before remote code runs), ``licence``, ``preprocessing`` and
the ``languages`` it expects, and optionally ``text_length``. ``make eval MODEL=zoo:<name>`` scores
one entry; ``make eval-zoo DATA=<data>`` (``python -m ccr.experiments.eval_zoo``) scores every entry
whose weights are already in the local cache and lists the others with the reason they were skipped.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from ccr.experiments.config_base import CONFIG_DIR, ConfigError
from ccr.methods.layers import pretrained_dual
from ccr.methods.layers.pretrained_dual import COMMIT, DualSpec

ZOO_DIR = CONFIG_DIR / "zoo"
LOADERS = {
    "open_clip": "open_clip",
    "hf_clip": "hf",
    "hf_metaclip2": "hf",
    "hf_remote": "hf",
    "mclip": "mclip",
}
REQUIRED = ("loader", "model", "licence", "preprocessing", "languages")
OPTIONAL = ("pretrained", "revision", "text_length", "image_model")
PREFIX = "zoo:"


@dataclass(frozen=True)
class ZooEntry:
    name: str
    source: Path
    loader: str
    model: str
    licence: str
    preprocessing: str
    languages: str
    pretrained: str | None = None
    revision: str | None = None
    text_length: int | None = None
    image_model: str | None = None

    @classmethod
    def read(cls, path: Path) -> ZooEntry:
        """Parse and check one zoo file; a bad field is an error naming the file and the field."""
        try:
            raw = OmegaConf.to_container(OmegaConf.load(path))
        except Exception as err:  # noqa: BLE001 - any YAML problem is the file's
            raise ConfigError(
                f"{path}: not a readable YAML mapping ({type(err).__name__})"
            ) from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of zoo fields")
        unknown = sorted(set(raw) - set(REQUIRED) - set(OPTIONAL))
        if unknown:
            raise ConfigError(f"{path}: unknown fields {unknown}; known: {[*REQUIRED, *OPTIONAL]}")
        for key in REQUIRED:
            if not isinstance(raw.get(key), str) or not raw[key].strip():
                raise ConfigError(f"{path}: field '{key}' must be a non-empty string")
        if raw["loader"] not in LOADERS:
            raise ConfigError(
                f"{path}: field 'loader' = {raw['loader']!r}: expected one of {list(LOADERS)}"
            )
        revision = raw.get("revision")
        if revision is not None and not (isinstance(revision, str) and COMMIT.fullmatch(revision)):
            raise ConfigError(
                f"{path}: field 'revision' = {revision!r}: a commit hash (40 lower-case "
                "hex digits) or null"
            )
        if raw["loader"] == "open_clip" and revision is not None:
            raise ConfigError(
                f"{path}: field 'revision' pins a Hugging Face model; open_clip downloads "
                "its tag's weights itself, unpinned: leave it null"
            )
        if (
            raw["loader"] == "open_clip"
            and not raw.get("pretrained")
            and not raw["model"].startswith(("local-dir:", "hf-hub:"))
        ):
            raise ConfigError(
                f"{path}: field 'pretrained' is needed for an open_clip arch (without it "
                "open_clip builds random weights)"
            )
        if (raw["loader"] == "mclip") != bool(raw.get("image_model")):
            raise ConfigError(
                f"{path}: field 'image_model' (the open_clip image tower, with its tag "
                "in 'pretrained') is for, and needed by, loader mclip"
            )
        text_length = raw.get("text_length")
        if text_length is not None and (not isinstance(text_length, int) or text_length < 2):
            raise ConfigError(f"{path}: field 'text_length' = {text_length!r}: an integer >= 2")
        return cls(name=path.stem, source=path, **{str(k): v for k, v in raw.items()})

    def spec(self, revision: str | None = None) -> DualSpec:
        """How to load it; ``revision`` (the command line's) overrides the entry's."""
        library = LOADERS[self.loader]
        if self.loader == "hf_metaclip2":
            import transformers

            if not hasattr(transformers, "MetaClip2Model"):
                raise ConfigError(
                    f"zoo:{self.name}: transformers {transformers.__version__} has no "
                    "MetaClip2Model; install a release that has it"
                )
        return DualSpec(
            library,
            self.model,
            self.pretrained,
            revision or self.revision,
            remote_code=self.loader == "hf_remote",
            text_length=self.text_length,
            image_model=self.image_model,
        )


ENCODERS_KEY = "method.encoders"
ENCODER_SECTIONS = ("image_encoder", "text_encoder")
# Methods that read only the towers' pooled embeddings, which is all a pretrained dual encoder's
# tower gives (ccrk and covlr read token states: fusion, a masked LM tied to the token embeddings).
POOLED_METHODS = ("clip", "cl2cm")


def expand_encoders(cfg, overrides: Sequence[str]) -> list[str]:
    """Apply ``method.encoders=zoo:<name>`` (if among ``overrides``) to the composed ``cfg``: both
    encoders become the zoo model's towers, the data reads images and captions through its own
    preprocessing and tokenizer, and a method with ``projection`` maps nothing more (``none``), so
    at step 0 the method embeds exactly as the model's external row does. Returns the other
    overrides."""
    rest = [item for item in overrides if not item.startswith(f"{ENCODERS_KEY}=")]
    given = [item.partition("=")[2] for item in overrides if item.startswith(f"{ENCODERS_KEY}=")]
    if not given:
        return rest
    value = given[-1]
    if not value.startswith(PREFIX):
        raise ConfigError(f"{ENCODERS_KEY}={value}: expected zoo:<name> (an entry of {zoo_dir()})")
    missing = [s for s in ENCODER_SECTIONS if s not in cfg.method]
    if missing:
        raise ConfigError(
            f"{ENCODERS_KEY}: method {cfg.method.name} has no top-level "
            f"{' / '.join(missing)} (its encoders are set elsewhere in its preset)"
        )
    if cfg.method.name not in POOLED_METHODS:
        raise ConfigError(
            f"{ENCODERS_KEY}: method {cfg.method.name} reads token states, which a "
            f"pretrained dual encoder's towers do not give (one embedding each); "
            f"fine-tune with {' or '.join(POOLED_METHODS)}, or name open_clip:/hf: "
            "encoders in its image_encoder / text_encoder"
        )
    spec = entry(value.removeprefix(PREFIX)).spec().to_dict()
    for section in ENCODER_SECTIONS:
        cfg.method[section] = {"name": "pretrained", "spec": dict(spec)}
    if "projection" in cfg.method:
        cfg.method.projection = "none"
    cfg.data.pretrained_io = dict(spec)
    return rest


def zoo_dir() -> Path:
    """Where zoo entries are read: ``CCR_ZOO_DIR`` if set (your own entries), else the suite's."""
    return Path(os.environ.get("CCR_ZOO_DIR") or ZOO_DIR)


def entry(name: str) -> ZooEntry:
    path = zoo_dir() / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(p.stem for p in sorted(zoo_dir().glob("*.yaml")))
        raise ConfigError(f"zoo:{name}: no {path}; the zoo has: {known}")
    return ZooEntry.read(path)


def entries() -> list[ZooEntry]:
    return [ZooEntry.read(p) for p in sorted(zoo_dir().glob("*.yaml"))]


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _in_hf_cache(repo: str, filenames: Sequence[str], revision: str | None) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return any(
        isinstance(try_to_load_from_cache(repo, f, revision=revision), str) for f in filenames
    )


def _weights_cached(spec: DualSpec) -> bool:
    """Whether the weights are on this machine (a folder, or the hub / open_clip cache)."""
    if spec.library == "mclip":
        # an mclip entry names its image tower: ZooEntry.load refuses one without it
        image = DualSpec("open_clip", str(spec.image_model), spec.pretrained)
        return _weights_cached(
            DualSpec("hf", spec.model, revision=spec.revision)
        ) and _weights_cached(image)
    if spec.library == "hf":
        if Path(spec.model).is_dir():
            return True
        return _in_hf_cache(spec.model, ("config.json",), spec.revision) and _in_hf_cache(
            spec.model,
            (
                "model.safetensors",
                "pytorch_model.bin",
                "model.safetensors.index.json",
                "pytorch_model.bin.index.json",
            ),
            spec.revision,
        )
    if spec.model.startswith("local-dir:"):
        return Path(spec.model.removeprefix("local-dir:")).is_dir()
    if spec.model.startswith("hf-hub:"):
        return _in_hf_cache(
            spec.model.removeprefix("hf-hub:"),
            ("open_clip_model.safetensors", "open_clip_pytorch_model.bin"),
            None,
        )
    if spec.pretrained and Path(spec.pretrained).is_file():
        return True
    from open_clip.pretrained import get_pretrained_cfg

    cfg = get_pretrained_cfg(spec.model, spec.pretrained or "")
    if cfg.get("hf_hub"):
        repo, filename = (
            os.path.split(cfg["hf_hub"].rstrip("/"))
            if not cfg["hf_hub"].endswith("/")
            else (cfg["hf_hub"].rstrip("/"), "")
        )
        names = (
            (filename,)
            if filename
            else ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
        )
        return _in_hf_cache(repo, names, None)
    if cfg.get("url"):
        cache = Path(os.path.expanduser("~/.cache/clip"))
        return (cache / os.path.basename(cfg["url"])).is_file()
    return False


def skip_reason(zoo_entry: ZooEntry) -> str | None:
    """Why ``make eval-zoo`` does not score this entry (None: it scores it)."""
    if zoo_entry.loader == "hf_remote" and zoo_entry.revision is None:
        return "remote code without a revision (pin one: revision=<40-hex commit>)"
    try:
        spec = zoo_entry.spec()
    except ConfigError as err:
        return str(err)
    if not _weights_cached(spec):
        return "not in the local cache" + (
            " and hub access is off (HF_HUB_OFFLINE)"
            if _hub_offline()
            else f" (make eval MODEL=zoo:{zoo_entry.name} downloads it)"
        )
    if spec.remote_code:
        return pretrained_dual.unpinned_code(spec)
    return None
