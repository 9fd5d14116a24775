"""GPU check for issue 26 (run when a GPU machine is lent; CI never runs it): the CUDA IPC weight sync
on its own, needing only torch with CUDA and transformers (no vLLM, no Ray).

A learner process writes a Mixtral-style MoE's weights, cast to bf16, into a slab in its GPU's
memory (rl/learner/shared_weights.py `SharedPublisher`, the layout the engines read); a second process, as a
rollout worker's engine would, maps the slab through CUDA IPC (rollout/shared_memory.py
`SlabReader`), copies every checkpoint-named tensor into its own parameters, and checks each one's
bits against what the learner meant to send. Then the learner starts the next version in the same
slab while the reader is still reading, and the reader must see the header change. Printed: the
publish (the cast) and the load against one device-to-device copy of the same bytes, each side's.

    python bench/gpu_ipc_check.py [--hidden 1024] [--layers 8] [--experts 8] [--cpu]

It stops with one line and exit 2 where no GPU is visible. `--cpu` runs the same steps through a
host-memory slab (the memfd path), a dry run of everything but CUDA itself.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _bits_sum(t):
    """An exact fingerprint of a tensor's bits (the same bits, the same integer)."""
    import torch

    t = t.contiguous()
    return int(t.view(torch.int16 if t.element_size() == 2 else torch.int32).to(torch.int64).sum())


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _copy_seconds(nbytes: int, device) -> float:
    import torch

    a = torch.ones(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    _sync(device)
    t0 = time.perf_counter()
    b.copy_(a)
    _sync(device)
    return time.perf_counter() - t0


def reader(address, entries, expected, to_learner, from_learner, out) -> None:
    """The engine's side, in its own process: map, copy into its own tensors, check, time."""
    import torch

    from rollout.shared_memory import SlabReader, view, written_version

    slab = SlabReader().open(address)
    params = [
        torch.empty(ref.shape, dtype=getattr(torch, ref.dtype), device=slab.device)
        for _, ref in entries
    ]
    for dst, (_, ref) in zip(params, entries):  # a warm-up load (the engine's first)
        dst.copy_(view(slab, ref))
    _sync(slab.device)
    t0 = time.perf_counter()
    for dst, (_, ref) in zip(params, entries):
        dst.copy_(view(slab, ref))
    _sync(slab.device)
    load_s = time.perf_counter() - t0
    wrong = [
        name for (name, _), dst, want in zip(entries, params, expected) if _bits_sum(dst) != want
    ]
    seen = written_version(slab)
    to_learner.put("rewrite")  # the learner starts the next version in this slab now
    from_learner.get(timeout=120)
    out.put(
        {
            "load_s": load_s,
            "copy_s": _copy_seconds(sum(p.nbytes for p in params), slab.device),
            "wrong": wrong,
            "version_seen": seen,
            "version_after_rewrite": written_version(slab),
        }
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--cpu", action="store_true", help="a dry run through host memory")
    a = ap.parse_args()
    import torch
    import torch.multiprocessing as mp

    if not a.cpu and not torch.cuda.is_available():
        print("error: no GPU here (this check needs torch with CUDA)", file=sys.stderr)
        return 2
    from transformers import MixtralConfig, MixtralForCausalLM

    from rl.learner.logprobs import CausalLM
    from rl.learner.shared_weights import SharedPublisher, layout
    from rl.learner.weight_source import _untied

    device = torch.device("cpu") if a.cpu else torch.device("cuda", 0)
    cfg = MixtralConfig(
        vocab_size=32000,
        hidden_size=a.hidden,
        intermediate_size=2 * a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        num_local_experts=a.experts,
        num_experts_per_tok=2,
    )
    model = MixtralForCausalLM(cfg).to(device)
    lm = CausalLM(model, "hf")
    named = list(_untied((n, t.detach()) for n, t in model.state_dict().items()))
    pub = SharedPublisher(layout(lm, named, torch.bfloat16), max_slabs=1)

    def publish(version):
        t0 = time.perf_counter()
        plan = pub.plan(version, 256, iter(named), device)
        entries = [e for i in range(len(plan["names"])) for e in pub.take(i)]
        return plan, entries, time.perf_counter() - t0

    publish(1)  # a warm-up (the slab's allocation)
    pub.release(1)
    plan, entries, publish_s = publish(2)
    expected = [
        _bits_sum(t) for _, t in lm.checkpoint_names((n, t.to(torch.bfloat16)) for n, t in named)
    ]
    ctx = mp.get_context("spawn")
    to_learner, from_learner, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    p = ctx.Process(
        target=reader, args=(plan["shared"], entries, expected, to_learner, from_learner, out)
    )
    p.start()
    to_learner.get(timeout=300)
    pub.release(2)
    # marks the slab -1 (being written): the reader must see it
    pub.plan(3, 256, iter(named), device)
    from_learner.put("done")
    r = out.get(timeout=300)
    p.join(60)
    nbytes = sum(plan["bytes"])
    copy_s = _copy_seconds(nbytes, device)
    where = "host memory (--cpu)" if a.cpu else torch.cuda.get_device_name(device)
    print(
        f"# CUDA IPC weight sync on {where}: Mixtral-style MoE, hidden {a.hidden}, "
        f"{a.layers} layers, {a.experts} experts, fp32 learner, bf16 engine; {len(entries)} tensors, {nbytes / 2**20:,.0f} MiB\n"
    )
    print("| step | s | one device copy of the bytes s | ratio |")
    print("| --- | ---: | ---: | ---: |")
    print(
        f"| publish (the cast into the slab) | {publish_s:.4f} | {copy_s:.4f} | {publish_s / copy_s:.1f}× |"
    )
    print(
        f"| load in the other process (copies into its tensors) | {r['load_s']:.4f} | {r['copy_s']:.4f} | "
        f"{r['load_s'] / r['copy_s']:.1f}× |"
    )
    print(
        f"\ntensors whose bits differ: {len(r['wrong'])}; header read {r['version_seen']} (want 2), "
        f"after the learner began version 3: {r['version_after_rewrite']} (want -1)"
    )
    ok = (
        not r["wrong"]
        and r["version_seen"] == 2
        and r["version_after_rewrite"] == -1
        and p.exitcode == 0
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
