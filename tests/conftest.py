"""Shared fixtures: one tiny policy, one local Ray, one in-process vLLM engine and one 2-iteration
training run per test session (starting these is what costs time)."""

from __future__ import annotations

import os
from contextlib import contextmanager

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local test cluster; no token written to ~/.ray

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory) -> str:
    from rl.start.tiny import make_tiny_qwen3_moe

    return str(make_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny-policy"), seed=0))


@pytest.fixture(scope="session")
def thinking_policy(tiny_policy, tmp_path_factory) -> str:
    """The tiny policy with a template that rewrites history, as DeepSeek-R1's and Qwen3's thinking
    templates do: the generation prompt opens a `<think>` block, and earlier assistant messages are
    rendered without it (only what follows a `</think>`). Weights linked, not copied."""
    out = tmp_path_factory.mktemp("thinking-policy")
    for f in Path(tiny_policy).iterdir():
        (out / f.name).symlink_to(f)
    template = (Path(tiny_policy) / "chat_template.jinja").read_text()
    rewrites = {
        "'<|im_start|>assistant\\n' + (message.content or '')": "'<|im_start|>assistant\\n' + (message.content or '').split('</think>')[-1].lstrip('\\n')",
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}": "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}",
    }
    for old, new in rewrites.items():
        assert old in template, old
        template = template.replace(old, new)
    (out / "chat_template.jinja").unlink()
    (out / "chat_template.jinja").write_text(template)
    return str(out)


@pytest.fixture(scope="session")
def tokenizer(tiny_policy):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_policy)


@pytest.fixture(scope="session")
def policy_dir(tmp_path_factory) -> str:
    """A debug-flavour `policy/` checkpoint with every part on (KDA, gated MLA with RoPE so positions
    matter, LatentMoE with group-limited routing, SiTU-GLU, AttnRes, the vision token), random fp32
    weights and a non-zero selection bias, for the engine tests (native and the vLLM plugin)."""
    import dataclasses

    import torch

    from policy.args import load_model_args
    from policy.checkpoint import load_policy, save_policy
    from rl.start.tiny import make_tiny_policy

    args = load_model_args("configs/policy/debug.yaml")
    args = dataclasses.replace(args, mla=dataclasses.replace(args.mla, rope=True))
    path = make_tiny_policy(tmp_path_factory.mktemp("engine-policy"), args, seed=0)
    model = load_policy(path)
    with torch.no_grad():  # a trained router has moved its selection bias away from zero
        for r in model.routers():
            r.bias.normal_(0.0, 0.1)
    save_policy(model, path)
    return str(path)


@pytest.fixture(scope="session")
def hf_model(tiny_policy):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def engine(tiny_policy):
    """One in-process vLLM engine for the session (vLLM allows one per process)."""
    from rollout.engines.vllm_engine import VLLMEngine

    return VLLMEngine(tiny_policy, kv_cache_gib=1, max_model_len=4096)


@pytest.fixture
def shared(engine):
    """The session's engine, driven by a SharedEngine's thread for the test (vLLM allows one engine
    per process), as a rollout worker drives its own: continuous batching; handed back afterwards."""
    from rollout.engines.shared import SharedEngine

    s = SharedEngine(lambda: engine)
    yield s
    s.close()


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from rl.config import RayConfig
    from rl.ray_utils import init_ray

    started = init_ray(RayConfig(num_cpus=2, object_store_mb=256))
    yield ray
    if started:
        ray.shutdown()


@contextmanager
def started_trainer(config: str, overrides: list[str], run_dir):
    """A Trainer for `configs/CONFIG` with `overrides`, started on the session's Ray; its actors are
    killed on the way out. Runs beside the session's e2e run, whose actors stay up: the overrides
    should keep `rollout.cpus_per_worker` small."""
    from rl.config import load_config
    from rl.loop.trainer import Trainer

    trainer = Trainer(load_config(REPO / "configs" / config, overrides), run_dir)
    try:
        trainer.start()
        yield trainer
    finally:
        trainer.close()


@pytest.fixture(scope="session")
def e2e_run(ray_cluster, tiny_policy, tmp_path_factory):
    """Two iterations of the quickstart config on the session's Ray, actors kept alive for probing.

    `algo.entropy_coef` makes every update change the weights even when a random policy earns no
    reward (all-zero GRPO advantages give zero gradients): a sync that changes nothing could not
    reveal a stale prefix cache. `env.workers=1` puts the environments in an EnvWorker actor (the
    in-process path is what the agent-loop tests run). Small sync buckets make every weight sync
    arrive in several parts, so the after-sync checks cover bucketed loading.
    """
    from rl.config import load_config
    from rl.loop.trainer import Trainer

    cfg = load_config(
        REPO / "configs" / "quickstart.yaml",
        [
            "iterations=2",
            f"policy.path={tiny_policy}",
            "algo.entropy_coef=0.01",
            "env.workers=1",
            "sync.bucket_mb=0.25",
            "eval.every=1",
            "eval.episodes=6",
            "eval.k=2",
        ],
    )
    run_dir = tmp_path_factory.mktemp("e2e-run")
    trainer = Trainer(cfg, run_dir)
    trainer.start()
    rows = trainer.run()
    yield trainer, rows, run_dir
    trainer.close()


@pytest.fixture(scope="session")
def docker_host(tmp_path_factory):
    """A Docker engine for the docker sandbox tests: the one DOCKER_HOST (or the default socket)
    reaches, else a private `dockerd` this fixture starts (root, Debian's docker.io: `make
    system-deps` installs it) on its own socket with no bridge and no iptables changes, stopped by
    PID at the end. Where neither is possible the tests skip saying why; under CI they fail."""
    from envs.sandbox.docker_engine import (
        private_dockerd,
        private_dockerd_unavailable,
        unavailable_reason,
    )

    if unavailable_reason() is None:
        yield os.environ.get("DOCKER_HOST")
        return
    reason = private_dockerd_unavailable()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the docker sandbox tests: {reason}")
        pytest.skip(reason)
    with private_dockerd() as sock:  # a dockerd that does not come up raises, with its log
        yield sock


@pytest.fixture(scope="session")
def gvisor_host(docker_host):
    """The docker engine above, when it has gVisor's `runsc` runtime (skip, or fail under CI, if not)."""
    import docker

    client = docker.DockerClient(base_url=docker_host) if docker_host else docker.from_env()
    runtimes = client.info().get("Runtimes", {})
    client.close()
    if "runsc" not in runtimes:
        reason = "the Docker engine has no runsc runtime (apt-get install runsc; a test-started dockerd adds it)"
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the gVisor sandbox tests: {reason}")
        pytest.skip(reason)
    return docker_host


def chromium_flags() -> list[str]:
    """Headless Debian chromium with no network chatter (skip the test where it is not installed)."""
    import shutil
    import tempfile

    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip(
            "chromium is not installed (make test installs Debian's chromium when run as root)"
        )
    return [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tempfile.mkdtemp()}",
        "--window-size=1400,1000",
        "--virtual-time-budget=5000",
    ]


def chromium_dom(page: Path) -> str:
    import subprocess

    return subprocess.run(
        chromium_flags() + ["--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
