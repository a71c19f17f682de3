"""``optim.grad_cache_chunks`` in cl2cm, covlr, mclip (its contrastive stages) and rc3: one optimiser
step on a batch encoded in micro-batches moves every parameter as the step on the whole batch does,
and the chunked passes really run on micro-batches (dropout off: masks are drawn per micro-batch)."""

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import rc3_helpers
import test_covlr_module as covlr_setup
import test_mclip_method as mclip_setup
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf
from worlds import random_backbones

from ccr.experiments.config import compose
from ccr.methods.cl2cm.module import CL2CM
from ccr.methods.covlr.module import CoVLR
from ccr.methods.mclip.module import FINETUNE, MCLIP, build_mte_stage
from ccr.methods.rc3.module import FINETUNE as RC3_FINETUNE

ROWS, CHUNKS = 16, 4
TOLERANCE = dict(rtol=1e-4, atol=1e-6)


@dataclass
class Case:
    """How to build a method with ``chunks`` micro-batches, its batch, its training loss, and the
    submodule whose calls show the micro-batches."""

    build: Callable[[int], torch.nn.Module]
    batch: Callable[[], dict]
    loss: Callable[[torch.nn.Module, dict], torch.Tensor]
    encoder: Callable[[torch.nn.Module], torch.nn.Module]


def quiet(module):
    module.log = module.log_dict = lambda *args, **kwargs: None  # no trainer attached here
    return module


# ---- cl2cm ------------------------------------------------------------------------------------------


def cl2cm(chunks, ablation="null"):
    cfg = compose(
        [
            "method=cl2cm",
            "method.embed_dim=16",
            f"method.ablation={ablation}",
            f"optim.grad_cache_chunks={chunks}",
        ]
    )
    torch.manual_seed(0)
    info = covlr_setup.Info(num_objects=0, backbones=random_backbones(width=32))
    return quiet(CL2CM(cfg.method, cfg.optim, info, cfg.evaluation))


def triples():
    batch = covlr_setup.training_batch(batch=ROWS, labels=False)
    return {
        "images": batch["images"],
        "src_input_ids": batch["input_ids"][:, 1],
        "src_attention_mask": batch["attention_mask"][:, 1],
        "tgt_input_ids": batch["input_ids"][:, 0],
        "tgt_attention_mask": batch["attention_mask"][:, 0],
        "tgt_languages": ["de"] * ROWS,
        "ids": batch["ids"],
    }


# ---- covlr ------------------------------------------------------------------------------------------


def covlr(chunks, **overrides):
    torch.manual_seed(0)
    optim = OmegaConf.merge(covlr_setup.OPTIM, {"grad_cache_chunks": chunks})
    method = covlr_setup.method_config(**overrides)
    return quiet(CoVLR(method, optim, covlr_setup.Info(), covlr_setup.EVALUATION))


# ---- mclip ------------------------------------------------------------------------------------------

MCLIP_DATA = mclip_setup.DATA
MCLIP_DATA.backbones["text"]["config"].update(
    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
)
NO_DROPOUT = {
    "trikd.dropout": 0.0,
    "trikd.attn_dropout": 0.0,
    "translation.dropout": 0.0,
    "trikd.languages": "[en,xx]",
}


def mclip_optim(chunks):
    return OmegaConf.merge(mclip_setup.BASE.optim, {"grad_cache_chunks": chunks})


def mclip(chunks, phase="trikd"):
    torch.manual_seed(0)
    method = mclip_setup.method_config(**NO_DROPOUT)
    return quiet(
        MCLIP(
            method,
            mclip_optim(chunks),
            MCLIP_DATA,
            mclip_setup.BASE.evaluation,
            phase=phase,
            protocol="translate-train",
        )
    )


def mte_stage(chunks, joint=True):
    torch.manual_seed(0)
    method = mclip_setup.method_config(**NO_DROPOUT)
    module = build_mte_stage(
        method, mclip_optim(chunks), MCLIP_DATA, mclip_setup.BASE.evaluation, joint
    )
    return quiet(module)


