"""Learner tokens/s per step on the real policy, fp32 against bf16 mixed precision, and each against
this machine's own matmul throughput measured in the same run (model FLOPs utilisation).

    .venv/bin/python bench/learner_throughput.py [--episodes 24] [--max-turns 4] [--microbatch-tokens 2048]

The policy is the demo's: SmolLM2-135M-Instruct upcycled into a 4-expert top-1 MoE (rl/start/pretrained.py).
The batch is one calculator-sized GRPO iteration: `--episodes` episodes of `tools/calculator-v0`
played by its scripted expert through the agent loop (`rl.start.sft.demonstrations`: token for token what
rollouts look like, the same template and loss mask), in groups of 8. One `Learner.train_step` (one optimiser step over
the whole batch, as configs/demo/calculator.yaml runs it) is timed in a fresh process per precision,
under the malloc the loop's learner actor gets (rl/learner/allocator.py: tcmalloc where installed), after
one untimed step (the first step's one-time costs: AdamW's state, first-touch pages).

The "engine" log-probs of the batch are the fp32 learner's own, so the bf16 step's rollout_kl and
perplexity ratio are the mismatch bf16 brings (what `algo.rollout_is` corrects). The physical limit
is a matmul of the model's own shape (2,048 tokens × hidden → the MLP width) in the same process and
precision: tokens/s × 6 × the active parameters (the LM head included, the embedding lookup not;
attention's T² term is small at these lengths) divided by that throughput is the share of the
machine's matmul speed the learner step reaches.
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


def matmul_gflops(hidden: int, width: int, dtype) -> float:
    import torch

    a, b = torch.randn(2048, hidden, dtype=dtype), torch.randn(hidden, width, dtype=dtype)
    for _ in range(3):
        a @ b
    n, t0 = 20, time.perf_counter()
    for _ in range(n):
        a @ b
    return 2 * 2048 * hidden * width * n / (time.perf_counter() - t0) / 1e9


def active_params(model, experts: int, top_k: int) -> int:
    """Parameters a token's forward multiplies by: routed experts at top_k / experts, the LM head
    counted (tied or not), the embedding lookup not."""
    total = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            continue
        total += p.numel() * (top_k / experts if ".experts." in name else 1)
    if model.config.tie_word_embeddings:  # the head shares the embedding's weight, skipped above
        total += model.get_output_embeddings().weight.numel()
    return int(total)


def one(precision: str, spec: dict, engine_logprobs: list | None) -> dict:
    import dataclasses

    import torch
    from transformers import AutoTokenizer

    from rl.config import AlgoConfig, LearnerConfig
    from rl.learner.learner import Learner
    from rl.start.sft import demonstrations
    from rollout.chat import ChatFormat

    chat = ChatFormat(AutoTokenizer.from_pretrained(spec["path"]))
    episodes = demonstrations(
        chat,
        "tools/calculator-v0",
        spec["episodes"],
        env_kwargs={"max_turns": spec["max_turns"]},
        max_turns=spec["max_turns"],
    )
    algo = AlgoConfig(minibatch_episodes=spec["episodes"], lr=1e-5, loss_aggregation="token_mean")
    system = LearnerConfig(
        microbatch_tokens=spec["microbatch_tokens"], threads=2, precision=precision
    )
    learner = Learner(spec["path"], algo, system)
    # the fp32 learner scores the batch: the engine's numbers for both runs
    if engine_logprobs is None:
        engine_logprobs = [[0.0] + learner.logprobs(t.token_ids) for t in episodes]
    # the expert always succeeds: rewards vary by episode so GRPO's advantages are not all zero
    batch = [
        dataclasses.replace(
            t,
            group_id=i // 8,
            reward=float(i % 3 == 0),
            rollout_logprobs=[lp if m else 0.0 for lp, m in zip(lps, t.loss_mask)],
        )
        for i, (t, lps) in enumerate(zip(episodes, engine_logprobs))
    ]
    start = {k: v.clone() for k, v in learner.model.state_dict().items()}
    # untimed: one-time costs; then the weights the engine log-probs are of
    learner.train_step(batch)
    learner.model.load_state_dict(start)
    del start
    t0 = time.perf_counter()
    stats = learner.train_step(batch)
    seconds = time.perf_counter() - t0
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    cfg = learner.model.config
    return {
        "seconds": seconds,
        "tokens": sum(len(t.token_ids) for t in episodes),
        "gflops": matmul_gflops(cfg.hidden_size, cfg.intermediate_size, dtype),
        "active": active_params(learner.model, cfg.num_local_experts, cfg.num_experts_per_tok),
        "rollout_kl": stats.get("rollout_kl"),
        "rollout_ppl_ratio": stats.get("rollout_ppl_ratio"),
        "rollout_logprob_diff_mean": stats.get("rollout_logprob_diff_mean"),
        "loss": stats.get("loss"),
        "malloc": learner.allocator(),
        "engine_logprobs": engine_logprobs if precision == "fp32" else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=24)
    ap.add_argument(
        "--max-turns", type=int, default=4, help="calculator turns per episode (the demo's 4)"
    )
    ap.add_argument("--microbatch-tokens", type=int, default=2048)
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # internal: PRECISION SPEC_JSON_FILE
    a = ap.parse_args()
    if a.one:
        spec = json.loads(Path(a.one[1]).read_text())
        print(json.dumps(one(a.one[0], spec, spec.get("engine_logprobs"))))
        return
    import torch
    from rich.console import Console

    from rl.learner.allocator import actor_env
    from rl.start.pretrained import policy

    console = Console(stderr=True)
    spec = {
        "path": str(policy("smollm2-135m-instruct", 4, 1)),
        "episodes": a.episodes,
        "max_turns": a.max_turns,
        "microbatch_tokens": a.microbatch_tokens,
    }
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for precision in ("fp32", "bf16"):
            f = Path(tmp) / "spec.json"
            f.write_text(json.dumps(spec))
            out = subprocess.run(
                [sys.executable, __file__, "--one", precision, str(f)],
                capture_output=True,
                text=True,
                cwd=REPO,
                env={**os.environ, **actor_env("auto")},
            )
            if out.returncode != 0:
                console.print(f"[red]{precision} failed[/]: {out.stderr[-800:]}")
                raise SystemExit(1)
            results[precision] = json.loads(out.stdout.strip().splitlines()[-1])
            if precision == "fp32":
                spec["engine_logprobs"] = results[precision].pop("engine_logprobs")
            r = results[precision]
            console.log(f"{precision}: {r['seconds']:.1f} s for {r['tokens']} tokens")
    print(
        f"# one GRPO learner step (one optimiser step over the batch) on SmolLM2-135M-Instruct upcycled to 4 experts "
        f"top-1: {a.episodes} `tools/calculator-v0` expert episodes ({results['fp32']['tokens']:,} tokens), micro-batches of ≤ {a.microbatch_tokens:,} "
        f"tokens, 2 threads; each precision in a fresh process, the second step timed, malloc: {results['fp32']['malloc']}"
    )
    print(
        f"# torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}\n"
    )
    print(
        "| precision | step s | tokens / s | matmul GFLOP/s (same precision) | model FLOPs utilisation | "
        "rollout KL vs fp32 | perplexity ratio vs fp32 |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for precision, r in results.items():
        tps = r["tokens"] / r["seconds"]
        mfu = tps * 6 * r["active"] / (r["gflops"] * 1e9)
        print(
            f"| {precision} | {r['seconds']:.1f} | {tps:.0f} | {r['gflops']:.0f} | {mfu:.0%} | "
            f"{r['rollout_kl']:.1e} | {r['rollout_ppl_ratio']:.4f} |"
        )
    f32, b16 = results["fp32"], results["bf16"]
    print(
        f"\nbf16 / fp32 tokens per second: {f32['seconds'] / b16['seconds']:.2f}×; "
        f"active parameters {f32['active'] / 1e6:.0f}M"
    )


if __name__ == "__main__":
    main()
