"""The device-agnostic learner, on what this machine has (a CPU): device selection, the backend it
implies, bf16 mixed precision with fp32 master weights, and the config's checks. The same code on a
GPU is exercised by bench/gpu_learner_check.py when a GPU machine is lent."""

from __future__ import annotations

import pytest
import torch

from conftest import REPO
from rl.config import AlgoConfig, ConfigError, LearnerConfig, load_config
from rl.learner import device as devices
from rl.learner.learner import Learner
from rollout.trajectory import Trajectory


def _batch(n_eps: int = 4, length: int = 48, seed: int = 0) -> list[Trajectory]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_eps):
        ids = torch.randint(2, 400, (length,), generator=g).tolist()
        p = length // 3
        out.append(
            Trajectory(
                episode_id=f"e{i}",
                iteration=0,
                group_id=i // 2,
                env_id="x",
                seed=0,
                prompt_len=p,
                token_ids=ids,
                loss_mask=[0] * p + [1] * (length - p),
                rollout_logprobs=[0.0] * p + [-6.0] * (length - p),
                reward=float(i % 2),
            )
        )
    return out


def test_device_selection_and_the_backend_it_implies():
    assert devices.resolve("cpu") == torch.device("cpu")
    assert devices.resolve("auto") == (
        torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    )
    assert devices.backend("auto", torch.device("cpu")) == "gloo"
    assert devices.backend("auto", torch.device("cuda", 0)) == "nccl"
    with pytest.raises(ValueError, match="nccl needs the learner on GPUs"):
        devices.backend("nccl", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(
            RuntimeError, match="learner.device is cuda, but this learner process sees no GPU"
        ):
            devices.resolve("cuda")
    with pytest.raises(ValueError, match="learner.precision must be fp32 or bf16"):
        devices.autocast(torch.device("cpu"), "fp16")


def test_bf16_mixed_precision_keeps_fp32_master_weights(tiny_policy):
    """bf16 runs the matmuls in bf16 (seen by a hook) but the weights, their gradients and AdamW's
    state stay fp32, and the step is the fp32 step up to bf16's rounding."""
    batch = _batch()
    steps, seen = {}, []
    for precision in ("fp32", "bf16"):
        torch.manual_seed(0)
        learner = Learner(
            tiny_policy,
            AlgoConfig(minibatch_episodes=4),
            LearnerConfig(threads=1, precision=precision),
        )
        before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
        linear = next(m for m in learner.model.modules() if isinstance(m, torch.nn.Linear))
        hook = linear.register_forward_hook(
            lambda m, i, o, precision=precision: seen.append((precision, o.dtype))
        )
        steps[precision] = learner.train_step(batch)
        hook.remove()
        assert all(p.dtype == torch.float32 for p in learner.model.parameters())
        assert all(s["exp_avg"].dtype == torch.float32 for s in learner.opt.state.values())
        moved = sum(
            float((p.detach() - before[n]).abs().max()) > 0
            for n, p in learner.model.named_parameters()
        )
        assert moved > 0
    assert ("fp32", torch.float32) in seen and ("bf16", torch.bfloat16) in seen
    a, b = steps["fp32"], steps["bf16"]
    assert b["loss"] == pytest.approx(a["loss"], rel=0.05, abs=0.02)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=0.1)
    # the rounding shows where it should: the learner's log-probs against the engine's
    assert b["rollout_logprob_diff_max"] != a["rollout_logprob_diff_max"]


def test_the_config_checks_device_and_backend(tmp_path):
    q = REPO / "configs" / "quickstart.yaml"
    with pytest.raises(ConfigError, match="learner.backend.*nccl needs the learner on GPUs"):
        load_config(q, ["learner.backend=nccl"])
    cfg = load_config(q, ["learner.device=cuda", "learner.backend=nccl", "learner.precision=bf16"])
    assert (cfg.learner.device, cfg.learner.backend, cfg.learner.precision) == (
        "cuda",
        "nccl",
        "bf16",
    )
    # a local run on this machine: its GPUs are counted before anything starts
    problem = cfg.local_problem()
    assert (problem is None) == (torch.cuda.device_count() >= 1)
    if problem:
        assert "learner.device cuda needs 1 GPU(s)" in problem
    with pytest.raises(ConfigError, match="learner.precision"):
        load_config(q, ["learner.precision=fp16"])


def test_the_learner_module_imports_no_ray():
    """The plain class runs where Ray is not installed (the GPU check's machine); its Ray shell
    lives in rl/learner/learner_group.py."""
    import subprocess
    import sys

    code = (
        "import sys; import rl.learner.learner; "
        "assert 'ray' not in sys.modules, [m for m in sys.modules if m.startswith('ray')][:5]"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_fused_adamw_step_equals_the_per_tensor_one(tiny_policy):
    """A single-process learner updates with fused AdamW (one kernel per tensor, no temporaries);
    its step is the per-tensor reference AdamW's on the same gradients, to rounding."""
    learner = Learner(
        tiny_policy,
        AlgoConfig(minibatch_episodes=4, lr=1e-3, weight_decay=0.1),
        LearnerConfig(threads=1),
    )
    assert all(g.get("fused") for g in learner.opt.param_groups)
    params = [p for g in learner.opt.param_groups for p in g["params"]]
    ref = [p.detach().clone().requires_grad_() for p in params]
    start = [p.detach().clone() for p in params]
    groups = [{"params": ref[: len(learner.opt.param_groups[0]["params"])]}]
    if len(learner.opt.param_groups) > 1:
        groups.append({"params": ref[len(groups[0]["params"]) :], "weight_decay": 0.0})
    ref_opt = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.1, foreach=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p, r in zip(params, ref):
            p.grad = torch.randn(p.shape, generator=g)
            r.grad = p.grad.clone()
        learner.opt.step()
        ref_opt.step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)
    # every tensor moved
    assert all(float((p.detach() - p0).abs().max()) > 1e-4 for p, p0 in zip(params, start))
