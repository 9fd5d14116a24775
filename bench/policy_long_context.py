"""Forward+backward time and peak memory of the tiny policy against long inputs, next to a
same-size softmax-attention-only stack measured in the same run.

    .venv/bin/python bench/policy_long_context.py [--lengths 2048 8192 32768 131072] [--config configs/policy/debug.yaml]
        [--k3-lengths 2048 8192 32768 131072] [--k3-config configs/policy/k3_width.yaml]

The baseline is the same flavour with every layer softmax attention (`mla_every: 1`), fused SDPA
(flash kernel on CPU) in the training form, so both stacks have linear memory in attention and
the difference is what KDA's chunked recurrence costs or saves. Each measurement runs in a fresh
subprocess so its peak RSS is its own. Two flavours: `debug` (toy widths, key dim 16) and
`k3_width` (the same four layers at K3's per-head widths: KDA head dim 128, chunk 64; MLA with a
512-wide latent), where the KDA state (128 × 128 per head) costs what it costs in K3. Prints one
table per flavour with the ratio KDA-hybrid / softmax and the memory slope (MiB per 1K tokens)
between the two longest lengths.
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


def build(config: str, length: int, all_attention: bool):
    import torch

    from policy.args import load_model_args
    from policy.model import Policy

    torch.manual_seed(0)
    args = load_model_args(config)
    args = dataclasses.replace(
        args,
        max_seq_len=max(args.max_seq_len, length),
        vision=dataclasses.replace(args.vision, enabled=False),
    )
    if all_attention:
        args = dataclasses.replace(args, mla_every=1)
    return args, Policy(args), torch.randint(2, args.vocab_size, (1, length))


def saved_per_token(config: str, length: int, all_attention: bool) -> dict:
    """Bytes autograd keeps for backward per token: in the KDA layers, in the MLA layers (everything
    their forward saves) and the rest (embedding, AttnRes, norms, MoE, logits, loss); each storage
    counted once, where it is first saved."""
    import torch

    args, model, ids = build(config, length, all_attention)
    where, seen = ["rest"], {}
    for blk in model.layers:
        blk.attn.register_forward_pre_hook(lambda m, i, kind=blk.kind: where.append(kind))
        blk.attn.register_forward_hook(lambda m, i, o: where.pop() and None)

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), (where[-1], t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits, _, _ = model(ids)
        torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
    parts = {"kda": 0.0, "mla": 0.0, "rest": 0.0}
    for part, nbytes in seen.values():
        parts[part] += nbytes / length
    return parts


def measure(config: str, length: int, all_attention: bool, repeats: int, ac: bool) -> dict:
    import torch

    args, model, ids = build(config, length, all_attention)
    model.activation_checkpointing = ac
    times = []
    # warm-up matters for short runs only; long ones take minutes
    warmup = 1 if length < 32768 else 0
    for _ in range(repeats + warmup):
        t0 = time.perf_counter()
        logits, _, _ = model(ids)
        loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
        loss.backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        del logits, loss
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "seconds": min(times[warmup:]),
        "peak_mib": peak_kib / 1024,
        "pattern": "".join(k[0].upper() for k in args.layer_kinds()),
    }


def run_flavour(config: str, lengths: list[int], repeats: int, ac: bool, console) -> list:
    rows = []
    for length in lengths:
        res = {}
        for kind in ("hybrid", "all"):
            cmd = [
                sys.executable,
                __file__,
                "--config",
                config,
                "--repeats",
                str(repeats),
                "--one",
                str(length),
                kind,
            ]
            if ac:
                cmd.append("--activation-checkpointing")
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
            if out.returncode != 0:
                console.print(f"[red]{kind} at {length} tokens failed[/]: {out.stderr[-500:]}")
                res[kind] = None
                continue
            res[kind] = json.loads(out.stdout.strip().splitlines()[-1])
            console.log(
                f"{Path(config).stem} {length:>7} tokens {kind:>6}: {res[kind]['seconds']:.2f} s, "
                f"{res[kind]['peak_mib']:.0f} MiB"
            )
        rows.append((length, res))
    saved = {}
    for kind in ("hybrid", "all"):
        out = subprocess.run(
            [sys.executable, __file__, "--config", config, "--saved", "2048", kind],
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        saved[kind] = (
            json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
        )
    return rows, saved


def print_saved(saved: dict) -> None:
    h, sm = saved.get("hybrid"), saved.get("all")
    if not h or not sm:
        print("\n(the saved-for-backward breakdown failed)")
        return
    total = {k: v["kda"] + v["mla"] + v["rest"] for k, v in saved.items()}
    print("\n| saved for backward at 2,048 tokens, bytes per token | hybrid | softmax | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for label, hv, sv in (
        ("attention layers (KDA + MLA / MLA)", h["kda"] + h["mla"], sm["mla"]),
        ("everything else", h["rest"], sm["rest"]),
        ("total", total["hybrid"], total["all"]),
    ):
        print(f"| {label} | {hv:,.0f} | {sv:,.0f} | {hv / sv:.2f} |")
    print(
        f"\nthe softmax stack's attention layers keep {sm['mla'] / total['all']:.0%} of its bytes: a hybrid whose KDA "
        f"layers kept nothing would keep {(total['hybrid'] - h['kda']) / total['all']:.2f}× the softmax stack's"
    )


def print_table(rows: list) -> None:
    print(
        "| tokens | hybrid s | softmax s | time ratio | hybrid MiB | softmax MiB | memory ratio |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for length, res in rows:
        h, sm = res.get("hybrid"), res.get("all")
        if not h or not sm:
            print(f"| {length:,} | - | - | - | - | - | - |")
            continue
        print(
            f"| {length:,} | {h['seconds']:.2f} | {sm['seconds']:.2f} | {h['seconds'] / sm['seconds']:.2f} | "
            f"{h['peak_mib']:,.0f} | {sm['peak_mib']:,.0f} | {h['peak_mib'] / sm['peak_mib']:.2f} |"
        )
    done = [(n, r) for n, r in rows if r.get("hybrid") and r.get("all")]
    if len(done) >= 2:
        (n0, r0), (n1, r1) = done[-2], done[-1]
        print()
        slopes = {
            kind: (r1[kind]["peak_mib"] - r0[kind]["peak_mib"]) / ((n1 - n0) / 1024)
            for kind in ("hybrid", "all")
        }
        for kind, slope in slopes.items():
            print(f"memory slope {kind}: {slope:.2f} MiB per 1K tokens ({n0} → {n1})")
        print(f"memory slope ratio hybrid / softmax: {slopes['hybrid'] / slopes['all']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(REPO / "configs/policy/debug.yaml"))
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768, 131072])
    ap.add_argument(
        "--k3-config",
        default=str(REPO / "configs/policy/k3_width.yaml"),
        help="the second flavour, at K3's per-head widths (head dim 128)",
    )
    ap.add_argument(
        "--k3-lengths",
        type=int,
        nargs="*",
        default=[2048, 8192, 32768, 131072],
        help="lengths for --k3-config (none: skip it); its softmax stack takes ~15 minutes at 128K tokens",
    )
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute layers in backward (both stacks)",
    )
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # internal: LENGTH all|hybrid
    ap.add_argument("--saved", nargs=2, help=argparse.SUPPRESS)  # internal: LENGTH all|hybrid
    a = ap.parse_args()
    if a.saved:
        print(json.dumps(saved_per_token(a.config, int(a.saved[0]), a.saved[1] == "all")))
        return
    if a.one:
        print(
            json.dumps(
                measure(
                    a.config,
                    int(a.one[0]),
                    a.one[1] == "all",
                    a.repeats,
                    a.activation_checkpointing,
                )
            )
        )
        return
    import platform

    import torch
    from rich.console import Console

    console = Console(stderr=True)
    flavours = [(a.config, a.lengths)] + ([(a.k3_config, a.k3_lengths)] if a.k3_lengths else [])
    results = [
        (config, run_flavour(config, lengths, a.repeats, a.activation_checkpointing, console))
        for config, lengths in flavours
    ]
    ac = ", activation checkpointing" if a.activation_checkpointing else ""
    # Markdown on stdout (what `make bench` collects); the progress lines above go to stderr
    print(
        f"# forward+backward (cross-entropy over every position), batch 1{ac}; hybrid = KDA + gated MLA, "
        "softmax = the same flavour with every layer softmax attention; each in a fresh process"
    )
    print(f"# torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}")
    for config, (rows, saved) in results:
        print(f"\n{Path(config).name}\n")
        print_table(rows)
        print_saved(saved)


if __name__ == "__main__":
    main()
