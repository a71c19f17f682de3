"""The synthetic world: determinism, grammars and agreement, the knobs, graded relevance."""

from __future__ import annotations

import importlib.util
import random
import re
from pathlib import Path

import pytest
import torch

from ccr.datamodules.synthetic import (
    PRETRAIN,
    WorldKnobs,
    build_pretrain,
    build_world,
    load_split,
    parallel_text_dir,
    relevance_matrix,
    scene_key,
    world_dir,
)
from ccr.datamodules.synthetic import languages as grammars
from ccr.datamodules.synthetic.plans import CaptionPlan, Mention, garble, mistranslate
from ccr.datamodules.synthetic.render import BACKGROUND_RGB, render_scene
from ccr.datamodules.synthetic.scene import (
    BACKGROUNDS,
    COLOURS,
    POSITIONS,
    SHAPES,
    SIZES,
    Scene,
    SceneObject,
)

TINY = {"num_train": 16, "num_val": 4, "num_test": 6}


def world_files(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def test_same_seed_gives_identical_bytes_and_another_seed_differs(tmp_path):
    first = build_world(tmp_path / "a", WorldKnobs(**TINY, seed=3))
    second = build_world(tmp_path / "b", WorldKnobs(**TINY, seed=3))
    other = build_world(tmp_path / "c", WorldKnobs(**TINY, seed=4))
    files = world_files(first)
    assert len([f for f in files if f.endswith(".png")]) == 26
    assert files == world_files(second)
    assert files["train.jsonl"] != world_files(other)["train.jsonl"]


def test_world_is_cached_and_keyed_by_knobs(tmp_path):
    folder = build_world(tmp_path, WorldKnobs(**TINY))
    stamp = (folder / "train.jsonl").stat().st_mtime_ns
    assert build_world(tmp_path, WorldKnobs(**TINY)) == folder
    assert (folder / "train.jsonl").stat().st_mtime_ns == stamp
    assert world_dir(tmp_path, WorldKnobs(**TINY, num_colours=4)) != folder


def test_records_have_five_captions_per_language_and_object_labels(tmp_path):
    records = load_split(build_world(tmp_path, WorldKnobs(**TINY)), "test")
    assert [r.id for r in records] == [f"test-{i:05d}" for i in range(6)]
    for record in records:
        assert sorted(record.captions) == grammars.available()
        assert all(len(texts) == 5 for texts in record.captions.values())
        scene = Scene.from_json(record.extras["scene"])
        assert record.extras["objects"] == [o.label for o in scene.objects]
        assert 1 <= len(scene.objects) <= 3
        assert record.extras["alignment"] == "strict"


def test_every_language_covers_every_attribute_value():
    assert {"en", "de", "fr", "cs", "ja", "zh"} <= set(grammars.available())
    for code in grammars.available():
        for shape in SHAPES:
            for colour, size, position, background in zip(  # cycled: 8 rows hold every value
                COLOURS, SIZES * 4, POSITIONS * 2, BACKGROUNDS * 2, strict=False
            ):
                for frame in range(4):
                    plan = CaptionPlan((Mention(shape, colour, size, position),), background, frame)
                    text = grammars.realise(code, plan)
                    assert text[-1] in ".。" and "  " not in text


def test_unknown_language_lists_available_grammars():
    with pytest.raises(
        KeyError, match="no synthetic grammar for language 'xx'; available: cs, de, en"
    ):
        grammars.grammar("xx")


def plan(*mentions, background=None, frame=0):
    return CaptionPlan(tuple(Mention(*m) for m in mentions), background, frame)


RED_CIRCLE_LEFT = ("circle", "red", "small", "left")
WHITE_STAR = ("star", "white", "small", None)
BLUE_TRIANGLE = ("triangle", "blue", "large", None)
ORANGE_ELLIPSE = ("ellipse", "orange", None, None)


def test_english_articles_and_lists():
    assert grammars.realise(
        "en", plan(ORANGE_ELLIPSE, RED_CIRCLE_LEFT, BLUE_TRIANGLE, frame=1)
    ) == ("There is an orange ellipse, a small red circle on the left and a large blue triangle.")


def test_german_gender_case_and_verb_second():
    assert grammars.realise("de", plan(RED_CIRCLE_LEFT, WHITE_STAR, frame=2)) == (
        "Das Bild zeigt einen kleinen roten Kreis links und einen kleinen weißen Stern."
    )
    assert grammars.realise(
        "de", plan(RED_CIRCLE_LEFT, BLUE_TRIANGLE, ORANGE_ELLIPSE, frame=0)
    ) == (
        "Ein kleiner roter Kreis links, ein großes blaues Dreieck und eine orangefarbene Ellipse."
    )
    assert grammars.realise("de", plan(BLUE_TRIANGLE, background="grass", frame=1)) == (
        "Im Gras gibt es ein großes blaues Dreieck."
    )


def test_french_gender_agreement_and_adjective_position():
    assert grammars.realise("fr", plan(WHITE_STAR, RED_CIRCLE_LEFT, frame=1)) == (
        "Il y a une petite étoile blanche et un petit cercle rouge à gauche."
    )
    assert grammars.realise("fr", plan(BLUE_TRIANGLE, background="snow", frame=3)) == (
        "On voit un grand triangle bleu dans la neige."
    )


def test_czech_gender_case_and_number():
    assert grammars.realise("cs", plan(WHITE_STAR, RED_CIRCLE_LEFT, frame=1)) == (
        "Na obrázku jsou malá bílá hvězda a malý červený kruh vlevo."
    )
    assert grammars.realise("cs", plan(WHITE_STAR, frame=3)) == "Vidíme malou bílou hvězdu."
    assert grammars.realise("cs", plan(BLUE_TRIANGLE, background="water", frame=1)) == (
        "Ve vodě je velký modrý trojúhelník."
    )


def test_japanese_and_chinese_are_written_without_spaces():
    assert grammars.realise("ja", plan(RED_CIRCLE_LEFT, frame=1)) == "左に小さい赤い円があります。"
    assert grammars.realise(
        "ja", plan(RED_CIRCLE_LEFT, WHITE_STAR, background="sand", frame=2)
    ) == ("背景は砂で、左の小さい赤い円と小さい白い星が写っている画像。")
    assert grammars.realise("zh", plan(RED_CIRCLE_LEFT, frame=1)) == "左边有一个小的红色圆形。"
    assert grammars.realise("zh", plan(RED_CIRCLE_LEFT, WHITE_STAR, BLUE_TRIANGLE, frame=3)) == (
        "可以看到左边的一个小的红色圆形、一个小的白色星形和一个大的蓝色三角形。"
    )


def mentioned_objects(english_caption: str) -> int:
    """English captions use an article only in front of each object."""
    return sum(word.lower() in ("a", "an") for word in english_caption.split())


def test_weak_instances_describe_different_subsets(tmp_path):
    records = load_split(build_world(tmp_path, WorldKnobs(**TINY, weak_fraction=1.0)), "train")
    weak = [r for r in records if r.extras["alignment"] == "weak"]
    assert weak and all(len(r.extras["objects"]) > 1 for r in weak)
    assert all(len(r.extras["objects"]) == 1 for r in records if r not in weak)
    for record in weak:
        assert all(
            mentioned_objects(t) < len(record.extras["objects"]) for t in record.captions["en"]
        )
    strict_test = load_split(world_dir(tmp_path, WorldKnobs(**TINY, weak_fraction=1.0)), "test")
    for record in strict_test:
        assert all(
            mentioned_objects(t) == len(record.extras["objects"]) for t in record.captions["en"]
        )


def test_translation_noise_changes_only_non_english_train_captions(tmp_path):
    clean = build_world(tmp_path, WorldKnobs(**TINY))
    noisy = build_world(tmp_path, WorldKnobs(**TINY, mt_noise=1.0))
    for split in ("val", "test"):
        assert (clean / f"{split}.jsonl").read_bytes() == (noisy / f"{split}.jsonl").read_bytes()
    clean_train, noisy_train = load_split(clean, "train"), load_split(noisy, "train")
    changed = total = 0
    for a, b in zip(clean_train, noisy_train, strict=True):
        assert a.captions["en"] == b.captions["en"] and a.extras == b.extras
        for code in a.captions:
            if code != "en":
                total += 5
                changed += sum(
                    x != y for x, y in zip(a.captions[code], b.captions[code], strict=True)
                )
    assert changed / total > 0.8
    assert (clean / "images/train-00003.png").read_bytes() == (
        noisy / "images/train-00003.png"
    ).read_bytes()


def test_noise_operations():
    words = ["one", "two", "three", "four"]
    rng = random.Random(0)
    outcomes = {tuple(garble(words, rng)) for _ in range(50)}
    assert ("two", "three", "four") in outcomes or ("one", "three", "four") in outcomes
    assert any(len(o) == 5 for o in outcomes) and any(
        sorted(o) == sorted(words) and list(o) != words for o in outcomes
    )
    original = plan(RED_CIRCLE_LEFT)
    wrong = mistranslate(original, SHAPES, COLOURS, random.Random(1))
    (before,), (after,) = original.mentions, wrong.mentions
    assert (before.shape != after.shape) != (before.colour != after.colour)
    assert (before.size, before.position) == (after.size, after.position)


def test_partial_language_coverage_applies_to_train_only(tmp_path):
    knobs = WorldKnobs(num_train=200, num_val=4, num_test=20, coverage={"de": 0.3, "ja": 0.0})
    folder = build_world(tmp_path, knobs)
    train = load_split(folder, "train")
    share_de = sum("de" in r.captions for r in train) / len(train)
    assert 0.2 < share_de < 0.4
    assert not any("ja" in r.captions for r in train)
    assert all("en" in r.captions for r in train)
    assert all(sorted(r.captions) == grammars.available() for r in load_split(folder, "test"))


def test_relevance_is_graded_by_shared_attributes():
    def scene(*objects):
        return Scene(tuple(SceneObject(*o) for o in objects), (), None)

    scenes = [
        scene(("circle", "red", "small", "left")),
        scene(("circle", "red", "large", "right")),  # size differs: (1 + 1) / 2 / 1.25
        scene(("square", "red", "small", "left")),  # colour only: 0.5 / 1.25
        scene(("square", "blue", "small", "left")),  # nothing shared
        scene(("circle", "red", "small", "top"), ("square", "blue", "small", "left")),
    ]
    rel = relevance_matrix(scenes)
    assert torch.allclose(rel, rel.T) and torch.allclose(rel.diag(), torch.ones(5))
    assert rel[0, 1].item() == pytest.approx(0.8)
    assert rel[0, 2].item() == pytest.approx(0.4)
    assert rel[0, 3].item() == 0.0
    # scene 0 vs 4: its circle matches fully (1.25); of scene 4, the circle 1.25 and the square 0.
    assert rel[0, 4].item() == pytest.approx((1.25 + 1.25 + 0.0) / 3 / 1.25)


def test_rendering_draws_the_background_and_the_objects():
    scene = Scene((SceneObject("square", "red", "large", "centre"),), (), "water")
    image = render_scene(scene, 64, random.Random(0))
    assert image.size == (64, 64)
    assert image.getpixel((0, 0)) == BACKGROUND_RGB["water"]
    assert image.getpixel((32, 32)) == (220, 30, 30)


def test_knobs_are_checked():
    with pytest.raises(KeyError, match=r"unknown synthetic knob\(s\) \['num_shape'\]"):
        WorldKnobs.from_config({"num_shape": 3})
    with pytest.raises(ValueError, match="num_shapes must be 1..8"):
        WorldKnobs.from_config({"num_shapes": 9})
    assert WorldKnobs.from_config({"coverage": {"de": 1}}).coverage == {"de": 1.0}


def test_scene_sampling_respects_the_difficulty_knobs(tmp_path):
    records = load_split(
        build_world(
            tmp_path, WorldKnobs(**TINY, num_shapes=2, num_colours=3, max_objects=2, distractors=2)
        ),
        "train",
    )
    for record in records:
        scene = Scene.from_json(record.extras["scene"])
        assert 1 <= len(scene.objects) <= 2 and len(scene.distractors) == 2
        assert {o.shape for o in scene.objects + scene.distractors} <= set(SHAPES[:2])
        assert {o.colour for o in scene.objects + scene.distractors} <= set(COLOURS[:3])
        assert len({o.position for o in scene.objects}) == len(scene.objects)
    assert not re.search(r"\s", "".join(r.captions["zh"][0] + r.captions["ja"][0] for r in records))


def test_the_documented_language_example_works(monkeypatch, tmp_path):
    doc = (Path(__file__).resolve().parents[1] / "docs/synthetic.md").read_text(encoding="utf-8")
    (tmp_path / "es.py").write_text(re.search(r"```python\n(.*?)```", doc, re.DOTALL).group(1))
    spec = importlib.util.spec_from_file_location("documented_es", tmp_path / "es.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(grammars.GRAMMARS, "es", module)
    assert grammars.realise("es", plan(WHITE_STAR, background="snow", frame=1)) == (
        "Hay una estrella blanca pequeña sobre la nieve."
    )
    assert grammars.realise("es", plan(RED_CIRCLE_LEFT, BLUE_TRIANGLE, frame=3)) == (
        "Se ven un círculo rojo pequeño a la izquierda y un triángulo azul grande."
    )
    for shape in SHAPES:
        for colour, size, position, background in zip(  # cycled: 8 rows hold every value
            COLOURS, SIZES * 4, POSITIONS * 2, BACKGROUNDS * 2, strict=False
        ):
            grammars.realise("es", plan((shape, colour, size, position), background=background))


def test_pretrain_split_and_parallel_corpus_share_no_scene_with_retrieval(tmp_path):
    """The backbones and mCLIP's Stage 1 learn from the ``pretrain`` split: no scene a retrieval
    split can ask about (described objects + background) may appear in it, and its parallel text
    is line-aligned translations of its captions. A world built for retrieval alone never
    renders it."""
    knobs = WorldKnobs(**{**TINY, "num_pretrain": 40})
    world = build_world(tmp_path, knobs)
    assert not (world / PRETRAIN).exists()
    folder = build_pretrain(world, knobs)
    pretrain = load_split(folder, PRETRAIN)
    retrieval = {
        scene_key(Scene.from_json(r.extras["scene"]))
        for split in ("train", "val", "test")
        for r in load_split(world, split)
    }
    assert len(pretrain) == 40
    assert not retrieval & {scene_key(Scene.from_json(r.extras["scene"])) for r in pretrain}
    lines = {
        code: (parallel_text_dir(folder) / f"{code}.txt").read_text(encoding="utf-8").splitlines()
        for code in grammars.available()
    }
    for code, texts in lines.items():
        assert texts == [t for r in pretrain for t in r.captions[code]]
    assert build_pretrain(world, knobs) == folder  # cached
