"""Learner cost per episode as the horizon grows: compacted context segments against step-wise
samples (every turn re-prompted as a sample of its own, as SkyRL's step-wise trajectories and
prime-rl's per-call samples train) and against one full context where the episode fits the window.

    .venv/bin/python bench/long_horizon_learner.py [--horizons 8 24 48] [--episodes 4]

The episodes are the scripted expert's on `long/oncall-v0` (a solution takes `horizon` + 1 tool
calls), recorded through the agent loop under `rollout.context.mode: compact` with a 1024-token
window (at_tokens 768, keep_turns 2): the contexts a policy sees there. Each layout trains the same
tokens the policy generated:
- compact: one sample per context segment (what the learner trains; rollout/context.py);
- step-wise: one sample per turn, the turn's whole context before it as its prompt: the same
  contexts, each prefix run again for every turn that follows it in its segment;
- full: the episode as one context (recorded under `full`), only where it fits the 1024-token window.
One GRPO step (bf16 mixed precision, micro-batches of 2,048 padded tokens, the demo's settings) of
the real policy (SmolLM2-135M upcycled to 4 experts, top-1) on each layout's batch, each in a fresh
process after a warm-up step on two short samples; learner tokens are the tokens of the rows the
forwards run. The learner's shared-prefix
path (a micro-batch whose rows all share a prefix runs it once) applies to every layout alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WINDOW, AT, KEEP = 1024, 768, 2


def episodes(horizon: int, n: int, mode: str):
    from transformers import AutoTokenizer

    from rl.start.pretrained import policy
    from rl.start.sft import demonstrations
    from rollout.chat import ChatFormat
    from rollout.context import ContextConfig

    chat = ChatFormat(AutoTokenizer.from_pretrained(policy("smollm2-135m-instruct", 4, 1)))
    ctx = ContextConfig(mode=mode, at_tokens=AT, keep_turns=KEEP)
    return demonstrations(
        chat,
        "long/oncall-v0",
        n,
        env_kwargs={"horizon": horizon},
        max_turns=horizon + 8,
        max_episode_tokens=1 << 16,
        context=ctx,
        max_model_len=WINDOW if mode != "full" else 1 << 16,
        max_new_tokens=96,
    )


def step_wise(t):
    """The episode as one sample per turn: its context before the turn, then the turn."""
    ids, mask, lps, turns, starts = [], [], [], [], []
    for u in t.turns:
        seg = max(s for s, _ in t.sample_spans() if s <= u.gen_start)
        starts.append(len(ids))
        off = len(ids) - seg
        ids += t.token_ids[seg : u.gen_end]
        mask += [0] * (u.gen_start - seg) + t.loss_mask[u.gen_start : u.gen_end]
        lps += [0.0] * (u.gen_start - seg) + t.rollout_logprobs[u.gen_start : u.gen_end]
        turns.append(
            dataclasses.replace(
                u, gen_start=u.gen_start + off, gen_end=u.gen_end + off, obs_end=u.gen_end + off
            )
        )
    return dataclasses.replace(
        t,
        token_ids=ids,
        loss_mask=mask,
        rollout_logprobs=lps,
        turns=turns,
        sample_starts=starts,
        milestones=[],
        routed_experts=None,
    )


def one(horizon: int, n: int, layout: str) -> dict:
    import torch

    from rl.config import AlgoConfig, LearnerConfig
    from rl.learner.batch import training_rows
    from rl.learner.learner import Learner
    from rl.start.pretrained import policy

    eps = episodes(horizon, n, "full" if layout == "full" else "compact")
    if layout == "step-wise":
        eps = [step_wise(t) for t in eps]
    # rewards that differ within the group, so every sample has an advantage to train with
    eps = [
        dataclasses.replace(t, episode_id=f"e{i}", group_id=0, reward=float(i % 2), milestones=[])
        for i, t in enumerate(eps)
    ]
    rows = training_rows(eps)
    sizes = {
        "samples": len(rows) / n,
        "tokens": sum(len(r.seq.token_ids) for r in rows) / n,
        "generated": sum(t.num_generated for t in eps) / n,
        "turns": sum(len(t.turns) for t in eps) / n,
        "longest": max(len(t.token_ids) for t in eps),
    }
    # no engine of this window could have produced it
    if layout == "full" and sizes["longest"] > WINDOW:
        return sizes
    torch.set_num_threads(2)
    learner = Learner(
        str(policy("smollm2-135m-instruct", 4, 1)),
        AlgoConfig(minibatch_episodes=n, lr=1e-6),
        LearnerConfig(microbatch_tokens=2048, threads=2, precision="bf16"),
    )
    # a first step on two short samples pays what a process pays once (allocator, kernels' set-up)
    learner.train_step(
        [
            dataclasses.replace(
                t,
                token_ids=t.token_ids[:256],
                loss_mask=t.loss_mask[:256],
                rollout_logprobs=t.rollout_logprobs[:256],
                turns=[],
                sample_starts=[],
            )
            for t in eps[:2]
        ]
    )
    t0 = time.perf_counter()
    learner.train_step(eps)
    return {**sizes, "seconds": (time.perf_counter() - t0) / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--horizons", type=int, nargs="+", default=[8, 24, 48])
    ap.add_argument("--episodes", type=int, default=4)
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(int(a.one[0]), int(a.one[1]), a.one[2])))
        return
    import torch
    import transformers

    def run(h: int, layout: str) -> dict:
        out = subprocess.run(
            [sys.executable, __file__, "--one", str(h), str(a.episodes), layout],
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        if out.returncode:
            raise SystemExit(f"horizon {h}, {layout}: {out.stderr[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    print(
        f"# learner cost per episode on long/oncall-v0 (the scripted expert's episodes, {a.episodes} per horizon), "
        f"a {WINDOW}-token window (compact at {AT}, {KEEP} turns kept); one GRPO step of SmolLM2-135M upcycled "
        "(4 experts, top-1), bf16 mixed precision, micro-batches of 2,048 tokens, each layout in a fresh process"
    )
    print(f"# torch {torch.__version__}, transformers {transformers.__version__}\n")
    print(
        "| horizon | turns | generated / episode | one context would hold | compact samples | compact tokens | compact s "
        "| step-wise samples | step-wise tokens | step-wise s | full tokens | full s | step-wise / compact s "
        "| step-wise / compact tokens | full / compact s |"
    )
    print(
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    for h in a.horizons:
        c, s = run(h, "compact"), run(h, "step-wise")
        f = run(h, "full")
        fits = f["longest"] <= WINDOW
        full = (
            (f"{f['tokens']:.0f}", f"{f['seconds']:.1f}", f"{f['seconds'] / c['seconds']:.2f}×")
            if fits
            else ("–", "–", "–")
        )
        print(
            f"| {h} | {c['turns']:.0f} | {c['generated']:.0f} | {f['tokens']:.0f} | {c['samples']:.1f} | {c['tokens']:.0f} "
            f"| {c['seconds']:.1f} | {s['samples']:.1f} | {s['tokens']:.0f} | {s['seconds']:.1f} | {full[0]} | {full[1]} "
            f"| {s['seconds'] / c['seconds']:.2f}× | {s['tokens'] / c['tokens']:.2f}× | {full[2]} |"
        )
    print(
        "\n(tokens and seconds per episode; full: one context holding the whole episode, run only where it fits the "
        f"{WINDOW}-token window: beyond it no engine of that window could have produced it.)"
    )


if __name__ == "__main__":
    main()
