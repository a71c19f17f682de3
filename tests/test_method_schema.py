"""Typed method sections (ccr/experiments/method_schema.py): a wrong type or an unknown key under
``method.*`` fails at composition naming the key, for every method and preset; a preset leaves no
key unset; variant tables are checked as the section they override; and typing changed neither a
published run's fingerprint nor a preset's."""

import json
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import ccr.experiments.config as config_module
from ccr.experiments.config import ConfigError, available, compose, typed
from ccr.experiments.leaderboard import as_current_code_reads
from ccr.experiments.method_schema import SCHEMAS
from ccr.experiments.runs import config_fingerprint

ROOT = Path(__file__).resolve().parents[1]
FINGERPRINTS = json.loads((ROOT / "tests" / "fixtures" / "fingerprints.json").read_text())
METHODS = ["clip", "ccrk", "cl2cm", "covlr", "mclip", "rc3"]
PRESETS = available("method")
# (an integer key, a boolean key) of each method's section
KEYS = {
    "clip": ("embed_dim", "lit"),
    "ccrk": ("fusion.layers", "hard_mitm"),
    "cl2cm": ("ot.iterations", "use_ckt"),
    "covlr": ("cross_modal.heads", "meta"),
    "mclip": ("trikd.max_steps", "translation.ctl.train_embeddings"),
    "rc3": ("backbone.d_model", "use_kl"),
}


def method_of(preset: str) -> str:
    return preset.removesuffix("_paper")


def test_every_method_preset_is_covered():
    assert sorted({method_of(p) for p in PRESETS}) == sorted(METHODS)
    assert set(METHODS) < set(SCHEMAS)


@pytest.mark.parametrize("preset", PRESETS)
def test_a_wrong_typed_method_key_fails_at_composition_naming_the_key(preset):
    number, switch = KEYS[method_of(preset)]
    for key, value, kind in ((number, "abc", "Integer"), (switch, "maybe", "bool")):
        with pytest.raises(ConfigError) as error:
            compose([f"method={preset}", f"method.{key}={value}"])
        message = str(error.value)
        assert f"config key 'method.{key}'" in message and kind in message
        assert "\n" not in message


@pytest.mark.parametrize("preset", PRESETS)
def test_a_misspelt_method_key_fails_naming_it_and_the_keys_there(preset):
    number, _ = KEYS[method_of(preset)]
    misspelt = f"{number}s"
    with pytest.raises(ConfigError, match=f"unknown config key 'method.{misspelt}'") as error:
        compose([f"method={preset}", f"method.{misspelt}=1"])
    assert number.rsplit(".", 1)[-1] in str(error.value)  # the keys that do exist there


@pytest.mark.parametrize("preset", PRESETS)
def test_a_method_key_of_the_right_type_is_accepted_and_typed(preset):
    number, switch = KEYS[method_of(preset)]
    cfg = compose([f"method={preset}", f"method.{number}=7", f"method.{switch}=false"])
    assert OmegaConf.select(cfg, f"method.{number}") == 7
    assert OmegaConf.select(cfg, f"method.{switch}") is False
    assert OmegaConf.get_type(cfg.method) is SCHEMAS[method_of(preset)]


@pytest.fixture
def configs(tmp_path, monkeypatch):
    """A copy of ccr/experiments/configs that composition reads instead."""
    copy = tmp_path / "configs"
    shutil.copytree(ROOT / "ccr/experiments/configs", copy)
    monkeypatch.setattr(config_module, "CONFIG_DIR", copy)
    return copy


def edit_preset(configs: Path, preset: str, change) -> None:
    path = configs / "method" / f"{preset}.yaml"
    cfg = OmegaConf.load(path)
    change(cfg)
    OmegaConf.save(cfg, path)


def test_a_wrong_type_in_a_preset_file_names_the_file_and_the_key(configs):
    edit_preset(configs, "ccrk", lambda cfg: setattr(cfg.method, "embed_dim", "sixty-four"))
    with pytest.raises(ConfigError, match=r"'method.embed_dim' \(method/ccrk.yaml\)"):
        compose(["method=ccrk"])


