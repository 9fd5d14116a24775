"""The vLLM engine against the Hugging Face model: log-probs, in-place weight reload, and the two
reload bugs the sync must not reintroduce (each shown to be caught by the same comparison)."""

import pytest
import torch

from envs.calculator import CalculatorEnv
from rl.grpo import token_logprobs
from rollout.chat import ChatFormat

pytestmark = pytest.mark.slow
TOL = 1e-3


def hf_logprobs(model, ids):
    with torch.no_grad():
        t = torch.tensor([ids])
        return token_logprobs(model(input_ids=t).logits, t)[0]


@pytest.fixture(scope="module")
def prompt(tokenizer):
    env = CalculatorEnv()
    obs, info = env.reset(seed=1)
    ids = ChatFormat(tokenizer).prompt_ids([{"role": "user", "content": obs}], info["tools"])
    assert len(ids) > 64  # several KV blocks: long enough to be served from the prefix cache
    return ids


def gen_error(engine, model, prompt, seed=7):
    """Max |engine - HF| log-prob of sampled tokens (the prompt is cached after the first call)."""
    g = engine.generate([prompt], max_tokens=8, seeds=[seed])[0]
    ref = hf_logprobs(model, prompt + g.token_ids)[len(prompt) - 1 :]
    return (ref - torch.tensor(g.logprobs)).abs().max().item()


@pytest.fixture(scope="module")
def perturbed(hf_model):
    """A copy of the HF model with every weight moved, as after a large learner update."""
    import copy

    model = copy.deepcopy(hf_model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def test_generate_and_score_match_hf(engine, hf_model, prompt):
    assert gen_error(engine, hf_model, prompt) < TOL
    g = engine.generate([prompt], max_tokens=8, seeds=[1])[0]
    full = prompt + g.token_ids
    assert (hf_logprobs(hf_model, full) - torch.tensor(engine.score(full))).abs().max().item() < TOL


def test_seeded_generation_is_reproducible(engine, prompt):
    a = engine.generate([prompt, prompt], max_tokens=16, seeds=[3, 4])
    b = engine.generate([prompt], max_tokens=16, seeds=[3])
    assert a[0].token_ids == b[0].token_ids
    assert a[0].token_ids != a[1].token_ids


def test_a_large_seeded_batch_is_prefilled_whole(engine):
    """More prompt tokens than one engine step holds, every request seeded: vLLM's chunked prefill
    would rewind the seeded CPU generators of the partly prefilled prompts and crash ("CPU
    Generator does not use offset"); prompts are prefilled whole instead."""
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(8, 1000) for _ in range(338)] for _ in range(64)]  # 21,632 prompt tokens
    gens = engine.generate(prompts, max_tokens=4, seeds=list(range(64)))
    assert len(gens) == 64 and all(len(g.token_ids) >= 1 for g in gens)
    again = engine.generate(prompts[:2], max_tokens=4, seeds=[0, 1])
    assert [g.token_ids for g in again] == [g.token_ids for g in gens[:2]]


def test_reload_bugs_are_caught_and_load_weights_avoids_them(engine, hf_model, perturbed, prompt):
    """Order matters: each step starts from the state the previous one left."""
    assert engine.llm.collective_rpc("lh_num_fused_moe_modules") == [2]
    gen_error(engine, hf_model, prompt)  # cache the prompt's prefix under the current weights
    new = list(perturbed.state_dict().items())

    # 1) reload without the MoE repack: outputs silently wrong even for the right weights
    engine.llm.collective_rpc("lh_reload_weights", args=(new,), kwargs={"repack_moe": False})
    engine.llm.reset_prefix_cache()
    assert gen_error(engine, perturbed, prompt) > 1e-2

    # 2) reload with the repack but without resetting the prefix cache: the cached prompt
    #    still carries KV computed with the previous weights
    engine.load_weights(list(hf_model.state_dict().items()), version=1)
    gen_error(engine, hf_model, prompt)  # re-cache under hf_model's weights
    engine.llm.collective_rpc("lh_reload_weights", args=(new,))
    assert gen_error(engine, perturbed, prompt) > 1e-2

    # 3) the engine's own path: repack and reset -> matches, and reloading is idempotent
    for version in (2, 3):
        engine.load_weights(new, version=version)
        assert engine.version == version
        assert gen_error(engine, perturbed, prompt) < TOL

    # back to the checkpoint's weights for the other tests of this session
    engine.load_weights(list(hf_model.state_dict().items()), version=0)
    assert gen_error(engine, hf_model, prompt) < TOL


def _checkpoint_tensors(path, moved: float = 0.0, seed: int = 0) -> list:
    """The checkpoint's tensors as a sync sends them (per-expert, checkpoint names), optionally moved."""
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(seed)
    return [(n, (t + torch.randn(t.shape, generator=g) * moved).numpy()) for n, t in load_file(f"{path}/model.safetensors").items()]


def _packed_experts(worker) -> list:
    from rollout.engines.vllm_ext import _fused_moe_modules

    return [(m.w13_weight.detach().clone(), m.w2_weight.detach().clone())
            for m, _ in _fused_moe_modules(worker.model_runner.get_model())]


def test_direct_expert_loading_packs_what_vllms_own_reload_packs(engine, hf_model, tiny_policy, prompt):
    """Expert tensors go straight into the packed kernel tensors (rollout/engines/vllm_ext.py): the
    packed bytes and the log-probs equal those of vLLM's layerwise reload of the same weights, and a
    version missing some of a layer's expert tensors fails the load, naming the layer."""
    moved = _checkpoint_tensors(tiny_policy, moved=0.02)
    n_experts = sum(".experts." in n for n, _ in moved)
    assert n_experts > 0
    try:
        out = engine.llm.collective_rpc("lh_reload_weights", args=(iter(moved),), kwargs={"direct_experts": False})[0]
        assert out == {"tensors": len(moved), "direct": 0}
        engine.llm.reset_prefix_cache()
        ref_packed, ref = engine.llm.collective_rpc(_packed_experts)[0], engine.score(prompt)
        engine.load_weights(_checkpoint_tensors(tiny_policy), version=1)  # back, through the direct path
        assert gen_error(engine, hf_model, prompt) < TOL
        out = engine.llm.collective_rpc("lh_reload_weights", args=(iter(moved),))[0]
        assert out == {"tensors": len(moved), "direct": n_experts}
        engine.llm.reset_prefix_cache()
        packed, got = engine.llm.collective_rpc(_packed_experts)[0], engine.score(prompt)
        assert all(torch.equal(a, b) for pa, pb in zip(packed, ref_packed) for a, b in zip(pa, pb))
        assert got == ref and max(abs(a - b) for a, b in zip(got, engine.score(prompt))) == 0.0
        partial = [(n, a) for n, a in moved if not n.endswith("experts.1.up_proj.weight")]
        with pytest.raises(Exception, match=r"layers\.\d+\.mlp\.experts received \d+ of its \d+ expert tensors"):
            engine.llm.collective_rpc("lh_reload_weights", args=(iter(partial),))
    finally:  # back to the checkpoint's weights for the other tests of this session
        engine.load_weights(_checkpoint_tensors(tiny_policy), version=0)
    assert gen_error(engine, hf_model, prompt) < TOL
