"""RC3's ITR fine-tuning stage (spec rc3.md §5, the IGLUE/VOLTA recipe): the 4-candidate loss, its
candidates, English captions only, the start from the pre-trained weights, the parameters it
trains, its optimiser settings, and a protocol label that follows what ran."""

import math
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from rc3_helpers import LANGUAGES, Info, build, config, train_batch, with_tiny_regions
from test_datamodule import synthetic_cfg

import ccr.methods.rc3.module as rc3_module
from ccr.datamodules.datamodule import CCRDataModule
from ccr.experiments.config import ConfigError, compose
from ccr.methods.rc3.module import (
    FINETUNE,
    PRETRAIN,
    RC3,
    VisualInput,
    four_way_loss,
    itr_negatives,
    same_image_rows,
)


def tuned(*overrides):
    return build(*overrides, phase=FINETUNE)


def seeded_finetune_losses(module, batch, seed=0):
    torch.manual_seed(seed)
    return module.finetune_losses(batch)


class FakeDataModule:
    """Records which languages and batch size each stage's training loader asks for."""

    def __init__(self):
        self.asked = []

    def train_dataloader(self, languages=None, batch_size=None):
        self.asked.append((languages, batch_size))
        return torch.utils.data.DataLoader([train_batch()], batch_size=None)


def pipeline(*overrides, languages=LANGUAGES):
    cfg = config(*overrides)
    info = Info(languages=languages)
    return RC3.pipeline(cfg.method, cfg.optim, info, cfg.evaluation, protocol=cfg.protocol)


# ---- the loss and its candidates -----------------------------------------------------------------


def test_four_way_loss_is_the_cross_entropy_with_the_true_pair_first():
    logits = torch.tensor([[2.0, 0.0, -1.0, 1.0], [0.0, 3.0, 0.0, 0.0]])
    by_hand = [
        -math.log(math.exp(2) / (math.exp(2) + 1 + math.exp(-1) + math.exp(1))),
        -math.log(1 / (1 + math.exp(3) + 1 + 1)),
    ]
    assert four_way_loss(logits).tolist() == pytest.approx(by_hand, rel=1e-6)


def test_negatives_come_from_other_images_and_the_hard_one_is_the_first_stages_best():
    same = same_image_rows(["a", "b", "a", "c"])
    assert same.tolist()[0] == [True, False, True, False]
    similarity = torch.tensor(
        [
            [9.0, 1.0, 8.0, 2.0],  # row 2 shows image a too: not a negative
            [0.0, 9.0, 5.0, 6.0],
            [3.0, 1.0, 9.0, 0.0],
            [7.0, 2.0, 1.0, 9.0],
        ]
    )
    torch.manual_seed(0)
    draws = [itr_negatives(similarity, same) for _ in range(200)]
    assert draws[0][2].tolist() == [3, 3, 1, 0]
    for index in (0, 1):  # random caption, random image: every other image, never the same one
        seen = {(row, int(d[index][row])) for d in draws for row in range(4)}
        assert seen == {(i, j) for i in range(4) for j in range(4) if not same[i, j]}


def test_a_batch_of_a_single_image_is_a_clear_error():
    with pytest.raises(ValueError, match="single image"):
        itr_negatives(torch.zeros(2, 2), same_image_rows(["a", "a"]))


def test_the_four_candidates_are_scored_by_the_itm_head():
    module = tuned().eval()
    batch = train_batch()
    visual = VisualInput(module.net.visual.patches(batch["images"][:4]))
    mask = batch["attention_mask"][:4, 0]
    captions = module.tag(batch["input_ids"][:4, 0], mask, "en")
    negatives = (torch.tensor([1, 2, 3, 0]), torch.tensor([2, 3, 0, 1]), torch.tensor([3, 0, 1, 2]))
    with torch.no_grad():
        logits = module.candidate_logits(visual, captions, mask, negatives)
    random_caption, random_image, hard_caption = negatives
    for row in range(4):
        pairs = [
            (row, row),
            (row, random_caption[row]),
            (random_image[row], row),
            (row, hard_caption[row]),
        ]
        for column, (image, caption) in enumerate(pairs):
            alone = module.match_logits(
                visual.rows(torch.tensor([int(image)])),
                captions[[int(caption)]],
                mask[[int(caption)]],
            )
            assert logits[row, column].item() == pytest.approx(alone.item(), abs=1e-5), (
                row,
                column,
            )


