"""One learner step (GRPO, 2 episodes of one group) on long trajectories with the tiny `policy/`
model: the memory-bounded settings (chunked output projection, activation checkpointing) against
the plain ones (whole-sequence logits, stored activations), each in a fresh process (peak RSS).

    .venv/bin/python bench/learner_long_trajectory.py [--lengths 8192 32768 131072]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one(length: int, bounded: bool) -> dict:
    import torch

    from policy.args import load_model_args
    from policy.checkpoint import save_policy
    from policy.model import Policy
    from rl.config import AlgoConfig, LearnerConfig
    from rl.learner.learner import Learner
    from rollout.trajectory import Trajectory

    args = load_model_args(REPO / "configs/policy/debug.yaml")
    args = dataclasses.replace(args, vision=dataclasses.replace(args.vision, enabled=False))
    torch.manual_seed(0)
    ckpt = save_policy(Policy(args), tempfile.mkdtemp())
    system = LearnerConfig(
        microbatch_tokens=length,
        threads=2,
        logprob_chunk_tokens=1024 if bounded else length,
        activation_checkpointing=bounded,
    )
    learner = Learner(str(ckpt), AlgoConfig(minibatch_episodes=2), system)
    g = torch.Generator().manual_seed(0)
    batch = []
    for i in range(2):
        ids = torch.randint(2, args.vocab_size, (length,), generator=g).tolist()
        p = length // 8
        batch.append(
            Trajectory(
                episode_id=f"e{i}",
                iteration=0,
                group_id=0,
                env_id="bench",
                seed=0,
                prompt_len=p,
                token_ids=ids,
                loss_mask=[0] * p + [1] * (length - p),
                rollout_logprobs=[0.0] * p + [-6.2] * (length - p),
                reward=float(i),
            )
        )
    t0 = time.perf_counter()
    stats = learner.train_step(batch)
    return {
        "seconds": time.perf_counter() - t0,
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "loss": stats["loss"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument(
        "--plain-max",
        type=int,
        default=32768,
        help="longest length the plain settings are tried at",
    )
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(int(a.one[0]), a.one[1] == "bounded")))
        return
    import platform

    import torch

    print(
        f"# one GRPO learner step on 2 episodes of one group, policy/ debug flavour (vision off), 2 threads; "
        f"bounded = LM head in 1,024-position chunks + activation checkpointing, plain = whole-sequence logits "
        f"and stored activations (tried up to {a.plain_max:,} tokens); each in a fresh process (peak RSS)"
    )
    print(f"# torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}")
    print()
    print(
        "| tokens per episode | bounded s | bounded peak MiB | plain s | plain peak MiB | memory bounded / plain |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in a.lengths:
        res = {}
        for kind in ("bounded", "plain"):
            if kind == "plain" and n > a.plain_max:
                continue
            out = subprocess.run(
                [sys.executable, __file__, "--one", str(n), kind],
                capture_output=True,
                text=True,
                cwd=REPO,
            )
            res[kind] = (
                json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
            )
            if out.returncode != 0:
                print(f"{kind} at {n} tokens failed: {out.stderr.strip()[-500:]}", file=sys.stderr)
        b, p = res.get("bounded"), res.get("plain")
        fmt = lambda r, k, f: (f % r[k]) if r else "–"  # noqa: E731
        ratio = f"{b['peak_mib'] / p['peak_mib']:.2f}" if b and p else "–"
        print(
            f"| {n:,} | {fmt(b, 'seconds', '%.1f')} | {fmt(b, 'peak_mib', '%.0f')} | {fmt(p, 'seconds', '%.1f')} | "
            f"{fmt(p, 'peak_mib', '%.0f')} | {ratio} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
