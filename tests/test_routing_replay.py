"""Rollout routing replay in the learner, with the `policy/` model: the experts recorded with the
trajectories are the ones every forward of the update uses (the pre-update log-probs equal a
forward given exactly that selection, and differ from the router's own), the router still learns,
and `router_decisions_differ` measures how often the learner's router would have chosen otherwise."""

import dataclasses

import pytest
import torch
from test_learner_memory import _batch, policy_ckpt  # noqa: F401  (a module fixture)

from rl.config import AlgoConfig, LearnerConfig
from rl.learner.learner import Learner


def _own_routing(learner, traj):
    ids = torch.tensor([traj.token_ids])
    with torch.no_grad():
        _, info = learner.model.hidden_states(ids)
    return info["experts"][:, 0]  # L × T × k


def _record(traj, experts_LTk, shift: int, n_experts: int):
    """The trajectory with per-token recorded experts at its generated positions: the router's own
    choice moved by `shift` expert ids (0: the same choice)."""
    L, T, _ = experts_LTk.shape
    moved = (experts_LTk + shift) % n_experts
    routed = [
        [moved[layer, p].tolist() for layer in range(L)] if traj.loss_mask[p] else []
        for p in range(T)
    ]
    return dataclasses.replace(traj, routed_experts=routed)


@pytest.fixture()
def learner(policy_ckpt):  # noqa: F811
    torch.manual_seed(0)
    return Learner(policy_ckpt, AlgoConfig(minibatch_episodes=4), LearnerConfig(threads=1))


def test_replayed_experts_are_the_ones_the_update_uses(learner):
    n_experts = learner.model.routers()[0].a.n_routed_experts
    plain = _batch([48, 40, 44, 36])
    batch = [_record(t, _own_routing(learner, t), 1, n_experts) for t in plain]
    t = batch[0]
    ids = torch.tensor([t.token_ids])
    routing = learner._routing([t], ids.shape[1])
    # -1 at prompt positions (nothing recorded); the recorded ids at generated ones
    gen = torch.tensor(t.loss_mask).bool()
    assert (routing[:, 0, ~gen] == -1).all() and (routing[:, 0, gen] >= 0).all()
    with torch.no_grad():
        replayed, _, _ = learner._logprobs(learner.lm, ids, torch.ones_like(ids), routing=routing)
        own, _, _ = learner._logprobs(learner.lm, ids, torch.ones_like(ids))
        # the same selection given in full (the router's own choice where nothing was recorded)
        explicit = torch.where(routing >= 0, routing, _own_routing(learner, t)[:, None])
        h, info = learner.model.hidden_states(ids, routing=explicit)
        logits = learner.model.lm_head(h)[:, :-1].float()
        direct = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert torch.equal(info["experts"], explicit)
    assert torch.allclose(replayed, direct, atol=1e-5)
    assert (replayed - own).abs().max() > 1e-3  # other experts, other log-probs

    router_before = [r.weight.detach().clone() for r in learner.model.routers()]
    stats = learner.train_step(batch)
    n_moe = len(learner.model.routers())
    assert stats["routing_replay_decisions"] == n_moe * sum(sum(t.loss_mask) for t in batch)
    # every recorded choice was moved off the router's own; under replay a later layer sees other
    # inputs, so now and then its own choice lands on the moved one
    assert 0.9 < stats["router_decisions_differ"] <= 1.0
    # the weights of the replayed experts come from the router: it still learns
    assert any(not torch.equal(a, r.weight) for a, r in zip(router_before, learner.model.routers()))


def test_decisions_the_router_agrees_with_count_as_the_same(learner):
    n_experts = learner.model.routers()[0].a.n_routed_experts
    batch = [_record(t, _own_routing(learner, t), 0, n_experts) for t in _batch([40, 40])]
    stats = learner.train_step(batch)
    assert stats["router_decisions_differ"] == 0.0 and stats["routing_replay_decisions"] > 0


