"""Wall time to a held-out success target on a multi-step tool task with the real policy: our loop
against TRL's `GRPOTrainer` running its own multi-turn tool loop.

    .venv/bin/python bench/calculator_vs_trl.py [--target 0.7] [--max-steps 12] [--eval-every 2]
        [--episodes 100] [--precision fp32|bf16] [--seeds 0 [1 2]] [--init WARM_START_DIR] [--plot PNG] [--json]

Task: `tools/calculator-v0` (a word problem `a·b − c`; tools `calculator` and `submit`; reward = its
sparse milestones, 0.25 for the product and 1 for the right answer). Policy: SmolLM2-135M-Instruct
upcycled into a 4-expert top-1 MoE, after the demo's supervised warm start on the scripted expert
(`configs/demo/calculator.yaml`: 40 demonstrations, 5 steps; the pretrained model has never seen
the tool-call format). Both sides start from that one checkpoint and train all of its parameters in
fp32 (`--precision bf16`: both learners under bf16 autocast, weights and optimizer state in fp32;
our vLLM engines in bf16, `rollout.dtype: bfloat16`, and TRL's `generate` under its bf16 autocast)
with the settings of `configs/demo/calculator.yaml`: 3 tasks × 8 episodes per step, one optimizer
step each, learning rate 1e-5, temperature 0.8, at most 4 model turns of at most 64 new tokens,
token-mean loss, no KL, no router loss (TRL's crashes `generate` on this model: transformers' Mixtral
aux loss under a KV cache), and the same training tasks in the same order (our seeds, TRL's dataset).
The tools reach TRL through `envs/trl_adapter.py`: the prompt is token for token ours (checked
here), and tool results and rewards are the environment's own.

Ours: the full loop in one process's local Ray (a vLLM rollout worker, the learner actor, in-place
weight sync every step), its GRPO with milestone credit. TRL: `GRPOTrainer(environment_factory=...)`
with Hugging Face `generate` (TRL runs vLLM only on CUDA), its tool loop batching the episodes that
called a tool, one process. Both learners run under the same malloc (tcmalloc where installed: our
learner actor's default, rl/learner/allocator.py, and TRL's process is started with it too).

Held-out success: every `--eval-every` steps, `--episodes` held-out seeds (the ones `longhorizon
eval` uses) played by one evaluator for both sides (rl/loop/evaluate.py on a vLLM engine, fp32, bf16
with `--precision bf16`; ours on its rollout worker, TRL's checkpoint in a child process), with the
Wilson 95% interval. Evaluation,
TRL's checkpoint save and start-up are outside the clock. Time to target: training wall seconds
until a held-out success of at least `--target`.

Training seeds (`--seeds`: the tasks, their order and the sampling on both sides; the warm start
and the held-out episodes stay the same for every seed): every seed is fixed, so a rerun repeats its
run, and the steps each side needs to cross the target are one sample per seed. With several seeds
the table has a row per seed and their medians: the crossing step is noisy (100 held-out episodes
give a 95% interval of about ±0.09 at 0.7, and the evaluation comes every `--eval-every` steps), so
one seed can make either side look twice as fast.

Below the table: the per-step ratio, where our step's time went (the wait for rollouts, the
learner's update, the weight sync; from the run's metrics), TRL's time in its `generate` calls
(its own profiling timers), and this machine's matmul speed before and after each side: the two
sides run one after the other, and on a shared host that speed has moved by 3×, within one run too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CONFIG = REPO / "configs" / "demo" / "calculator.yaml"
ENV = "tools/calculator-v0"


def base_config(overrides: list[str] = ()):
    from rl.config import load_config

    return load_config(CONFIG, ["algo.router_aux_coef=0", *overrides])


def make_warm_start(out: Path) -> str:
    """The demo's warm-started checkpoint (its warm start run on the learner, made once in `out`,
    reused by both sides): the demo config's warm start, RL not started."""
    from rich.console import Console

    from rl.loop.trainer import Trainer

    trainer = Trainer(base_config(["iterations=1"]), out, console=Console(stderr=True))
    try:
        trainer.start()
    finally:
        trainer.close()
    return str(out / "warm-start")


