"""The learner's memory-bounded paths against the plain ones: chunked log-probs, micro-batches
by token budget, activation checkpointing; and the project's own policy trained by the learner."""

import dataclasses

import pytest
import torch

from conftest import REPO
from policy.args import load_model_args
from policy.checkpoint import save_policy
from policy.model import Policy
from rl.config import AlgoConfig, LearnerConfig
from rl.learner.grpo import token_logprobs
from rl.learner.learner import Learner
from rl.learner.logprobs import chunked_logprobs
from rollout.trajectory import Trajectory


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunked_logprobs_equal_full_logits(chunk):
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False).double()
    h = torch.randn(2, 9, 8, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 11, (2, 9))
    ref = token_logprobs(head(h), ids, temperature=0.7)
    ref_ent = -(
        torch.log_softmax(head(h)[:, :-1] / 0.7, -1).exp()
        * torch.log_softmax(head(h)[:, :-1] / 0.7, -1)
    ).sum(-1)
    got, ent = chunked_logprobs(
        h, head, ids, temperature=0.7, chunk_tokens=chunk, with_entropy=True
    )
    assert torch.allclose(got, ref, atol=1e-12) and torch.allclose(ent, ref_ent, atol=1e-12)
    g_ref = torch.autograd.grad((ref * 1.3).sum() + ref_ent.sum(), (h, head.weight))
    g_got = torch.autograd.grad((got * 1.3).sum() + ent.sum(), (h, head.weight))
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(g_ref, g_got))
    # without entropies: the fused head (`_HeadLogprobs`), the same numbers and gradients
    ref = token_logprobs(head(h), ids, temperature=0.7)
    lp, none = chunked_logprobs(h, head, ids, temperature=0.7, chunk_tokens=chunk)
    assert none is None and torch.allclose(lp, ref, atol=1e-12)
    g_ref = torch.autograd.grad((ref * 1.3).sum(), (h, head.weight))
    assert all(
        torch.allclose(a, b, atol=1e-12)
        for a, b in zip(g_ref, torch.autograd.grad((lp * 1.3).sum(), (h, head.weight)))
    )

    # the head on the generated positions only: the same numbers there, 0 elsewhere, the same
    # gradients of any loss masked to them
    only = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 1], [1, 0, 0, 0, 1, 1, 0, 0]], dtype=torch.float64)
    ref = token_logprobs(head(h), ids, temperature=0.7)  # a fresh graph (the one above was used)
    ref_ent = -(
        torch.log_softmax(head(h)[:, :-1] / 0.7, -1).exp()
        * torch.log_softmax(head(h)[:, :-1] / 0.7, -1)
    ).sum(-1)
    sel, sel_ent = chunked_logprobs(
        h, head, ids, temperature=0.7, chunk_tokens=chunk, with_entropy=True, only_BT=only
    )
    assert torch.allclose(sel, ref * only, atol=1e-12) and torch.allclose(
        sel_ent, ref_ent * only, atol=1e-12
    )
    g_ref = torch.autograd.grad(((ref * 1.3 + ref_ent) * only).sum(), (h, head.weight))
    g_sel = torch.autograd.grad((sel * 1.3 + sel_ent).sum(), (h, head.weight))
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(g_ref, g_sel))


@pytest.fixture(scope="module")
def policy_ckpt(tmp_path_factory):
    args = load_model_args(REPO / "configs" / "policy" / "debug.yaml")
    args = dataclasses.replace(args, vision=dataclasses.replace(args.vision, enabled=False))
    torch.manual_seed(0)
    return str(save_policy(Policy(args), tmp_path_factory.mktemp("policy-ckpt")))


