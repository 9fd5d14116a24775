"""Wall time to a target reward: our loop against TRL's GRPOTrainer, same environment, model,
reward, group size, learning rate and generated tokens, measured in the same run.

    .venv/bin/python bench/time_to_reward.py [--target 0.8] [--max-steps 300] [--repeats 1] [--plot PNG] [--json]

Task: `text/digits-v0` (one turn, reward = the share of the reply's characters that are digits;
TRL's reward function is the environment's own `digit_share`). Model: the tiny random Qwen3-MoE
of the tests (seed 0) and its chat template on both sides. Both: 4 prompts × 4 completions per
step, at most 24 new tokens, temperature 1, learning rate 1e-3, no KL, token-mean (DAPO) loss,
one optimizer step per batch, prompts from the environment's seeds in the same order. Ours is
the full loop in one process's local Ray (one vLLM rollout worker, the learner actor, weight sync
every step); TRL is `GRPOTrainer` with Hugging Face `generate` (no vLLM on CPU), one process.
Time to target: wall seconds from the first step until the mean reward of the last 3 steps is at
least `--target`; start-up (vLLM and Ray for us, model load for TRL) is reported apart. Each side
runs in a fresh process; `--repeats` alternates them.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GROUPS, GROUP_SIZE, NEW_TOKENS, LR, WINDOW = 4, 4, 24, 1e-3, 3


def reached(curve: list[float], target: float) -> bool:
    return len(curve) >= WINDOW and sum(curve[-WINDOW:]) / WINDOW >= target


def run_ours(policy: str, target: float, max_steps: int, run_dir: str) -> dict:
    from rich.console import Console

    from rl.config import load_config
    from rl.loop.trainer import Trainer

    t0 = time.perf_counter()
    cfg = load_config(
        REPO / "configs" / "quickstart.yaml",
        [
            f"policy.path={policy}",
            "env.id=text/digits-v0",
            "env.kwargs={}",
            f"iterations={max_steps}",
            "checkpoint_every=100000",
            "rollout.num_workers=1",
            f"rollout.groups_per_iteration={GROUPS}",
            f"rollout.group_size={GROUP_SIZE}",
            "rollout.max_turns=1",
            f"rollout.max_new_tokens={NEW_TOKENS}",
            f"algo.lr={LR}",
            "algo.kl_beta=0",
            "algo.loss_aggregation=token_mean",
            f"algo.minibatch_episodes={GROUPS * GROUP_SIZE}",
            "algo.epochs=1",
        ],
    )
    trainer = Trainer(cfg, run_dir, console=Console(stderr=True, quiet=True))
    trainer.start()
    startup = time.perf_counter() - t0
    curve, t_start, hit = [], time.perf_counter(), None
    try:
        for it in range(max_steps):
            curve.append(trainer.iteration(it)["mean_reward"])
            if reached(curve, target):
                hit = time.perf_counter() - t_start
                break
    finally:
        trainer.close()
    return {
        "startup_s": startup,
        "seconds": hit,
        "steps": len(curve),
        "curve": curve,
        "train_s": time.perf_counter() - t_start,
    }


def run_trl(policy: str, target: float, max_steps: int, run_dir: str) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import envs
    from envs.digits import digit_share

    t0 = time.perf_counter()
    torch.manual_seed(0)
    env = envs.make("text/digits-v0")
    seeds = range(max_steps * GROUPS)
    prompts = [[{"role": "user", "content": env.reset(seed=s)[0]}] for s in seeds]

    def reward(completions, **_):
        return [digit_share(c[0]["content"] if isinstance(c, list) else c) for c in completions]

    curve, state = [], {"t_start": None, "hit": None}

    class Watch(TrainerCallback):
        def on_step_begin(self, args, st, control, **kw):
            if state["t_start"] is None:
                state["t_start"] = time.perf_counter()

        def on_log(self, args, st, control, logs=None, **kw):
            if logs and "reward" in logs:
                curve.append(float(logs["reward"]))
                if state["hit"] is None and reached(curve, target):
                    state["hit"] = time.perf_counter() - state["t_start"]
                    control.should_training_stop = True

    args = GRPOConfig(
        output_dir=run_dir,
        per_device_train_batch_size=GROUPS * GROUP_SIZE,
        num_generations=GROUP_SIZE,
        gradient_accumulation_steps=1,
        max_completion_length=NEW_TOKENS,
        learning_rate=LR,
        beta=0.0,
        loss_type="dapo",
        temperature=1.0,
        top_p=1.0,
        num_iterations=1,
        max_steps=max_steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
        shuffle_dataset=False,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        max_grad_norm=1.0,
        disable_tqdm=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        callbacks=[Watch()],
    )
    startup = time.perf_counter() - t0
    trainer.train()
    return {
        "startup_s": startup,
        "seconds": state["hit"],
        "steps": len(curve),
        "curve": curve,
        "train_s": time.perf_counter() - (state["t_start"] or t0),
    }


def measure(side: str, policy: str, target: float, max_steps: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            side,
            "--policy",
            policy,
            "--target",
            str(target),
            "--max-steps",
            str(max_steps),
            "--run-dir",
            str(Path(d) / "run"),
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"{side} failed:\n{r.stderr[-3000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    curve = " ".join(f"{x:.2f}" for x in res["curve"])
    reached = f"at {res['seconds']:.1f} s" if res["seconds"] else "not reached"
    print(
        f"{side}: {res['steps']} steps, target {reached}; rewards {curve}",
        file=sys.stderr,
        flush=True,
    )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--max-steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--plot", help="write the reward curves against wall time to this PNG")
    ap.add_argument("--child", choices=["ours", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--policy", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        fn = run_ours if args.child == "ours" else run_trl
        print(json.dumps(fn(args.policy, args.target, args.max_steps, args.run_dir)))
        return

    import torch
    import trl
    import vllm

    from rl.start.tiny import make_tiny_qwen3_moe

    policy = str(make_tiny_qwen3_moe(Path(tempfile.mkdtemp()) / "policy", seed=0))
    runs = {"ours": [], "trl": []}
    for _ in range(args.repeats):
        for side in runs:
            runs[side].append(measure(side, policy, args.target, args.max_steps))
    summary = {}
    for side, rs in runs.items():
        hits = [r["seconds"] for r in rs if r["seconds"] is not None]
        summary[side] = {
            "seconds": statistics.median(hits) if len(hits) == len(rs) else None,
            "steps": statistics.median(r["steps"] for r in rs),
            "startup_s": statistics.median(r["startup_s"] for r in rs),
            "s_per_step": statistics.median(r["train_s"] / max(1, r["steps"]) for r in rs),
        }
    versions = {
        "torch": torch.__version__,
        "vllm": vllm.__version__,
        "trl": trl.__version__,
        "python": platform.python_version(),
    }
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for side, rs in runs.items():
            r = rs[0]
            per = r["train_s"] / max(1, r["steps"])
            ax.plot([per * (i + 1) for i in range(len(r["curve"]))], r["curve"], label=side)
        ax.axhline(args.target, color="grey", linestyle=":", label="target")
        ax.set_xlabel("training wall seconds (start-up excluded)")
        ax.set_ylabel("mean reward per step")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
    if args.json:
        print(json.dumps({"summary": summary, "runs": runs, "versions": versions}))
        return
    o, t = summary["ours"], summary["trl"]
    fmt = lambda x: f"{x:.1f}" if x is not None else "not reached"
    ratio = f"{t['seconds'] / o['seconds']:.2f}×" if o["seconds"] and t["seconds"] else "-"
    print(
        f"# time to mean reward ≥ {args.target} (last {WINDOW} steps) on text/digits-v0, tiny Qwen3-MoE, "
        f"{GROUPS}×{GROUP_SIZE} completions of ≤ {NEW_TOKENS} tokens per step, lr {LR}; median of {args.repeats}"
    )
    print(f"# torch {torch.__version__}, vllm {vllm.__version__}, trl {trl.__version__}\n")
    print("| loop | seconds to target | steps | s / step | start-up s | TRL s / ours s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    print(
        f"| ours (Ray + vLLM + learner + sync) | {fmt(o['seconds'])} | {o['steps']:.0f} | {o['s_per_step']:.2f} | "
        f"{o['startup_s']:.1f} | {ratio} |"
    )
    print(
        f"| TRL GRPOTrainer (HF generate) | {fmt(t['seconds'])} | {t['steps']:.0f} | {t['s_per_step']:.2f} | "
        f"{t['startup_s']:.1f} | 1.00× |"
    )


if __name__ == "__main__":
    main()
