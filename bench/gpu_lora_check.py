"""GPU check for issue 26 (run when a GPU machine is lent; CI never runs it): LoRA RL on CUDA against
full fine-tuning.

The learner (rl/learner/learner.py, no Ray) on the demo's model shape — SmolLM2-135M upcycled to a Mixtral
of 4 experts, top-1, random weights (the packaged checkpoint does not travel to the GPU machine) —
in bf16 mixed precision, once with rank-8 adapters on attention and on every expert (rl/learner/lora.py),
once fully fine-tuned, on the same batch (24 episodes of calculator length, one optimiser step):

1. cost: step seconds, peak GPU memory, trainable parameters, and what a weight sync would move
   (the adapter factors against the whole model's tensors) with the seconds to produce it;
2. the adapter sync is exact: after training steps moved the adapters, the rollout side's merge
   (rollout/weights.py `merge_adapters` on the checkpoint file) equals the learner's merged weights,
   and a model loaded with those weights on the GPU scores the batch as the adapted learner does
   (the engine/learner log-prob gap an adapter sync leaves, bf16 autocast on both sides).

    python bench/gpu_lora_check.py          # JSON lines, then a Markdown table; exit 1 if a check fails
    python bench/gpu_lora_check.py --cpu    # a dry run on the CPU (2 layers, small batch)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_learner_check import (
    SMOLLM2_MOE,
    algo,
    batch,
    command_line,
    make_model,
    system,
    timed_steps,
)  # noqa: E402


def measure(path: str, device: str, lora: bool, episodes: int, length: int, steps: int) -> dict:
    from rl.config import LoraConfig
    from rl.learner.learner import Learner

    torch.manual_seed(0)
    lrn = Learner(
        path,
        algo(minibatch_episodes=episodes, lr=2e-4 if lora else 1e-5),
        system("bf16"),
        device=device,
        lora=LoraConfig(enabled=lora),
    )
    b = batch(episodes, length, SMOLLM2_MOE["vocab_size"])
    # the warm-up step also moves the adapters off zero
    step_s, stats = timed_steps(lrn, b, steps, device)
    t0 = time.perf_counter()
    payload = list(lrn.engine_factors()) if lora else lrn.weights()
    produce_s = time.perf_counter() - t0
    out = {
        "check": "lora" if lora else "full",
        "ok": stats["loss"] == stats["loss"],
        "step_s": step_s,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device != "cpu" else None,
        "trainable_params": stats["trainable_params"],
        "sync_mib": sum(a.nbytes for _, a in payload) / 2**20,
        "sync_produce_s": produce_s,
    }
    if lora:
        out.update(exactness(path, lrn, payload, b[:4], device))
    return out


def exactness(path: str, lrn, payload, episodes, device: str) -> dict:
    from transformers import AutoModelForCausalLM

    from rl.learner.lora import merged_state
    from rollout.weights import CheckpointTensors, merge_adapters

    t0 = time.perf_counter()
    merged = dict(merge_adapters(CheckpointTensors(path), payload))
    merge_s = time.perf_counter() - t0
    want = dict(lrn.weights())
    weight_diff = max(float((t - torch.from_numpy(want[n])).abs().max()) for n, t in merged.items())
    engine = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    engine.load_state_dict(merged_state(lrn.model), strict=True)
    ids = torch.tensor([t.token_ids for t in episodes], device=device)
    gaps = {}
    for precision in (
        "fp32",
        "bf16",
    ):  # fp32: the sync's exactness; bf16: what autocast adds on top
        lps = []
        with (
            torch.no_grad(),
            torch.autocast(
                device_type=torch.device(device).type,
                dtype=torch.bfloat16,
                enabled=precision == "bf16",
            ),
        ):
            for model in (lrn.model, engine):
                logits = model(ids).logits.float()
                lps.append(
                    torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
                )
        gaps[precision] = (lps[0] - lps[1]).abs()
    moved = sum(1 for n in merged if not torch.equal(merged[n], CheckpointTensors(path)[n]))
    return {
        "merged_tensors": len(merged),
        "tensors_moved": moved,
        "merge_s": merge_s,
        "merged_weight_diff_max": weight_diff,
        "logprob_gap_max_fp32": float(gaps["fp32"].max()),
        "logprob_gap_mean_bf16": float(gaps["bf16"].mean()),
        "logprob_gap_max_bf16": float(gaps["bf16"].max()),
        "ok": weight_diff < 1e-5 and float(gaps["fp32"].max()) < 1e-3 and moved > 0,
    }


def main() -> int:
    parsed = command_line(__doc__)
    if parsed is None:
        return 2
    a, device = parsed
    if a.cpu:
        a.episodes, a.length, a.steps = 4, 64, 1
    path = make_model(layers=2 if a.cpu else None)
    rows = []
    for lora in (True, False):
        rows.append(measure(path, device, lora, a.episodes, a.length, a.steps))
        print(json.dumps(rows[-1]), flush=True)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    lo, full = rows
    print(
        f"\n# LoRA vs full fine-tuning on {name}, torch {torch.__version__}; SmolLM2-135M upcycled to 4 experts "
        f"top-1 (random weights), bf16 autocast, {a.episodes} episodes × {a.length} tokens, one optimiser step\n"
    )
    print("| run | trainable params | step s | peak GiB | MiB per sync | s to produce it |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for label, r in (("LoRA r=8 (attention + experts)", lo), ("full fine-tuning", full)):
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "–"
        print(
            f"| {label} | {r['trainable_params']:,} | {r['step_s']:.3f} | {peak} | {r['sync_mib']:.1f} | "
            f"{r['sync_produce_s']:.2f} |"
        )
    peak = f"{lo['peak_gib'] / full['peak_gib']:.2f}×" if lo["peak_gib"] else "–"
    print(
        f"| LoRA / full | {lo['trainable_params'] / full['trainable_params']:.4f}× | {lo['step_s'] / full['step_s']:.2f}× | "
        f"{peak} | {lo['sync_mib'] / full['sync_mib']:.4f}× | |"
    )
    print(
        f"\nAdapter sync exactness: {lo['merged_tensors']} served tensors merged ({lo['tensors_moved']} changed) in "
        f"{lo['merge_s']:.2f} s on the rollout side; largest difference from the learner's merged weights "
        f"{lo['merged_weight_diff_max']:.2e}; log-prob gap adapted learner vs the merged model "
        f"{lo['logprob_gap_max_fp32']:.1e} max in fp32; under bf16 autocast (different rounding of W·x + B·A·x "
        f"and (W + B·A)·x) {lo['logprob_gap_mean_bf16']:.4f} mean, {lo['logprob_gap_max_bf16']:.3f} max."
    )
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
