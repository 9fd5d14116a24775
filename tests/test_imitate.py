"""The warm start's supervised step on the run's own learner (`Learner.imitate`), against a naive
reference: the mean negative log-likelihood of the demonstrations' generated tokens, from a plain
Hugging Face forward over the whole vocabulary."""

import pytest
import torch

from rl.start.sft import demonstrations
from rollout.chat import ChatFormat


def test_imitate_is_the_demonstrations_nll_and_its_gradient(tiny_policy, tokenizer):
    from transformers import AutoModelForCausalLM

    from rl.config import AlgoConfig, LearnerConfig
    from rl.learner.learner import Learner

    demos = demonstrations(ChatFormat(tokenizer), "tools/calculator-v0", 3, max_turns=4)
    learner = Learner(
        tiny_policy,
        AlgoConfig(max_grad_norm=1e9),
        LearnerConfig(threads=1, microbatch_tokens=300),
        seed=0,
    )
    ref = AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.float32)
    total, n = 0.0, sum(t.num_generated for t in demos)
    for t in demos:  # naive: full logits, every position, then the generated ones picked
        ids = torch.tensor([t.token_ids])
        logp = torch.log_softmax(ref(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[
            :, 0
        ]
        total = total - (logp * torch.tensor(t.loss_mask[1:], dtype=torch.float32)).sum() / n
    total.backward()
    # lr 0: the gradient is left for comparison, the weights stay
    stats = learner.imitate(demos, lr=0.0)
    assert stats["sft_loss"] == pytest.approx(total.item(), rel=1e-5) and stats["tokens"] == n
    got = dict(learner.model.named_parameters())
    compared = 0
    for name, p in ref.named_parameters():
        if p.grad is not None and p.grad.abs().sum() > 0:
            assert got[name].grad is not None and torch.allclose(
                got[name].grad, p.grad, atol=1e-6, rtol=1e-4
            ), name
            compared += 1
    assert compared > 10
    first = stats["sft_loss"]
    for _ in range(5):
        last = learner.imitate(demos, lr=3e-3)["sft_loss"]
    assert last < first - 0.5  # it learns the demonstrations
    assert learner.opt.param_groups[0]["lr"] == learner.cfg.lr  # the RL learning rate is back
    learner.reset_optimizer()
    assert not learner.opt.state  # RL starts with fresh moments
