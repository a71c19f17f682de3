"""The ITM heads of ccrk and rc3 learn through their real ``training_step``: on world images, with
the hard negatives each method mines from its own space after that space has warmed up, each
fits one fixed batch within a stated number of steps. (The earlier memorisation test drew
uniform negatives for noise images through a hand-assembled path, so it never exercised this.)"""

import pytest
import torch
from worlds import QUICK_BACKBONES, SMALL_PRETRAINED_BACKBONES

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


def fit(module, batches, fixed, loss_of, steps, stop_below=None):
    """Warm up on ``batches``, then train on ``fixed`` alone; the ITM loss at every fixed step
    (up to the first below ``stop_below`` when given)."""
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
        if stop_below is not None and losses[-1] < stop_below:
            break
    return losses


def cycle(loader):
    while True:
        yield from loader


def ccrk_matching_losses(root, backbones, steps, stop_below=None, seed=0):
    """CCRk's MITM loss at each fixed-batch step (see ``fit``) on the test world under ``root``
    with the world overrides ``backbones``; ``seed`` seeds the model's initialisation."""
    cfg, data = setup("ccrk", root, *backbones)
    torch.manual_seed(seed)
    module = methods.get("ccrk")(cfg.method, cfg.optim, with_backbones(data), cfg.evaluation)
    seen = []
    real = module.matching_loss
    module.matching_loss = lambda *args: seen.append(real(*args)) or seen[-1]
    loader = data.train_dataloader()
    fixed = next(iter(loader))
    return fit(module, cycle(loader), fixed, lambda: seen[-1].item(), steps, stop_below)


@pytest.mark.slow
def test_ccrk_mitm_on_mined_hard_negatives_fits_a_world_batch_within_700_steps(world):
    """MITM (3B pairs: the hard positive caption, a hard negative caption and a hard negative
    image per image, mined from the KCL space) through ``CCRk.training_step``, from a text tower
    pretrained as the default world's is (``SMALL_PRETRAINED_BACKBONES``: the fusion's
    self-attention and FFN are copied from it, as CCRk copies XLM-R's upper layers). The bar:
    below 0.1 (the 1:2 prior is 0.636). Measured (one thread; the model seeded 0, 1, 2): first
    below 0.1 at fixed step 349, 285 and 325; 700 is twice the slowest. The fusion starts
    additive (image x text holds 0.3 % of the fused [CLS] variance), so it leaves the prior
    slowly; from the 8-step ``QUICK_BACKBONES`` tower it took 763 steps (docs/ccrk.md, "Why it
    is flat")."""
    losses = ccrk_matching_losses(world, SMALL_PRETRAINED_BACKBONES, 700, stop_below=0.1)
    assert min(losses) < 0.1, [round(x, 3) for x in losses[::25]]


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
