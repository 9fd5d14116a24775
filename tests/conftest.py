"""Shared fixtures: one tiny policy, one local Ray, one in-process vLLM engine and one 2-iteration
training run per test session (starting these is what costs time)."""

from __future__ import annotations

import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local test cluster; no token written to ~/.ray

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory) -> str:
    from policy.tiny_hf import make_tiny_qwen3_moe

    return str(make_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny-policy"), seed=0))


@pytest.fixture(scope="session")
def tokenizer(tiny_policy):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_policy)


@pytest.fixture(scope="session")
def hf_model(tiny_policy):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def engine(tiny_policy):
    """One in-process vLLM engine for the session (vLLM allows one per process)."""
    from rollout.vllm_engine import VLLMEngine

    return VLLMEngine(tiny_policy, kv_cache_gib=1, max_model_len=4096)


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from rl.config import RayConfig
    from rl.ray_utils import init_ray

    started = init_ray(RayConfig(num_cpus=2, object_store_mb=256))
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def e2e_run(ray_cluster, tiny_policy, tmp_path_factory):
    """Two iterations of the quickstart config on the session's Ray, actors kept alive for probing.

    `algo.entropy_coef` makes every update change the weights even when a random policy earns no
    reward (all-zero GRPO advantages give zero gradients): a sync that changes nothing could not
    reveal a stale prefix cache.
    """
    from rl.config import load_config
    from rl.trainer import Trainer

    cfg = load_config(
        REPO / "configs" / "quickstart.yaml",
        ["iterations=2", f"policy.path={tiny_policy}", "algo.entropy_coef=0.01"],
    )
    run_dir = tmp_path_factory.mktemp("e2e-run")
    trainer = Trainer(cfg, run_dir)
    trainer.start()
    rows = trainer.run()
    yield trainer, rows, run_dir
    trainer.close()
