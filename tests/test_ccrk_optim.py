"""CCRk's optimiser and schedule are spec §7's in both presets: AdamW wd 0.01 (none on biases and
norms), eps 1e-8, betas (0.9, 0.98), linear warm-up over the first 3 % of the steps, then linear
decay to 0; lr 1e-4 in the paper preset; new parts at 2x in both."""

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from ccr.experiments.config import compose
from ccr.methods.ccrk.module import CCRk
from tests.test_ccrk_module import EVALUATION, Info, method_config

TOTAL_STEPS = 200  # 3 % of 200 = 6 warm-up steps


def optimiser_of(preset: str):
    """The optimiser and scheduler a CCRk module builds under ``preset``'s optim section (the tiny
    encoders stand in for the paper's, which would need downloads)."""
    optim = compose([f"method={preset}"]).optim
    module = CCRk(
        method_config(new_param_lr_scale=compose([f"method={preset}"]).method.new_param_lr_scale),
        OmegaConf.to_container(optim),
        Info(),
        EVALUATION,
    )
    module._trainer = SimpleNamespace(estimated_stepping_batches=TOTAL_STEPS)
    configured = module.configure_optimizers()
    return module, configured["optimizer"], configured["lr_scheduler"]["scheduler"]


def lr_at(optimizer, scheduler, steps):
    """The learning rates of every parameter group at each optimizer step in ``steps``."""
    seen, wanted = {}, set(steps)
    for step in range(max(steps) + 1):
        if step in wanted:
            seen[step] = [group["lr"] for group in optimizer.param_groups]
        optimizer.step()
        scheduler.step()
    return seen


@pytest.mark.parametrize("preset, lr, new_scale", [("ccrk", 1e-3, 2.0), ("ccrk_paper", 1e-4, 2.0)])
def test_learning_rate_warms_up_linearly_over_3_percent_then_decays_linearly_to_zero(
    preset, lr, new_scale
):
    module, optimizer, scheduler = optimiser_of(preset)
    new_params = {id(p) for name, p in module.named_parameters() if name.startswith("itm_head")}
    scale = [
        new_scale if any(id(p) in new_params for p in g["params"]) else 1.0
        for g in optimizer.param_groups
    ]
    expected = {0: 1 / 6, 2: 3 / 6, 5: 1.0, 6: 1.0, 103: 0.5, 150: 50 / 194, 199: 1 / 194, 200: 0.0}
    for step, lrs in lr_at(optimizer, scheduler, list(expected)).items():
        assert lrs == pytest.approx([lr * s * expected[step] for s in scale], abs=1e-12), step


@pytest.mark.parametrize("preset", ["ccrk", "ccrk_paper"])
def test_adamw_settings_are_the_specs(preset):
    module, optimizer, _ = optimiser_of(preset)
    assert isinstance(optimizer, torch.optim.AdamW)
    for group in optimizer.param_groups:
        assert group["eps"] == 1e-8 and group["betas"] == (0.9, 0.98)
        assert group["weight_decay"] in (0.0, 0.01)
    decayed = {
        id(p) for g in optimizer.param_groups if g["weight_decay"] == 0.01 for p in g["params"]
    }
    for name, part in module.named_modules():
        if isinstance(part, torch.nn.Linear):
            assert id(part.weight) in decayed, name
            assert part.bias is None or id(part.bias) not in decayed, name
        if isinstance(part, torch.nn.LayerNorm):
            assert id(part.weight) not in decayed and id(part.bias) not in decayed, name


def test_command_line_still_overrides_the_presets_optimiser():
    cfg = compose(["method=ccrk_paper", "optim.lr=3e-5", "optim.schedule=cosine"])
    assert (cfg.optim.lr, cfg.optim.schedule, cfg.optim.weight_decay) == (3e-5, "cosine", 0.01)