def _batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(2, 512, (n,), generator=g).tolist()
        prompt = max(1, n // 4)
        out.append(
            Trajectory(
                episode_id=f"e{i}",
                iteration=0,
                group_id=i // 2,
                env_id="x",
                seed=0,
                prompt_len=prompt,
                token_ids=ids,
                loss_mask=[0] * prompt + [1] * (n - prompt),
                rollout_logprobs=[0.0] * prompt
                + (-6.0 - torch.rand(n - prompt, generator=g)).tolist(),
                reward=float(i % 2),
            )
        )
    return out


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_micro_batches_and_chunks_give_the_same_update(policy_ckpt, aggregation):
    batch = _batch([40, 25, 33, 18, 50, 27])
    plain = Learner(
        policy_ckpt,
        AlgoConfig(loss_aggregation=aggregation, minibatch_episodes=6, entropy_coef=0.01),
        LearnerConfig(threads=1),
    )
    small = Learner(
        policy_ckpt,
        AlgoConfig(loss_aggregation=aggregation, minibatch_episodes=6, entropy_coef=0.01),
        LearnerConfig(
            threads=1, microbatch_tokens=60, logprob_chunk_tokens=7, activation_checkpointing=True
        ),
    )
    assert len(small.plan(batch)[0]) > 2 and len(plain.plan(batch)[0]) == 1
    for learner in (plain, small):  # plain SGD, lr 1: the step *is* the gradient (Adam's first step
        # is sign-like, amplifying fp32 noise)
        learner.opt = torch.optim.SGD(learner.model.parameters(), lr=1.0)
    a, b = plain.train_step(batch), small.train_step(batch)
    assert b["microbatches"] > 2
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    for p, q in zip(plain.model.parameters(), small.model.parameters()):
        assert torch.allclose(p, q, atol=1e-5)


def test_long_trajectory_trains_the_policy_model(policy_ckpt, tmp_path):
    learner = Learner(
        policy_ckpt,
        AlgoConfig(minibatch_episodes=2),
        LearnerConfig(threads=2, logprob_chunk_tokens=1024, activation_checkpointing=True),
    )
    batch = _batch([8192, 8192])
    before = [p.detach().clone() for p in learner.model.parameters()]
    stats = learner.train_step(batch)
    assert torch.isfinite(torch.tensor(stats["loss"])) and stats["grad_norm"] > 0
    assert any((p - b).abs().max() > 0 for p, b in zip(learner.model.parameters(), before))
    saved = learner.save_checkpoint(str(tmp_path / "ckpt"), {"iteration": 0})
    again = Learner(policy_ckpt, AlgoConfig(), LearnerConfig(threads=1))
    again.load_checkpoint(saved)
    assert again.version == 1
    assert all(
        torch.equal(p, q) for p, q in zip(learner.model.parameters(), again.model.parameters())
    )


@pytest.mark.parametrize("balance", ["quantile", "quantile_hist"])
def test_router_balancing_during_rl_steps(tmp_path, balance):
    """A deliberately skewed router becomes balanced over a few learner steps (QB during RL)."""
    args = load_model_args(REPO / "configs" / "policy" / "debug.yaml")
    args = dataclasses.replace(
        args,
        vision=dataclasses.replace(args.vision, enabled=False),
        moe=dataclasses.replace(args.moe, balance=balance),
    )
    torch.manual_seed(0)
    model = Policy(args)
    with torch.no_grad():
        for r in model.routers():
            r.weight[:2] += 0.5 * torch.randn(args.dim)  # experts 0 and 1 win almost every token
    ckpt = str(save_policy(model, tmp_path / balance))
    learner = Learner(
        ckpt,
        AlgoConfig(minibatch_episodes=4, lr=1e-6),
        LearnerConfig(threads=1, microbatch_tokens=300),
    )
    batch = _batch([200, 180, 190, 210], seed=1)
    steps = [learner.train_step(batch) for _ in range(8)]
    loads = [s["router_load_max_over_mean"] for s in steps]
    # each layer's scores move when earlier layers' routing changes, so a few steps, not one
    assert loads[0] > 1.6
    assert max(loads[-3:]) <= 1.3
    # every layer's shares per expert, the worst layer's max/mean among them
    first, last = (torch.tensor(s["router_load"]) for s in (steps[0], steps[-1]))
    n_moe = sum(1 for _ in learner.model.routers())
    assert first.shape == (n_moe, args.moe.n_routed_experts)
    assert torch.allclose(first.sum(-1), torch.ones(n_moe, dtype=first.dtype))
    assert (first.max(-1).values * first.shape[-1]).max() == pytest.approx(loads[0], rel=1e-4)
    assert (last.max(-1).values * last.shape[-1]).max() < (
        first.max(-1).values * first.shape[-1]
    ).max()
    assert all(r.bias.abs().sum() > 0 for r in learner.model.routers())


@pytest.mark.parametrize("balance", ["quantile", "quantile_hist", "sign"])
def test_router_statistics_keep_scores_only_where_exact_quantiles_need_them(tmp_path, balance):
    """A step's router statistics, added a micro-batch at a time, give the bias update computed from
    all of the step's scores at once; only the exact `quantile` mode keeps the scores to do it."""
    from policy.balance import QuantileHistogram, quantile_bias, sign_update
    from rl.learner.logprobs import CausalLM
    from rl.learner.routing import RouterStats, balance_policy_routers

    args = load_model_args(REPO / "configs" / "policy" / "debug.yaml")
    args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, balance=balance))
    torch.manual_seed(0)
    lm = CausalLM(Policy(args), "policy")
    routers = lm.module.routers()
    with torch.no_grad():
        for r in routers:
            r.bias.uniform_(-0.1, 0.1)
    micro = [[torch.rand(n, args.moe.n_routed_experts) for _ in routers] for n in (30, 50, 20)]
    stats = RouterStats(lm)
    for m in micro:
        stats.add(m)
    kept = sum(t.numel() for layer in stats.scores for t in layer)
    assert kept == (100 * args.moe.n_routed_experts * len(routers) if balance == "quantile" else 0)
    want, worst = [], 0.0
    for layer, r in enumerate(routers):
        scores, bias = torch.cat([m[layer] for m in micro]), r.bias.detach().clone()
        load = torch.bincount(
            (scores + bias).topk(r.a.top_k, -1).indices.flatten(), minlength=r.a.n_routed_experts
        )
        worst = max(worst, float(load.max()) / float(load.float().mean()))
        if balance == "quantile":
            want.append(quantile_bias(scores, bias, r.a.top_k))
        elif balance == "quantile_hist":
            hist = QuantileHistogram(r.a.n_routed_experts, r.a.top_k, r.a.hist_bins, r.a.hist_range)
            hist.add(scores, bias)
            want.append(hist.bias())
        else:
            want.append(sign_update(load, bias, r.a.balance_rate))
    # the metric is the worst layer's max/mean load under the bias the step's forwards used
    assert balance_policy_routers(lm, stats)["router_load_max_over_mean"] == pytest.approx(
        worst, rel=1e-6
    )
    for r, w in zip(routers, want):
        assert torch.allclose(r.bias, w, atol=1e-6)


