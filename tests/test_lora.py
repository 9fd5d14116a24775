"""LoRA RL (rl/learner/lora.py, rollout/weights.py): adapters on attention and on every routed expert, trained
alone, synced as factors and merged into the base weights on the rollout side.

Each optimised path is checked against the naive one: the cut factors against converting the full
update to checkpoint format, the worker's merge against the learner's merged state dict, the
engine's log-probs after an adapter sync against the learner's own."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from test_learner_device import _batch

from rl.config import AlgoConfig, LearnerConfig, LoraConfig
from rl.learner.learner import Learner
from rl.learner.lora import EngineFactors, adapter_state, merged_state
from rollout.weights import CheckpointTensors, merge_adapters

LORA = LoraConfig(enabled=True, rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def tiny_mixtral(tiny_policy, tokenizer, tmp_path_factory) -> str:
    """A random dense Llama upcycled into a 4-expert top-2 Mixtral: the real policy's layout (experts
    stored per tensor as w1/w2/w3 on disk, fused gate_up in memory), at toy size."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rl.start.pretrained import upcycle

    root = tmp_path_factory.mktemp("tiny-mixtral")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    LlamaForCausalLM(cfg).save_pretrained(root / "dense")
    tokenizer.save_pretrained(root / "dense")
    return str(upcycle(root / "dense", root / "moe", experts=4, top_k=2).path)


