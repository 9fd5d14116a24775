"""GPU check for issue 26 (run when a GPU machine with vLLM's CUDA build is lent; CI never runs it):
the whole loop on one GPU.

`longhorizon train configs/gpu/one_gpu.yaml` for a few iterations — the real policy (SmolLM2-135M
upcycled to 4 experts, top-1), the learner on CUDA in bf16 and one vLLM engine sharing the GPU,
GRPO on the calculator — then, per iteration from metrics.jsonl: generated tokens/s of the rollouts,
the learner's seconds and tokens/s, the weight sync's seconds, bytes and path (the one-GPU config's
must be the learner's GPU memory, mapped by the engine through CUDA IPC), and the engine/learner
log-prob gap on the tokens of the current version (mean |Δ log p| and the k3 KL), which is what a
wrong or stale sync would show first. Add `lora.enabled=true algo.lr=2e-4` (or any override) after
`--` to check LoRA RL on the GPU the same way.

    python bench/gpu_loop_check.py [--iterations 3] [-- override ...]

Needs: a GPU, `pip install -e ".[gpu]"` (vLLM's CUDA build, Ray). It stops with one line when one
is missing. A run takes ~5 minutes on an H200 (most of it vLLM's start and the warm start).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--config", default=str(REPO / "configs" / "gpu" / "one_gpu.yaml"))
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    import torch

    missing = [m for m in ("vllm", "ray") if importlib.util.find_spec(m) is None]
    if not torch.cuda.is_available() or missing:
        why = (
            "no GPU here"
            if not torch.cuda.is_available()
            else f"not installed: {', '.join(missing)}"
        )
        print(
            f'error: {why} (this check needs a GPU and `pip install -e ".[gpu]"`)', file=sys.stderr
        )
        return 2
    run_dir = Path(tempfile.mkdtemp(prefix="lh-gpu-loop-"))
    cli = str(Path(sys.executable).with_name("longhorizon"))
    cmd = [
        cli,
        "train",
        a.config,
        "--run-dir",
        str(run_dir / "run"),
        f"iterations={a.iterations}",
        f"checkpoint_every={a.iterations + 1}",
        *a.overrides,
    ]
    try:
        r = subprocess.run(
            cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        if r.returncode != 0:
            print(
                f"error: the run failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}",
                file=sys.stderr,
            )
            return 1
        rows = [
            json.loads(line)
            for line in (run_dir / "run" / "metrics.jsonl").read_text().splitlines()
            if line
        ]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    for row in rows:
        print(
            json.dumps(
                {
                    k: row.get(k)
                    for k in (
                        "iteration",
                        "mean_reward",
                        "generated_tokens",
                        "gen_tokens_per_s",
                        "rollout_s",
                        "train_s",
                        "sync_s",
                        "sync_bytes",
                        "sync_shared_gpu",
                        "rollout_logprob_diff_mean_current",
                        "rollout_kl",
                        "learner_gpu_peak_mib",
                        "iteration_s",
                    )
                }
            )
        )
    print(
        f"\n# {' '.join(['longhorizon train', Path(a.config).name, *cmd[5:]])} on {torch.cuda.get_device_name()}\n"
    )
    print(
        "| iteration | reward | rollout gen tok/s | learner s | sync s | sync MiB | sync through | engine/learner |Δ log p| | "
        "KL | learner GPU peak GiB |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    for row in rows:
        print(
            f"| {row['iteration']} | {row['mean_reward']:.3f} | {row['generated_tokens'] / max(row['rollout_s'], 1e-9):,.0f} | "
            f"{row['train_s']:.2f} | {row.get('sync_s', 0):.2f} | {row.get('sync_bytes', 0) / 2**20:,.0f} | "
            f"{'GPU memory (CUDA IPC)' if row.get('sync_shared_gpu') else 'host memory' if row.get('sync_shared') else 'object store'} | "
            f"{row.get('rollout_logprob_diff_mean_current', float('nan')):.2e} | {row['rollout_kl']:.2e} | "
            f"{row.get('learner_gpu_peak_mib', 0) / 1024:.1f} |"
        )
    gap = max(r.get("rollout_logprob_diff_mean_current", 0) for r in rows)
    # one_gpu.yaml's engine shares the learner's GPU: its syncs must go through that GPU's memory
    ipc = any(r.get("sync_shared_gpu") for r in rows) or a.config != ap.get_default("config")
    if not ipc:
        print("error: no sync went through the GPU's memory (CUDA IPC)", file=sys.stderr)
    # bf16 learner against an fp32 engine: ~1e-2 (bench/gpu_learner_check.py)
    return 0 if gap < 0.05 and ipc else 1


if __name__ == "__main__":
    sys.exit(main())
