"""Forward+backward time and peak memory of the tiny policy against long inputs, next to a
same-size softmax-attention-only stack measured in the same run.

    .venv/bin/python bench/policy_long_context.py [--lengths 2048 8192 32768 131072] [--config configs/policy/debug.yaml]

The baseline is the same flavour with every layer softmax attention (`mla_every: 1`), fused SDPA
(flash kernel on CPU) in the training form, so both stacks have linear memory in attention and
the difference is what KDA's chunked recurrence costs or saves. Each measurement runs in a fresh
subprocess so its peak RSS is its own. Prints one table with the ratio KDA-hybrid / softmax and
the memory slope (MiB per 1K tokens) between the two longest lengths.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure(config: str, length: int, all_attention: bool, repeats: int, ac: bool) -> dict:
    import torch

    from policy.args import load_model_args
    from policy.model import Policy

    torch.manual_seed(0)
    args = load_model_args(config)
    args = dataclasses.replace(args, max_seq_len=max(args.max_seq_len, length),
                               vision=dataclasses.replace(args.vision, enabled=False))
    if all_attention:
        args = dataclasses.replace(args, mla_every=1)
    model = Policy(args)
    model.activation_checkpointing = ac
    ids = torch.randint(2, args.vocab_size, (1, length))
    times = []
    warmup = 1 if length < 32768 else 0  # warm-up matters for short runs only; long ones take minutes
    for _ in range(repeats + warmup):
        t0 = time.perf_counter()
        logits, _, _ = model(ids)
        loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
        loss.backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        del logits, loss
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": min(times[warmup:]), "peak_mib": peak_kib / 1024, "pattern": "".join(k[0].upper() for k in args.layer_kinds())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(REPO / "configs/policy/debug.yaml"))
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768, 131072])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--activation-checkpointing", action="store_true", help="recompute layers in backward (both stacks)")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # internal: LENGTH all|hybrid
    a = ap.parse_args()
    if a.one:
        print(json.dumps(measure(a.config, int(a.one[0]), a.one[1] == "all", a.repeats, a.activation_checkpointing)))
        return
    from rich.console import Console

    console = Console(stderr=True)
    rows = []
    for length in a.lengths:
        res = {}
        for kind in ("hybrid", "all"):
            cmd = [sys.executable, __file__, "--config", a.config, "--repeats", str(a.repeats), "--one", str(length), kind]
            if a.activation_checkpointing:
                cmd.append("--activation-checkpointing")
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
            if out.returncode != 0:
                console.print(f"[red]{kind} at {length} tokens failed[/]: {out.stderr[-500:]}")
                res[kind] = None
                continue
            res[kind] = json.loads(out.stdout.strip().splitlines()[-1])
            console.log(f"{length:>7} tokens {kind:>6}: {res[kind]['seconds']:.2f} s, {res[kind]['peak_mib']:.0f} MiB")
        rows.append((length, res))
    ac = ", activation checkpointing" if a.activation_checkpointing else ""
    import platform

    import torch

    # Markdown on stdout (what `make bench` collects); the progress lines above go to stderr
    print(f"# forward+backward (cross-entropy over every position), {Path(a.config).name}, batch 1{ac}; "
          "hybrid = KDA + gated MLA, softmax = every layer softmax attention; each in a fresh process")
    print(f"# torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}\n")
    print("| tokens | hybrid s | softmax s | time ratio | hybrid MiB | softmax MiB | memory ratio |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for length, res in rows:
        h, sm = res.get("hybrid"), res.get("all")
        if not h or not sm:
            print(f"| {length:,} | - | - | - | - | - | - |")
            continue
        print(f"| {length:,} | {h['seconds']:.2f} | {sm['seconds']:.2f} | {h['seconds'] / sm['seconds']:.2f} | "
              f"{h['peak_mib']:,.0f} | {sm['peak_mib']:,.0f} | {h['peak_mib'] / sm['peak_mib']:.2f} |")
    done = [(n, r) for n, r in rows if r.get("hybrid") and r.get("all")]
    if len(done) >= 2:
        (n0, r0), (n1, r1) = done[-2], done[-1]
        print()
        for kind in ("hybrid", "all"):
            slope = (r1[kind]["peak_mib"] - r0[kind]["peak_mib"]) / ((n1 - n0) / 1024)
            print(f"memory slope {kind}: {slope:.2f} MiB per 1K tokens ({n0} → {n1})")


if __name__ == "__main__":
    main()
