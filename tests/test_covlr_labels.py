"""CoVLR's intra-modal classifier labels (paper Eq. 5) on the synthetic world: object categories
(the shape, the world's analogue of COCO's categories) by default, the colour × shape labels as the
``objects`` variant, and the τ 0.07 diagnostic variant."""

from dataclasses import replace

import pytest
import torch
from omegaconf import OmegaConf
from test_covlr_module import EVALUATION, OPTIM, method_config
from test_datamodule import synthetic_cfg
from worlds import RANDOM_BACKBONES

from ccr.datamodules.datamodule import CCRDataModule
from ccr.datamodules.synthetic.scene import SHAPES
from ccr.experiments.config import compose, typed
from ccr.methods.covlr.module import CoVLR

NUM_SHAPES, NUM_COLOURS = 3, 4


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> CCRDataModule:
    cfg = synthetic_cfg(
        tmp_path_factory.mktemp("covlr_labels"),
        **{
            "synthetic.num_shapes": NUM_SHAPES,
            "synthetic.num_colours": NUM_COLOURS,
            "synthetic.weak_fraction": 0.0,
        },
    )
    data = CCRDataModule(cfg, seed=0)
    data.prepare_data()
    data.setup("fit")
    return data


def build(world, **overrides) -> CoVLR:
    torch.manual_seed(0)
    info = replace(world.info, backbones=RANDOM_BACKBONES)
    return CoVLR(method_config(**overrides), OPTIM, info, EVALUATION)


def scene_multi_hot(world, batch, key) -> torch.Tensor:
    """Per batch row, the multi-hot of ``key`` ("shape", or "label": colour shape) over the sorted
    values the train split holds, read from the records' scenes."""
    records = {r.id: r for r in world.records("train")}

    def values(record):
        return {
            o["shape"] if key == "shape" else f"{o['colour']} {o['shape']}"
            for o in record.extras["scene"]["objects"]
        }

    names = sorted(set().union(*(values(r) for r in records.values())))
    rows = torch.zeros(len(batch["ids"]), len(names), dtype=torch.long)
    for row, record_id in enumerate(batch["ids"]):
        for value in values(records[record_id]):
            rows[row, names.index(value)] = 1
    return rows


def test_the_world_gives_the_shape_as_each_labels_category(world):
    info = world.info
    assert info.num_objects > NUM_SHAPES  # several colours per shape in the train split
    assert info.object_categories == [
        label.split(" ")[1]
        for label in sorted(
            {label for r in world.records("train") for label in r.extras["objects"]}
        )
    ]
    assert set(info.object_categories) == set(SHAPES[:NUM_SHAPES])


def test_default_classifiers_predict_the_shapes_of_the_image(world):
    module = build(world)
    assert module.image_uni_head.out_features == module.text_uni_head.out_features == NUM_SHAPES
    batch = next(iter(world.train_dataloader()))
    view = module.training_view(batch)
    expected = scene_multi_hot(world, batch, "shape")
    assert expected.shape[1] == NUM_SHAPES
    assert torch.equal(view.objects, expected)
    assert (expected.sum(1) < batch["objects"].sum(1)).any()  # a shape held twice counts once
    per_caption = expected.repeat_interleave(batch["present"].shape[1], 0)[
        batch["present"].reshape(-1)
    ]
    assert torch.equal(view.caption_objects, per_caption)


def test_objects_variant_classifies_the_colour_shape_labels(world):
    module = build(world, ablation="objects")
    assert module.image_uni_head.out_features == world.info.num_objects
    batch = next(iter(world.train_dataloader()))
    view = module.training_view(batch)
    assert torch.equal(view.objects, batch["objects"])
    assert torch.equal(view.objects, scene_multi_hot(world, batch, "label"))


def test_category_and_object_runs_each_train_a_step(world):
    batch = next(iter(world.train_dataloader()))
    for ablation in (None, "objects"):
        module = build(world, ablation=ablation)
        module.log = module.log_dict = lambda *args, **kwargs: None
        loss = module.training_step(batch, 0)
        assert torch.isfinite(loss)


def test_variants_name_their_rows_and_switch_labels_and_temperature():
    for variant, labels, temperature in (
        (None, "category", 0.2),
        ("objects", "object", 0.2),
        ("tau007", "category", 0.07),
    ):
        cfg = compose(["method=covlr", *([f"variant={variant}"] if variant else [])])
        assert cfg.method.ablation == variant
        settings = OmegaConf.merge(cfg.method, cfg.method.ablations[variant] if variant else {})
        assert (settings.uni_labels, settings.temperature) == (labels, temperature)


TINY = {"embed_dim": 32, "cross_modal": {"layers": 1, "heads": 2}}  # as method_config()


def test_a_config_stored_before_uni_labels_trains_on_the_object_labels(world):
    """Read through the method's schema, as ccr.experiments.evaluate reads a stored run."""
    stored = OmegaConf.to_container(compose(["method=covlr"]))
    for key in ("uni_labels", "ablation", "ablations"):
        stored["method"].pop(key)
    method = OmegaConf.merge(typed(OmegaConf.create(stored)).method, TINY)
    torch.manual_seed(0)
    module = CoVLR(method, OPTIM, replace(world.info, backbones=RANDOM_BACKBONES), EVALUATION)
    assert module.image_uni_head.out_features == world.info.num_objects


def test_category_labels_on_data_without_categories_is_a_clear_error(world):
    info = replace(world.info, backbones=RANDOM_BACKBONES, object_categories=[])
    with pytest.raises(ValueError, match="uni_labels=category needs the category of each"):
        CoVLR(method_config(), OPTIM, info, EVALUATION)


def test_an_unknown_label_level_or_ablation_is_a_clear_error(world):
    with pytest.raises(ValueError, match="method.uni_labels: expected one of"):
        build(world, uni_labels="colour")
    with pytest.raises(ValueError, match="covlr ablation 'wo_mlm'"):
        build(world, ablation="wo_mlm")
