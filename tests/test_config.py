"""Config composition: presets by name, struct-mode overrides, one-line errors."""

import pytest
from omegaconf import OmegaConf

from ccr.experiments.config import ConfigError, available, compose, method_label, typed


def test_defaults_compose_every_group():
    cfg = compose([])
    assert cfg.preset == {"method": "clip", "data": "synthetic", "trainer": "cpu"}
    assert cfg.method.name == "clip"
    assert cfg.trainer.accelerator == "cpu"
    assert cfg.data.name == "synthetic"


def test_overrides_change_nested_keys_and_types():
    cfg = compose(["optim.lr=5e-4", "seed=3", "trainer.max_steps=7", "data.languages=[en,de]"])
    assert cfg.optim.lr == pytest.approx(5e-4)
    assert cfg.seed == 3 and cfg.trainer.max_steps == 7
    assert list(cfg.data.languages) == ["en", "de"]


def test_typo_in_key_is_an_error_naming_it():
    with pytest.raises(ConfigError, match=r"unknown config key 'optim\.lrr'.*lr"):
        compose(["optim.lrr=1"])


def test_unknown_preset_lists_the_available_ones():
    with pytest.raises(ConfigError, match="unknown method 'nope'; available: .*clip"):
        compose(["method=nope"])


def test_override_without_equals_sign_is_rejected():
    with pytest.raises(ConfigError, match="key=value"):
        compose(["seed"])


def test_override_whose_value_is_not_yaml_is_one_line_naming_it():
    with pytest.raises(
        ConfigError, match=r"^override 'data\.batch_size=\{a:1' is not valid YAML: [^\n]+$"
    ):
        compose(["data.batch_size={a:1"])


def test_every_trainer_preset_composes():
    for name in available("trainer"):
        cfg = compose([f"trainer={name}"])
        assert cfg.trainer.max_steps > 0


def test_method_label_includes_variant():
    assert method_label(compose([])) == "clip"
    assert method_label(compose(["variant=no-warmup"])) == "clip+no-warmup"


def test_method_preset_may_fix_the_protocol_and_the_cli_still_wins():
    assert compose(["method=mclip"]).protocol == "zero-shot"
    assert "protocol" not in compose(["method=mclip"]).method
    assert compose(["method=mclip", "protocol=fine-tune"]).protocol == "fine-tune"
    assert compose(["method=clip"]).protocol == "default"


@pytest.mark.parametrize("method", ["mclip", "rc3"])
def test_the_protocol_has_one_key_the_run_records_and_no_method_copy(method):
    """A method that trains by protocol is handed ``protocol`` when it is built; a second key
    for it under ``method`` could only disagree with the recorded label."""
    with pytest.raises(ConfigError, match="unknown config key 'method.run_protocol'"):
        compose([f"method={method}", "method.run_protocol=pretrain-only"])


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.max_steps=abc", "trainer.max_steps"),
        ("optim.lr=abc", "optim.lr"),
        ("data.batch_size=-4", "data.batch_size"),
        ("data.languages=en", "data.languages"),
        ("trainer.max_steps=0", "trainer.max_steps"),
        ("data.on_missing_image=skipp", "data.on_missing_image"),
        ("evaluation.unimodal_ndcg_ks=[10,0]", "evaluation.unimodal_ndcg_ks"),
        ("evaluation.unimodal_ndcg_ks=[]", "evaluation.unimodal_ndcg_ks"),
        ("evaluation.unimodal_ndcg_ks=20", "evaluation.unimodal_ndcg_ks"),
    ],
)
def test_wrong_type_sign_or_shape_names_the_key_at_compose_time(override, key):
    with pytest.raises(ConfigError) as err:
        compose([override])
    message = str(err.value)
    assert f"'{key}'" in message and "\n" not in message


def test_every_preset_combination_composes_against_the_schema():
    for method in available("method"):
        for data in available("data"):
            cfg = compose([f"method={method}", f"data={data}"])
            assert isinstance(list(cfg.data.languages), list)


def test_the_cpu_preset_takes_the_methods_thread_count_and_it_is_execution_only():
    from ccr.experiments.runs import config_fingerprint

    rc3, clip = compose(["method=rc3"]), compose(["method=clip"])
    assert rc3.trainer.cpu_threads == 2 and clip.trainer.cpu_threads == 1  # clip declares none
    assert compose(["method=rc3", "trainer.cpu_threads=1"]).trainer.cpu_threads == 1  # the CLI wins
    assert compose(["method=rc3", "trainer=gpu"]).trainer.cpu_threads is None  # torch's default
    one_thread = compose(["method=rc3", "method.cpu_threads=1", "trainer.cpu_threads=1"])
    assert config_fingerprint(one_thread) == config_fingerprint(rc3)  # same experiment, same row


