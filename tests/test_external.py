"""Pretrained models as leaderboard rows: tiny open_clip and Hugging Face CLIP models, saved here,
scored on a tiny world through ``ccr.experiments.external`` (the ``make eval MODEL=...`` path)."""

import io
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from external_models import save_tiny_hf_clip, save_tiny_open_clip
from omegaconf import OmegaConf
from PIL import Image

from ccr.datamodules import synthetic
from ccr.experiments import external, leaderboard
from ccr.experiments.config import compose
from ccr.experiments.report.evaluated import EMBEDDINGS, EvaluatedSet
from ccr.metrics import METRIC_PROTOCOL, retrieval_report

LANGUAGES = ["en", "de", "ja"]
TINY_WORLD = [
    "data.synthetic.num_train=8",
    "data.synthetic.num_val=4",
    "data.synthetic.num_test=16",
    "data.eval_batch_size=16",
    f"data.languages=[{','.join(LANGUAGES)}]",
    "data.num_workers=0",
]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return tmp_path_factory.mktemp("world")


@pytest.fixture(scope="module")
def open_clip_dir(tmp_path_factory):
    return save_tiny_open_clip(tmp_path_factory.mktemp("models") / "tiny-open-clip")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    corpus = ["a red square on the left", "ein grüner Kreis unten", "左に赤い四角"] * 4
    return save_tiny_hf_clip(tmp_path_factory.mktemp("models") / "tiny-hf-clip", corpus)


def world_overrides(world, runs):
    return [f"data.root={world}", f"run_dir={runs}", *TINY_WORLD]


def score(model, world, runs, *extra):
    external.main([f"model={model}", "device=cpu", *world_overrides(world, runs), *extra])
    (folder,) = [p.parent for p in Path(runs).rglob("metrics.json")]
    return folder, json.loads((folder / "metrics.json").read_text())


def hand_listed_test_set(world):
    """Images and captions of the test split, listed here without the suite's view code."""
    cfg = compose(world_overrides(world, "unused"))
    world_dir = synthetic.world_dir(
        str(world), synthetic.WorldKnobs.from_config(OmegaConf.to_container(cfg.data.synthetic))
    )
    records = [json.loads(line) for line in (world_dir / "test.jsonl").read_text().splitlines()]
    paths = [world_dir / "images" / r["image"] for r in records]
    captions = [
        (text, i, lang)
        for lang in LANGUAGES
        for i, r in enumerate(records)
        for text in r["captions"].get(lang, [])
    ]
    return records, paths, captions


def direct_report(records, paths, captions, encode_image, encode_text):
    """The suite's metrics on embeddings made here, one item at a time."""
    image_emb = torch.cat([encode_image(Image.open(p).convert("RGB")) for p in paths])
    text_emb = torch.cat([encode_text(text, lang) for text, _, lang in captions])
    caption_image = torch.tensor([i for _, i, _ in captions])
    report = retrieval_report(
        F.normalize(image_emb.float(), dim=-1),
        F.normalize(text_emb.float(), dim=-1),
        caption_image,
        [lang for _, _, lang in captions],
        [r["id"] for r in records],
    )
    return report, image_emb, text_emb


def assert_same_scores(recorded, direct):
    cross_modal = {k: v for k, v in direct.items() if not k.startswith(("i2i/", "t2t/"))}
    assert set(cross_modal) <= set(recorded)
    for key, value in cross_modal.items():
        assert recorded[key] == pytest.approx(value, abs=1e-9), key


def test_open_clip_row_equals_scoring_the_same_embeddings_directly(world, open_clip_dir, tmp_path):
    import open_clip

    folder, record = score(f"open_clip:local-dir:{open_clip_dir}", world, tmp_path / "runs")
    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{open_clip_dir}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{open_clip_dir}")
    model.eval()
    records, paths, captions = hand_listed_test_set(world)
    with torch.no_grad():
        direct, image_emb, _ = direct_report(
            records,
            paths,
            captions,
            lambda im: model.encode_image(preprocess(im)[None]),
            lambda text, lang: model.encode_text(tokenizer([text])),
        )
    assert_same_scores(record["metrics"], direct)
    stored = EvaluatedSet.load(folder / EMBEDDINGS)
    assert torch.allclose(stored.image_emb, F.normalize(image_emb, dim=-1), atol=1e-5)
    assert stored.captions == [text for text, _, _ in captions]
    assert_equal_captions_embed_equally(stored)
    assert record["method"] == f"open_clip:local-dir:{open_clip_dir}"
    assert_external(record, library="open_clip", model=f"local-dir:{open_clip_dir}")
    assert (record["protocol"], record["scorer"], record["split"]) == ("zero-shot", "itc", "test")
    assert record["metric_protocol"] == METRIC_PROTOCOL