# --- held-out evaluation (the same for both sides) ---
def engines(precision: str) -> list[str]:
    """Our engines' dtype for a `--precision`: bf16 learners roll out with bf16 engines."""
    return [f"rollout.dtype={'bfloat16' if precision == 'bf16' else 'float32'}"]


def held_out(policy: str, episodes: int, precision: str) -> dict:
    """`episodes` held-out episodes of `policy` on a fresh vLLM engine, as the run's rollout worker plays them."""
    from rl.loop.evaluate import evaluate_policy

    cfg = base_config(engines(precision))
    summary, _ = evaluate_policy(
        policy,
        cfg.rollout,
        ENV,
        episodes,
        env_kwargs=dict(cfg.env.kwargs),
        temperature=cfg.eval.temperature or None,
        seed=cfg.seed,
    )
    return {
        "success": summary["success"],
        "ci95": list(summary["ci95"]),
        "reward": summary["reward_mean"],
    }


def held_out_in_child(policy: str, episodes: int, precision: str) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "eval",
        "--policy",
        policy,
        "--episodes",
        str(episodes),
        "--precision",
        precision,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"held-out evaluation of {policy} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# --- the two loops ---
def run_ours(init: str, a, run_dir: str) -> dict:
    from rich.console import Console

    from rl.loop.trainer import Trainer

    t0 = time.perf_counter()
    cfg = base_config(
        [
            f"policy.path={init}",
            "policy.pretrained=''",
            "warm_start.demos=0",
            "eval.every=0",
            f"eval.episodes={a.episodes}",
            f"iterations={a.max_steps}",
            "checkpoint_every=100000",
            f"learner.precision={a.precision}",
            *engines(a.precision),
            f"seed={a.seed}",
        ]
    )
    trainer = Trainer(cfg, run_dir, console=Console(stderr=True, quiet=True))
    trainer.start()
    startup = time.perf_counter() - t0
    malloc = trainer.learner.call("allocator")
    steps, train_s, hit = [], 0.0, None
    try:
        for it in range(a.max_steps):
            t = time.perf_counter()
            row = trainer.iteration(it)
            train_s += time.perf_counter() - t
            # where the step's wall time went: the wait for rollouts, the learner's update, the weight sync
            step = {
                "step": it + 1,
                "train_s": train_s,
                "reward": row["mean_reward"],
                "rollout_s": row["rollout_s"],
                "learner_s": row.get("train_s", 0.0),
                "sync_s": row.get("sync_s", 0.0),
            }
            if (it + 1) % a.eval_every == 0:
                ev = trainer.evaluate()
                step.update(
                    success=ev["eval/success"], ci95=[ev["eval/ci95_low"], ev["eval/ci95_high"]]
                )
            steps.append(step)
            print(f"ours: {step}", file=sys.stderr, flush=True)
            if step.get("success", -1) >= a.target:
                hit = train_s
                break
    finally:
        trainer.close()
    return {
        "startup_s": startup,
        "seconds": hit,
        "steps": steps,
        "train_s": train_s,
        "malloc": malloc,
    }