def test_a_preset_that_leaves_a_method_key_unset_is_an_error_naming_it(configs):
    edit_preset(configs, "cl2cm", lambda cfg: cfg.method.pop("kd_temperature"))
    with pytest.raises(ConfigError, match="config key 'method.kd_temperature' has no value"):
        compose(["method=cl2cm"])


@pytest.mark.parametrize(
    "row,key,value,message",
    [
        ("no_kl", "use_kll", False, "unknown config key 'method.ablations.no_kl.use_kll'"),
        ("no_kl", "use_kl", "sometimes", "config key 'method.ablations.no_kl.use_kl'"),
    ],
)
def test_a_variant_row_is_checked_as_the_section_it_overrides(configs, row, key, value, message):
    edit_preset(configs, "rc3", lambda cfg: cfg.method.ablations[row].__setitem__(key, value))
    with pytest.raises(ConfigError, match=message):
        compose(["method=rc3"])


def variants(preset: str) -> list[str]:
    table = OmegaConf.load(ROOT / "ccr/experiments/configs/method" / f"{preset}.yaml")
    if method_of(preset) == "mclip":  # mCLIP's variants are its Table 2 ablations, in code
        from ccr.methods.mclip.module import ABLATIONS

        return sorted(ABLATIONS)
    return sorted(table.method.get("ablations") or {})


@pytest.mark.parametrize("preset", PRESETS)
def test_every_variant_of_every_preset_composes_and_passes_the_method_checks(preset):
    from ccr import methods

    cfg = None
    for variant in [None, *variants(preset)]:
        cfg = compose([f"method={preset}", *([f"variant={variant}"] if variant else [])])
        methods.get(cfg.method.name).check_config(
            cfg.method, list(cfg.data.languages), protocol=cfg.protocol
        )
    assert cfg is not None and not OmegaConf.missing_keys(cfg)


def test_a_stored_config_with_keys_the_code_no_longer_reads_still_reads():
    stored = OmegaConf.to_container(compose(["method=rc3"]))
    stored["method"]["run_protocol"] = stored["protocol"]  # written before the protocol was
    stored["method"]["rerank_batch_size"] = 64  # handed over at build time; before pair_batch_size
    cfg = typed(OmegaConf.create(stored))
    assert "run_protocol" not in cfg.method and "rerank_batch_size" not in cfg.method
    assert config_fingerprint(cfg) == config_fingerprint(OmegaConf.create(stored))


def test_a_stored_config_of_an_unknown_method_is_an_error_naming_it():
    stored = OmegaConf.to_container(compose(["method=clip"]))
    stored["method"]["name"] = "clipp"
    with pytest.raises(ConfigError, match="'method.name'.*'clipp': not a method; known: ccrk"):
        typed(OmegaConf.create(stored), "runs/x/config.yaml")


PER_RUN = ("seed", "run_id")  # execution-only keys (ccr.experiments.runs.EXECUTION_ONLY)


def stored_config(path: Path) -> dict:
    if path.suffix == ".json":
        return json.loads(path.read_text())["config"]
    return OmegaConf.to_container(OmegaConf.load(path))


def test_every_published_run_keeps_its_fingerprint():
    """The leaderboard groups runs by the fingerprint of their stored config as the current code
    reads it; ``tests/fixtures/fingerprints.json`` holds those computed before typing."""
    expected = FINGERPRINTS["published"]
    now, seen = {}, {}
    for path in sorted(expected):
        stored = stored_config(ROOT / path)
        # Seeds of one experiment (and a run's metrics.json and config.yaml) are read once.
        text = json.dumps({k: v for k, v in stored.items() if k not in PER_RUN}, sort_keys=True)
        if text not in seen:
            seen[text] = config_fingerprint(as_current_code_reads(stored, ROOT / path))
        now[path] = seen[text]
    assert now == expected


def test_every_preset_composes_to_the_fingerprint_it_had_before_typing():
    """Equal settings keep naming the same experiment (``make compare`` run ids, resuming)."""
    expected = FINGERPRINTS["composed"]
    assert {argv: config_fingerprint(compose(argv.split())) for argv in expected} == expected
