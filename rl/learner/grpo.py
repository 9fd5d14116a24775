"""GRPO, readable in one place: group-relative advantages and the clipped policy-gradient loss.

advantage_i = (r_i - mean_g(r)) / (std_g(r) + eps)   for episode i in group g (Bessel std, as TRL)
ratio_t     = exp(logp_t - logp_old_t)                 per generated token
loss_t      = -min(ratio_t * A, clip(ratio_t, 1 - clip_low, 1 + clip_high) * A)
loss        = aggregated over generated tokens: token mean over the batch (DAPO), mean of
              per-episode means (GRPO) or sum / (B · max tokens) (Dr.GRPO); optional GSPO
              sequence ratio, dual clip, truncated importance weights, KL to a reference and an
              entropy bonus (see `policy_loss`).

`logp_old` is the learner's own log-prob before the update (so several optimiser steps per batch
stay a proper PPO-style ratio); the gap between it and the rollout engine's log-prob (fp32:
~1e-6; bf16, MoE routing differences or async staleness: more) is corrected by importance weights,
truncated or masked, per token or per sequence (`rollout_is_weights`).
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
    ratio_level: str = "token",
    max_tokens: int | None = None,
    dual_clip: float = 0.0,
    is_weight_BT: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    ref_logp_BT: torch.Tensor | None = None,
    kl_estimator: str = "k3",
    entropy_BT: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    num_tokens: float | None = None,
    num_seqs: int | None = None,
) -> tuple[torch.Tensor, dict]:
    """The clipped surrogate loss and its diagnostics. Shapes: B episodes × T tokens; advantages
    per episode (B) or per token (B × T).

    aggregation: `token_mean` (DAPO: over every generated token of the batch), `seq_mean` (GRPO:
    mean of per-episode means), `seq_sum_norm` (Dr.GRPO: sum / (B · max_tokens)).
    ratio_level: `token`, or `sequence` (GSPO: one ratio per episode, the exp of the mean log-ratio).
    dual_clip > 1 bounds the loss of negative-advantage tokens at dual_clip·|A| (dual-clip PPO).
    is_weight: per-token truncated importance weights (behaviour → old policy), multiplied in.
    KL to a reference (k3: e^{ref−logp} − (ref−logp) − 1, or k1: logp − ref) is added per token,
    times the ratio (the same bias correction TRL applies). The entropy bonus subtracts
    entropy_coef × the mean entropy over generated tokens, whatever the aggregation.
    num_tokens / num_seqs: the whole minibatch's generated tokens and episodes, when this call
    sees one micro-batch of it; the micro-batch losses then add up to the minibatch's loss.
    """
    mask = mask_BT.to(logp_BT.dtype)
    log_ratio = logp_BT - old_logp_BT
    if ratio_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1))[:, None]
    elif ratio_level != "token":
        raise ValueError(f"unknown ratio level {ratio_level!r}")
    ratio = torch.exp(log_ratio)
    # per episode, or per token (milestone credit)
    adv = adv_B[:, None] if adv_B.dim() == 1 else adv_B
    objective = torch.minimum(
        ratio * adv, torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    )
    if dual_clip > 1.0:
        objective = torch.where(adv < 0, torch.maximum(objective, dual_clip * adv), objective)
    per_token = -objective
    if is_weight_BT is not None:
        per_token = per_token * is_weight_BT
    if kl_beta:
        d = ref_logp_BT - logp_BT
        kl = torch.exp(d) - d - 1 if kl_estimator == "k3" else -d
        per_token = per_token + kl_beta * kl * ratio

    per_token = per_token.expand_as(mask)
    n_tok = mask.sum().clamp(min=1) if num_tokens is None else max(float(num_tokens), 1.0)
    n_seq = mask.shape[0] if num_seqs is None else num_seqs
    if aggregation == "token_mean":
        loss = (per_token * mask).sum() / n_tok
    elif aggregation == "seq_mean":
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / n_seq
    elif aggregation == "seq_sum_norm":
        if not max_tokens:
            raise ValueError("seq_sum_norm aggregation needs max_tokens")
        loss = (per_token * mask).sum() / (n_seq * max_tokens)
    else:
        raise ValueError(f"unknown loss aggregation {aggregation!r}")
    if entropy_BT is not None and entropy_coef:
        loss = loss - entropy_coef * (entropy_BT * mask).sum() / n_tok
    n = mask.sum().clamp(min=1)

    with torch.no_grad():
        r = ratio.expand_as(mask)
        a = adv.expand_as(mask)
        is_clipped = ((r < 1 - clip_low) & (a < 0)) | ((r > 1 + clip_high) & (a > 0))
        metrics = {
            "clip_frac": float((is_clipped.to(mask.dtype) * mask).sum() / n),
            "ratio_mean": float((r * mask).sum() / n),
            # k3 estimator of KL(old || new) over generated tokens
            "kl_old_new": float(
                ((torch.exp(logp_BT - old_logp_BT) - 1 - (logp_BT - old_logp_BT)) * mask).sum() / n
            ),
        }
    return loss, metrics


def rollout_is_weights(
    old_logp_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    mode: str = "token_truncate",
    low: float = 0.0,
    high: float = 2.0,
) -> torch.Tensor:
    """Importance weights per token (B × T, detached) that correct for an engine that sampled from a
    slightly different distribution than the learner's weights give (kernels, dtype, routing,
    async staleness), from r = π_old / π_rollout on the generated tokens (`mask_BT`):

    token_truncate (TIS)   w_t = clamp(r_t, low, high)
    token_mask (IcePop)    w_t = r_t if low <= r_t <= high else 0   (two-sided token masking)
    sequence_truncate      w_t = clamp(R, low, high),  R = Π_t r_t over the sequence
    sequence_mask (MIS)    w_t = R if low <= R <= high else 0       (the whole sequence dropped)
    geometric_mask         as sequence_mask with R = (Π_t r_t)^(1/n), the per-token geometric mean

    `low` 0 is no lower bound. Tokens outside the mask get weight 1 (they are not in the loss)."""
    mask = mask_BT.to(old_logp_BT.dtype)
    log_r = (old_logp_BT - rollout_logp_BT) * mask
    if mode in ("sequence_truncate", "sequence_mask"):
        log_r = log_r.sum(-1, keepdim=True)
    elif mode == "geometric_mask":
        log_r = log_r.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    elif mode not in ("token_truncate", "token_mask"):
        raise ValueError(f"unknown rollout importance-sampling mode {mode!r}")
    r = torch.exp(log_r.clamp(max=80.0))  # a product over thousands of tokens: large, never inf·0
    if mode.endswith("truncate"):
        w = r.clamp(min=low if low > 0 else None, max=high)
    else:
        w = r.masked_fill((r < low) | (r > high), 0.0)
    return torch.where(mask.bool(), w.expand_as(mask), torch.ones_like(mask)).detach()


def mismatch_metrics(
    logr_N: torch.Tensor, w_N: torch.Tensor, lag_N: torch.Tensor, seqs_dropped: int, n_seqs: int
) -> dict:
    """How far the engine's log-probs are from the learner's over N generated tokens (`logr_N` = log
    π_learner/π_engine, `lag_N` the versions each token's policy lags by, `w_N` the importance weights
    `rollout_is_weights` gave them): numerical noise for tokens of the current version, real policy
    lag for stale ones, split by version to show which; the mismatch as KL, χ² and perplexity ratio
    (learner / engine); and what the weights did: their mean, and the share of tokens and sequences
    they dropped."""
    r, w, lag = logr_N, w_N, lag_N
    d = r.abs()
    out = {
        "rollout_logprob_diff_mean": float(d.mean()),
        "rollout_logprob_diff_max": float(d.max()),
        "rollout_kl": float((torch.exp(-r) + r - 1).mean()),  # k3 estimate of KL(learner ‖ engine)
        # χ²(learner ‖ engine), sampled by the engine
        "rollout_chi2": float(((torch.exp(r) - 1) ** 2).mean()),
        # perplexity of the tokens, learner / engine
        "rollout_ppl_ratio": float(torch.exp(-r.mean())),
        "rollout_is_weight_mean": float(w.mean()),
        "rollout_is_dropped_tokens": float((w == 0).float().mean()),
        "rollout_is_dropped_seqs": seqs_dropped / max(n_seqs, 1),
        "staleness_token_mean": float(lag.float().mean()),
    }
    if bool((lag > 0).any()):
        out["rollout_logprob_diff_mean_stale"] = float(d[lag > 0].mean())
    if bool((lag == 0).any()):
        out["rollout_logprob_diff_mean_current"] = float(d[lag == 0].mean())
    return out


def token_logprobs(logits_BTV: torch.Tensor, ids_BT: torch.Tensor, temperature: float = 1.0):
    """log p(ids[:, t+1] | ids[:, :t+1]) from next-token logits; returns (B, T-1), fp32 or wider.
    The whole-sequence reference for `rl.learner.logprobs.chunked_logprobs`, which the learner uses."""
    logits = (
        logits_BTV[:, :-1].to(torch.promote_types(logits_BTV.dtype, torch.float32)) / temperature
    )
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, ids_BT[:, 1:, None]).squeeze(-1)