def run_trl(init: str, a, run_dir: str) -> dict:
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    import envs
    from envs.trl_adapter import trl_environment, trl_prompts
    from rl.loop.episodes import iteration_tasks
    from rollout.chat import ChatFormat

    t0 = time.perf_counter()
    cfg = base_config([f"seed={a.seed}"])
    r, algo = cfg.rollout, cfg.algo
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.learner.threads or os.cpu_count())
    tok = AutoTokenizer.from_pretrained(init)
    # our template's <tool_call> JSON blocks are Qwen's: TRL parses them with its Qwen response template
    tok.response_template = qwen3_template
    tok.padding_side = "left"
    # the same training tasks in the same order: the seeds of our groups, each once (TRL repeats a prompt per generation)
    seeds = [
        t.seed
        for it in range(a.max_steps)
        for t in iteration_tasks(r, cfg.seed, it)[:: r.group_size]
    ]
    data = trl_prompts(ENV, seeds, **cfg.env.kwargs)
    environment = trl_environment(ENV, **cfg.env.kwargs)
    env = envs.make(ENV, **cfg.env.kwargs)
    obs, info = env.reset(seed=seeds[0])
    ours_prompt = ChatFormat(tok).prompt_ids([{"role": "user", "content": obs}], info["tools"])
    probe = environment()
    tools = [getattr(probe, s.name) for s in envs.env_class(ENV).tools]
    trl_prompt = tok.apply_chat_template(
        data["prompt"][0], tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    if list(trl_prompt) != ours_prompt:
        raise RuntimeError(
            "TRL's first prompt differs from our loop's: the comparison would not be like for like"
        )
    model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32)
    model.config.output_router_logits = False  # see the docstring: no router loss on either side

    state = {"begin": None, "train_s": 0.0, "hit": None, "steps": [], "generate_s": 0.0}
    # TRL times each of its generate calls (trl/extras/profiling.py, for its loggers): summed per step here
    from trl.extras import profiling

    log_metrics = profiling.ProfilingContext._log_metrics

    def timed(self, duration):
        if "generate" in self.name:
            state["generate_s"] += duration
        return log_metrics(self, duration)

    profiling.ProfilingContext._log_metrics = timed

    class Watch(TrainerCallback):
        def on_step_begin(self, args, st, control, **kw):
            state["begin"] = time.perf_counter()

        def on_step_end(self, args, st, control, model=None, **kw):
            state["train_s"] += time.perf_counter() - state["begin"]
            step = {
                "step": st.global_step,
                "train_s": state["train_s"],
                "generate_s": state["generate_s"],
            }
            state["generate_s"] = 0.0
            if st.global_step % a.eval_every == 0:
                ckpt = Path(run_dir) / f"step-{st.global_step}"
                model.save_pretrained(ckpt)
                tok.save_pretrained(ckpt)
                ev = held_out_in_child(str(ckpt), a.episodes, a.precision)
                step.update(success=ev["success"], ci95=ev["ci95"])
                if ev["success"] >= a.target and state["hit"] is None:
                    state["hit"] = state["train_s"]
                    control.should_training_stop = True
            state["steps"].append(step)

        def on_log(self, args, st, control, logs=None, **kw):
            if logs and "reward" in logs and state["steps"]:
                state["steps"][-1]["reward"] = float(logs["reward"])
                print(f"trl: {state['steps'][-1]}", file=sys.stderr, flush=True)

    groups = r.groups_per_iteration
    args = GRPOConfig(
        output_dir=run_dir,
        per_device_train_batch_size=groups * r.group_size,
        num_generations=r.group_size,
        gradient_accumulation_steps=1,
        max_completion_length=r.max_episode_tokens - len(ours_prompt),
        generation_kwargs={"max_new_tokens": r.max_new_tokens},
        max_tool_calling_iterations=r.max_turns - 1,
        learning_rate=algo.lr,
        beta=0.0,
        loss_type="dapo",
        temperature=r.temperature,
        top_p=r.top_p,
        num_iterations=1,
        max_steps=a.max_steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=a.precision == "bf16",
        seed=cfg.seed,
        shuffle_dataset=False,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=algo.weight_decay,
        max_grad_norm=algo.max_grad_norm,
        router_aux_loss_coef=0.0,
        disable_tqdm=True,
        log_completions=False,
    )
    trainer = GRPOTrainer(
        model=model,
        args=args,
        processing_class=tok,
        train_dataset=Dataset.from_dict(data),
        environment_factory=environment,
        callbacks=[Watch()],
    )
    startup = time.perf_counter() - t0
    trainer.train()
    from rl.learner.allocator import in_use

    return {
        "startup_s": startup,
        "seconds": state["hit"],
        "steps": state["steps"],
        "train_s": state["train_s"],
        "malloc": in_use(),
    }


