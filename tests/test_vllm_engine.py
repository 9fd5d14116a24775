"""The vLLM engine against the Hugging Face model: log-probs, in-place weight reload, and the two
reload bugs the sync must not reintroduce (each shown to be caught by the same comparison)."""

import pytest
import torch

from envs.calculator import CalculatorEnv
from rl.learner.grpo import token_logprobs
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
    # 21,632 prompt tokens
    prompts = [[rng.randrange(8, 1000) for _ in range(338)] for _ in range(64)]
    gens = engine.generate(prompts, max_tokens=4, seeds=list(range(64)))
    assert len(gens) == 64 and all(len(g.token_ids) >= 1 for g in gens)
    again = engine.generate(prompts[:2], max_tokens=4, seeds=[0, 1])
    assert [g.token_ids for g in again] == [g.token_ids for g in gens[:2]]


def test_reload_bugs_are_caught_and_load_weights_avoids_them(engine, hf_model, perturbed, prompt):
    """vLLM's own reload path (`direct=False`; the engine's load takes it for what its direct path does
    not cover). Order matters: each step starts from the state the previous one left."""
    assert engine.llm.collective_rpc("lh_num_fused_moe_modules") == [2]
    gen_error(engine, hf_model, prompt)  # cache the prompt's prefix under the current weights
    new = list(perturbed.state_dict().items())

    # 1) reload without the MoE repack: outputs silently wrong even for the right weights
    engine.llm.collective_rpc(
        "lh_reload_weights", args=(new,), kwargs={"repack_moe": False, "direct": False}
    )
    engine.llm.reset_prefix_cache()
    assert gen_error(engine, perturbed, prompt) > 1e-2

    # 2) reload with the repack but without resetting the prefix cache: the cached prompt
    #    still carries KV computed with the previous weights
    engine.load_weights(list(hf_model.state_dict().items()), version=1)
    gen_error(engine, hf_model, prompt)  # re-cache under hf_model's weights
    engine.llm.collective_rpc("lh_reload_weights", args=(new,), kwargs={"direct": False})
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
    return [
        (n, (t + torch.randn(t.shape, generator=g) * moved).numpy())
        for n, t in load_file(f"{path}/model.safetensors").items()
    ]


def _served(worker) -> dict:
    """What the engine computes with: the packed experts, live parameters (norms, the embedding), and a
    CPU linear layer's output on a fixed input (its packed oneDNN copy is all the engine keeps)."""
    from rollout.engines.vllm_ext import _fused_moe_modules

    model = worker.model_runner.get_model()
    out = {}
    for module, _ in _fused_moe_modules(model):
        out[f"{module.layer_name}.w13"] = module.w13_weight.detach().clone()
        out[f"{module.layer_name}.w2"] = module.w2_weight.detach().clone()
    for name, module in model.named_modules():
        w = module._parameters.get("weight")
        if w is None or name.endswith("experts"):
            continue
        if w.numel():
            out[name] = w.detach().clone()
        elif hasattr(module, "cpu_linear"):
            k = getattr(module, "input_size_per_partition", None) or module.input_size
            x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
            out[name] = module.cpu_linear(x.to(w.dtype), w, None).detach().clone()
    return out


def test_direct_loading_serves_what_vllms_own_reload_serves(engine, hf_model, tiny_policy, prompt):
    """Every tensor goes straight where the engine reads it (rollout/engines/vllm_ext.py): experts into
    the packed kernel tensors, q/k/v into the fused qkv layer packed again, norms and the embedding in
    place. What the engine then computes with, and its log-probs, equal those after vLLM's layerwise
    reload of the same weights; a version missing part of a layer fails the load, naming the layer."""
    moved = _checkpoint_tensors(tiny_policy, moved=0.02)
    n_experts = sum(".experts." in n for n, _ in moved)
    assert n_experts > 0 and any(n.endswith("q_proj.weight") for n, _ in moved)
    try:
        out = engine.llm.collective_rpc(
            "lh_reload_weights", args=(iter(moved),), kwargs={"direct": False}
        )[0]
        assert out == {"tensors": len(moved), "direct": 0, "unstaged": 0}
        engine.llm.reset_prefix_cache()
        ref_served, ref = engine.llm.collective_rpc(_served)[0], engine.score(prompt)
        # back, through the direct path
        engine.load_weights(_checkpoint_tensors(tiny_policy), version=1)
        assert gen_error(engine, hf_model, prompt) < TOL
        out = engine.llm.collective_rpc("lh_reload_weights", args=(iter(moved),))[0]
        assert out == {
            "tensors": len(moved),
            "direct": len(moved),
            "unstaged": 0,
        }  # separate arrays: staged
        engine.llm.reset_prefix_cache()
        served, got = engine.llm.collective_rpc(_served)[0], engine.score(prompt)
        assert served.keys() == ref_served.keys() and any("qkv_proj" in k for k in served)
        assert [k for k in served if not torch.equal(served[k], ref_served[k])] == []
        assert got == ref and max(abs(a - b) for a, b in zip(got, engine.score(prompt))) == 0.0
        partial = [(n, a) for n, a in moved if not n.endswith("experts.1.up_proj.weight")]
        with pytest.raises(
            Exception, match=r"layers\.\d+\.mlp\.experts received \d+ of its \d+ expert tensors"
        ):
            engine.llm.collective_rpc("lh_reload_weights", args=(iter(partial),))
        partial = [(n, a) for n, a in moved if not n.endswith("layers.0.self_attn.k_proj.weight")]
        with pytest.raises(
            Exception,
            match=r"layers\.0\.self_attn\.qkv_proj received 2 of its 3 checkpoint tensors",
        ):
            engine.llm.collective_rpc("lh_reload_weights", args=(iter(partial),))
        wrong = [
            (n, a[:-1] if n.endswith("layers.1.self_attn.v_proj.weight") else a) for n, a in moved
        ]
        with pytest.raises(
            Exception, match=r"layers\.1\.self_attn\.qkv_proj\.weight shard 2: got shape"
        ):
            engine.llm.collective_rpc("lh_reload_weights", args=(iter(wrong),))
    finally:  # back to the checkpoint's weights for the other tests of this session
        engine.load_weights(_checkpoint_tensors(tiny_policy), version=0)
    assert gen_error(engine, hf_model, prompt) < TOL


