"""Our GRPO-family losses against TRL's GRPOTrainer on identical tensors (TRL's own code runs;
its formula is not re-typed here)."""

import pytest
import torch

from rl.learner.grpo import policy_loss

B, P, T = 4, 5, 7


@pytest.fixture(scope="module")
def tensors():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    # ratios on both sides of the clip range
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 5:] = 0
    mask[2, 3:] = 0
    adv = torch.tensor([1.5, -0.7, 0.2, -1.1], dtype=torch.float64)
    entropy = torch.rand(B, T, generator=g, dtype=torch.float64)
    return logp, old, ref, mask, adv, entropy


def trl_loss(
    tiny_policy,
    tokenizer,
    tmp_path,
    tensors,
    *,
    loss_type,
    beta=0.0,
    level="token",
    entropy_coef=0.0,
):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    logp, old, ref, mask, adv, entropy = tensors
    args = GRPOConfig(
        output_dir=str(tmp_path / loss_type),
        loss_type=loss_type,
        beta=beta,
        epsilon=0.2,
        epsilon_high=0.28,
        importance_sampling_level=level,
        max_completion_length=T,
        num_generations=2,
        per_device_train_batch_size=B,
        report_to=[],
        use_cpu=True,
        entropy_coef=entropy_coef,
        logging_steps=1000,
    )
    trainer = GRPOTrainer(
        model=tiny_policy,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["a"] * B}),
        processing_class=tokenizer,
    )
    # our log-probs in place of a forward pass; the MoE aux loss (TRL adds it for MoE models) is 0
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (
        logp,
        entropy,
        torch.zeros((), dtype=logp.dtype),
    )
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    inputs = {
        "prompt_ids": torch.ones(B, P, dtype=torch.long),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.ones(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "num_items_in_batch": mask.sum(),
        "old_per_token_logps": old,
    }
    if beta:
        inputs["ref_per_token_logps"] = ref
    return trainer._compute_loss(trainer.model, inputs).item()


OURS = {"dapo": "token_mean", "bnpo": "token_mean", "grpo": "seq_mean", "dr_grpo": "seq_sum_norm"}


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "grpo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_aggregations_match_trl(tiny_policy, tokenizer, tmp_path, tensors, loss_type, beta):
    logp, old, ref, mask, adv, _ = tensors
    ours, _ = policy_loss(
        logp,
        old,
        adv,
        mask,
        clip_low=0.2,
        clip_high=0.28,
        aggregation=OURS[loss_type],
        max_tokens=T,
        kl_beta=beta,
        ref_logp_BT=ref,
    )
    assert ours.item() == pytest.approx(
        trl_loss(tiny_policy, tokenizer, tmp_path, tensors, loss_type=loss_type, beta=beta),
        abs=1e-6,
    )


def test_gspo_sequence_ratio_matches_trl(tiny_policy, tokenizer, tmp_path, tensors):
    logp, old, ref, mask, adv, _ = tensors
    ours, _ = policy_loss(
        logp,
        old,
        adv,
        mask,
        clip_low=0.2,
        clip_high=0.28,
        aggregation="seq_mean",
        ratio_level="sequence",
    )
    theirs = trl_loss(tiny_policy, tokenizer, tmp_path, tensors, loss_type="grpo", level="sequence")
    assert ours.item() == pytest.approx(theirs, abs=1e-6)


def test_entropy_bonus_matches_trl(tiny_policy, tokenizer, tmp_path, tensors):
    logp, old, ref, mask, adv, entropy = tensors
    ours, _ = policy_loss(
        logp,
        old,
        adv,
        mask,
        clip_low=0.2,
        clip_high=0.28,
        aggregation="seq_mean",
        entropy_BT=entropy,
        entropy_coef=0.05,
    )
    theirs = trl_loss(
        tiny_policy, tokenizer, tmp_path, tensors, loss_type="grpo", entropy_coef=0.05
    )
    assert ours.item() == pytest.approx(theirs, abs=1e-6)
