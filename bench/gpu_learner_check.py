"""GPU check for issue 26 (run when a GPU machine is lent; CI never runs it): the learner on CUDA.

The learner (rl/learner/learner.py, the plain class, no Ray) on the model the demo trains: SmolLM2-135M
upcycled to a Mixtral of 4 experts, top-1 (its dimensions; random weights, since the packaged
checkpoint does not travel to the GPU machine: the step's cost does not depend on the values).

1. The same GRPO step on CPU and on CUDA, fp32 (TF32 off), from the same weights on the same
   batch: loss, gradient norm and the updated weights agree (a 4-layer cut of the model, so the
   CPU side stays quick; plain SGD for this check, so the update is the gradient itself).
2. bf16 mixed precision against fp32 on CUDA: the loss and the learner/engine log-prob gap (the
   batch's "engine" log-probs are the fp32 learner's own, so the gap is bf16's rounding alone),
   and the weights, gradients and AdamW state still fp32.
3. Throughput of full-size steps (the demo's shape: 24 episodes of calculator length, one
   optimiser step) in fp32 and bf16: generated tokens/s, peak memory, and the model FLOP
   utilisation against a bf16 matrix product measured in the same run (the physical limit).
The NCCL path of a learner group (FSDP2 and expert parallelism over NCCL) is bench/gpu_parallel_check.py's
(one GPU: a one-rank group at the model level; a learner group of several ranks needs several GPUs).

    python bench/gpu_learner_check.py            # prints JSON lines, then a Markdown table; exit 1 if a check fails
    python bench/gpu_learner_check.py --cpu      # checks 2 and 3 on the CPU (a dry run of the script)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

SMOLLM2_MOE = dict(  # ~/.cache/longhorizon/v1/upcycled/smollm2-135m-instruct-e4-k1-s0/config.json
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
    tie_word_embeddings=True,
    num_local_experts=4,
    num_experts_per_tok=1,
    output_router_logits=False,
    router_jitter_noise=0.0,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def make_model(layers: int | None = None) -> str:
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()

    torch.manual_seed(0)
    cfg = MixtralConfig(**{**SMOLLM2_MOE, **({"num_hidden_layers": layers} if layers else {})})
    model = MixtralForCausalLM(cfg).float()
    out = tempfile.mkdtemp(prefix="lh-gpu-model-")
    model.save_pretrained(out)
    return out


def batch(episodes: int, length: int, vocab: int, seed: int = 0, logprobs: float = -10.8):
    from rollout.trajectory import Trajectory

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(episodes):
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        p = int(length * 0.6)  # a calculator episode: prompt and observations ~60%, generated ~40%
        out.append(
            Trajectory(
                episode_id=f"e{i}",
                iteration=0,
                group_id=i // 8,
                env_id="bench",
                seed=0,
                prompt_len=p,
                token_ids=ids,
                loss_mask=[0] * p + [1] * (length - p),
                rollout_logprobs=[0.0] * p + [logprobs] * (length - p),
                reward=float(i % 3 == 0),
            )
        )
    return out


def algo(**kw):
    from rl.config import AlgoConfig

    return AlgoConfig(**{**dict(lr=1e-5, minibatch_episodes=24), **kw})


def system(precision: str = "fp32"):
    from rl.config import LearnerConfig

    return LearnerConfig(microbatch_tokens=4096, threads=os.cpu_count() or 1, precision=precision)


def learner(path, device, precision="fp32", **kw):
    from rl.learner.learner import Learner

    torch.manual_seed(0)
    return Learner(path, algo(**kw), system(precision), device=device)


def params(lrn) -> dict:
    # a copy, not a view
    return {n: p.detach().float().cpu().clone() for n, p in lrn.model.named_parameters()}


def check_equal_step(device: str) -> dict:
    """1: CPU fp32 against `device` fp32, one step on a 4-layer cut."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    path = make_model(layers=4)
    b = batch(8, 256, SMOLLM2_MOE["vocab_size"])
    cpu, dev = (
        learner(path, "cpu", minibatch_episodes=8),
        learner(path, device, minibatch_episodes=8),
    )
    for lrn in (
        cpu,
        dev,
    ):  # plain SGD, lr 1: the step is the gradient (Adam's first step is sign-like,
        # which blows near-zero gradients' noise up)
        lrn.opt = torch.optim.SGD(lrn.model.parameters(), lr=1.0)
    before = params(cpu)
    a, g = cpu.train_step(b), dev.train_step(b)
    pa, pg = params(cpu), params(dev)
    moved = max(float((pa[n] - before[n]).abs().max()) for n in pa)
    diff = max(float((pa[n] - pg[n]).abs().max()) for n in pa)
    ok = (
        abs(a["loss"] - g["loss"]) <= 1e-4 * max(1.0, abs(a["loss"]))
        and abs(a["grad_norm"] - g["grad_norm"]) <= 1e-3 * a["grad_norm"]
        and 0 < moved
        and diff <= 0.05 * moved
    )
    return {
        "check": "cpu_vs_device_fp32",
        "ok": ok,
        "loss_cpu": a["loss"],
        "loss_device": g["loss"],
        "grad_norm_cpu": a["grad_norm"],
        "grad_norm_device": g["grad_norm"],
        "max_weight_change": moved,
        "max_weight_diff": diff,
    }


