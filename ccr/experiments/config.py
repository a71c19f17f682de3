"""Compose a run's configuration: base + method + data + trainer + command-line overrides.

Selectors (``method=ccrk data=multi30k trainer=gpu``) pick YAML files under ``configs/``; every
other ``key=value`` overrides a key that must already exist (struct mode), so a typo fails naming
the key instead of being silently ignored. Values are typed by ``ccr/experiments/schema.py`` and, for
the ``method`` section, by its method's schema (``ccr/experiments/method_schema.py``): a wrong type,
shape or sign fails here, naming the key, before anything runs.

A data or trainer preset holds its section's keys. A method preset is a fragment of the run: its
``method:`` section and whatever run setting the method fixes beside it (mCLIP's ``protocol``,
CCRk's ``optim``, RC3's ``evaluation``), all typed by the same schema.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import cast

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from ccr import metrics
from ccr.experiments.config_base import CONFIG_DIR, ConfigError
from ccr.experiments.method_schema import SCHEMAS, MethodConfig
from ccr.experiments.schema import RunConfig, check_bounds

GROUPS = {"method": "clip", "data": "synthetic", "trainer": "cpu"}
RUN_FRAGMENTS = ("method",)  # groups whose presets are merged at the run's root, not into a section
# Keys earlier versions recorded that the code no longer reads; a stored config drops them.
# method.run_protocol mirrored ``protocol`` (a method now gets the protocol at build time);
# method.rerank_batch_size is evaluation.pair_batch_size.
RETIRED = ("method.run_protocol", "method.rerank_batch_size")


def available(group: str) -> list[str]:
    """Names of the YAML presets of one group (``method``, ``data`` or ``trainer``)."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def _load_group(group: str, name: str) -> DictConfig:
    path = CONFIG_DIR / group / f"{name}.yaml"
    if not path.exists():
        raise ConfigError(f"unknown {group} '{name}'; available: {', '.join(available(group))}")
    return as_mapping(OmegaConf.load(path), str(path))


def split_overrides(overrides: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """Separate group selectors (``method=ccrk``) from dotted key overrides."""
    selectors = dict(GROUPS)
    rest = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        if key in GROUPS:
            selectors[key] = value
        else:
            rest.append(item)
    return selectors, rest


def _merge(cfg: DictConfig, other, source: str) -> DictConfig:
    """``OmegaConf.merge`` with the schema's complaints turned into one line naming the key."""
    with _naming_keys(cfg, source):
        merged = OmegaConf.merge(cfg, other)
    return cast(DictConfig, merged)  # merged onto a mapping, a mapping


@contextmanager
def _naming_keys(cfg: DictConfig, source: str, prefix: str = "") -> Iterator[None]:
    """Turn the schema's complaints about a merge into ``cfg`` into one line naming the key
    (``prefix`` + its key in ``cfg``)."""
    try:
        yield
    except (ConfigKeyError, ConfigAttributeError) as err:
        key = getattr(err, "full_key", None) or str(err).splitlines()[0]
        parent = key.rsplit(".", 1)[0] if "." in key else None
        node = OmegaConf.select(cfg, parent) if parent else cfg
        known = (
            ", ".join(sorted(str(k) for k in node.keys())) if isinstance(node, DictConfig) else ""
        )
        key = prefix + key
        schema = "method_schema.py" if key.startswith("method.") else "schema.py"
        where = (
            ""
            if source == "command line"
            else f" in {source} (declare it in ccr/experiments/{schema})"
        )
        raise ConfigError(
            f"unknown config key '{key}'{where}" + (f"; keys here: {known}" if known else "")
        ) from None
    except ValidationError as err:
        key = prefix + (getattr(err, "full_key", None) or "?")
        reason = str(err).splitlines()[0]
        if "is not a ListConfig" in reason:
            reason = f"a list is expected, e.g. {key}=[a,b]"
        raise ConfigError(f"config key '{key}' ({source}): {reason}") from None


def method_schema(name: object, source: str) -> type[MethodConfig]:
    """The schema of the method named ``name``; an unknown name is an error listing them."""
    if name not in SCHEMAS:
        raise ConfigError(
            f"config key 'method.name' ({source}) = {name!r}: not a method; "
            f"known: {', '.join(sorted(SCHEMAS))}"
        )
    return SCHEMAS[str(name)]


def _typed_method(cfg: DictConfig, other: DictConfig, source: str) -> DictConfig:
    """``cfg`` whose still untyped ``method`` section takes the schema of the method ``other``
    names (``method.name``), so merging ``other`` checks every method key."""
    name = OmegaConf.select(other, "method.name", default=None)
    if name is not None and cfg.get("method") is None:
        cfg.method = OmegaConf.structured(method_schema(name, source))
    return cfg


def _check_variants(method: DictConfig, rows: DictConfig, source: str) -> None:
    """Each row of a variant table (``method.ablations``) sets keys of its method's section,
    typed as there."""
    section = OmegaConf.structured(OmegaConf.get_type(method))
    for name, switches in rows.items():
        with _naming_keys(section, source, prefix=f"method.ablations.{name!s}."):
            section.merge_with(switches)


def as_mapping(cfg: DictConfig | ListConfig, source: str) -> DictConfig:
    """``cfg`` as loaded from ``source``; a YAML list where sections belong is an error."""
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{source}: a configuration is a mapping of keys, not a list")
    return cfg


def typed(cfg: DictConfig | ListConfig, source: str = "config") -> DictConfig:
    """``cfg`` (e.g. a stored ``config.yaml``) checked against the schema, without the keys
    earlier versions wrote that the code no longer reads (``RETIRED``)."""
    cfg = as_mapping(cfg, source).copy()
    for key in RETIRED:
        section, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, section, default=None)
        if isinstance(node, DictConfig) and leaf in node:
            node.pop(leaf)
    return merge_fragment(OmegaConf.structured(RunConfig), cfg, source)


