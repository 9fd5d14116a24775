"""The learner's shared-prefix forward (rl/learner/logprobs.py `_hf_shared_prefix`) against the plain one: a
micro-batch whose rows start with the same tokens (a group's prompt) runs that prefix once, and
must give the same hidden states, router captures, gradients and optimiser step as running every
row whole."""

from __future__ import annotations

import pytest
import torch

from rl.config import AlgoConfig, LearnerConfig
from rl.learner.learner import Learner
from rl.learner.logprobs import load_causal_lm
from rl.learner.routing import balance_terms
from rollout.trajectory import Trajectory


def _rows(prefix: int = 40, suffixes=(30, 17, 25, 9), seed: int = 0):
    """Right-padded ids and mask: every row starts with the same `prefix` tokens, then its own suffix."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(2, 400, (prefix,), generator=g)
    rows = [torch.cat([head, torch.randint(2, 400, (n,), generator=g)]) for n in suffixes]
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    attn = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)], attn[b, : len(r)] = r, 1
    return ids, attn


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> bool:
    """Equal up to rounding, judged on the whole tensor: ‖got − want‖ ≤ rel·‖want‖ (elementwise
    tolerances fail on a sum of hundreds of positions whose order differs between the two paths)."""
    return float((got.float() - want.float()).norm()) <= rel * float(want.float().norm()) + 1e-12


def _forward(lm, ids, attn, shared: int):
    """Hidden states, router captures, and every parameter's gradient of a loss over the valid positions."""
    lm.shared_prefix_tokens = shared
    lm.module.zero_grad(set_to_none=True)
    h, info = lm.hidden_and_routing(ids, attn, capture=True)
    captured = info["hf_routers"]
    valid = attn.bool()
    w = torch.linspace(-1, 1, h.shape[-1])
    aux, _ = balance_terms(captured, attn.reshape(-1).bool())
    ((h[valid] * w).sum() + aux).backward()
    grads = {n: p.grad.clone() for n, p in lm.module.named_parameters() if p.grad is not None}
    return h.detach(), [(logits.detach(), i) for logits, i in captured], grads


def test_the_shared_prefix_forward_equals_the_plain_one(tiny_policy):
    lm = load_causal_lm(tiny_policy, torch.float32)
    lm.module.train()
    ids, attn = _rows()
    assert lm.shared_prefix(ids, attn) == 0  # off by default
    lm.shared_prefix_tokens = 8
    assert lm.shared_prefix(ids, attn) == 40
    h0, cap0, g0 = _forward(lm, ids, attn, shared=0)
    h1, cap1, g1 = _forward(lm, ids, attn, shared=8)
    valid = attn.bool()
    torch.testing.assert_close(h1[valid], h0[valid], rtol=1e-4, atol=1e-5)
    assert len(cap1) == len(cap0) > 0
    for (l0, i0), (l1, i1) in zip(cap0, cap1):
        keep = attn.reshape(-1).bool()
        assert l1.shape == l0.shape and torch.equal(i1[keep], i0[keep])
        torch.testing.assert_close(l1[keep], l0[keep], rtol=1e-4, atol=1e-5)
    assert g1.keys() == g0.keys() and len(g0) > 10
    assert all(_close(g1[name], g0[name], 1e-5) for name in g0), [
        n for n in g0 if not _close(g1[n], g0[n], 1e-5)
    ]


def test_only_a_long_enough_prefix_every_row_shares_is_run_once(tiny_policy):
    lm = load_causal_lm(tiny_policy, torch.float32)
    lm.shared_prefix_tokens = 8
    ids, attn = _rows(prefix=40)
    assert lm.shared_prefix(ids[:1], attn[:1]) == 0  # one row: nothing to share
    # routing replay: the plain path
    assert lm.shared_prefix(ids, attn, routing=torch.zeros(1)) == 0
    other = ids.clone()
    other[2, 5] += 1  # one row leaves the prefix at token 5
    assert lm.shared_prefix(other, attn) == 0
    lm.shared_prefix_tokens = 4
    assert lm.shared_prefix(other, attn) == 5
    # a row that is all prefix keeps one token
    short_ids, short_attn = _rows(prefix=40, suffixes=(30, 0))
    assert lm.shared_prefix(short_ids, short_attn) == 40 - 0 and short_ids.shape[1] - 1 >= 40


