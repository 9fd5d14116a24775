"""The project's vLLM model plugin (rollout/engines/vllm_plugin.py) serving the `policy/` model, through the
rollout worker's own engine class (rollout/engines/vllm_engine.py), against the full forward, the learner's
log-probs and the native engine.

A debug-flavour model with every part on (KDA, gated MLA with RoPE so positions matter, LatentMoE
with group-limited routing and a non-zero selection bias, SiTU-GLU, AttnRes, the vision token),
random weights, fp32. Prompts of different lengths with different token budgets, so sequences join
and leave vLLM's running batch at different steps."""

from __future__ import annotations

import pytest
import torch

from policy.checkpoint import load_policy

pytestmark = pytest.mark.slow

LENGTHS = (5, 17, 33, 9, 60)
BUDGETS = [12, 20, 7, 15, 9]


@pytest.fixture(scope="module")
def model(policy_dir):
    return load_policy(policy_dir).eval()


@pytest.fixture(scope="module")
def engine(policy_dir):
    from rollout.engines import make_engine

    return make_engine("vllm", policy_dir, seed=0, max_model_len=512)


@pytest.fixture(scope="module")
def prompts(model):
    g = torch.Generator().manual_seed(1)
    return [
        torch.randint(3, model.args.vocab_size - 1, (n,), generator=g).tolist() for n in LENGTHS
    ]


def full_logits(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0][0].float()
    logits[:, model.never_generated()] = -torch.inf
    return logits


def test_the_plugin_is_what_vllm_serves(engine):
    from rollout.engines.vllm_plugin import LonghorizonPolicyForCausalLM

    served = engine.llm.collective_rpc(
        lambda worker: type(worker.model_runner.get_model()).__name__
    )
    assert served == [LonghorizonPolicyForCausalLM.__name__]


def test_greedy_equals_the_argmax_of_the_full_forward_and_the_native_engine(
    engine, policy_dir, model, prompts
):
    from rollout.engines.native import NativeEngine

    gens = engine.generate(prompts, max_tokens=BUDGETS, temperature=0.0)
    assert [len(g.token_ids) for g in gens] == BUDGETS
    for p, g in zip(prompts, gens):
        steps = full_logits(model, p + g.token_ids)[len(p) - 1 : -1]
        assert steps.argmax(-1).tolist() == g.token_ids  # at every step
        lp = steps.log_softmax(-1).gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
        assert torch.allclose(lp, torch.tensor(g.logprobs), atol=1e-4)
    native = NativeEngine(policy_dir, max_batch=2).generate(
        prompts, max_tokens=BUDGETS, temperature=0
    )
    assert [g.token_ids for g in gens] == [n.token_ids for n in native]


def test_sampled_logprobs_equal_the_learners(engine, policy_dir, prompts):
    """Temperature 0.7, seeded: the learner's code path (load_causal_lm + chunked log-probs at the
    same temperature, the image token banned) gives the engine's log-probs within 1e-3."""
    from rl.learner.logprobs import chunked_logprobs, load_causal_lm

    lm = load_causal_lm(policy_dir, torch.float32)
    gens = engine.generate(
        prompts, max_tokens=BUDGETS, temperature=0.7, seeds=list(range(len(prompts)))
    )
    worst = 0.0
    for p, g in zip(prompts, gens):
        ids = torch.tensor([p + g.token_ids])
        with torch.no_grad():
            lp, _ = chunked_logprobs(
                lm.hidden(ids), lm.head, ids, temperature=0.7, banned_ids=lm.banned_ids
            )
        worst = max(worst, (lp[0, len(p) - 1 :] - torch.tensor(g.logprobs)).abs().max().item())
    assert worst < 1e-3
    # and the engine's scoring of a whole sequence (prompt log-probs, temperature 1)
    seq = prompts[4] + gens[4].token_ids
    with torch.no_grad():
        ref, _ = chunked_logprobs(
            lm.hidden(torch.tensor([seq])), lm.head, torch.tensor([seq]), banned_ids=lm.banned_ids
        )
    assert (torch.tensor(engine.score(seq)) - ref[0]).abs().max().item() < 1e-3


def test_a_sequence_decodes_the_same_alone_and_inside_a_changing_batch(engine, prompts):
    for temperature, seeds in ((0.0, None), (1.0, [7])):
        alone = engine.generate(prompts[1:2], max_tokens=16, temperature=temperature, seeds=seeds)[
            0
        ]
        crowd = engine.generate(
            prompts,
            max_tokens=[3, 16, 5, 9, 1],
            temperature=temperature,
            seeds=None if seeds is None else [11, 7, 12, 13, 14],
        )[1]
        assert crowd.token_ids == alone.token_ids
        assert torch.allclose(torch.tensor(crowd.logprobs), torch.tensor(alone.logprobs), atol=1e-5)


def test_after_an_in_place_reload_the_plugin_serves_the_new_weights(engine, model, prompts):
    """New weights through the sync path's load (vLLM's in-place reload), with the head now
    favouring the image placeholder: the engine follows the new weights and never samples it; then
    the original weights come back through vLLM's own layerwise reload."""
    new = load_policy(engine.model_path).eval()
    image = new.never_generated()[0]
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        new.lm_head.weight[image] = new.lm_head.weight.abs().max() * 50
    try:
        engine.load_weights(
            [(n, t.detach().numpy()) for n, t in new.state_dict().items()], version=1
        )
        gens = engine.generate(prompts, max_tokens=BUDGETS, temperature=0.0)
        for p, g in zip(prompts, gens):
            steps = full_logits(new, p + g.token_ids)[len(p) - 1 : -1]
            assert steps.argmax(-1).tolist() == g.token_ids and image not in g.token_ids
        assert engine.version == 1
    finally:  # back through vLLM's own in-place reload (what other RL frameworks call)
        engine.llm.collective_rpc(
            "reload_weights",
            kwargs={
                "weights_iterator": iter(
                    [(n, t.detach().clone()) for n, t in model.state_dict().items()]
                ),
                "is_checkpoint_format": True,
            },
        )
        engine.llm.reset_prefix_cache()
    g = engine.generate(prompts[:1], max_tokens=8, temperature=0.0)[0]
    assert (
        full_logits(model, prompts[0] + g.token_ids)[len(prompts[0]) - 1 : -1].argmax(-1).tolist()
        == g.token_ids
    )


def test_the_plugin_refuses_a_tensor_that_is_not_a_weight_of_the_model_by_name(
    engine, model, prompts
):
    with pytest.raises(Exception, match="'layers.0.attn.nope' is not a weight of this model"):
        engine.load_weights([("layers.0.attn.nope", torch.zeros(2).numpy())], version=3)
    with pytest.raises(Exception, match="embed.weight has shape"):
        engine.load_weights([("embed.weight", torch.zeros(2, 2).numpy())], version=3)
    # the worker still serves, unchanged
    g = engine.generate(prompts[:1], max_tokens=8, temperature=0.0)[0]
    assert (
        full_logits(model, prompts[0] + g.token_ids)[len(prompts[0]) - 1 : -1].argmax(-1).tolist()
        == g.token_ids
    )