def engine_logprobs(lrn, b):
    """The fp32 learner's own log-probs as the batch's rollout log-probs (an exact engine)."""
    for t in b:
        lp = lrn.logprobs(t.token_ids)
        t.rollout_logprobs = [0.0] + [x if m else 0.0 for x, m in zip(lp, t.loss_mask[1:])]
    return b


def check_bf16(device: str) -> dict:
    """2: bf16 against fp32 on `device`, the batch scored by the fp32 weights."""
    path = make_model(layers=8)
    b = engine_logprobs(
        learner(path, device, minibatch_episodes=8), batch(8, 256, SMOLLM2_MOE["vocab_size"])
    )
    f32, b16 = (
        learner(path, device, minibatch_episodes=8),
        learner(path, device, "bf16", minibatch_episodes=8),
    )
    a, h = f32.train_step(b), b16.train_step(b)
    master = all(p.dtype == torch.float32 for p in b16.model.parameters()) and all(
        s["exp_avg"].dtype == torch.float32 for s in b16.opt.state.values()
    )
    ok = (
        master
        and abs(a["loss"] - h["loss"]) <= 0.05 * max(abs(a["loss"]), 0.1)
        and a["rollout_logprob_diff_max"] < 1e-3
    )
    return {
        "check": "bf16_vs_fp32",
        "ok": ok,
        "loss_fp32": a["loss"],
        "loss_bf16": h["loss"],
        "logprob_gap_mean_fp32": a["rollout_logprob_diff_mean"],
        "logprob_gap_mean_bf16": h["rollout_logprob_diff_mean"],
        "logprob_gap_max_bf16": h["rollout_logprob_diff_max"],
        "fp32_master_weights": master,
    }


def matmul_peak(device: str) -> float:
    """bf16 TFLOP/s of an 8192³ matrix product here: the same run's physical limit."""
    if device == "cpu":
        n, dtype = 1024, torch.float32
    else:
        n, dtype = 8192, torch.bfloat16
    x = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        x @ x
    sync(device)
    t0, reps = time.perf_counter(), 10
    for _ in range(reps):
        x @ x
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12


def sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def timed_steps(lrn, b, steps: int, device: str) -> tuple[float, dict]:
    """Seconds per `train_step` on `b` after a warm-up step (allocator, kernels), with the peak
    memory counter reset after the warm-up; and the last step's stats."""
    lrn.train_step(b)
    if device != "cpu":
        torch.cuda.reset_peak_memory_stats()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        stats = lrn.train_step(b)
    sync(device)
    return (time.perf_counter() - t0) / steps, stats


