"""mCLIP fine-tuning (spec §5 settings 2-4, §9 test 17): the multi-positive loss, the stage after
TriKD chosen by ``protocol=``, the restarted temperature, and a protocol label that follows what
ran."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_mclip_method import BASE, DATA, image_batch, method_config, snapshot
from test_mclip_stages import FakeDataModule, changed_names, fit

from ccr.experiments.config import compose
from ccr.methods.layers.contrastive import info_nce
from ccr.methods.mclip.distillation import multi_positive_info_nce
from ccr.methods.mclip.module import FINETUNE, MCLIP, image_keys, protocol_of


def unit(n, d, seed):
    return F.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed)), dim=-1)


def numpy_multi_positive(text, image, keys, scale):
    """Spec §5 written out: P_ij = [key_i == key_j]; each direction sums -log softmax over the
    positives of a row, then averages over rows."""
    s = scale * text @ image.T
    p = (keys[:, None] == keys[None, :]).astype(float)

    def direction(logits):
        log_softmax = logits - np.log(np.exp(logits).sum(1, keepdims=True))
        return (-(p * log_softmax).sum(1)).mean()

    return 0.5 * (direction(s) + direction(s.T))


def test_multi_positive_loss_is_itc_when_every_image_is_distinct():
    text, image = unit(6, 8, 0), unit(6, 8, 1)
    keys = torch.arange(6)
    loss = multi_positive_info_nce(text, image, keys, 1 / 0.07)
    assert loss.item() == pytest.approx(info_nce(image, text, 0.07).item(), rel=1e-6)


def test_multi_positive_loss_puts_a_positive_on_every_caption_of_a_duplicated_image():
    text, image = unit(5, 8, 2), unit(5, 8, 3)
    keys = torch.tensor([7, 3, 7, 9, 7])  # rows 0, 2, 4: three captions of one image
    loss = multi_positive_info_nce(text, image, keys, 10.0)
    expected = numpy_multi_positive(
        text.double().numpy(), image.double().numpy(), keys.numpy(), 10.0
    )
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert abs(loss.item() - info_nce(image, text, 0.1).item()) > 1e-3  # not the 1-to-1 loss


def test_image_keys_match_equal_ids_and_separate_different_ones():
    keys = image_keys(["a", "b", "a", "c"], torch.device("cpu"))
    assert keys[0] == keys[2] and len(set(keys.tolist())) == 3 and (keys >= 0).all()


@pytest.mark.parametrize(
    "protocol,languages,block",
    [
        ("zero-shot", (), None),
        ("fine-tune-en", ("en",), "english"),
        ("fine-tune-xx", ("xx",), "single"),
        ("fine-tune-all", ("en", "xx"), "all"),
    ],
)
def test_the_protocol_decides_whether_and_on_what_fine_tuning_runs(protocol, languages, block):
    method = method_config()
    parsed = protocol_of(protocol, method, DATA.languages)
    assert parsed.finetune_languages == languages and parsed.finetune_settings == block
    stages = MCLIP.pipeline(method, BASE.optim, DATA, BASE.evaluation, protocol=protocol)
    names = [s.name for s in stages]
    assert names[-1] == (FINETUNE if languages else "trikd")
    if languages:
        data = FakeDataModule()
        stages[-1].dataloader(data)
        assert data.languages_asked == [list(languages)]
        assert stages[-1].max_steps == method.finetune[block].max_steps
        assert stages[-1].budget_key == f"method.finetune.{block}.max_steps"


@pytest.mark.parametrize(
    "protocol,trikd_languages,message",
    [
        ("fine-tune", "[en]", "not one of"),
        ("default", "[en]", "not one of"),
        ("fine-tune-fr", "[en]", "not one of"),  # fr is not a configured language
        ("zero-shot", "[en,xx]", "protocol=translate-train"),
        ("fine-tune-en", "[en,xx]", "protocol=translate-train"),
        ("translate-train", "[en]", "needs non-English"),
    ],
)
def test_a_protocol_that_would_mislabel_the_run_is_refused(protocol, trikd_languages, message):
    method = method_config(**{"trikd.languages": trikd_languages})
    with pytest.raises(ValueError, match=message):
        MCLIP.pipeline(method, BASE.optim, DATA, BASE.evaluation, protocol=protocol)
    with pytest.raises(ValueError, match=message):
        MCLIP.check_config(method, DATA.languages, protocol=protocol)


def test_the_preset_protocol_is_zero_shot_and_the_command_line_replaces_it():
    assert compose(["method=mclip"]).protocol == "zero-shot"
    assert compose(["method=mclip", "protocol=fine-tune-de"]).protocol == "fine-tune-de"


def test_the_fine_tuning_phase_needs_the_run_protocol():
    with pytest.raises(ValueError, match="needs the run's protocol"):
        MCLIP(method_config(), BASE.optim, DATA, BASE.evaluation, phase=FINETUNE)


def test_fine_tuning_starts_from_tri_kd_with_the_temperature_restarted(tmp_path):
    method = method_config(**{"trikd.dropout": 0.0})
    stages = MCLIP.pipeline(method, BASE.optim, DATA, BASE.evaluation, protocol="fine-tune-en")
    trikd = stages[-2].build(None)
    with torch.no_grad():
        trikd.logit_scale.fill_(4.0)
        trikd.clip_projector.weight.mul_(3.0)
    fit(trikd, [image_batch(seed=5)], 1, save_to=tmp_path / "trikd.ckpt")
    tuned = stages[-1].build(tmp_path / "trikd.ckpt")
    assert tuned.phase == FINETUNE
    assert tuned.logit_scale.item() == pytest.approx(math.log(1 / 0.07))
    assert torch.equal(tuned.clip_projector.weight, trikd.clip_projector.weight)
    for name, tensor in trikd.x_projector.state_dict().items():
        assert torch.equal(tensor, tuned.x_projector.state_dict()[name]), name
    lr, weight_decay, warmup = tuned.phase_settings()
    assert (lr, weight_decay, warmup) == (
        method.finetune.english.lr,
        0.001,
        method.finetune.warmup_steps,
    )


def test_the_fine_tuning_step_is_the_multi_positive_loss_and_moves_only_the_projectors():
    method = method_config(**{"trikd.dropout": 0.0})
    torch.manual_seed(0)
    module = MCLIP(
        method, BASE.optim, DATA, BASE.evaluation, phase=FINETUNE, protocol="fine-tune-all"
    ).eval()
    batch = image_batch(n=6, languages=("en", "xx"))
    batch["ids"] = ["a", "b", "a", "c", "d", "e"]  # one image twice (e.g. a DDP-padded repeat)
    keys = image_keys(batch["ids"], torch.device("cpu"))
    with torch.no_grad():
        h_i = module.encode_images(batch["images"])
        per_language = [
            multi_positive_info_nce(
                module.encode_texts(batch["input_ids"][:, k], batch["attention_mask"][:, k]),
                h_i,
                keys,
                1 / 0.07,
            )
            for k in range(2)
        ]
        expected = sum(per_language) / 2
        assert module.training_step(batch, 0).item() == pytest.approx(expected.item(), rel=1e-5)
        plain_itc = (
            sum(
                info_nce(
                    h_i,
                    module.encode_texts(batch["input_ids"][:, k], batch["attention_mask"][:, k]),
                    0.07,
                )
                for k in range(2)
            )
            / 2
        )
        assert abs(expected.item() - plain_itc.item()) > 1e-4
    before = snapshot(module)
    optimizer = module.configure_optimizers()["optimizer"]
    for group in optimizer.param_groups:
        group["lr"] = 1e-2
    module.train()
    module.training_step(batch, 0).backward()
    optimizer.step()
    changed = changed_names(before, snapshot(module))
    trainable = {
        n
        for n, p in module.named_parameters()
        if n.startswith(("clip_projector.", "x_projector.", "logit_scale"))
    }
    assert changed == trainable