def test_the_loss_takes_the_probes_hard_negatives_and_strict_rows_as_anchors(monkeypatch):
    module = tuned()
    batch = train_batch(weak=[i in (1, 4) for i in range(8)])
    seen = {}
    negatives, candidates = rc3_module.itr_negatives, module.candidate_logits

    def spy_negatives(similarity, same):
        seen.update(similarity=similarity, same=same)
        return negatives(similarity, same)

    def spy_candidates(*args):
        seen["logits"] = candidates(*args)
        return seen["logits"]

    monkeypatch.setattr(rc3_module, "itr_negatives", spy_negatives)
    monkeypatch.setattr(module, "candidate_logits", spy_candidates)
    losses = seeded_finetune_losses(module, batch)
    assert set(losses) == {"itr", "probe"}
    strict = torch.tensor([i not in (1, 4) for i in range(8)])
    assert losses["itr"].item() == pytest.approx(
        four_way_loss(seen["logits"])[strict].mean().item()
    )
    with torch.no_grad():
        mask = batch["attention_mask"][:, 0]
        visual = module.visual_tokens(batch["images"])
        image = module.probe_image(module.image_only_features(visual))
        text = module.probe_text(module.text_representation(batch["input_ids"][:, 0], mask, "en"))
    torch.testing.assert_close(seen["similarity"], image @ text.T)
    assert torch.equal(seen["same"], torch.eye(8, dtype=torch.bool))


# ---- English only --------------------------------------------------------------------------------


def test_only_english_captions_reach_fine_tuning():
    data = FakeDataModule()
    for stage in pipeline("method.finetune.batch_size=4"):
        stage.dataloader(data)
    assert data.asked == [(None, None), (["en"], 4)]  # pre-training: every language
    batch = train_batch()
    others = dict(batch, input_ids=batch["input_ids"].clone())
    others["input_ids"][:, 1:] = torch.flip(batch["input_ids"][:, 1:], [0])
    english = dict(batch, input_ids=batch["input_ids"].clone())
    english["input_ids"][:, 0] = torch.flip(batch["input_ids"][:, 0], [0])
    base = seeded_finetune_losses(tuned(), batch)
    same = seeded_finetune_losses(tuned(), others)
    assert all(torch.equal(same[key], base[key]) for key in base)
    assert seeded_finetune_losses(tuned(), english)["itr"] != base["itr"]


def test_the_fine_tuning_loader_holds_english_captions_in_batches_of_its_own_size(tmp_path):
    data = CCRDataModule(synthetic_cfg(tmp_path, languages="[en,de]"), seed=0)
    data.prepare_data()
    data.setup("fit")
    _, finetune = pipeline("method.finetune.batch_size=4", languages=("en", "de"))
    batch = next(iter(finetune.dataloader(data)))
    assert batch["languages"] == ["en"] and batch["input_ids"].shape[:2] == (4, 1)


# ---- the start from pre-training, what trains, how ---------------------------------------------


def saved(module, path):
    torch.save({"state_dict": module.state_dict()}, path)
    return path


def test_fine_tuning_starts_from_the_pretrained_weights(tmp_path):
    pretrain, finetune = pipeline()
    assert (pretrain.name, finetune.name) == (PRETRAIN, FINETUNE)
    trained = pretrain.build(None)
    assert trained.phase == PRETRAIN
    with torch.no_grad():
        trained.itm_head.weight.mul_(3.0)
        trained.net.model.encoder.layers[0].fc1.weight.add_(0.5)
    start = finetune.build(saved(trained, tmp_path / "a.ckpt"))
    assert start.phase == FINETUNE
    for name, tensor in trained.state_dict().items():
        assert torch.equal(tensor, start.state_dict()[name]), name
    with torch.no_grad():
        trained.itm_head.weight.mul_(-1.0)
    other = finetune.build(saved(trained, tmp_path / "b.ckpt"))
    batch = train_batch()
    assert (
        seeded_finetune_losses(start, batch)["itr"] != seeded_finetune_losses(other, batch)["itr"]
    )


def snapshot(module):
    return {name: p.detach().clone() for name, p in module.named_parameters()}