def _nudge(model: torch.nn.Module, seed: int = 0) -> None:
    """Move every adapter away from its start (B = 0 makes the update zero), as training would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _learner(path: str, **kw) -> Learner:
    torch.manual_seed(0)
    return Learner(
        path, AlgoConfig(minibatch_episodes=4, **kw), LearnerConfig(threads=1), lora=LORA
    )


def test_only_the_adapters_train_and_start_at_the_base(tiny_policy, hf_model):
    learner = _learner(tiny_policy)
    names = [n for n, p in learner.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert any(".self_attn.q_proj.lora_A" in n for n in names) and any(
        ".mlp.experts." in n for n in names
    )
    ids = torch.randint(2, 400, (1, 24))
    with torch.no_grad():  # B starts at zero: the adapted model is the base model
        assert torch.allclose(learner.model(ids).logits, hf_model(ids).logits, atol=1e-5)
    base = {
        n: p.detach().clone() for n, p in learner.model.named_parameters() if not p.requires_grad
    }
    out = learner.train_step(_batch())
    assert out["trainable_params"] == sum(
        p.numel() for p in learner.model.parameters() if p.requires_grad
    )
    assert out["trainable_params"] < 0.2 * sum(p.numel() for p in learner.model.parameters())
    assert all(torch.equal(p, base[n]) for n, p in learner.model.named_parameters() if n in base)
    assert {id(p) for p in learner.opt.state} <= {
        id(p) for p in learner.model.parameters() if p.requires_grad
    }
    assert any(
        float(learner.model.get_parameter(n).detach().abs().max()) > 0
        for n in names
        if "lora_B" in n
    )


def test_merged_state_computes_what_the_adapted_model_computes(tiny_policy, hf_model):
    learner = _learner(tiny_policy)
    _nudge(learner.model)
    merged = copy.deepcopy(hf_model)
    merged.load_state_dict(merged_state(learner.model), strict=True)
    ids = torch.randint(2, 400, (2, 20))
    with torch.no_grad():
        want = learner.model(ids).logits
        # the nudge changed the model
        assert not torch.allclose(want, hf_model(ids).logits, atol=1e-3)
        assert torch.allclose(merged(ids).logits, want, atol=1e-4)


@pytest.mark.parametrize("which", ["qwen3", "mixtral"])
def test_engine_factors_merge_into_the_checkpoint_tensors(which, tiny_policy, tiny_mixtral):
    """The worker's merge of the cut factors onto the checkpoint file = the learner's merged state in
    checkpoint format (the naive path: convert every full tensor), for both fused-expert layouts."""
    path = tiny_mixtral if which == "mixtral" else tiny_policy
    learner = _learner(path)
    _nudge(learner.model, seed=1)
    pairs = list(learner.engine_factors())
    got = dict(merge_adapters(CheckpointTensors(path), pairs))
    want = dict(learner.weights())
    expert_names = [n for n in got if ".experts." in n]
    assert expert_names and any("q_proj" in n for n in got)
    if which == "mixtral":
        assert any(n.endswith("experts.3.w3.weight") for n in got)
    for name, t in got.items():
        assert torch.allclose(t, torch.from_numpy(want[name]), atol=1e-5), name
    base = CheckpointTensors(path)
    untouched = [n for n in want if n not in got]
    assert untouched and all(torch.equal(base[n], torch.from_numpy(want[n])) for n in untouched)
    full = sum(a.nbytes for a in want.values())
    assert sum(a.nbytes for _, a in pairs) < 0.25 * full


def test_a_conversion_that_mixes_experts_is_refused(tiny_policy):
    learner = _learner(tiny_policy)

    class Mixing:  # a checkpoint format that interleaves two experts' rows in one tensor
        def checkpoint_names(self, named):
            for name, t in named:
                if t.dim() == 3:
                    yield name, t.transpose(0, 1).reshape(-1, *t.shape[2:])
                else:
                    yield name, t

    with pytest.raises(ValueError, match="mixes experts"):
        EngineFactors(Mixing(), learner.model)


def test_an_adapter_manifest_with_a_missing_half_is_refused(tiny_policy):
    learner = _learner(tiny_policy)
    pairs = list(learner.engine_factors())
    base = CheckpointTensors(tiny_policy)
    with pytest.raises(ValueError, match="came without its lora_A"):
        list(merge_adapters(base, pairs[:1]))
    with pytest.raises(ValueError, match="unexpected tensor"):
        list(merge_adapters(base, pairs[1:2]))


def test_checkpoints_keep_the_merged_model_and_resume_the_adapters(tiny_policy, hf_model, tmp_path):
    """A checkpoint is a whole model (engines and eval load it alone) plus the adapters and their
    optimiser state; resuming puts the adapters back on the base, not on the merged weights."""
    from transformers import AutoModelForCausalLM

    learner = _learner(tiny_policy)
    learner.train_step(_batch())
    _nudge(learner.model, seed=2)
    path = learner.save_checkpoint(str(tmp_path / "version-1"))
    ids = torch.randint(2, 400, (1, 16))
    with torch.no_grad():
        want = learner.model(ids).logits
        alone = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        assert torch.allclose(alone(ids).logits, want, atol=1e-4)
    resumed = _learner(tiny_policy)
    resumed.load_checkpoint(path)
    assert resumed.version == learner.version
    with torch.no_grad():
        assert torch.allclose(resumed.model(ids).logits, want, atol=1e-5)
    saved = adapter_state(learner.model)
    assert all(torch.equal(v, adapter_state(resumed.model)[k]) for k, v in saved.items())
    assert len(resumed.opt.state) == len(learner.opt.state) > 0
    other = Learner(
        tiny_policy, AlgoConfig(), LearnerConfig(threads=1), lora=LoraConfig(enabled=True, rank=2)
    )
    with pytest.raises(ValueError, match="lora.rank or lora.targets changed"):
        other.load_checkpoint(path)


@pytest.mark.slow
def test_an_adapter_sync_makes_the_engine_compute_the_learners_logprobs(
    engine, hf_model, tiny_policy, ray_cluster
):
    """Through the real wire format (Ray's object store) and the real vLLM engine: after loading the
    adapter manifest the engine scores tokens as the adapted learner does; before, as the base."""
    from rollout.weights import iter_weights

    learner = _learner(tiny_policy)
    _nudge(learner.model, seed=3)
    learner.version = 5
    manifest = learner.publish(bucket_mb=0.05)
    assert manifest.adapter and len(manifest.buckets) > 1
    ids = torch.randint(2, 400, (40,)).tolist()
    want = torch.tensor(learner.logprobs(ids))
    try:
        engine.load_weights(
            merge_adapters(CheckpointTensors(tiny_policy), iter_weights(manifest)), manifest.version
        )
        assert engine.version == 5
        assert (torch.tensor(engine.score(ids)) - want).abs().max() < 1e-3
    finally:  # back to the checkpoint's weights for the other tests of this session
        engine.load_weights(list(hf_model.state_dict().items()), version=0)
    base = torch.tensor(engine.score(ids))
    assert (base - want).abs().max() > 1e-2


def test_lora_settings_are_validated():
    from conftest import REPO
    from rl.config import ConfigError, load_config

    for override, message in [
        ("lora.rank=0", "lora.rank"),
        ("lora.targets=[mlp]", "lora.targets"),
        ("lora.alpha=0", "lora.alpha"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(REPO / "configs" / "quickstart.yaml", [override])
    with pytest.raises(ConfigError, match="learner.world_size 1"):
        load_config(
            REPO / "configs" / "quickstart.yaml", ["lora.enabled=true", "learner.world_size=2"]
        )


@pytest.mark.slow
def test_the_lora_quickstart_trains_through_the_whole_loop(ray_cluster, tiny_policy, tmp_path):
    """configs/quickstart_lora.yaml on the tiny policy (the real one is bench/lora_vs_full.py's):
    every sync moves a small fraction of the model's bytes, the engine then samples with the adapted
    weights (its log-probs match the learner's as closely as at the start, and the turns record the
    version), and the checkpoint holds the adapters."""
    from conftest import started_trainer

    with started_trainer(
        "quickstart_lora.yaml",
        [
            "policy.pretrained=",
            f"policy.path={tiny_policy}",
            "warm_start.demos=0",
            "iterations=3",
            "checkpoint_every=3",
            "algo.entropy_coef=0.05",
            "algo.lr=1.0e-2",
            "stop_after_flat=0",
            "rollout.max_new_tokens=24",
            "ray.object_store_mb=256",
            "sync.bucket_mb=0.05",
            "rollout.cpus_per_worker=0.1",
        ],
        tmp_path,
    ) as trainer:
        rows = trainer.run()
    base = CheckpointTensors(tiny_policy)
    full = sum(base[n].numel() * base[n].element_size() for n in base.files)
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    assert all(0 < r["sync_bytes"] < 0.25 * full for r in rows)
    assert all(r["sync_buckets"] > 1 for r in rows)
    # iteration 0 ran on the base (version 0), the next ones on adapters the learner had moved: a
    # stale engine would show the learner's whole update as a gap
    moved = rows[-1]["rollout_logprob_diff_mean_current"]
    assert moved < 0.01, rows[-1]
    ckpt = tmp_path / "checkpoints" / "version-000003"
    assert (ckpt / "adapters" / "adapters.safetensors").exists()
    # what an engine loads (every *.safetensors beside config.json) is the model's weights and only them
    from safetensors import safe_open

    names = lambda d: {
        k for f in Path(d).glob("*.safetensors") for k in safe_open(str(f), "pt").keys()
    }  # noqa: E731
    assert names(ckpt) == names(tiny_policy)
    from rl.store import TrajectoryStore

    versions: dict[int, set] = {}
    for t in TrajectoryStore(tmp_path).trajectories():
        versions.setdefault(t.iteration, set()).update(turn.policy_version for turn in t.turns)
    assert versions[0] == {0} and versions[2] == {2}