def _fused_slices(named: list) -> list:
    """`named` (checkpoint names, one array per expert) with each layer's experts turned into slices
    of two blocks in the kernel's layout, as a shared-memory sync sends them (the learner's fused
    gate_up_proj E × 2I × H and down_proj E × H × I); everything else as it is, in the same order."""
    import re

    tensors = {n: torch.from_numpy(a) for n, a in named}
    experts: dict = {}
    for n in tensors:
        m = re.match(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", n)
        if m:
            experts.setdefault(m[1], set()).add(int(m[2]))
    blocks = {}
    for prefix, ids in experts.items():
        e = range(len(ids))
        blocks[prefix] = (
            torch.stack(
                [
                    torch.cat(
                        [
                            tensors[f"{prefix}.{i}.gate_proj.weight"],
                            tensors[f"{prefix}.{i}.up_proj.weight"],
                        ]
                    )
                    for i in e
                ]
            ),
            torch.stack([tensors[f"{prefix}.{i}.down_proj.weight"] for i in e]),
        )
    out = []
    for n, t in tensors.items():
        m = re.match(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", n)
        if m:
            (gate_up, down), i = blocks[m[1]], int(m[2])
            inter = down.shape[-1]
            t = {"gate": gate_up[i, :inter], "up": gate_up[i, inter:], "down": down[i]}[m[3]]
        out.append((n, t))
    return out


def test_experts_sent_as_slices_of_the_kernels_layout_are_packed_without_staging(
    engine, hf_model, tiny_policy, prompt
):
    """A shared-memory sync sends the experts as slices of the learner's fused blocks, which are in
    the CPU kernel's layout: the engine packs each layer straight from them (no staging copy) and then
    serves exactly what the same weights sent as separate arrays (staged) give. A block whose slices
    are out of place (one expert's up taken from another row) is staged and still loads the same."""
    moved = _checkpoint_tensors(tiny_policy, moved=0.02, seed=3)
    layers = len({n.split(".experts.")[0] for n, _ in moved if ".experts." in n})
    try:
        out = engine.llm.collective_rpc("lh_reload_weights", args=(iter(moved),))[0]
        assert out["unstaged"] == 0
        engine.llm.reset_prefix_cache()
        ref_served, ref = engine.llm.collective_rpc(_served)[0], engine.score(prompt)
        engine.load_weights(_checkpoint_tensors(tiny_policy), version=1)
        sliced = _fused_slices(moved)
        out = engine.llm.collective_rpc("lh_reload_weights", args=(iter(sliced),))[0]
        assert out == {"tensors": len(moved), "direct": len(moved), "unstaged": layers}
        engine.llm.reset_prefix_cache()
        served = engine.llm.collective_rpc(_served)[0]
        assert [k for k in served if not torch.equal(served[k], ref_served[k])] == []
        assert engine.score(prompt) == ref
        # one tensor out of place: that layer is staged (its held slices copied), the others are not
        odd = next(n for n, _ in sliced if n.endswith("experts.1.up_proj.weight"))
        swapped = [(n, t.clone() if n == odd else t) for n, t in sliced]
        engine.load_weights(_checkpoint_tensors(tiny_policy), version=2)
        out = engine.llm.collective_rpc("lh_reload_weights", args=(iter(swapped),))[0]
        assert out["unstaged"] == layers - 1
        served = engine.llm.collective_rpc(_served)[0]
        assert [k for k in served if not torch.equal(served[k], ref_served[k])] == []
    finally:
        engine.load_weights(_checkpoint_tensors(tiny_policy), version=0)
    assert gen_error(engine, hf_model, prompt) < TOL


def test_a_module_loads_by_one_path_only():
    """A module's tensors go all straight in place or all to vLLM's reload: vLLM's layerwise reload
    materialises a layer in fresh memory and copies all of it back, so a layer it loads only partly
    would overwrite the directly loaded part with uninitialised memory."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    from rollout.engines.vllm_ext import _DirectLoader

    model = torch.nn.Module()
    model.norm = torch.nn.LayerNorm(4)
    model.odd = torch.nn.LayerNorm(4)
    model.odd.bias.weight_loader = lambda param, w: param.data.copy_(-w)  # a loader that transforms
    model.odd.weight.weight_loader = default_weight_loader
    loader = _DirectLoader(model)
    loader.begin()
    w, b = torch.arange(4.0), torch.ones(4)
    assert loader.take("norm.weight", w) and loader.take("norm.bias", b)
    assert torch.equal(model.norm.weight.data, w) and torch.equal(model.norm.bias.data, b)
    # both to vLLM's reload
    assert not loader.take("odd.weight", w) and not loader.take("odd.bias", b)
    assert not loader.take("missing.weight", w)
    with pytest.raises(ValueError, match=r"norm\.weight: got shape \(3,\), the engine's is \(4,\)"):
        loader.take("norm.weight", torch.zeros(3))
