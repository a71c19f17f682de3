"""Faithfulness of CoVLR's meta-optimisation (spec §8, tests 1-4): the toy quadratic's closed forms,
the merged gradient against a brute-force SGD reference and the in-place variant, the degenerate
settings, and which task's gradient reaches which parameter group."""

import copy

import pytest
import torch
from test_covlr_module import build, grads, training_batch
from torch import nn

from ccr.methods.covlr.meta import meta_objective

A, B_TARGET, THETA, ALPHA = (0.0, 0.0), (3.0, 3.0), (1.0, 2.0), 0.1


def quadratic(alpha, second_order=False):
    theta = nn.Parameter(torch.tensor(THETA, dtype=torch.float64))
    a, b = torch.tensor(A, dtype=torch.float64), torch.tensor(B_TARGET, dtype=torch.float64)
    cro = 0.5 * (theta - a).square().sum()
    step = meta_objective(
        cro,
        {"theta": theta},
        ["theta"],
        lambda p: 0.5 * (p["theta"] - b).square().sum(),
        alpha,
        second_order=second_order,
    )
    step.loss.backward()
    return step, theta.grad


def test_toy_quadratic_first_order_gradient_is_the_closed_form():
    step, grad = quadratic(ALPHA)
    assert torch.allclose(grad, torch.tensor([-1.1, 0.8], dtype=torch.float64), atol=1e-12)
    assert step.inner.item() == pytest.approx(2.5)
    assert step.outer.item() == pytest.approx(2.925)  # ℓ_uni(Θ') with Θ' = (0.9, 1.8)
    assert step.loss.item() == pytest.approx(2.5 + 2.925)  # the value of Eq. 7
    assert torch.allclose(step.inner_grads["theta"], torch.tensor([1.0, 2.0], dtype=torch.float64))


def test_toy_quadratic_second_order_matches_finite_differences_of_eq7():
    _, grad = quadratic(ALPHA, second_order=True)
    assert torch.allclose(grad, torch.tensor([-0.89, 0.92], dtype=torch.float64), atol=1e-12)

    def eq7(theta):
        inner = theta - ALPHA * theta  # ∇ ½‖Θ‖² = Θ
        return 0.5 * theta.square().sum() + 0.5 * (inner - 3.0).square().sum()

    theta, eps = torch.tensor(THETA, dtype=torch.float64), 1e-6
    numeric = torch.stack(
        [
            (eq7(theta + eps * e) - eq7(theta - eps * e)) / (2 * eps)
            for e in torch.eye(2, dtype=torch.float64)
        ]
    )
    assert torch.allclose(grad, numeric, atol=1e-6)


def test_toy_quadratic_alpha_zero_is_the_plain_sum():
    _, grad = quadratic(0.0)
    assert torch.allclose(grad, torch.tensor([-1.0, 1.0], dtype=torch.float64), atol=1e-12)


def test_constant_meta_train_loss_leaves_the_virtual_parameters_in_place():
    theta = nn.Parameter(torch.tensor(THETA))
    seen = {}
    meta_objective(
        torch.tensor(0.0),
        {"theta": theta},
        ["theta"],
        lambda p: seen.setdefault("theta", p["theta"]).sum(),
        0.5,
    )
    assert torch.equal(seen["theta"], theta.detach())


# ---- the module against a brute-force reference (spec §8.2) ----------------------------------------


def module_grads(module, batch, seed=1):
    torch.manual_seed(seed)
    module.zero_grad()
    loss = module.training_step(batch, 0)
    loss.backward()
    return loss.detach(), grads(module)


def reference_pieces(module, batch, alpha, seed=1):
    """Brute force on a deep copy: g_cro by backward, an SGD(lr=α) step on the virtual parameters only,
    then ∇ℓ_uni at Θ' by backward. Returns (g_cro, g_uni at Θ', ℓ_cro, ℓ_uni(Θ'))."""
    ref = copy.deepcopy(module)
    torch.manual_seed(seed)  # the same draws as training_step: language, then MLM / MPM masks
    view = ref.training_view(batch)
    cro = sum(ref.cross_modal_losses(view).values())
    cro.backward()
    g_cro = grads(ref)
    virtual = module.virtual_parameter_names()
    params = dict(ref.named_parameters())
    sgd = torch.optim.SGD([params[n] for n in virtual], lr=alpha)
    sgd.step()
    ref.zero_grad()
    uni = sum(ref.intra_modal_losses(view, {n: params[n] for n in virtual}).values())
    uni.backward()
    return g_cro, grads(ref), cro.detach(), uni.detach()