def test_hf_clip_row_equals_scoring_the_same_embeddings_directly(world, hf_dir, tmp_path):
    from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

    folder, record = score(f"hf:{hf_dir}", world, tmp_path / "runs")
    model = AutoModel.from_pretrained(hf_dir).eval()
    processor, tokenizer = (
        AutoImageProcessor.from_pretrained(hf_dir),
        AutoTokenizer.from_pretrained(hf_dir),
    )
    records, paths, captions = hand_listed_test_set(world)

    def features(output):
        return output if isinstance(output, torch.Tensor) else output.pooler_output

    with torch.no_grad():
        direct, _, _ = direct_report(
            records,
            paths,
            captions,
            lambda im: features(
                model.get_image_features(**processor(images=[im], return_tensors="pt"))
            ),
            lambda text, lang: features(
                model.get_text_features(
                    **{
                        k: v
                        for k, v in tokenizer(
                            [text], padding="max_length", truncation=True, return_tensors="pt"
                        ).items()
                        if k in ("input_ids", "attention_mask")
                    }
                )
            ),
        )
    assert_same_scores(record["metrics"], direct)
    assert_external(record, library="hf", model=str(hf_dir))
    stored = EvaluatedSet.load(folder / EMBEDDINGS)
    assert_equal_captions_embed_equally(stored)


def assert_external(
    record, *, library, model, pretrained=None, revision=None, remote_code=False, zoo=None
):
    """The row's ``external`` record: what was loaded, and a passed batch-size check."""
    external_fields = {k: v for k, v in record["external"].items() if k != "batch_invariance"}
    assert external_fields == {
        "library": library,
        "model": model,
        "pretrained": pretrained,
        "revision": revision,
        "remote_code": remote_code,
        "zoo": zoo,
        "image_model": None,
    }
    check = record["external"]["batch_invariance"]
    assert check["invariant"] and check["batch_sizes"] == [16, 1], check
    assert check["images"] == 16 and check["captions"] == 16 and check["max_abs_diff"] <= 1e-4


def assert_equal_captions_embed_equally(stored):
    """Equal captions in different batches (so different padding) get bit-equal embeddings: their
    ties stay ties instead of being broken by rounding."""
    first = {}
    repeated = 0
    for index, text in enumerate(stored.captions):
        if text in first:
            repeated += 1
            assert torch.equal(stored.text_emb[index], stored.text_emb[first[text]]), text
        first.setdefault(text, index)
    assert repeated > 0


def test_open_clip_weights_file_is_the_tag_and_the_leaderboard_marks_the_row(
    world, open_clip_dir, tmp_path
):
    """An arch plus a weights file (as PRETRAINED=<tag> for a public model): the row is marked
    external with its tag, beside a trained method's row."""
    import open_clip

    weights = open_clip_dir / "open_clip_pytorch_model.bin"
    (tmp_path / "cfg").mkdir()
    config = json.loads((open_clip_dir / "open_clip_config.json").read_text())["model_cfg"]
    (tmp_path / "cfg" / "tiny-arch.json").write_text(json.dumps(config))
    open_clip.add_model_config(tmp_path / "cfg" / "tiny-arch.json")
    runs = tmp_path / "runs"
    folder, record = score("open_clip:tiny-arch", world, runs, f"pretrained={weights}")
    assert record["external"]["pretrained"] == str(weights)
    assert folder.parent.name == "open_clip-tiny-arch-open_clip_pytorch_model.bin"
    rows = leaderboard.build(runs)
    (row,) = rows
    assert row["external"] == record["external"]
    table = (runs / "leaderboard.md").read_text()
    assert f"| open_clip:tiny-arch (external, {weights}) | zero-shot | itc |" in table
    assert "(external) a pretrained model scored zero-shot" in table
    csv_text = (runs / "leaderboard.csv").read_text()
    assert f"external, {weights}" in csv_text


def test_a_trained_row_is_not_marked_external():
    row = {"method": "ccrk", "mark": "", "external": None}
    assert leaderboard.external_label(row) == "" and leaderboard._method_cell(row) == "ccrk"