def machine_gflops(policy: str, precision: str) -> float:
    """This machine's matmul speed now, at the policy's shape (hidden × an expert's width) on the
    learners' threads (its speed drifts on a shared host: taken before and after each side, so a
    drift between the two sides shows beside their ratio)."""
    import torch
    from learner_throughput import matmul_gflops

    shape = json.loads((Path(policy) / "config.json").read_text())
    threads = torch.get_num_threads()
    torch.set_num_threads(base_config().learner.threads)
    try:
        return matmul_gflops(
            shape["hidden_size"],
            shape["intermediate_size"],
            torch.bfloat16 if precision == "bf16" else torch.float32,
        )
    finally:
        torch.set_num_threads(threads)


def measure(side: str, init: str, a, seed: int) -> dict:
    from rl.learner.allocator import actor_env

    with tempfile.TemporaryDirectory() as d:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            side,
            "--policy",
            init,
            "--run-dir",
            str(Path(d) / "run"),
            "--target",
            str(a.target),
            "--max-steps",
            str(a.max_steps),
            "--eval-every",
            str(a.eval_every),
            "--episodes",
            str(a.episodes),
            "--precision",
            a.precision,
            "--seed",
            str(seed),
        ]
        # TRL's process gets the malloc our learner actor gets (rl/learner/allocator.py: tcmalloc where installed):
        # an allocator is the machine's setting, not the framework's
        env = {**os.environ, **actor_env("auto")} if side == "trl" else None
        before = machine_gflops(init, a.precision)
        r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=REPO, timeout=7200, env=env)
        after = machine_gflops(init, a.precision)
    if r.returncode != 0:
        raise RuntimeError(f"{side} failed (its stderr is above)")
    return {**json.loads(r.stdout.strip().splitlines()[-1]), "gflops": [before, after]}


