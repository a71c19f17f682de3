"""The model zoo, remote code pinned to a revision, and the batch-size check of external rows: tiny
models of each loader family saved here, scored on a tiny world (nothing is downloaded)."""

import json
import shutil
from pathlib import Path

import open_clip
import pytest
from external_models import (
    save_tiny_hf_clip,
    save_tiny_mclip,
    save_tiny_metaclip2,
    save_tiny_open_clip,
    save_tiny_remote_code,
)
from test_external import assert_same_scores, run_cli, world_overrides

from ccr.experiments import eval_zoo, external, leaderboard, zoo
from ccr.experiments.config import ConfigError

CORPUS = ["a red square on the left", "ein grüner Kreis unten", "左に赤い四角"] * 4
COMMIT = "0123456789abcdef0123456789abcdef01234567"
ENTRY_TEXT = {"licence": "test", "preprocessing": "its own", "languages": "any"}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return tmp_path_factory.mktemp("world")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "open_clip": save_tiny_open_clip(root / "open-clip"),
        "hf_clip": save_tiny_hf_clip(root / "hf-clip", CORPUS),
        "hf_metaclip2": save_tiny_metaclip2(root / "metaclip2", CORPUS),
        "hf_remote": save_tiny_remote_code(root / "remote", CORPUS),
        "batch_dependent": save_tiny_remote_code(
            root / "batch-dependent", CORPUS, batch_centered=True
        ),
        "mclip": save_tiny_mclip(root / "mclip", CORPUS),
    }


def write_entry(folder: Path, name: str, **fields) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(json.dumps({**ENTRY_TEXT, **fields}))  # JSON is YAML
    return path


def family_entries(folder: Path, models: dict) -> dict[str, dict]:
    """A zoo entry per loader family, each pointing at its tiny saved model."""
    fields = {
        "tiny-open-clip": {"loader": "open_clip", "model": f"local-dir:{models['open_clip']}"},
        "tiny-hf-clip": {"loader": "hf_clip", "model": str(models["hf_clip"])},
        "tiny-metaclip2": {"loader": "hf_metaclip2", "model": str(models["hf_metaclip2"])},
        "tiny-remote": {
            "loader": "hf_remote",
            "model": str(models["hf_remote"]),
            "revision": COMMIT,
        },
        "tiny-mclip": {
            "loader": "mclip",
            "model": str(models["mclip"]),
            "image_model": f"local-dir:{models['open_clip']}",
        },
    }
    for name, entry in fields.items():
        write_entry(folder, name, **entry)
    return fields


def score(args, world, runs):
    external.main([*args, "device=cpu", *world_overrides(world, runs)])
    (folder,) = [p.parent for p in Path(runs).rglob("metrics.json")]
    return json.loads((folder / "metrics.json").read_text())


def test_every_shipped_zoo_entry_parses_and_names_a_model_its_loader_knows():
    entries = {e.name: e for e in zoo.entries()}
    listed = set(open_clip.list_pretrained())
    for e in entries.values():
        if e.loader == "open_clip":
            assert (e.model, e.pretrained) in listed, e.name
    models = {(e.loader, e.model, e.pretrained) for e in entries.values()}
    for wanted in [
        ("open_clip", "ViT-H-14-worldwide", "metaclip2_worldwide"),
        ("open_clip", "ViT-bigG-14-worldwide", "metaclip2_worldwide"),
        ("hf_metaclip2", "facebook/metaclip-2-mt5-worldwide-s16", None),
        ("open_clip", "nllb-clip-base-siglip", "mrl"),
        ("open_clip", "ViT-B-16-SigLIP-i18n-256", "webli"),
        ("open_clip", "xlm-roberta-large-ViT-H-14", "frozen_laion5b_s13b_b90k"),
        ("hf_clip", "BAAI/AltCLIP-m18", None),
        ("hf_remote", "jinaai/jina-clip-v2", None),
        ("mclip", "M-CLIP/XLM-Roberta-Large-Vit-B-16Plus", "laion400m_e32"),
    ]:
        assert wanted in models, wanted
    for e in entries.values():
        if e.loader == "hf_remote":  # a shipped remote-code entry runs: it is pinned
            assert e.revision is not None, e.name
        if e.loader == "open_clip":  # open_clip downloads its tag unpinned: no revision applies
            assert e.revision is None, e.name