def run_cli(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        external.main(args)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    return err


def test_an_arch_without_weights_is_refused_not_scored_at_random(capsys, tmp_path):
    err = run_cli(["model=open_clip:ViT-B-32", f"run_dir={tmp_path}"], capsys)
    assert "needs pretrained=<tag or weights file>" in err
    assert not list(tmp_path.rglob("metrics.json"))


def test_a_local_dir_without_weights_is_refused(world, open_clip_dir, tmp_path, capsys):
    folder = tmp_path / "config-only"
    folder.mkdir()
    (folder / "open_clip_config.json").write_text(
        (open_clip_dir / "open_clip_config.json").read_text()
    )
    err = run_cli(
        [f"model=open_clip:local-dir:{folder}", *world_overrides(world, tmp_path / "runs")], capsys
    )
    assert f"{folder} holds no open_clip weights" in err
    assert not list(tmp_path.rglob("metrics.json"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["model=clip:ViT-B-32"], "expected open_clip:<arch>, hf:<name or path> or zoo:<name>"),
        (["model=hf:some/model", "pretrained=v1"], "brings its own weights"),
        (["pretrained=v1"], "usage: python -m ccr.experiments.external model="),
    ],
)
def test_bad_model_arguments_are_one_line_errors(args, message, capsys):
    assert message in run_cli(args, capsys)


def test_a_missing_hf_model_names_it(world, tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    err = run_cli([f"model=hf:{missing}", *world_overrides(world, tmp_path / "runs")], capsys)
    assert err.startswith(f"error: cannot load hf:{missing}")


def test_non_finite_embeddings_write_no_row(world, open_clip_dir, tmp_path, capsys):
    """A model that outputs NaN (a broken checkpoint) is an error, never a score."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "open_clip_config.json").write_text(
        (open_clip_dir / "open_clip_config.json").read_text()
    )
    state = torch.load(open_clip_dir / "open_clip_pytorch_model.bin", weights_only=True)
    state["visual.proj"] = torch.full_like(state["visual.proj"], float("nan"))
    torch.save(state, broken / "open_clip_pytorch_model.bin")
    err = run_cli(
        [f"model=open_clip:local-dir:{broken}", *world_overrides(world, tmp_path / "runs")], capsys
    )
    assert "non-finite embeddings: 16 of 16 images" in err
    assert not list(tmp_path.rglob("metrics.json")) and not list(tmp_path.rglob(EMBEDDINGS))


def test_the_same_model_scored_twice_is_one_row(world, open_clip_dir, tmp_path):
    runs = tmp_path / "runs"
    for _ in range(2):
        external.main(
            [
                f"model=open_clip:local-dir:{open_clip_dir}",
                "device=cpu",
                *world_overrides(world, runs),
            ]
        )
    folders = sorted(p.parent for p in runs.rglob("metrics.json"))
    assert len(folders) == 2
    (row,) = leaderboard.aggregate(leaderboard.load_results(runs))
    assert row["seeds"] == [0] and len(row["duplicates"][0]) == 2


def _folder_with_weights(open_clip_dir, folder, name, content: bytes):
    folder.mkdir()
    (folder / "open_clip_config.json").write_text(
        (open_clip_dir / "open_clip_config.json").read_text()
    )
    (folder / name).write_bytes(content)
    return folder / name


def test_open_clip_weights_that_are_not_a_state_dict_are_refused_naming_the_file(
    world, open_clip_dir, tmp_path, capsys
):
    buffer = io.BytesIO()
    torch.save([1, 2, 3], buffer)
    weights = _folder_with_weights(
        open_clip_dir, tmp_path / "list", "open_clip_pytorch_model.bin", buffer.getvalue()
    )
    err = run_cli(
        [f"model=open_clip:local-dir:{weights.parent}", *world_overrides(world, tmp_path / "runs")],
        capsys,
    )
    assert f"{weights}: not a state dict (it holds a list)" in err
    assert not list(tmp_path.rglob("metrics.json"))


def test_truncated_open_clip_safetensors_are_refused_naming_the_file(
    world, open_clip_dir, tmp_path, capsys
):
    from safetensors.torch import save_file

    state = torch.load(open_clip_dir / "open_clip_pytorch_model.bin", weights_only=True)
    save_file(state, str(tmp_path / "full.safetensors"))
    raw = (tmp_path / "full.safetensors").read_bytes()
    weights = _folder_with_weights(
        open_clip_dir, tmp_path / "cut", "open_clip_model.safetensors", raw[: len(raw) // 2]
    )
    err = run_cli(
        [f"model=open_clip:local-dir:{weights.parent}", *world_overrides(world, tmp_path / "runs")],
        capsys,
    )
    assert f"{weights}: not a readable safetensors file" in err


def test_open_clip_pretrained_file_that_is_not_a_state_dict_is_refused_naming_it(
    world, tmp_path, capsys
):
    weights = tmp_path / "weights.pt"
    torch.save({"epoch": 3}, weights)
    err = run_cli(
        [
            "model=open_clip:ViT-B-32",
            f"pretrained={weights}",
            *world_overrides(world, tmp_path / "runs"),
        ],
        capsys,
    )
    assert f"{weights}: not a state dict (entry 'epoch' is int, not a tensor)" in err