def merge_fragment(cfg: DictConfig, fragment: DictConfig, source: str) -> DictConfig:
    """``fragment`` (a preset, a stored config) merged into ``cfg``; its ``method`` section, and
    each of that method's variants (``method.ablations``), typed by the method's schema."""
    merged = _merge(_typed_method(cfg, fragment, source), fragment, source)
    rows = OmegaConf.select(fragment, "method.ablations", default=None)
    if rows:
        _check_variants(merged.method, rows, source)
    return merged


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """The resolved, type-checked run configuration for these command-line overrides."""
    selectors, rest = split_overrides(overrides)
    cfg = typed(OmegaConf.load(CONFIG_DIR / "base.yaml"), "base.yaml")
    for group, name in selectors.items():  # a preset overrides the base file's keys, if any
        preset = _load_group(group, name)
        fragment = preset if group in RUN_FRAGMENTS else OmegaConf.create({group: preset})
        cfg = merge_fragment(cfg, fragment, f"{group}/{name}.yaml")
    cfg.preset = selectors
    from ccr.experiments.zoo import expand_encoders  # the zoo reads configs/zoo

    return apply_overrides(cfg, expand_encoders(cfg, rest))


def apply_overrides(cfg: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """Merge ``key=value`` overrides into ``cfg`` in struct mode; unknown keys are errors."""
    OmegaConf.set_struct(cfg, True)
    merged = _merge(cfg, _parse(overrides), "command line")
    check_complete(merged)
    OmegaConf.resolve(merged)
    try:
        check_bounds(merged)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    check_run_protocol(merged)
    label_lit(merged)
    fit_mrv_languages(merged, explicit=any(o.startswith("data.mrv_languages=") for o in overrides))
    check_select_on(merged)
    return merged


def _parse(overrides: Sequence[str]) -> DictConfig:
    """``key=value`` strings as a config; a value YAML cannot read is one line naming it."""
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except yaml.YAMLError:
        for override in overrides:  # find the culprit, to name it
            try:
                OmegaConf.from_dotlist([override])
            except yaml.YAMLError as err:
                reason = getattr(err, "problem", None) or type(err).__name__
                raise ConfigError(
                    f"override '{override}' is not valid YAML: {reason}; quote the value "
                    f"(e.g. key='\"...\"')"
                ) from None
        raise


def label_lit(cfg: DictConfig) -> None:
    """A method run LiT-style (``method.lit``: its image tower frozen) is labelled so: the variant
    is ``lit`` unless one naming it is given; any other label would hide what ran."""
    method = cfg.get("method")
    if not (isinstance(method, DictConfig) and method.get("lit")):
        return
    if cfg.variant is None:
        cfg.variant = "lit"
    elif "lit" not in str(cfg.variant).split("+"):
        raise ConfigError(
            f"method.lit=true runs {cfg.method.name} with a frozen image tower; "
            f"variant={cfg.variant} would hide it (use variant=lit or lit+<label>)"
        )


def fit_mrv_languages(cfg: DictConfig, explicit: bool) -> None:
    """``data.mrv_languages`` within ``data.languages``, checked now rather than at the test.

    A list set on the command line (``explicit``) must be a subset: an error naming the key
    otherwise. A preset's list (e.g. xFlickr&CO's en de ja zh, CCRk's protocol) is narrowed to
    the languages the run evaluates, in its order, or to null (every evaluated language) when it
    keeps none of them; the narrowed list is what ``config.yaml`` records."""
    data = cfg.data
    mrv = data.get("mrv_languages")
    if mrv is None:
        return
    languages = [str(lang) for lang in data.languages]
    outside = [str(lang) for lang in mrv if lang not in languages]
    if not outside:
        return
    if explicit:
        raise ConfigError(
            f"data.mrv_languages={[str(x) for x in mrv]} names "
            f"{', '.join(outside)}, which data.languages={languages} does not "
            "evaluate; list a subset of data.languages, or null for all of them"
        )
    kept = [str(lang) for lang in mrv if lang in languages]
    data.mrv_languages = kept or None


DEFAULT_PROTOCOL = "default"  # a method without protocols of its own trains on data.languages


def check_run_protocol(cfg: DictConfig) -> None:
    """The ``protocol`` a run records is what it trains. A method that trains by its protocol
    (``trains_by_protocol`` in its schema: mCLIP, RC3) is handed the run's ``protocol`` when it is
    built and checks it there; any other method has one way to train (on every language of
    ``data.languages``), recorded as ``default``, so another label would not be what ran."""
    method = cfg.get("method")
    if not isinstance(method, DictConfig):
        return
    schema = OmegaConf.get_type(method)
    if getattr(schema, "trains_by_protocol", False) or cfg.protocol == DEFAULT_PROTOCOL:
        return
    raise ConfigError(
        f"protocol={cfg.protocol}: {method.get('name')} has no protocols of its own; it "
        f"trains on every language of data.languages, recorded as protocol={DEFAULT_PROTOCOL} "
        "(mclip and rc3 train by protocol)"
    )


def check_complete(cfg: DictConfig) -> None:
    """Every key of the schema has a value: a method preset sets each key of its method's
    schema that has no default (``ccr/experiments/method_schema.py``)."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(
            f"config key '{missing[0]}' has no value; set it in the "
            f"{missing[0].split('.')[0]} preset or as {missing[0]}=<value>"
            + (f" (also unset: {', '.join(missing[1:])})" if len(missing) > 1 else "")
        )


def check_select_on(cfg: DictConfig) -> None:
    """``evaluation.select_on`` names a score of the validation report (its direction, higher
    or lower is better, follows from the key). Whether the data has a val split is the training
    run's check (a preset pair without one still composes, e.g. to evaluate on it)."""
    key = cfg.evaluation.get("select_on")
    if key is None:
        return
    e = cfg.evaluation
    known = metrics.report_keys(
        list(cfg.data.languages),
        ks=list(e.ks),
        ndcg_k=e.ndcg_k,
        unimodal_ndcg_ks=list(e.unimodal_ndcg_ks),
        graded=cfg.data.name == "synthetic",
    )
    if key not in known:
        examples = [k for k in known if k.endswith(("/mR", "/R@1", "/MeanR", "all/MRV"))]
        raise ConfigError(
            f"evaluation.select_on={key} is not a key of the validation report; "
            f"e.g. {', '.join(['mR', *examples[:6]])} (docs/metrics.md)"
        )
    try:
        metrics.better_direction(key)
    except ValueError as err:
        raise ConfigError(f"evaluation.select_on={key}: {err}") from None


def method_label(cfg: DictConfig) -> str:
    """The leaderboard name of the method: its preset, plus the variant when one is set."""
    label = cfg.preset.method
    return f"{label}+{cfg.variant}" if cfg.get("variant") else label