def plot(seeds: dict, start: dict, target: float, path: str) -> None:
    """Held-out success against training wall time, one line per side and seed (one seed: with its
    95% band and the train reward)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colours, styles = {"ours": "tab:blue", "trl": "tab:orange"}, ["-", "--", ":", "-."]
    one = len(seeds) == 1
    for k, (seed, runs) in enumerate(seeds.items()):
        for side, res in runs.items():
            pts = [(0.0, start["success"], *start["ci95"])] + [
                (s["train_s"], s["success"], *s["ci95"]) for s in res["steps"] if "success" in s
            ]
            x, y, lo, hi = zip(*pts)
            label = f"{side}: held-out success" + ("" if one else f", seed {seed}")
            ax.plot(
                x,
                y,
                marker="o",
                color=colours[side],
                linestyle=styles[k % len(styles)],
                label=label,
            )
            if one:
                ax.fill_between(x, lo, hi, alpha=0.15, color=colours[side])
                rs = [(s["train_s"], s["reward"]) for s in res["steps"] if "reward" in s]
                if rs:
                    ax.plot(
                        *zip(*rs),
                        linestyle="--",
                        color=colours[side],
                        alpha=0.6,
                        label=f"{side}: train reward",
                    )
    ax.axhline(target, color="grey", linewidth=1, alpha=0.6, label="target")
    ax.set_xlabel("training wall seconds (start-up and evaluation excluded)")
    ax.set_ylabel("held-out success / train reward" if one else "held-out success")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def speedup(o: dict, t: dict) -> tuple[float | None, str]:
    """TRL's seconds to target over ours, as (a value to order seeds by, its text). A side that did
    not reach the target bounds the ratio with its whole training time: ours alone reaching it is
    above TRL's training time over ours (ordered as +inf), TRL alone below (ordered as 0); neither
    reaching it says nothing (None)."""
    if o["seconds"] and t["seconds"]:
        r = t["seconds"] / o["seconds"]
        return r, f"{r:.2f}×"
    if o["seconds"]:
        return float("inf"), f"> {t['train_s'] / o['seconds']:.2f}×"
    if t["seconds"]:
        return 0.0, f"< {t['seconds'] / o['train_s']:.2f}×"
    return None, "-"


def median_text(values: list[tuple[float | None, str]]) -> str:
    """The median of per-seed ratios (bounds ordered as `speedup` says); seeds where neither side
    reached the target are left out."""
    known = sorted((v for v in values if v[0] is not None), key=lambda v: v[0])
    if not known:
        return "-"
    mid = len(known) // 2
    if len(known) % 2:
        return known[mid][1]
    lo, hi = known[mid - 1], known[mid]
    if all(0 < v[0] < float("inf") for v in (lo, hi)):
        return f"{(lo[0] + hi[0]) / 2:.2f}×"
    return f"between {lo[1]} and {hi[1]}"


def per_step(res: dict) -> float:
    return res["train_s"] / max(1, len(res["steps"]))


def step_split(o: dict, t: dict, precision: str) -> str:
    n = max(1, len(o["steps"]))
    part = lambda k: sum(s.get(k, 0.0) for s in o["steps"]) / n  # noqa: E731
    return (
        f"Our step's wall time, mean over its {len(o['steps'])} steps: rollout {part('rollout_s'):.1f} s, "
        f"learner update {part('learner_s'):.1f} s, weight sync {part('sync_s'):.1f} s; TRL's, over its "
        f"{len(t['steps'])}: generation (its `generate` calls) "
        f"{sum(s['generate_s'] for s in t['steps']) / max(1, len(t['steps'])):.1f} s. This machine's {precision} "
        f"matmul GFLOP/s at the policy's shape, before and after each side: ours {o['gflops'][0]:.0f} → "
        f"{o['gflops'][1]:.0f}, TRL {t['gflops'][0]:.0f} → {t['gflops'][1]:.0f}."
    )


def report(seeds: dict, start: dict, a) -> None:
    import statistics

    import torch
    import trl
    import vllm

    fmt = lambda x: f"{x:.0f}" if x is not None else f"not reached in {a.max_steps} steps"  # noqa: E731
    first = next(iter(seeds.values()))
    where = "training seed" + (
        f" {a.seeds[0]}" if len(a.seeds) == 1 else f"s {', '.join(map(str, a.seeds))}"
    )
    print(
        f"# time to held-out success ≥ {a.target} on {ENV} ({a.episodes} held-out episodes every {a.eval_every} "
        f"steps), {where}, SmolLM2-135M upcycled to 4 experts top-1, {a.precision} learners"
        f"{' and engines' if a.precision == 'bf16' else ''}, from one warm start (held-out success "
        f"{start['success']:.2f} [{start['ci95'][0]:.2f}, {start['ci95'][1]:.2f}]); 3×8 episodes of ≤ 4 turns per "
        f"step; learners' malloc: ours {first['ours']['malloc']}, TRL {first['trl']['malloc']}"
    )
    print(f"# torch {torch.__version__}, vllm {vllm.__version__}, trl {trl.__version__}\n")

    def last(res):
        ev = [s for s in res["steps"] if "success" in s][-1:]
        return (
            f"{ev[0]['success']:.2f} [{ev[0]['ci95'][0]:.2f}, {ev[0]['ci95'][1]:.2f}]"
            if ev
            else "-"
        )

    if len(seeds) == 1:
        o, t = first["ours"], first["trl"]
        print(
            "| loop | seconds to target | steps | s / step | held-out success at the end | start-up s | TRL s / ours s |"
        )
        print("| --- | ---: | ---: | ---: | --- | ---: | ---: |")
        for name, res, r in (
            ("ours (Ray + vLLM + learner + sync)", o, speedup(o, t)[1]),
            ("TRL GRPOTrainer (HF generate, its tool loop)", t, "1.00×"),
        ):
            print(
                f"| {name} | {fmt(res['seconds'])} | {len(res['steps'])} | {per_step(res):.1f} | {last(res)} | "
                f"{res['startup_s']:.1f} | {r} |"
            )
        print(
            f"\nPer step, TRL's s / ours: {per_step(t) / per_step(o):.2f}×. {step_split(o, t, a.precision)}"
        )
        return
    print(
        "| training seed | ours: seconds to target | steps | s / step | TRL: seconds to target | steps | s / step "
        "| time to target, TRL / ours | per step, TRL / ours |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    ratios = []
    for seed, runs in seeds.items():
        o, t = runs["ours"], runs["trl"]
        ratios.append(speedup(o, t))
        print(
            f"| {seed} | {fmt(o['seconds'])} | {len(o['steps'])} | {per_step(o):.1f} | {fmt(t['seconds'])} | "
            f"{len(t['steps'])} | {per_step(t):.1f} | {ratios[-1][1]} | {per_step(t) / per_step(o):.2f}× |"
        )
    med = statistics.median
    os_, ts_ = [r["ours"] for r in seeds.values()], [r["trl"] for r in seeds.values()]
    print(
        f"| median | | {med([len(o['steps']) for o in os_]):g} | {med([per_step(o) for o in os_]):.1f} | | "
        f"{med([len(t['steps']) for t in ts_]):g} | {med([per_step(t) for t in ts_]):.1f} | {median_text(ratios)} | "
        f"{med([per_step(t) / per_step(o) for o, t in zip(os_, ts_)]):.2f}× |"
    )
    print()
    for seed, runs in seeds.items():
        print(
            f"Seed {seed}: held-out success at the end, ours {last(runs['ours'])} and TRL {last(runs['trl'])}; "
            f"start-up ours {runs['ours']['startup_s']:.1f} s, TRL {runs['trl']['startup_s']:.1f} s. "
            + step_split(runs["ours"], runs["trl"], a.precision)
            + "\n"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=float, default=0.7)
    ap.add_argument("--max-steps", type=int, default=12)
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--episodes", type=int, default=100, help="held-out episodes per evaluation")
    ap.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default="fp32",
        help="both learners' precision; bf16 also puts our engines (and the evaluator) in bf16",
    )
    ap.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0],
        help="training seeds, one run of each side per seed (its tasks, their order, the sampling); the "
        "warm start and the held-out episodes are the same for every seed; several: the median too",
    )
    ap.add_argument(
        "--init",
        help="a warm-started checkpoint to start both from (default: made here, as the demo does)",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--plot", help="write held-out success against training wall time to this PNG")
    ap.add_argument("--child", choices=["ours", "trl", "eval"], help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)  # a child's one seed
    ap.add_argument("--policy", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child == "eval":
        print(json.dumps(held_out(a.policy, a.episodes, a.precision)))
        return
    if a.child:
        fn = run_ours if a.child == "ours" else run_trl
        print(json.dumps(fn(a.policy, a, a.run_dir)))
        return
    if len(set(a.seeds)) != len(a.seeds):
        ap.error(
            f"--seeds repeats a seed ({a.seeds}): every seed is fixed, a repeat is the same run"
        )

    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        init = a.init or make_warm_start(Path(d) / "warm")
        warm_s = time.perf_counter() - t
        start = held_out_in_child(init, a.episodes, a.precision)
        print(
            f"start: held-out success {start['success']:.3f} {start['ci95']}",
            file=sys.stderr,
            flush=True,
        )
        seeds = {}
        for seed in a.seeds:
            seeds[seed] = {side: measure(side, init, a, seed) for side in ("ours", "trl")}
            print(
                f"seed {seed}: {speedup(seeds[seed]['ours'], seeds[seed]['trl'])[1]} to target",
                file=sys.stderr,
                flush=True,
            )
    if a.plot:
        plot(seeds, start, a.target, a.plot)
    if a.json:
        import torch
        import trl
        import vllm

        versions = {
            "torch": torch.__version__,
            "vllm": vllm.__version__,
            "trl": trl.__version__,
            "python": platform.python_version(),
        }
        print(
            json.dumps(
                {"start": start, "seeds": seeds, "warm_start_s": warm_s, "versions": versions}
            )
        )
        return
    report(seeds, start, a)


if __name__ == "__main__":
    main()
