"""GRPO advantages and loss against values computed by hand."""

import math

import pytest
import torch

from rl.grpo import group_advantages, policy_loss, token_logprobs


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = group_advantages(rewards, groups, scale="group", eps=1e-4)
    # group 0: mean 0.5, Bessel std sqrt(1/3); group 1: all equal -> 0
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    assert adv.tolist() == pytest.approx([a, -a, -a, a, 0.0, 0.0], abs=1e-6)


def test_group_advantages_unscaled_and_batch():
    rewards = torch.tensor([3.0, 1.0, 0.0, 0.0])
    groups = torch.tensor([7, 7, 9, 9])
    assert group_advantages(rewards, groups, scale="none").tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0])
    batch_std = torch.tensor([3.0, 1.0, 0.0, 0.0]).std().item()
    expect = [1 / (batch_std + 1e-4), -1 / (batch_std + 1e-4), 0.0, 0.0]
    assert group_advantages(rewards, groups, scale="batch").tolist() == pytest.approx(expect, abs=1e-6)
    with pytest.raises(ValueError, match="unknown reward scaling"):
        group_advantages(rewards, groups, scale="rank")


def _case():
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.5, -0.5, -2.5]])
    ratios = torch.tensor([[1.0, 1.5, 0.5], [1.0, 0.5, 1.5]])
    logp = (old + ratios.log()).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return logp, old, adv, mask


def test_clipped_loss_token_mean_by_hand():
    logp, old, adv, mask = _case()
    loss, m = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, aggregation="token_mean")
    # ep0 (A=+1): -1, -min(1.5, 1.28) = -1.28, masked; ep1 (A=-1): +1, -min(-0.5, -0.8) = 0.8, -min(-1.5, -1.28) = 1.5
    assert loss.item() == pytest.approx((-1 - 1.28 + 1 + 0.8 + 1.5) / 5, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(2 / 5)
    loss.backward()
    g = logp.grad
    assert g[0, 1].item() == 0.0  # clipped with A > 0: no gradient
    assert g[1, 1].item() == 0.0  # clipped with A < 0: no gradient
    assert g[1, 2].item() == pytest.approx(-1 * 1.5 * -1 / 5)  # ratio*A kept: d(-r*A)/dlogp = -A*r / n
    assert g[0, 2].item() == 0.0  # masked


def test_clipped_loss_seq_mean_by_hand():
    logp, old, adv, mask = _case()
    loss, _ = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, aggregation="seq_mean")
    assert loss.item() == pytest.approx(((-1 - 1.28) / 2 + (1 + 0.8 + 1.5) / 3) / 2, abs=1e-6)


def test_entropy_bonus_lowers_loss_by_coef_times_mean_entropy():
    logp, old, adv, mask = _case()
    ent = torch.full((2, 3), 2.0)
    base, _ = policy_loss(logp, old, adv, mask)
    bonus, _ = policy_loss(logp, old, adv, mask, entropy_BT=ent, entropy_coef=0.1)
    assert (base - bonus).item() == pytest.approx(0.2, abs=1e-6)


def test_token_logprobs_shift_by_hand():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [1 / 3, 1 / 3, 1 / 3]]]))
    ids = torch.tensor([[0, 1, 2]])
    lp = token_logprobs(logits, ids)
    assert lp.exp()[0].tolist() == pytest.approx([0.25, 0.1], abs=1e-6)
