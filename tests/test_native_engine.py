"""The native engine (rollout/engines/native.py) against the full forward and the learner.

A debug-flavour `policy/` model with every part on (KDA, gated MLA with RoPE so positions matter,
LatentMoE with group-limited routing and a non-zero selection bias, SiTU-GLU, AttnRes), random
weights, fp32. Prompts of different lengths and `max_batch` smaller than the number of prompts, so
requests join and leave a running batch and MLA caches are left-padded."""

from __future__ import annotations

import pytest
import torch

from policy.checkpoint import load_policy
from rollout.engines.native import NativeEngine, processed_logprobs

LENGTHS = (5, 17, 33, 9, 60)


@pytest.fixture(scope="module")
def model(policy_dir):
    return load_policy(policy_dir).eval()


@pytest.fixture(scope="module")
def prompts(model):
    g = torch.Generator().manual_seed(1)
    return [
        torch.randint(3, model.args.vocab_size - 1, (n,), generator=g).tolist() for n in LENGTHS
    ]


def full_forward(model, ids):
    """Logits of every position (the input-only image placeholder at -inf) and the router's choices."""
    with torch.no_grad():
        logits, _, info = model(torch.tensor([ids]))
    logits = logits[0].float()
    logits[:, model.never_generated()] = -torch.inf
    return logits, (
        info["experts"][:, 0].transpose(0, 1).tolist() if info["experts"] is not None else None
    )


def test_greedy_equals_the_argmax_of_the_full_forward_at_every_step(policy_dir, model, prompts):
    eng = NativeEngine(policy_dir, max_batch=2)
    gens = eng.generate(prompts, max_tokens=[12, 20, 7, 15, 9], temperature=0)
    assert [len(g.token_ids) for g in gens] == [12, 20, 7, 15, 9]
    assert all(g.finish_reason == "length" for g in gens)
    for p, g in zip(prompts, gens):
        logits, experts = full_forward(model, p + g.token_ids)
        steps = logits[len(p) - 1 : -1]
        assert steps.argmax(-1).tolist() == g.token_ids
        lp = steps.log_softmax(-1).gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
        assert torch.allclose(lp, torch.tensor(g.logprobs), atol=1e-4)
        # routed experts: the prompt's and every generated token's but the last (never fed back)
        assert g.prompt_routed_experts == experts[: len(p)]
        assert g.routed_experts[:-1] == experts[len(p) : len(p) + len(g.token_ids) - 1]
        assert g.routed_experts[-1] == [] and len(g.routed_experts) == len(g.token_ids)
    assert eng.stats["decode_steps"] < sum(len(g.token_ids) for g in gens)  # it did batch


def test_logprobs_equal_the_learners_with_temperature_and_routing_replay(policy_dir, prompts):
    """The learner's log-probs for the engine's sampled tokens, at the same temperature, both with
    its own routing and replaying the engine's recorded routing: fp32 within 1e-3."""
    from rl.config import AlgoConfig
    from rl.learner.learner import Learner
    from rl.learner.logprobs import chunked_logprobs

    eng = NativeEngine(policy_dir, max_batch=3)
    gens = eng.generate(prompts, max_tokens=16, temperature=0.7, seeds=list(range(len(prompts))))
    learner = Learner(policy_dir, AlgoConfig(), temperature=0.7)
    for p, g in zip(prompts, gens):
        ids = torch.tensor([p + g.token_ids])
        routed = g.prompt_routed_experts + g.routed_experts
        routing = torch.tensor([r if r else [[-1, -1]] * 3 for r in routed]).permute(1, 0, 2)[
            :, None
        ]  # L × 1 × T × k
        for replay in (None, routing):
            with torch.no_grad():
                h, info = learner.lm.hidden_and_routing(ids, routing=replay)
                lp, _ = chunked_logprobs(
                    h, learner.lm.head, ids, temperature=0.7, banned_ids=learner.lm.banned_ids
                )
            assert (lp[0, len(p) - 1 :] - torch.tensor(g.logprobs)).abs().max() < 1e-3
            if replay is not None:
                assert info["replayed"][0] == 3 * (len(routed) - 1) and info["replayed"][1] == 0


