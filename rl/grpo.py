"""GRPO, readable in one place: group-relative advantages and the clipped policy-gradient loss.

advantage_i = (r_i - mean_g(r)) / (std_g(r) + eps)   for episode i in group g (Bessel std, as TRL)
ratio_t     = exp(logp_t - logp_old_t)                 per generated token
loss_t      = -min(ratio_t * A, clip(ratio_t, 1 - clip_low, 1 + clip_high) * A)
loss        = token mean over all generated tokens of the batch (DAPO), or the mean of
              per-episode token means (original GRPO), each optionally minus an entropy bonus.

`logp_old` is the log-prob of the policy that generated the tokens. With one optimiser step per
batch it is the rollout engine's own log-prob, so the ratio also corrects for the (fp32: ~1e-6)
engine/learner mismatch.
"""

from __future__ import annotations

import torch


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, scale: str = "group", eps: float = 1e-4
) -> torch.Tensor:
    """Per-episode advantages, centred within each group.

    scale: "group" divides by the group's std, "batch" by the whole batch's std, "none" not at all.
    A group whose rewards are all equal gets advantage 0 (nothing to learn from it).
    """
    rewards = rewards.to(torch.float64)
    adv = torch.zeros_like(rewards)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        r = rewards[idx]
        centred = r - r.mean()
        if scale == "group":
            std = r.std(unbiased=True) if r.numel() > 1 else torch.zeros((), dtype=r.dtype)
            centred = centred / (std + eps)
        adv[idx] = centred
    if scale == "batch":
        adv = adv / (rewards.std(unbiased=True) + eps)
    elif scale not in ("group", "none"):
        raise ValueError(f"unknown reward scaling {scale!r}")
    return adv.to(torch.float32)


def policy_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    aggregation: str = "token_mean",
    entropy_BT: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict]:
    """The clipped surrogate loss and its diagnostics. Shapes: B episodes × T tokens."""
    mask = mask_BT.to(logp_BT.dtype)
    ratio = torch.exp(logp_BT - old_logp_BT)
    adv = adv_B[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if entropy_BT is not None and entropy_coef:
        per_token = per_token - entropy_coef * entropy_BT

    if aggregation == "token_mean":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
    elif aggregation == "seq_mean":
        per_seq = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)
        loss = per_seq.mean()
    else:
        raise ValueError(f"unknown loss aggregation {aggregation!r}")

    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        is_clipped = ((ratio < 1 - clip_low) & (adv < 0)) | ((ratio > 1 + clip_high) & (adv > 0))
        metrics = {
            "clip_frac": float((is_clipped.to(mask.dtype) * mask).sum() / n),
            "ratio_mean": float((ratio * mask).sum() / n),
            # k3 estimator of KL(old || new) over generated tokens
            "kl_old_new": float(((ratio - 1 - (logp_BT - old_logp_BT)) * mask).sum() / n),
        }
    return loss, metrics


def token_logprobs(logits_BTV: torch.Tensor, ids_BT: torch.Tensor, temperature: float = 1.0):
    """log p(ids[:, t+1] | ids[:, :t+1]) from next-token logits; returns (B, T-1), fp32."""
    logits = logits_BTV[:, :-1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, ids_BT[:, 1:, None]).squeeze(-1)


def token_entropy(logits_BTV: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    logp = torch.log_softmax(logits_BTV[:, :-1].float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)