def test_the_cpu_preset_takes_the_methods_validation_cadence_and_the_command_line_wins():
    rc3, clip = compose(["method=rc3"]), compose(["method=clip"])
    assert rc3.trainer.check_val_every_n_epoch == 3 and clip.trainer.check_val_every_n_epoch == 1
    assert (
        compose(["method=rc3", "method.check_val_every_n_epoch=2"]).trainer.check_val_every_n_epoch
        == 2
    )
    assert (
        compose(["method=rc3", "trainer.check_val_every_n_epoch=1"]).trainer.check_val_every_n_epoch
        == 1
    )
    assert (
        compose(["method=rc3", "trainer=gpu"]).trainer.check_val_every_n_epoch == 5
    )  # the gpu preset's own


@pytest.mark.parametrize(
    "value, reason",
    [
        ("0", "must be >= 1"),
        ("-5", "must be >= 1"),
        ("many", "Value 'many' of type 'str' could not be converted"),
    ],
)
def test_an_image_budget_below_one_or_not_a_number_is_a_one_line_error_naming_the_key(
    value, reason
):
    with pytest.raises(ConfigError) as err:
        compose(["method=rc3", f"evaluation.max_images={value}"])
    message = str(err.value)
    assert "'evaluation.max_images'" in message and reason in message and "\n" not in message


def test_rc3s_cpu_preset_scores_the_first_100_images_and_its_paper_preset_every_image():
    from ccr.experiments.runs import config_fingerprint, experiment_settings

    rc3, paper = compose(["method=rc3"]), compose(["method=rc3_paper"])
    assert (rc3.evaluation.max_images, paper.evaluation.max_images) == (100, None)
    assert compose(["method=clip"]).evaluation.max_images is None
    every_pair = compose(["method=rc3", "evaluation.max_images=null"])
    assert config_fingerprint(every_pair) != config_fingerprint(rc3)  # it changes the scores
    assert experiment_settings(rc3)["evaluation.max_images"] == 100
    assert "evaluation.max_images" not in experiment_settings(
        every_pair
    )  # null: as runs before the key


def test_a_stored_config_that_is_a_yaml_list_is_a_one_line_error_naming_the_file(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("- seed: 1\n")
    with pytest.raises(ConfigError, match=r"config\.yaml: a configuration is a mapping"):
        typed(OmegaConf.load(path), str(path))


def test_a_language_subset_keeps_the_presets_mrv_languages_it_evaluates():
    cfg = compose(["data=xflickrco", "data.languages=[ja,de]"])
    assert list(cfg.data.mrv_languages) == ["de", "ja"]  # the preset's order (CCRk's protocol)


def test_a_language_subset_outside_the_presets_mrv_languages_takes_mrv_over_its_own():
    cfg = compose(["data=xflickrco", "data.languages=[es,ru]"])
    assert cfg.data.mrv_languages is None  # MRV over every evaluated language: es, ru


@pytest.mark.parametrize("data", available("data"))
def test_every_data_preset_composes_with_a_two_language_subset(data):
    languages = list(compose([f"data={data}"]).data.languages)[-2:]
    cfg = compose([f"data={data}", f"data.languages=[{','.join(languages)}]"])
    mrv = cfg.data.mrv_languages
    assert mrv is None or set(mrv) <= set(languages)


def test_mrv_languages_set_outside_the_run_languages_is_an_error_naming_the_key():
    with pytest.raises(
        ConfigError,
        match=r"data\.mrv_languages=\['en', 'de'\] names en, which "
        r"data\.languages=\['de', 'ja'\] does not evaluate",
    ):
        compose(["data=xflickrco", "data.languages=[de,ja]", "data.mrv_languages=[en,de]"])


@pytest.mark.parametrize("method", ["clip", "ccrk", "cl2cm", "covlr"])
def test_a_method_without_protocols_refuses_another_protocol_label(method):
    """They train on every language of data.languages: a zero-shot label would not be what ran."""
    assert compose([f"method={method}"]).protocol == "default"
    with pytest.raises(
        ConfigError,
        match=f"protocol=zero-shot: {method} has no protocols of its "
        "own; it trains on every language of data.languages",
    ):
        compose([f"method={method}", "protocol=zero-shot"])


@pytest.mark.parametrize(
    "key, problem",
    [
        ("en/mr", "is not a key of the validation report"),  # misspelt
        ("xx/mR", "is not a key of the validation report"),  # a language the run lacks
        ("en/i2t/R@3", "is not a key of the validation report"),  # a k not in evaluation.ks
        ("all/MRV_dropped", "it is not a score"),
    ],
)
def test_select_on_must_name_a_score_of_the_validation_report_at_composition(key, problem):
    with pytest.raises(ConfigError, match=f"evaluation.select_on={key}.*{problem}"):
        compose([f"evaluation.select_on={key}"])


@pytest.mark.parametrize(
    "key",
    [
        "en/mR",
        "mR",
        "mR_non_en",
        "de/t2i/MeanR",
        "ja/i2t/MedR",
        "all/MRV",
        "zh/i2t/NDCG@10",
        "fr/t2i/MRR",
        "i2i/NDCG@20",
    ],
)
def test_every_score_of_the_validation_report_can_be_selected_on(key):
    assert compose([f"evaluation.select_on={key}"]).evaluation.select_on == key
