"""The ITM heads of ccrk and rc3 learn through their real ``training_step``: on world images, with
the hard negatives each method mines from its own space after that space has warmed up, each
fits one fixed batch within a stated number of steps. (The earlier memorisation test drew
uniform negatives for noise images through a hand-assembled path, so it never exercised this.)"""

import pytest
import torch
from worlds import QUICK_BACKBONES

from ccr import methods
from ccr.experiments.config import compose
from ccr.experiments.pretrain.backbones import with_backbones
from ccr.experiments.train import build_datamodule
from ccr.methods.rc3.module import FINETUNE

WORLD = [
    *QUICK_BACKBONES,
    "data.synthetic.num_train=96",
    "data.synthetic.num_val=8",
    "data.synthetic.num_test=8",
    "data.synthetic.num_pretrain=48",
    "data.batch_size=16",
    "data.tokenizer.vocab_size=300",
    "data.languages=[en,de]",
]
WARM_STEPS = (
    40  # full training steps on other batches before the fixed one: the space hard mining reads
)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return tmp_path_factory.mktemp("itm-world")


def setup(method, world, *overrides):
    cfg = compose([f"method={method}", f"data.root={world}", *WORLD, *overrides])
    data = build_datamodule(cfg, roles=())
    torch.manual_seed(0)
    return cfg, data


def fit(module, batches, fixed, loss_of, steps):
    """Warm up on ``batches``, then train on ``fixed`` alone; the ITM loss at every fixed step."""
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-3)

    def step(batch):
        optimizer.zero_grad()
        module.training_step(batch, 0).backward()
        optimizer.step()

    module.train()
    for _, batch in zip(range(WARM_STEPS), batches, strict=False):
        step(batch)
    losses = []
    for _ in range(steps):
        step(fixed)
        losses.append(loss_of())
    return losses


def cycle(loader):
    while True:
        yield from loader


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason=(
        "measured (issue 32; cause in docs/ccrk.md, 'MITM through the real training step'): the "
        "path is wired (swapping the image moves the fused [CLS] 7.8 % after the warm-up, gradient "
        "reaches the cross-attention) but the fusion starts additive: over the batch's 16x16 pairs "
        "the fused [CLS] variance is image 0.42, text 0.58, image x text 0.003, the [CLS] cross-"
        "attention is near uniform (entropy 2.79 of 2.83 nats), and an additive score cannot beat "
        "the 1:2 prior (0.636) because every caption and image sits in positive and negative "
        "pairs. It leaves the prior near fixed step 250 on this world (0.507 at 400) and near 110 "
        "with worlds.SMALL_PRETRAINED_BACKBONES (0.29 at 250); lr x10, a frozen text tower, "
        "uniform negatives, no CMLM/KCL, random fusion init and noise images do not change it. "
        "Strict: when it starts to fit within 100 steps, this test fails and the marker goes."
    ),
)
def test_ccrk_mitm_on_mined_hard_negatives_fits_a_world_batch_within_100_steps(world):
    """MITM (3B pairs: the hard positive caption, a hard negative caption and a hard negative
    image per image, mined from the KCL space) through ``CCRk.training_step``. The bar:
    below 0.1 (the 1:2 prior is 0.636) within 100 steps."""
    cfg, data = setup("ccrk", world)
    module = methods.get("ccrk")(cfg.method, cfg.optim, with_backbones(data), cfg.evaluation)
    seen = []
    real = module.matching_loss
    module.matching_loss = lambda *args: seen.append(real(*args)) or seen[-1]
    loader = data.train_dataloader()
    fixed = next(iter(loader))
    losses = fit(module, cycle(loader), fixed, lambda: seen[-1].item(), steps=100)
    assert min(losses) < 0.1, [round(x, 3) for x in losses[::5]]


@pytest.mark.slow
def test_rc3_itm_on_mined_hard_negatives_fits_a_world_batch_within_160_steps(world):
    """RC3's ITR fine-tuning loss (the 4-way cross-entropy over ITM logits: the true pair, a random
    caption, a random image and the hard negative caption mined by the first stage) through
    ``RC3.training_step`` on English world captions, from the preset's starting point, the world's
    pretrained mBART. Measured (seed 0, one thread): 1.12 at the first fixed step after the warm-up
    (chance: ln 4 = 1.39), first below 0.2 at step 66, 0.075 at step 100 (from a random mBART it
    was 24 steps: the denoising-pretrained start fits the 4-way head more slowly); 160 steps
    (2.4x the measured 66) leaves room for rounding on other machines."""
    cfg, data = setup("rc3", world)
    module = methods.get("rc3")(
        cfg.method, cfg.optim, with_backbones(data), cfg.evaluation, phase=FINETUNE
    )
    seen = []
    real = module.finetune_losses
    module.finetune_losses = lambda batch: seen.append(real(batch)) or seen[-1]
    loader = data.train_dataloader(languages=["en"])
    fixed = next(iter(loader))
    losses = fit(module, cycle(loader), fixed, lambda: seen[-1]["itr"].item(), steps=160)
    assert min(losses) < 0.2, [round(x, 3) for x in losses[::10]]
