"""GPU check for issue 11 (run by hand when a GPU machine is lent; CI never runs it).

The same equality the gloo tests assert (tests/test_parallel.py, tests/test_learner_group.py), on
CUDA tensors with the NCCL backend: one AdamW step of the `policy/` debug model and of the tiny
Hugging Face Qwen3-MoE, parallelized (expert parallelism + FSDP2 over a one-rank NCCL group, so the
all-to-all dispatch, the reduce-scatters and the all-gathers all run through NCCL) against the
same step of the plain model. Prints one JSON line per model and exits 1 if a check fails.

    python bench/gpu_parallel_check.py            # one GPU: world size 1
    torchrun --nproc-per-node N bench/gpu_parallel_check.py   # N GPUs (each rank its share)
    python bench/gpu_parallel_check.py --cpu      # the same script on CPU with gloo (a dry run)
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LR, MAX_NORM = 1e-2, 0.5


def nll(logits_BTV, ids_BT):
    return -logits_BTV[:, :-1].float().log_softmax(-1).gather(-1, ids_BT[:, 1:, None])[..., 0].sum()


def step(model, forward, ids_BT, total: int, parallel: bool) -> tuple[float, float]:
    from policy.parallelize import clip_grad_norm_, fill_expert_grads

    # a sharded model mixes DTensors (FSDP) and plain tensors (expert blocks): the per-tensor update,
    # since torch 2.11's multi-tensor (foreach) kernels refuse such a mix
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False if parallel else None)
    loss = nll(forward(model, ids_BT), ids_BT) / total
    loss.backward()
    if parallel:
        fill_expert_grads(model)
        norm = clip_grad_norm_(model, MAX_NORM)
        loss = loss.detach().clone()
        dist.all_reduce(loss)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        loss = loss.detach()
    opt.step()
    return float(loss), float(norm)


def check(name: str, make, parallelize, forward, vocab: int) -> bool:
    from policy.parallelize import gather_full_state

    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available() and CUDA
        else torch.device("cpu")
    )
    g = torch.Generator().manual_seed(3)
    batch = torch.randint(2, vocab, (4 * world, 48), generator=g).to(device)
    total = batch.shape[0] * (batch.shape[1] - 1)
    plain = make().to(device)
    sharded = copy.deepcopy(plain)
    ref_loss, ref_norm = step(plain, forward, batch, total, parallel=False)
    parallelize(sharded)
    loss, norm = step(sharded, forward, batch[rank::world], total, parallel=True)
    state = gather_full_state(sharded)
    ref = plain.state_dict()
    worst = max(float((state[k].float() - ref[k].float()).abs().max()) for k in ref)
    ok = abs(loss - ref_loss) < 1e-4 and abs(norm - ref_norm) < 1e-3 and worst < 0.02 * LR
    if rank == 0:
        print(
            json.dumps(
                {
                    "model": name,
                    "backend": dist.get_backend(),
                    "world_size": world,
                    "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "loss": loss,
                    "loss_single": ref_loss,
                    "grad_norm": norm,
                    "grad_norm_single": ref_norm,
                    "max_weight_diff": worst,
                    "tolerance": 0.02 * LR,
                    "ok": ok,
                }
            ),
            flush=True,
        )
    return ok


CUDA = "--cpu" not in sys.argv


def main() -> int:
    if CUDA and not torch.cuda.is_available():
        print(
            "no CUDA device: this check is for a GPU machine (--cpu runs it with gloo)",
            file=sys.stderr,
        )
        return 2
    if "RANK" not in os.environ:  # plain `python`: a one-rank group
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517"
        )
    if CUDA:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if CUDA else "gloo")
    import dataclasses

    from transformers import AutoConfig, AutoModelForCausalLM

    from policy.args import load_model_args
    from policy.model import Policy
    from policy.parallelize import parallelize, parallelize_hf
    from rl.start.tiny import make_tiny_qwen3_moe

    args = load_model_args(str(Path(__file__).resolve().parents[1] / "configs/policy/debug.yaml"))
    args = dataclasses.replace(args, vision=dataclasses.replace(args.vision, enabled=False))

    def make_policy():
        torch.manual_seed(0)
        return Policy(args)

    ok = check("policy/debug", make_policy, parallelize, lambda m, ids: m(ids)[0], args.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_qwen3_moe(Path(tmp) / "tiny", seed=0) if dist.get_rank() == 0 else None
        box = [str(path) if path else None]
        dist.broadcast_object_list(box)
        ok &= check(
            "hf/tiny-qwen3-moe",
            lambda: AutoModelForCausalLM.from_pretrained(box[0], dtype=torch.float32),
            parallelize_hf,
            lambda m, ids: m(input_ids=ids).logits,
            AutoConfig.from_pretrained(box[0]).vocab_size,
        )
        dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