def _group_batch(n: int = 6, prompt: int = 48, seed: int = 0) -> list[Trajectory]:
    """One group: the same prompt, different completions and rewards (milestones)."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(2, 400, (prompt,), generator=g).tolist()
    out = []
    for i in range(n):
        gen = torch.randint(2, 400, (20 + 3 * i,), generator=g).tolist()
        ids = head + gen
        out.append(
            Trajectory(
                episode_id=f"e{i}",
                iteration=0,
                group_id=0,
                env_id="x",
                seed=0,
                prompt_len=prompt,
                token_ids=ids,
                loss_mask=[0] * prompt + [1] * len(gen),
                rollout_logprobs=[0.0] * prompt + [-6.0] * len(gen),
                reward=float(i % 3),
            )
        )
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_train_step_with_shared_prefixes_is_the_plain_step(tiny_policy, precision):
    """The whole update (pre-update log-probs fused into the training forward, the router loss
    included) reaches the optimiser with the plain forward's gradients. (Compared before AdamW:
    its first step is about lr·sign(g), which turns rounding in near-zero gradients into ±lr.)"""
    batch = _group_batch()
    grads, metrics = {}, {}
    for shared in (0, 16):
        torch.manual_seed(0)
        learner = Learner(
            tiny_policy,
            AlgoConfig(minibatch_episodes=6, router_aux_coef=0.01, lr=1e-3),
            LearnerConfig(threads=1, shared_prefix_tokens=shared, precision=precision),
        )
        step = learner._clip_and_step

        def record(shared=shared, step=step, learner=learner):
            grads[shared] = {
                n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None
            }
            return step()

        learner._clip_and_step = record
        metrics[shared] = learner.train_step(batch)
    rel = 1e-5 if precision == "fp32" else 2e-2  # bf16: the two paths round different sums
    assert grads[0].keys() == grads[16].keys() and len(grads[0]) > 10
    assert all(_close(grads[16][n], g, rel) for n, g in grads[0].items()), [
        n for n, g in grads[0].items() if not _close(grads[16][n], g, rel)
    ]
    for key in ("loss", "router_aux_loss", "rollout_kl", "grad_norm"):
        assert metrics[16][key] == pytest.approx(
            metrics[0][key], rel=1e-4 if precision == "fp32" else 2e-2, abs=1e-7
        ), key


def test_a_cache_that_cannot_be_shared_falls_back_to_the_plain_forward(tiny_policy, monkeypatch):
    """A model whose cache layers are not plain dynamic ones (sliding windows) takes the plain forward,
    and the prefix forward already run leaves no captures behind: the same outputs and router
    captures as with sharing off."""
    import transformers.cache_utils

    lm = load_causal_lm(tiny_policy, torch.float32)
    lm.module.eval()
    ids, attn = _rows()
    with torch.no_grad():
        lm.shared_prefix_tokens = 0
        h0, info0 = lm.hidden_and_routing(ids, attn, capture=True)
        monkeypatch.setattr(transformers.cache_utils, "DynamicLayer", type("OtherLayer", (), {}))
        lm.shared_prefix_tokens = 8
        assert lm.shared_prefix(ids, attn) == 40
        h1, info1 = lm.hidden_and_routing(ids, attn, capture=True)
    torch.testing.assert_close(h1, h0)
    assert len(info1["hf_routers"]) == len(info0["hf_routers"]) > 0
    for (l0, i0), (l1, i1) in zip(info0["hf_routers"], info1["hf_routers"]):
        assert l1.shape == l0.shape and torch.equal(i1, i0)


def test_right_padding_runs_without_a_mask_and_gives_the_masked_forward(tiny_policy):
    """A right-padded micro-batch (the learner's) runs without its attention mask (SDPA's causal
    kernel instead of a materialised mask): the same hidden states at every real token as the masked
    forward; a mask that pads on the left is still applied."""
    from rl.learner.logprobs import right_padded

    lm = load_causal_lm(tiny_policy, torch.float32)
    lm.module.eval()
    ids, attn = _rows(prefix=3, suffixes=(30, 17, 25, 9))
    assert right_padded(attn) and right_padded(None)
    left = attn.flip(1)
    assert not right_padded(left)
    with torch.no_grad():
        masked = lm.module.model(input_ids=ids, attention_mask=attn).last_hidden_state
        h, _ = lm.hidden_and_routing(ids, attn)
        valid = attn.bool()
        torch.testing.assert_close(h[valid], masked[valid], rtol=1e-5, atol=1e-6)
        left_ids = torch.stack([torch.roll(r, int((1 - a).sum())) for r, a in zip(ids, attn)])
        want = lm.module.model(input_ids=left_ids, attention_mask=left).last_hidden_state
        got, _ = lm.hidden_and_routing(left_ids, left)
        torch.testing.assert_close(got, want)  # passed through: the left padding stays masked
        unmasked = lm.module.model(input_ids=left_ids).last_hidden_state
        assert not torch.allclose(got[left.bool()], unmasked[left.bool()], atol=1e-4)