def test_a_sequence_samples_the_same_tokens_alone_and_inside_a_changing_batch(policy_dir, prompts):
    eng = NativeEngine(policy_dir, max_batch=2, prefix_cache_entries=0)
    kw = dict(max_tokens=[20, 5, 11, 20, 3], temperature=1.0, top_p=0.9, top_k=50)
    seeds = [11, 12, 13, 14, 15]
    together = eng.generate(prompts, seeds=seeds, **kw)
    for i, (p, s) in enumerate(zip(prompts, seeds)):
        alone = eng.generate([p], seeds=[s], **{**kw, "max_tokens": kw["max_tokens"][i]})[0]
        assert alone.token_ids == together[i].token_ids
        assert max(abs(a - b) for a, b in zip(alone.logprobs, together[i].logprobs)) < 1e-4
        assert alone.routed_experts == together[i].routed_experts
    other = eng.generate(prompts[:1], seeds=[99], **{**kw, "max_tokens": 20})[0]
    assert other.token_ids != together[0].token_ids  # the seed matters


def test_a_cached_prefix_continues_exactly_like_a_fresh_prefill(policy_dir, prompts):
    """Turn 2 of an episode extends turn 1's prompt and output: the engine reuses turn 1's state
    and gives what an engine without a prefix cache gives."""
    cached, fresh = NativeEngine(policy_dir), NativeEngine(policy_dir, prefix_cache_entries=0)
    turn1 = cached.generate(prompts[:2], max_tokens=8, temperature=0)
    observation = [7, 8, 9, 10]
    turn2_prompts = [p + g.token_ids + observation for p, g in zip(prompts[:2], turn1)]
    hits_before = cached.stats["prefix_hit_tokens"]
    a = cached.generate(turn2_prompts, max_tokens=10, temperature=0)
    b = fresh.generate(turn2_prompts, max_tokens=10, temperature=0)
    assert cached.stats["prefix_hit_tokens"] - hits_before == sum(len(p) + 7 for p in prompts[:2])
    for x, y, p in zip(a, b, turn2_prompts):
        assert x.token_ids == y.token_ids
        assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < 1e-4
        n_hit = len(p) - len(observation) - 1
        assert all(r == [] for r in x.prompt_routed_experts[:n_hit])  # reused: recorded in turn 1
        assert x.prompt_routed_experts[n_hit:] == y.prompt_routed_experts[n_hit:]


def test_after_a_weight_reload_it_serves_the_new_weights(policy_dir, prompts):
    eng = NativeEngine(policy_dir)
    before = eng.generate(prompts[:2], max_tokens=10, temperature=0)
    new = load_policy(policy_dir)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.5)
        for r in new.routers():
            r.bias.normal_(0.0, 0.5)
    eng.load_weights(((n, t.numpy()) for n, t in new.state_dict().items()), version=3)
    assert eng.version == 3 and not eng._prefixes
    after = eng.generate(prompts[:2], max_tokens=10, temperature=0)
    assert any(a.token_ids != b.token_ids for a, b in zip(before, after))
    for p, g in zip(prompts[:2], after):
        logits, experts = full_forward(new.eval(), p + g.token_ids)
        assert logits[len(p) - 1 : -1].argmax(-1).tolist() == g.token_ids
        assert g.prompt_routed_experts == experts[: len(p)]
    with pytest.raises(KeyError, match="layers.0.nope"):
        eng.load_weights([("layers.0.nope", torch.zeros(1))], version=4)
    with pytest.raises(ValueError, match="embed.weight.*shape"):
        eng.load_weights([("embed.weight", torch.zeros(2, 2))], version=4)