def mclip_images():
    batch = mclip_setup.image_batch(n=ROWS, languages=("en", "xx"))
    batch["present"][::3, 1] = False  # languages of unequal row counts
    batch["ids"] = [str(i // 2) for i in range(ROWS)]  # two rows per image: fine-tuning positives
    return batch


def parallel_text():
    src, src_mask = mclip_setup.caption_ids(ROWS, seed=0)
    tgt, tgt_mask = mclip_setup.caption_ids(ROWS, seed=100)
    return {
        "src_input_ids": src,
        "src_attention_mask": src_mask,
        "tgt_input_ids": tgt,
        "tgt_attention_mask": tgt_mask,
        "src_language": "en",
        "tgt_language": "xx",
    }


# ---- rc3 --------------------------------------------------------------------------------------------


def rc3(chunks, phase="pretrain"):
    return quiet(
        rc3_helpers.build(
            f"optim.grad_cache_chunks={chunks}",
            f"method.anchors_per_task={ROWS}",  # every row an anchor (benchmarks raise ROWS)
            phase=phase,
        )
    )


def rc3_pretraining_loss(module, batch):
    return module.total_loss(module.losses(batch, rc3_helpers.parallel_batch(n=ROWS)))


def step(module, batch):
    return module.training_step(batch, 0)


CASES = {
    "cl2cm": Case(cl2cm, triples, step, lambda m: m.text_encoder),
    "cl2cm cm_only": Case(lambda c: cl2cm(c, "cm_only"), triples, step, lambda m: m.image_encoder),
    "covlr meta cls": Case(
        covlr, lambda: covlr_setup.training_batch(batch=ROWS), step, lambda m: m.image_tower
    ),
    "covlr meta nce": Case(
        lambda c: covlr(c, uni_mode="nce"),
        lambda: covlr_setup.training_batch(batch=ROWS, labels=False),
        step,
        lambda m: m.text_tower,
    ),
    "covlr multi-task": Case(
        lambda c: covlr(c, meta=False),
        lambda: covlr_setup.training_batch(batch=ROWS),
        step,
        lambda m: m.cross_t2i,
    ),
    "mclip trikd": Case(mclip, mclip_images, step, lambda m: m.x_projector),
    "mclip finetune": Case(
        lambda c: mclip(c, FINETUNE), mclip_images, step, lambda m: m.x_projector
    ),
    "mclip stage 1b": Case(mte_stage, parallel_text, step, lambda m: m.mte),
    "mclip stage 1a": Case(
        lambda c: mte_stage(c, joint=False), parallel_text, step, lambda m: m.decoder
    ),
    "rc3 pretrain": Case(
        rc3,
        lambda: rc3_helpers.train_batch(n=ROWS, weak=[i % 3 == 0 for i in range(ROWS)]),
        rc3_pretraining_loss,
        lambda m: m.net.model.encoder,
    ),
    "rc3 finetune": Case(
        lambda c: rc3(c, RC3_FINETUNE),
        lambda: rc3_helpers.train_batch(n=ROWS),
        step,
        lambda m: m.net.model.encoder,
    ),
}


def sgd_update(module, batch, loss_of, lr=1.0):
    """The loss and every trainable parameter's change after one SGD step (seeded draws)."""
    module.train()
    params = {n: p for n, p in module.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in params.items()}
    optimizer = torch.optim.SGD(params.values(), lr=lr)
    optimizer.zero_grad()
    torch.manual_seed(1)
    loss = loss_of(module, batch)
    loss.backward()
    optimizer.step()
    return loss.detach(), {n: p.detach() - before[n] for n, p in params.items()}


def rows_per_call(module: torch.nn.Module) -> list[int]:
    """Rows of every forward call of ``module`` from now on (its first input's first dimension)."""
    seen: list[int] = []
    module.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(len(args[0] if args else next(iter(kwargs.values())))),
        with_kwargs=True,
    )
    return seen


@pytest.mark.parametrize("name", list(CASES))
def test_one_step_on_four_micro_batches_moves_every_parameter_as_the_whole_batch_does(name):
    case = CASES[name]
    batch = case.batch()
    whole_module = case.build(1)
    whole_rows = rows_per_call(case.encoder(whole_module))
    whole_loss, whole = sgd_update(whole_module, batch, case.loss)
    assert any(delta.abs().sum() > 0 for delta in whole.values())

    chunked_module = case.build(CHUNKS)
    chunked_rows = rows_per_call(case.encoder(chunked_module))
    loss, update = sgd_update(chunked_module, batch, case.loss)

    assert max(chunked_rows) <= math.ceil(max(whole_rows) / CHUNKS), (whole_rows, chunked_rows)
    assert torch.allclose(loss, whole_loss, **TOLERANCE), (loss, whole_loss)
    assert update.keys() == whole.keys()
    moved = 0
    for param, delta in update.items():
        assert torch.allclose(delta, whole[param], **TOLERANCE), param
        moved += bool(delta.abs().sum() > 0)
    assert moved == sum(bool(d.abs().sum() > 0) for d in whole.values())


def test_rc3_pretraining_keeps_its_trackers_and_draws_under_micro_batches():
    """The positive-probability trackers read the whole step's losses, not a micro-batch's."""
    batch = rc3_helpers.train_batch(n=ROWS, weak=[i % 3 == 0 for i in range(ROWS)])
    modules = [rc3(1), rc3(CHUNKS)]
    for module in modules:
        sgd_update(module, batch, rc3_pretraining_loss)
    for tracker in ("vt_tracker", "xtcl_tracker"):
        values = [getattr(m, tracker).p_avg() for m in modules]
        assert values[0] == pytest.approx(values[1], rel=1e-5), tracker


# ---- two processes --------------------------------------------------------------------------------

WORLD = 2
DDP_CASES = ["cl2cm", "covlr meta cls", "mclip trikd", "mclip finetune", "rc3 pretrain"]


def averaged_update(module, batch, loss_of):
    """One SGD step's parameter changes with the gradient averaged over the processes (what DDP
    does), the losses' own gathers and all-reduces running inside the step."""
    module.train()
    params = {n: p for n, p in module.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in params.items()}
    torch.manual_seed(1)
    loss_of(module, batch).backward()
    for p in params.values():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad)
        p.grad = grad / WORLD
    torch.optim.SGD(params.values(), lr=1.0).step()
    return {n: p.detach() - before[n] for n, p in params.items()}


def ddp_worker(rank, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        results = {}
        for name in DDP_CASES:
            case = CASES[name]
            batch = case.batch()
            half = slice(rank * ROWS // WORLD, (rank + 1) * ROWS // WORLD)
            local = {k: v[half] if len(v) == ROWS else v for k, v in batch.items()}
            results[name] = [averaged_update(case.build(c), local, case.loss) for c in (1, 2)]
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_under_two_processes_micro_batches_move_every_parameter_as_whole_local_batches_do(
    tmp_path,
):
    mp.spawn(ddp_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for name in DDP_CASES:
            whole, chunked = results[name]
            assert any(delta.abs().sum() > 0 for delta in whole.values()), name
            for param, delta in chunked.items():
                assert torch.allclose(delta, whole[param], **TOLERANCE), (name, param)