@pytest.mark.parametrize("visual", ["roi", "patch"])
def test_fine_tuning_trains_the_encoder_the_itm_head_and_the_probe(visual):
    module = with_tiny_regions(phase=FINETUNE) if visual == "roi" else tuned()
    before = snapshot(module)
    optimiser = torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    module.total_loss(seeded_finetune_losses(module, train_batch())).backward()
    missing = [n for n, p in module.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing  # DDP: every trained parameter is in the step's graph
    optimiser.step()
    changed = {n for n, p in module.named_parameters() if not torch.equal(before[n], p)}
    kept = ("net.model.decoder.", "mlm_head.") + (("net.visual.patch_",) if visual == "roi" else ())
    assert changed == {n for n in before if not n.startswith((*kept, "regions."))}
    assert {"net.model.shared.weight", "itm_head.weight", "probe_text.linear.weight"} <= changed
    pretraining = with_tiny_regions() if visual == "roi" else build()
    assert all(p.requires_grad for n, p in pretraining.named_parameters() if n.startswith(kept))


def test_fine_tuning_uses_its_own_optimiser_settings():
    module = tuned("method.finetune.optim.lr=0.5", "method.finetune.optim.warmup_ratio=0.1")
    module._trainer = SimpleNamespace(estimated_stepping_batches=100)
    setup = module.configure_optimizers()
    optimiser, schedule = setup["optimizer"], setup["lr_scheduler"]["scheduler"]
    assert optimiser.param_groups[0]["lr"] == pytest.approx(0.5 / 10)  # step 1 of a 10-step warm-up
    for _ in range(99):
        optimiser.step()
        schedule.step()
    assert optimiser.param_groups[0]["lr"] == pytest.approx(0.5 / 90, rel=1e-6)  # linear decay to 0
    assert {g["weight_decay"] for g in optimiser.param_groups} == {0.0, 0.01}
    assert build().optim_cfg.lr == compose(["method=rc3"]).optim.lr  # pre-training: the run's optim


def test_an_unknown_fine_tuning_optim_key_is_a_clear_error():
    with pytest.raises(ConfigError, match="unknown config key 'method.finetune.optim.lrr'"):
        config("method.finetune.optim.lrr=1.0")
    method = OmegaConf.to_container(config().method)  # a section built by hand, not composed
    method["finetune"]["optim"]["lrr"] = 1.0
    with pytest.raises(ValueError, match="method.finetune.optim.lrr is not an optim key"):
        RC3(OmegaConf.create(method), config().optim, Info(), config().evaluation, phase=FINETUNE)


# ---- protocols -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "protocol,stages", [("fine-tune-en", [PRETRAIN, FINETUNE]), ("pretrain-only", [PRETRAIN])]
)
def test_the_protocol_picks_the_stages_and_is_the_label(protocol, stages):
    cfg = compose(["method=rc3", f"protocol={protocol}"])
    assert cfg.protocol == protocol  # what metrics.json records
    built = pipeline(f"protocol={protocol}")
    assert [s.name for s in built] == stages
    assert [(s.max_steps, s.budget_key) for s in built] == [
        (cfg.method.pretrain.max_steps, "method.pretrain.max_steps"),
        (cfg.method.finetune.max_steps, "method.finetune.max_steps"),
    ][: len(stages)]


def test_fine_tune_en_is_the_default():
    assert compose(["method=rc3"]).protocol == "fine-tune-en"
    assert compose(["method=rc3_paper"]).protocol == "fine-tune-en"


@pytest.mark.parametrize(
    "protocol,message",
    [
        ("default", "is not one of"),
        ("zero-shot", "is not one of"),
        ("fine-tune-de", "is not one of"),
    ],
)
def test_a_wrong_protocol_is_a_one_line_error(protocol, message):
    def check():
        cfg = config(f"protocol={protocol}")
        RC3.check_config(cfg.method, list(LANGUAGES), protocol=cfg.protocol)

    for make in (lambda: pipeline(f"protocol={protocol}"), check):
        with pytest.raises(ValueError, match=message) as error:
            make()
        assert "\n" not in str(error.value) and "protocol=" in str(error.value)


def test_english_fine_tuning_without_english_data_is_an_error():
    with pytest.raises(ValueError, match="has no 'en'"):
        pipeline(languages=("de", "ja"))
    assert len(pipeline("protocol=pretrain-only", languages=("de", "ja"))) == 1