def throughput(
    device: str, precision: str, episodes: int, length: int, steps: int, path: str
) -> dict:
    """3: full-size steps: generated tokens/s and peak memory."""
    lrn = learner(path, device, precision, minibatch_episodes=episodes)
    b = batch(episodes, length, SMOLLM2_MOE["vocab_size"])
    gen = sum(t.num_generated for t in b)
    dt, stats = timed_steps(lrn, b, steps, device)
    total = sum(p.numel() for p in lrn.model.parameters())
    experts = sum(p.numel() for n, p in lrn.model.named_parameters() if ".experts." in n)
    e = SMOLLM2_MOE["num_local_experts"]
    active = total - experts + experts // e * SMOLLM2_MOE["num_experts_per_tok"]
    tokens = episodes * length
    # forward + backward ≈ 6 × active parameters per token (the LM head only at generated positions
    # is not subtracted: an upper bound on the FLOPs, so the utilisation is not flattered)
    return {
        "check": f"throughput_{precision}",
        "ok": stats["loss"] == stats["loss"],
        "step_s": dt,
        "generated_tok_per_s": gen / dt,
        "all_tok_per_s": tokens / dt,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device != "cpu" else None,
        "tflops": 6 * active * tokens / dt / 1e12,
        "active_params": active,
        "total_params": total,
    }


def command_line(doc: str):
    """The learner GPU checks' arguments and device (cuda, or cpu for `--cpu`); None (after one
    line on stderr) when there is no GPU and no `--cpu`."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="a dry run on the CPU (small sizes)")
    ap.add_argument("--episodes", type=int, default=24)
    ap.add_argument(
        "--length", type=int, default=400, help="tokens per episode (the demo's calculator: ~400)"
    )
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    device = "cpu" if a.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("error: no GPU here (use --cpu for a dry run)", file=sys.stderr)
        return None
    return a, device


def main() -> int:
    parsed = command_line(__doc__)
    if parsed is None:
        return 2
    a, device = parsed
    rows = []
    if device == "cuda":
        rows.append(check_equal_step(device))
        print(json.dumps(rows[-1]), flush=True)
    rows.append(check_bf16(device))
    print(json.dumps(rows[-1]), flush=True)
    peak = matmul_peak(device)
    full = make_model(layers=None if device == "cuda" else 2)
    episodes, length = (a.episodes, a.length) if device == "cuda" else (4, 64)
    for precision in ("fp32", "bf16"):
        rows.append(
            throughput(device, precision, episodes, length, a.steps, full)
            | {"matmul_peak_tflops": peak}
        )
        print(json.dumps(rows[-1]), flush=True)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(
        f"\n# learner on {name}, torch {torch.__version__}; SmolLM2-135M upcycled to 4 experts top-1 "
        f"(random weights), {episodes} episodes × {length} tokens (~40% generated), one optimiser step"
    )
    print(
        "\n| precision | step s | generated tok/s | all tok/s | peak GiB | model TFLOP/s | "
        "bf16 matmul TFLOP/s (same run) | utilisation |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        if r["check"].startswith("throughput_"):
            print(
                f"| {r['check'].removeprefix('throughput_')} | {r['step_s']:.3f} | {r['generated_tok_per_s']:,.0f} | "
                f"{r['all_tok_per_s']:,.0f} | {r['peak_gib'] or 0:.1f} | {r['tflops']:.1f} | "
                f"{r['matmul_peak_tflops']:.0f} | {r['tflops'] / r['matmul_peak_tflops']:.1%} |"
            )
    print("\n| check | result | numbers |\n| --- | --- | --- |")
    for r in rows:
        if not r["check"].startswith("throughput_"):
            nums = ", ".join(
                f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}"
                for k, v in r.items()
                if k not in ("check", "ok")
            )
            print(f"| {r['check']} | {'ok' if r['ok'] else 'FAILED'} | {nums} |")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