def test_replay_off_and_a_malformed_record(policy_ckpt):  # noqa: F811
    off = Learner(
        policy_ckpt,
        AlgoConfig(minibatch_episodes=4, routing_replay="never"),
        LearnerConfig(threads=1),
    )
    n_experts = off.model.routers()[0].a.n_routed_experts
    batch = [_record(t, _own_routing(off, t), 1, n_experts) for t in _batch([40, 40])]
    assert "routing_replay_decisions" not in off.train_step(batch)
    on = Learner(policy_ckpt, AlgoConfig(minibatch_episodes=4), LearnerConfig(threads=1))
    bad = dataclasses.replace(
        batch[0], routed_experts=[[[1]] if m else [] for m in batch[0].loss_mask]
    )
    with pytest.raises(ValueError, match="episode e0: token .* records 1 MoE layer"):
        on.train_step([bad, batch[1]])


def test_hugging_face_moe_replays_through_router_hooks(tiny_policy, tokenizer):
    """The same for a Hugging Face Qwen3-MoE checkpoint: hooks on its routers swap in the recorded
    selection, weights from the current router (it still learns)."""
    torch.manual_seed(0)
    hf = Learner(tiny_policy, AlgoConfig(minibatch_episodes=4), LearnerConfig(threads=1))
    replay = hf.lm.hf_replay
    assert replay.supported and hf.lm.moe_shape() == (len(replay.gates), replay.top_k)
    n_experts = replay.gates[0].num_experts
    batch = []
    for t in _batch([30, 26, 28, 24]):
        t = dataclasses.replace(t, token_ids=[x % tokenizer.vocab_size for x in t.token_ids])
        own = replay.own_choice(torch.tensor([t.token_ids]))[:, 0]
        batch.append(_record(t, own, 1, n_experts))
    t = batch[0]
    ids = torch.tensor([t.token_ids])
    routing = hf._routing([t], ids.shape[1])
    with torch.no_grad():
        replayed, _, _ = hf._logprobs(hf.lm, ids, torch.ones_like(ids), routing=routing)
        own_lp, _, _ = hf._logprobs(hf.lm, ids, torch.ones_like(ids))
    assert (replayed - own_lp).abs().max() > 1e-4
    # the hooks saw the recorded selection: with it set, the routers' output indices are the record
    gates_out = []
    handles = [
        g.register_forward_hook(lambda m, i, o: gates_out.append(o[2])) for g in replay.gates
    ]
    try:
        replay.set(routing)
        with torch.no_grad():
            hf.model.model(input_ids=ids)
    finally:
        replay.set(None)
        for h in handles:
            h.remove()
    gen = torch.tensor(t.loss_mask).bool()
    # forward hooks run in registration order: ours first, so these outputs are already swapped
    assert all(torch.equal(out[gen], routing[layer, 0][gen]) for layer, out in enumerate(gates_out))
    before = [g.weight.detach().clone() for g in replay.gates]
    stats = hf.train_step(batch)
    assert stats["routing_replay_decisions"] == len(replay.gates) * sum(
        sum(x.loss_mask) for x in batch
    )
    assert 0.9 < stats["router_decisions_differ"] <= 1.0
    assert any(not torch.equal(b, g.weight) for b, g in zip(before, replay.gates))


def test_replay_asked_for_with_an_engine_that_records_none_stops_the_config():
    """`algo.routing_replay: always` with vLLM (no routed experts recorded here) is one line at load;
    with the native engine, which records them, the config loads; `auto` loads with either."""
    from conftest import REPO
    from rl.config import ConfigError, load_config

    with pytest.raises(
        ConfigError, match="algo.routing_replay always needs an engine that records"
    ):
        load_config(REPO / "configs" / "quickstart_policy.yaml", ["algo.routing_replay=always"])
    native = load_config(
        REPO / "configs" / "quickstart_policy.yaml",
        ["algo.routing_replay=always", "rollout.engine=native"],
    )
    assert native.algo.routing_replay == "always"
    assert load_config(REPO / "configs" / "quickstart.yaml").algo.routing_replay == "auto"
    with pytest.raises(ConfigError, match="algo.routing_replay"):
        load_config(REPO / "configs" / "quickstart.yaml", ["algo.routing_replay=true"])