def in_place_grads(module, batch, alpha, seed=1):
    """The in-place variant of spec §3.5: backward ℓ_cro, shift p.data by −α g, backward ℓ_uni through
    the real module (grads accumulate onto g_cro), restore p.data."""
    ref = copy.deepcopy(module)
    torch.manual_seed(seed)
    view = ref.training_view(batch)
    sum(ref.cross_modal_losses(view).values()).backward()
    params = dict(ref.named_parameters())
    virtual = module.virtual_parameter_names()
    saved = {n: params[n].data.clone() for n in virtual}
    for n in virtual:
        params[n].data.sub_(alpha * params[n].grad)
    sum(ref.intra_modal_losses(view, {n: params[n] for n in virtual}).values()).backward()
    for n in virtual:
        params[n].data.copy_(saved[n])
    return grads(ref)


@pytest.mark.parametrize("uni_mode", ["cls", "nce"])
def test_merged_gradient_equals_the_brute_force_reference(uni_mode):
    alpha = 0.5  # large, so Θ' is far from Θ and a wrong step would show
    module = build(uni_mode=uni_mode, meta_alpha=alpha)
    batch = training_batch(absent=[(2, 1), (5, 0)])
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    loss, merged = module_grads(module, batch)
    g_cro, g_uni, cro, uni = reference_pieces(module, batch, alpha)
    assert loss.item() == pytest.approx((cro + uni).item(), abs=1e-5)
    for name in merged:
        assert torch.allclose(merged[name], g_cro[name] + g_uni[name], atol=1e-6), name
    in_place = in_place_grads(module, batch, alpha)
    for name in merged:
        assert torch.allclose(merged[name], in_place[name], atol=1e-6), name
    for name, p in module.named_parameters():  # the virtual step never touches the real weights
        assert torch.equal(p.detach(), before[name]), name


def test_gradient_routing_between_the_parameter_groups():
    alpha = 0.5
    module = build(meta_alpha=alpha)
    batch = training_batch()
    _, merged = module_grads(module, batch)
    g_cro, g_uni, _, _ = reference_pieces(module, batch, alpha)
    groups = module.parameter_groups()
    assert groups["virt"] == ["image_tower", "text_tower"]
    for name in merged:
        top = name.split(".")[0]
        if top in groups["uni"]:  # Θ_uni: only ℓ_uni(Θ'), nothing from ℓ_cro
            assert g_cro[name].abs().sum() == 0 and g_uni[name].abs().sum() > 0, name
            assert torch.allclose(merged[name], g_uni[name], atol=1e-6), name
        elif top in groups["cro"] or top in ("cross_i2t", "cross_t2i"):  # exactly ∇ℓ_cro
            assert g_uni[name].abs().sum() == 0, name
            assert torch.allclose(merged[name], g_cro[name], atol=1e-6), name
    encoder = "text_tower.encoder.backbone.token_embed.weight"
    assert not torch.allclose(merged[encoder], g_cro[encoder], atol=1e-4)


def test_alpha_zero_and_the_plain_sum_ablation_give_the_summed_gradient():
    batch = training_batch()
    module = build(meta_alpha=0.0)
    _, meta_zero = module_grads(module, batch)
    summed = build(meta=False)
    _, plain = module_grads(summed, batch)
    g_cro, g_uni_at_theta, _, _ = reference_pieces(module, batch, 0.0)
    for name in plain:
        expected = g_cro[name] + g_uni_at_theta[name]
        assert torch.allclose(meta_zero[name], expected, atol=1e-6), name
        assert torch.allclose(plain[name], expected, atol=1e-6), name
    # the switch is not ignored: with α > 0 the meta gradient differs from the plain sum
    _, meta = module_grads(build(meta_alpha=0.5), batch)
    assert not all(torch.allclose(meta[n], plain[n], atol=1e-5) for n in plain)


def test_without_intra_modal_loss_only_the_consistency_gradient_remains():
    batch = training_batch()
    module = build(use_uni_img=False, use_uni_txt=False, meta_alpha=0.5)
    assert module.virtual_parameter_names() == []
    assert not any(
        name.startswith(("image_uni_head", "text_uni_head"))
        for name, _ in module.named_parameters()
    )
    _, got = module_grads(module, batch)
    torch.manual_seed(1)
    module.zero_grad()
    sum(module.cross_modal_losses(module.training_view(batch)).values()).backward()
    for name, expected in grads(module).items():
        assert torch.allclose(got[name], expected, atol=1e-7), name
    full = build(meta_alpha=0.5)
    _, with_uni = module_grads(full, batch)
    name = "text_tower.encoder.backbone.token_embed.weight"
    assert not torch.allclose(with_uni[name], got[name], atol=1e-4)
