"""Learner tokens/s per step on the real policy, fp32 against bf16 mixed precision, and each against
this machine's own matmul throughput measured in the same run (model FLOPs utilisation).

    .venv/bin/python bench/learner_throughput.py [--episodes 24] [--tokens 640] [--microbatch-tokens 2048]

The policy is the demo's: SmolLM2-135M-Instruct upcycled into a 4-expert top-1 MoE (rl/pretrained.py).
The batch is one calculator-sized GRPO iteration: `--episodes` chat transcripts of about `--tokens`
tokens (a task, tool calls and results, an answer; numbers vary per episode), in groups of 8, the
generated tokens being what the assistant wrote. One `Learner.train_step` (one optimiser step over
the whole batch, as configs/demo/calculator.yaml runs it) is timed in a fresh process per precision.

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
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def transcripts(n: int, tokens: int, tokenizer, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) per episode: a calculator conversation rendered with the policy's chat
    template, grown with more tool rounds until it reaches about `tokens` tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, c = rng.randint(10, 999), rng.randint(10, 999), rng.randint(2, 99)
        messages = [{"role": "system", "content": "You are a careful assistant. Use the calculator tool for arithmetic."},
                    {"role": "user", "content": f"What is ({a} + {b}) * {c}? Answer with the number only."}]
        while True:
            x, y = rng.randint(10, 9999), rng.randint(10, 9999)
            call = {"role": "assistant", "content": f"I will compute {x} * {y} with the calculator first.",
                    "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{x} * {y}"}}}]}
            messages += [call, {"role": "tool", "content": str(x * y)}]
            ids = _ids(tokenizer, messages, False)
            if len(ids) >= tokens:
                break
        ids = ids[:tokens]
        # generated tokens: the assistant turns (found by re-rendering the prefix before each)
        mask = [0] * len(ids)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = len(_ids(tokenizer, messages[:i], True))
            end = len(_ids(tokenizer, messages[: i + 1], False))
            for p in range(start, min(end, len(ids))):
                mask[p] = 1
        out.append((ids, mask))
    return out


def _ids(tokenizer, messages, generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


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
    import torch

    from rl.config import AlgoConfig
    from rl.learner import Learner
    from rollout.trajectory import Trajectory
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec["path"])
    episodes = transcripts(spec["episodes"], spec["tokens"], tok)
    algo = AlgoConfig(minibatch_episodes=spec["episodes"], microbatch_tokens=spec["microbatch_tokens"], lr=1e-5,
                      loss_aggregation="token_mean", threads=2)
    learner = Learner(spec["path"], algo, precision=precision)
    if engine_logprobs is None:  # the fp32 learner scores the batch: the engine's numbers for both runs
        engine_logprobs = [[0.0] + learner.logprobs(ids) for ids, _ in episodes]
    batch = []
    for i, ((ids, mask), lps) in enumerate(zip(episodes, engine_logprobs)):
        first = mask.index(1)
        batch.append(Trajectory(episode_id=f"e{i}", iteration=0, group_id=i // 8, env_id="tools/calculator-v0", seed=i,
                                prompt_len=first, token_ids=ids, loss_mask=mask,
                                rollout_logprobs=[lp if m else 0.0 for lp, m in zip(lps, mask)], reward=float(i % 3 == 0)))
    t0 = time.perf_counter()
    stats = learner.train_step(batch)
    seconds = time.perf_counter() - t0
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    cfg = learner.model.config
    return {"seconds": seconds, "tokens": sum(len(ids) for ids, _ in episodes),
            "generated": sum(sum(m) for _, m in episodes),
            "gflops": matmul_gflops(cfg.hidden_size, cfg.intermediate_size, dtype),
            "active": active_params(learner.model, cfg.num_local_experts, cfg.num_experts_per_tok),
            "rollout_kl": stats.get("rollout_kl"), "rollout_ppl_ratio": stats.get("rollout_ppl_ratio"),
            "rollout_logprob_diff_mean": stats.get("rollout_logprob_diff_mean"), "loss": stats.get("loss"),
            "engine_logprobs": engine_logprobs if precision == "fp32" else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=640, help="tokens per episode")
    ap.add_argument("--microbatch-tokens", type=int, default=2048)
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # internal: PRECISION SPEC_JSON_FILE
    a = ap.parse_args()
    if a.one:
        spec = json.loads(Path(a.one[1]).read_text())
        print(json.dumps(one(a.one[0], spec, spec.get("engine_logprobs"))))
        return
    import torch
    from rich.console import Console

    from rl.pretrained import policy

    console = Console(stderr=True)
    spec = {"path": str(policy("smollm2-135m-instruct", 4, 1)), "episodes": a.episodes, "tokens": a.tokens,
            "microbatch_tokens": a.microbatch_tokens}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for precision in ("fp32", "bf16"):
            f = Path(tmp) / "spec.json"
            f.write_text(json.dumps(spec))
            out = subprocess.run([sys.executable, __file__, "--one", precision, str(f)], capture_output=True, text=True,
                                 cwd=REPO)
            if out.returncode != 0:
                console.print(f"[red]{precision} failed[/]: {out.stderr[-800:]}")
                raise SystemExit(1)
            results[precision] = json.loads(out.stdout.strip().splitlines()[-1])
            if precision == "fp32":
                spec["engine_logprobs"] = results[precision].pop("engine_logprobs")
            r = results[precision]
            console.log(f"{precision}: {r['seconds']:.1f} s for {r['tokens']} tokens")
    print(f"# one GRPO learner step (one optimiser step over the batch) on SmolLM2-135M-Instruct upcycled to 4 experts "
          f"top-1: {a.episodes} calculator transcripts of {a.tokens} tokens, micro-batches of ≤ {a.microbatch_tokens:,} "
          "tokens, 2 threads; each precision in a fresh process")
    print(f"# torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}\n")
    print("| precision | step s | tokens / s | matmul GFLOP/s (same precision) | model FLOPs utilisation | "
          "rollout KL vs fp32 | perplexity ratio vs fp32 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for precision, r in results.items():
        tps = r["tokens"] / r["seconds"]
        mfu = tps * 6 * r["active"] / (r["gflops"] * 1e9)
        print(f"| {precision} | {r['seconds']:.1f} | {tps:.0f} | {r['gflops']:.0f} | {mfu:.0%} | "
              f"{r['rollout_kl']:.1e} | {r['rollout_ppl_ratio']:.4f} |")
    f32, b16 = results["fp32"], results["bf16"]
    print(f"\nbf16 / fp32 tokens per second: {f32['seconds'] / b16['seconds']:.2f}×; "
          f"active parameters {f32['active'] / 1e6:.0f}M")


if __name__ == "__main__":
    main()
