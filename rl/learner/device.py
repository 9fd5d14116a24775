"""Where the learner trains, and in what precision (config: `learner.device`, `learner.precision`).

`cpu` trains in fp32 (or bf16 autocast) with gloo between ranks; `cuda` puts each rank's model,
micro-batches and optimizer state on its GPU with NCCL between ranks. `auto` is `cuda` where the
learner's process sees a GPU (Ray gives a rank one when `learner.device` is `cuda`, or `auto` on a
cluster with GPUs), else `cpu`, decided on the learner's node, not the driver's.

bf16 is mixed precision: the weights, their gradients and AdamW's state stay fp32 (the master
copy); the forward and backward run under `torch.autocast` in bf16, and the log-probs, the loss
and the importance weights are computed in fp32 from the bf16 logits. The engine samples in its
own precision, so the learner/engine log-prob gap grows; truncated importance weights
(`algo.tis_cap`) correct it, and `rollout_logprob_diff_*` reports it. Autocast does not reach a
Hugging Face MoE's fused experts (transformers multiplies them with `torch._grouped_mm`, in the
weights' fp32): rl/learner/hf_experts.py runs them in bf16 too.

Not covered: fp16 (no loss scaling here), bf16 master weights, several GPUs per rank.
"""

from __future__ import annotations

import contextlib

import torch


def resolve(device: str) -> torch.device:
    """`cpu`, `cuda` (this process's current GPU) or `auto` as a torch device; `cuda` where no
    GPU is visible raises, naming the setting."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                "learner.device is cuda, but this learner process sees no GPU "
                "(torch.cuda.is_available() is False)"
            )
        return torch.device("cuda", torch.cuda.current_device())
    if device != "cpu":
        raise ValueError(f"learner.device must be cpu, cuda or auto, got {device!r}")
    return torch.device("cpu")


def backend(setting: str, device: torch.device) -> str:
    """The process-group backend: `auto` is nccl on GPUs and gloo on CPU."""
    if setting == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if setting == "nccl" and device.type != "cuda":
        raise ValueError("learner.backend nccl needs the learner on GPUs (learner.device cuda)")
    return setting


def autocast(device: torch.device, precision: str):
    """The forward/backward context of `precision` on `device` (a no-op for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    raise ValueError(f"learner.precision must be fp32 or bf16, got {precision!r}")