@pytest.mark.parametrize("kind", ["policy", "hf"])
def test_fused_pre_update_logprobs_give_the_separate_passs_update(policy_ckpt, tiny_policy, kind):
    """One optimiser step per batch: the pre-update log-probs taken from the training forward itself
    give the same metrics, annotations and weights as the separate no-grad pass."""
    path = policy_ckpt if kind == "policy" else tiny_policy
    batch = _batch([40, 25, 33, 18, 50, 27])
    learners = {}
    for fuse in (True, False):
        learner = Learner(
            path,
            AlgoConfig(minibatch_episodes=6, router_aux_coef=0.01 if kind == "hf" else 0.0),
            LearnerConfig(threads=1, microbatch_tokens=100, fuse_old_logprobs=fuse),
        )
        assert learner.fuses_old_logprobs(len(learner.plan(batch))) == fuse
        # the step is the gradient
        learner.opt = torch.optim.SGD(learner.model.parameters(), lr=1.0)
        learners[fuse] = (learner, learner.train_step(batch))
    (fused, a), (plain, b) = learners[True], learners[False]
    assert a["microbatches"] > 1
    for key in (
        "loss",
        "grad_norm",
        "rollout_logprob_diff_mean",
        "rollout_kl",
        "clip_frac",
        "ratio_mean",
        "router_load_max_over_mean",
    ):
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    for episode, notes in b["annotations"].items():
        assert a["annotations"][episode]["learner_logprobs"] == pytest.approx(
            notes["learner_logprobs"], abs=1e-5
        )
        assert a["annotations"][episode]["advantages"] == notes["advantages"]
    for p, q in zip(fused.model.parameters(), plain.model.parameters()):
        assert torch.allclose(p, q, atol=1e-5)
    # two minibatches need the weights' log-probs from before the first step: never fused
    assert not fused.fuses_old_logprobs(2)


@pytest.mark.parametrize("temperature,bias,banned", [(0.7, True, True), (1.0, False, False)])
def test_the_fused_head_equals_the_autograd_head(temperature, bias, banned):
    """The head's log-probs without an entropy bonus go through `_HeadLogprobs` (its own backward):
    outputs and the gradients of h, the head's weight and bias equal the autograd reference in fp64,
    a frozen head gets no weight gradient, and under bf16 autocast it stays within bf16 rounding."""
    from rl.learner.logprobs import _chunk_logprobs, _HeadLogprobs

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=bias).double()
    h = torch.randn(2, 9, 8, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 11, (2, 9))
    ban = torch.zeros(11, dtype=torch.bool)
    if banned:
        ban[[3, 7]] = True
        ids[ids == 3] = 4
        ids[ids == 7] = 5
    ban = ban if banned else None
    ref, _ = _chunk_logprobs(h, head.weight, head.bias, ids, temperature, False, ban)
    got = _HeadLogprobs.apply(h, head.weight, head.bias, ids, temperature, ban)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    g = torch.randn(2, 9, dtype=torch.float64)
    wrt = [h, head.weight] + ([head.bias] if bias else [])
    for a, b in zip(
        torch.autograd.grad((ref * g).sum(), wrt), torch.autograd.grad((got * g).sum(), wrt)
    ):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
    head.weight.requires_grad_(False)  # a frozen head (LoRA): no weight gradient is computed
    out = _HeadLogprobs.apply(h, head.weight, head.bias, ids, temperature, ban)
    out.sum().backward()
    assert head.weight.grad is None and h.grad is not None
    head32 = torch.nn.Linear(8, 11, bias=bias)
    h32 = h.detach().float().requires_grad_()
    ref32 = _HeadLogprobs.apply(h32, head32.weight, head32.bias, ids, temperature, ban)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = _HeadLogprobs.apply(h32, head32.weight, head32.bias, ids, temperature, ban)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, ref32, rtol=0, atol=5e-2)
    grad_low = torch.autograd.grad(low.sum(), head32.weight)[0]
    grad32 = torch.autograd.grad(ref32.sum(), head32.weight)[0]
    assert grad_low.dtype == torch.float32
    torch.testing.assert_close(grad_low, grad32, rtol=0, atol=5e-2)
