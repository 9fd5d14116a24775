"""LoRA RL against full fine-tuning, the same run otherwise (issue 26): what a weight sync moves,
what the learner holds, what an iteration costs.

Runs `longhorizon train configs/quickstart_lora.yaml` twice through the whole loop (local Ray, the
vLLM engine, the real policy: SmolLM2-135M-Instruct upcycled to 4 experts, top-1), once as is
(rank-8 adapters on attention and on every expert) and once with `lora.enabled=false` (full
fine-tuning, its own learning rate), each in its own process, and reads each run's metrics.jsonl:
bytes per sync, sync seconds (publish + the slowest load), learner seconds per step, the learner
process's peak resident memory, trainable parameters, iteration wall time. The warm start is off
(it is full fine-tuning in both and the same for both); the comparison is about cost, not reward.

    .venv/bin/python bench/lora_vs_full.py [--iterations 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).with_name("longhorizon"))


def run(name: str, overrides: list[str], iterations: int, root: Path) -> list[dict]:
    run_dir = root / name
    cmd = [
        CLI,
        "train",
        str(REPO / "configs" / "quickstart_lora.yaml"),
        "--run-dir",
        str(run_dir),
        f"iterations={iterations}",
        f"checkpoint_every={iterations + 1}",
        "warm_start.demos=0",
        "stop_after_flat=0",
        *overrides,
    ]
    print(f"[lora_vs_full] {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    r = subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{name} run failed (exit {r.returncode}): {r.stderr.strip()[-1500:]}")
    return [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]


def summary(rows: list[dict]) -> dict:
    mean = lambda key: sum(r[key] for r in rows) / len(rows)
    return {
        "trainable": rows[-1]["trainable_params"],
        "sync_mib": mean("sync_bytes") / 2**20,
        "sync_s": mean("sync_s"),
        "train_s": mean("train_s"),
        "peak_mib": max(r["learner_peak_mib"] for r in rows),
        "iteration_s": mean("iteration_s"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=2)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="lh-lora-bench-"))
    try:
        lora = summary(run("lora", [], args.iterations, root))
        full = summary(run("full", ["lora.enabled=false", "algo.lr=1.0e-5"], args.iterations, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"# configs/quickstart_lora.yaml, {args.iterations} iterations each, warm start off; "
        "means over iterations, peak memory the learner process's maximum RSS\n"
    )
    print(
        "| run | trainable params | MiB per sync | sync s | learner step s | learner peak MiB | iteration s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, s in (("LoRA r=8 (attention + experts)", lora), ("full fine-tuning", full)):
        print(
            f"| {name} | {s['trainable']:,} | {s['sync_mib']:.2f} | {s['sync_s']:.2f} | {s['train_s']:.1f} | "
            f"{s['peak_mib']:,.0f} | {s['iteration_s']:.1f} |"
        )
    ratio = {k: lora[k] / full[k] for k in lora}
    print(
        f"| LoRA / full | {ratio['trainable']:.4f}× | {ratio['sync_mib']:.4f}× | {ratio['sync_s']:.2f}× | "
        f"{ratio['train_s']:.2f}× | {ratio['peak_mib']:.2f}× | {ratio['iteration_s']:.2f}× |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