def test_every_pinned_shipped_zoo_entry_names_where_its_commit_came_from():
    for path in sorted(zoo.ZOO_DIR.glob("*.yaml")):
        (line,) = [x for x in path.read_text().splitlines() if x.startswith("revision:")]
        value, _, comment = line.removeprefix("revision:").partition("#")
        if value.strip() != "null":
            assert comment.strip().startswith("from "), f"{path.name}: {line}"


def test_a_revision_for_an_open_clip_model_is_refused_not_recorded_unapplied(
    world, models, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("CCR_ZOO_DIR", str(tmp_path / "zoo"))
    family_entries(tmp_path / "zoo", models)
    path = write_entry(
        tmp_path / "zoo",
        "pinned-open-clip",
        loader="open_clip",
        model=f"local-dir:{models['open_clip']}",
        revision=COMMIT,
    )
    with pytest.raises(ConfigError, match=f"{path}: field 'revision' pins a Hugging Face"):
        zoo.entry("pinned-open-clip")
    err = run_cli(
        [
            "model=zoo:tiny-open-clip",
            f"revision={COMMIT}",
            *world_overrides(world, tmp_path / "runs"),
        ],
        capsys,
    )
    assert "revision= pins a Hugging Face model; open_clip" in err
    assert not list(tmp_path.rglob("metrics.json"))


@pytest.mark.parametrize(
    "family, direct",
    [
        ("tiny-open-clip", lambda m: [f"model=open_clip:local-dir:{m['open_clip']}"]),
        ("tiny-hf-clip", lambda m: [f"model=hf:{m['hf_clip']}"]),
        ("tiny-metaclip2", lambda m: [f"model=hf:{m['hf_metaclip2']}"]),
        (
            "tiny-remote",
            lambda m: [f"model=hf:{m['hf_remote']}", "remote_code=true", f"revision={COMMIT}"],
        ),
    ],
)
def test_a_zoo_entry_scores_as_the_model_it_names(
    family, direct, world, models, tmp_path, monkeypatch
):
    monkeypatch.setenv("CCR_ZOO_DIR", str(tmp_path / "zoo"))
    family_entries(tmp_path / "zoo", models)
    row = score([f"model=zoo:{family}"], world, tmp_path / "zoo-runs")
    plain = score(direct(models), world, tmp_path / "plain-runs")
    assert_same_scores(row["metrics"], plain["metrics"])
    assert row["method"] == f"zoo:{family}" and row["external"]["zoo"] == family
    assert row["external"]["remote_code"] is (family == "tiny-remote")
    assert row["external"]["revision"] == (COMMIT if family == "tiny-remote" else None)


def test_remote_code_without_a_revision_is_a_one_line_error(
    world, models, tmp_path, capsys, monkeypatch
):
    err = run_cli(
        [
            f"model=hf:{models['hf_remote']}",
            "remote_code=true",
            *world_overrides(world, tmp_path / "runs"),
        ],
        capsys,
    )
    assert "runs modelling code from its repository: pin it with revision=<40-hex commit>" in err
    monkeypatch.setenv("CCR_ZOO_DIR", str(tmp_path / "zoo"))
    write_entry(tmp_path / "zoo", "unpinned", loader="hf_remote", model=str(models["hf_remote"]))
    err = run_cli(["model=zoo:unpinned", *world_overrides(world, tmp_path / "runs")], capsys)
    assert "pin it with revision=<40-hex commit>" in err
    assert not list(tmp_path.rglob("metrics.json"))


def test_remote_code_from_another_repository_is_refused_as_not_pinned_by_the_revision(
    world, models, tmp_path, capsys, monkeypatch
):
    # jina-clip-v2's config names its code as "jinaai/jina-clip-implementation--modeling_clip...":
    # transformers fetches that repository's latest code, whatever revision= pins
    folder = tmp_path / "code-elsewhere"
    shutil.copytree(models["hf_remote"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {
        k: f"ccr-suite-tests/tiny-code--{v}" for k, v in config["auto_map"].items()
    }
    (folder / "config.json").write_text(json.dumps(config))
    message = (
        "takes its modelling code from ccr-suite-tests/tiny-code, which revision= does not pin"
    )
    err = run_cli(
        [
            f"model=hf:{folder}",
            "remote_code=true",
            f"revision={COMMIT}",
            *world_overrides(world, tmp_path / "runs"),
        ],
        capsys,
    )
    assert message in err
    assert not list(tmp_path.rglob("metrics.json"))
    monkeypatch.setenv("CCR_ZOO_DIR", str(tmp_path / "zoo"))
    write_entry(
        tmp_path / "zoo", "elsewhere", loader="hf_remote", model=str(folder), revision=COMMIT
    )
    assert message in zoo.skip_reason(zoo.entry("elsewhere"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["remote_code=true", "revision=main"], "revision 'main' is not a commit hash"),
        ([], "cannot load hf:"),  # transformers refuses custom code it was not allowed to run
    ],
)
def test_remote_code_runs_only_when_asked_with_a_commit(
    args, message, world, models, tmp_path, capsys
):
    err = run_cli(
        [f"model=hf:{models['hf_remote']}", *args, *world_overrides(world, tmp_path / "runs")],
        capsys,
    )
    assert message in err
    assert not list(tmp_path.rglob("metrics.json"))


def test_a_bad_zoo_file_is_refused_naming_the_file_and_field(tmp_path, monkeypatch):
    monkeypatch.setenv("CCR_ZOO_DIR", str(tmp_path))
    path = write_entry(
        tmp_path, "bad", loader="open_clip", model="ViT-B-32", pretrained="x", revision="v1.0"
    )
    with pytest.raises(ConfigError, match=f"{path}: field 'revision' = 'v1.0'"):
        zoo.entry("bad")
    path = write_entry(tmp_path, "bad", loader="open_clip", model="ViT-B-32")
    with pytest.raises(ConfigError, match=f"{path}: field 'pretrained' is needed"):
        zoo.entry("bad")
    path = write_entry(tmp_path, "bad", loader="onnx", model="x")
    with pytest.raises(ConfigError, match=f"{path}: field 'loader' = 'onnx'"):
        zoo.entry("bad")


@pytest.mark.parametrize("offline", [False, True])
def test_eval_zoo_scores_each_local_model_once_and_lists_the_skipped_with_reasons(
    offline, world, models, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("CCR_ZOO_DIR", str(tmp_path / "zoo"))
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    local = family_entries(tmp_path / "zoo", models)
    write_entry(
        tmp_path / "zoo", "not-cached", loader="hf_clip", model="ccr-suite-tests/no-such-model"
    )
    write_entry(tmp_path / "zoo", "unpinned", loader="hf_remote", model="ccr-suite-tests/remote")
    write_entry(
        tmp_path / "zoo",
        "mclip",
        loader="mclip",
        model="M-CLIP/XLM-Roberta-Large-Vit-B-16Plus",
        image_model="ViT-B-16-plus-240",
        pretrained="laion400m_e32",
    )
    runs = tmp_path / "runs"
    eval_zoo.main(["device=cpu", *world_overrides(world, runs)])
    out = capsys.readouterr().out
    rows = leaderboard.aggregate(leaderboard.load_results(runs))
    assert sorted(r["method"] for r in rows) == sorted(f"zoo:{name}" for name in local)
    assert "zoo: scored 5 of 8 models; skipped 3:" in out
    cache = (
        "not in the local cache and hub access is off (HF_HUB_OFFLINE)"
        if offline
        else "not in the local cache (make eval MODEL=zoo:not-cached downloads it)"
    )
    assert f"  not-cached: {cache}" in out
    assert "  unpinned: remote code without a revision (pin one: revision=<40-hex commit>)" in out
    assert "  mclip: not in the local cache" in out


def test_a_model_whose_embeddings_depend_on_the_batch_is_scored_and_marked(world, models, tmp_path):
    runs = tmp_path / "runs"
    row = score(
        [f"model=hf:{models['batch_dependent']}", "remote_code=true", f"revision={COMMIT}"],
        world,
        runs,
    )
    check = row["external"]["batch_invariance"]
    assert check["invariant"] is False and check["batch_sizes"] == [16, 1]
    assert check["max_abs_diff"] > 1e-2
    assert "mR" in row["metrics"]
    (board_row,) = leaderboard.build(runs)
    assert leaderboard.external_label(board_row) == "external, batch-dependent"
    table = (runs / "leaderboard.md").read_text()
    assert (
        "(external, batch-dependent)" in table
        and "its score depends on the evaluation batch" in table
    )
    clean = score(
        [f"model=hf:{models['hf_remote']}", "remote_code=true", f"revision={COMMIT}"],
        world,
        tmp_path / "clean",
    )
    assert clean["external"]["batch_invariance"]["invariant"] is True


LANGUAGES_SET = []


class _HfStyleTokenizer:
    """open_clip's HFTokenizer as XLM-R models get it: ``set_language`` exists, but only an NLLB
    tokenizer has a language function (``set_lang_fn``)."""

    context_length = 4

    def __init__(self, nllb):
        if nllb:
            self.set_lang_fn = LANGUAGES_SET.append

    def set_language(self, code):
        self.set_lang_fn(code)

    def __call__(self, texts):
        import torch

        return torch.ones(len(texts), self.context_length, dtype=torch.long)


def test_only_an_nllb_tokenizer_is_told_the_caption_language():
    from ccr.methods.layers.pretrained_dual import DualSpec, PretrainedIO, PretrainedModelError

    spec = DualSpec("open_clip", "some-arch", "tag")
    xlmr = PretrainedIO(spec, None, _HfStyleTokenizer(nllb=False), 4)
    assert xlmr.tokenize(["a caption"], None)["input_ids"].shape == (1, 4)  # no language needed
    nllb = PretrainedIO(spec, None, _HfStyleTokenizer(nllb=True), 4)
    nllb.tokenize(["ein Bild"], "de")
    assert LANGUAGES_SET == ["deu_Latn"]
    with pytest.raises(PretrainedModelError, match="needs each caption's language"):
        nllb.tokenize(["a caption"], None)


def test_an_mclip_row_is_xlmr_mean_pooled_and_mapped_against_its_open_clip_image_tower(
    world, models, tmp_path, monkeypatch
):
    """M-CLIP scored as its authors compute it: the mask-weighted mean of XLM-R's last states, then
    the linear map; images through the open_clip tower and its transform."""
    import torch
    from test_external import direct_report, hand_listed_test_set
    from transformers import AutoTokenizer, XLMRobertaConfig, XLMRobertaModel

    monkeypatch.setenv("CCR_ZOO_DIR", str(tmp_path / "zoo"))
    family_entries(tmp_path / "zoo", models)
    row = score(["model=zoo:tiny-mclip"], world, tmp_path / "runs")
    state = torch.load(models["mclip"] / "pytorch_model.bin", weights_only=True)
    config = json.loads((models["mclip"] / "config.json").read_text())
    xlmr = XLMRobertaModel(XLMRobertaConfig.from_pretrained(config["modelBase"])).eval()
    xlmr.load_state_dict(
        {
            k.removeprefix("transformer."): v
            for k, v in state.items()
            if k.startswith("transformer.")
        }
    )
    weight, bias = state["LinearTransformation.weight"], state["LinearTransformation.bias"]
    tokenizer = AutoTokenizer.from_pretrained(models["mclip"])
    image_model, _, preprocess = open_clip.create_model_and_transforms(
        f"local-dir:{models['open_clip']}"
    )
    image_model.eval()

    def encode_text(text, lang):
        batch = tokenizer([text], truncation=True, max_length=32, return_tensors="pt")
        states = xlmr(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        return ((states * mask).sum(1) / mask.sum(1)) @ weight.T + bias

    records, paths, captions = hand_listed_test_set(world)
    with torch.no_grad():
        direct, _, _ = direct_report(
            records,
            paths,
            captions,
            lambda im: image_model.encode_image(preprocess(im)[None]),
            encode_text,
        )
    assert_same_scores(row["metrics"], direct)
    assert row["external"]["image_model"] == f"local-dir:{models['open_clip']}"