def test_stop_tokens_stop_strings_min_tokens_and_limits(policy_dir, prompts):
    eng = NativeEngine(policy_dir, max_model_len=64)
    free = eng.generate(prompts[:1], max_tokens=12, temperature=0)[0]
    stop_tok = free.token_ids[4]
    first = free.token_ids.index(stop_tok)
    g = eng.generate(prompts[:1], max_tokens=12, temperature=0, stop_token_ids=[stop_tok])[0]
    assert g.token_ids == free.token_ids[: first + 1] and g.finish_reason == "stop"
    # min_tokens forbids the stop token until then: the sample at `first` must change
    g = eng.generate(
        prompts[:1], max_tokens=12, temperature=0, stop_token_ids=[stop_tok], min_tokens=first + 2
    )[0]
    assert len(g.token_ids) >= first + 2 and g.token_ids[first] != stop_tok
    text = eng.tokenizer.decode(free.token_ids[:6], skip_special_tokens=False)
    needle = text[-3:]
    g = eng.generate(prompts[:1], max_tokens=12, temperature=0, stop=[needle])[0]
    assert g.finish_reason == "stop" and needle in eng.tokenizer.decode(
        g.token_ids, skip_special_tokens=False
    )
    assert needle not in eng.tokenizer.decode(g.token_ids[:-1], skip_special_tokens=False)
    # the context limit caps the output; a prompt that fills it is refused by name
    g = eng.generate([prompts[4]], max_tokens=50, temperature=0)[0]
    assert len(g.token_ids) == 64 - len(prompts[4]) and g.finish_reason == "length"
    with pytest.raises(ValueError, match="prompt 0 has 70 tokens; max_model_len is 64"):
        eng.generate([prompts[4] + prompts[0] * 2], max_tokens=1)


def test_the_image_placeholder_is_never_generated(policy_dir, prompts, tmp_path):
    """A model whose head favours the input-only image token above all others still never samples
    it (the learner scores it at zero probability too)."""
    from policy.checkpoint import save_policy

    model = load_policy(policy_dir)
    image = model.never_generated()
    assert image == [model.args.vision.image_token_id]
    # point the image token's output row along the prompts' last hidden states
    with torch.no_grad():
        last = torch.stack([model.hidden_states(torch.tensor([p]))[0][0, -1] for p in prompts])
        model.lm_head.weight[image] = last.sum(0) / last.sum(0).norm() * 100
        for p in prompts:
            raw, _, _ = model(torch.tensor([p]))
            assert int(raw[0, -1].argmax()) == image[0]  # unmasked, it would win
    eng = NativeEngine(str(save_policy(model, tmp_path / "favours-image")))
    gens = eng.generate(prompts, max_tokens=8, temperature=1.0, seeds=list(range(len(prompts))))
    assert all(image[0] not in g.token_ids for g in gens)
    assert all(lp > -torch.inf for g in gens for lp in g.logprobs)


def test_processed_logprobs_match_a_naive_top_k_top_p():
    torch.manual_seed(0)
    logits = torch.randn(6, 40) * 3
    for temperature, k, p in [
        (1.0, 0, 1.0),
        (0.7, 5, 1.0),
        (1.3, 0, 0.8),
        (0.9, 12, 0.6),
        (1.0, 1, 0.5),
    ]:
        got = processed_logprobs(logits, temperature, k, p)
        for row, out in zip(logits, got):
            x = (row / temperature).tolist()
            order = sorted(range(40), key=lambda i: -x[i])
            keep = order[:k] if k else order
            probs = torch.tensor([x[i] for i in keep]).softmax(0).tolist()
            kept, mass = [], 0.0
            for i, pr in zip(keep, probs):
                if mass >= p:
                    break
                kept.append(i)
                mass += pr
            ref = torch.full((40,), -torch.inf)
            ref[kept] = torch.tensor([x[i] for i in kept]).log_softmax(0)
            assert torch.equal(out.isinf(), ref.isinf())
            assert torch.allclose(out[~out.isinf()], ref[~ref.isinf()], atol=1e-5)


def test_each_engine_refuses_a_checkpoint_it_cannot_serve_by_name(policy_dir, tiny_policy):
    from rollout.engines import make_engine

    with pytest.raises(
        ValueError, match="rollout.engine=native serves the project's policy/ model only"
    ):
        make_engine("native", tiny_policy, seed=0, max_model_len=256)
    with pytest.raises(ValueError, match="unknown rollout engine 'sglang'"):
        make_engine("sglang", policy_dir, seed=0, max_model_len=256)
