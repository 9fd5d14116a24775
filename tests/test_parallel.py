"""Expert parallelism + FSDP2 (policy/parallelize.py) against the single-process model: 2 and 4
ranks as Ray actors joined in a gloo process group, one training step on the same batch."""

from __future__ import annotations

import dataclasses
import socket
import sys

import pytest
import ray
import torch

from policy.args import load_model_args
from policy.checkpoint import load_policy, save_policy
from policy.model import Policy

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

LR = 1e-2
MAX_NORM = 0.5


def nll_sum(model, ids_BT):
    logits, _, info = model(ids_BT)
    lp = logits[:, :-1].float().log_softmax(-1).gather(-1, ids_BT[:, 1:, None])[..., 0]
    return -lp.sum(), info


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@ray.remote(num_cpus=0)  # the session's long-lived actors may hold most CPUs
class Rank:
    def __init__(self, rank: int, world: int, port: int):
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        self.rank, self.world = rank, world

    def step(self, ckpt: str, batch: list[list[int]]) -> dict:
        """One AdamW step on this rank's share of `batch` (sequences rank, rank + world, ...), the
        loss scaled by the global token count; returns the global loss, the gradient norm before
        clipping and (rank 0) the full updated state."""
        import torch.distributed as dist

        from policy.parallelize import clip_grad_norm_, gather_full_state, parallelize

        model = parallelize(load_policy(ckpt))
        opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
        total = sum(len(s) - 1 for s in batch)
        mine = torch.tensor(batch[self.rank :: self.world])
        loss, info = nll_sum(model, mine)
        (loss / total).backward()
        grads = gather_full_state(model, grads=True)
        norm = clip_grad_norm_(model, MAX_NORM)
        opt.step()
        loss = loss.detach() / total
        dist.all_reduce(loss)
        state = gather_full_state(model)
        return {"loss": float(loss), "norm": float(norm), "experts": info["experts"].tolist(),
                "state": state if self.rank == 0 else None, "grads": grads if self.rank == 0 else None}

    def close(self):
        import torch.distributed as dist

        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    args = load_model_args("configs/policy/debug.yaml")
    args = dataclasses.replace(args, vision=dataclasses.replace(args.vision, enabled=False), vocab_size=256)
    torch.manual_seed(0)
    model = Policy(args)
    with torch.no_grad():
        for r in model.routers():
            r.bias.normal_(0.0, 0.1)
    return str(save_policy(model, tmp_path_factory.mktemp("parallel-policy")))


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 256, (8, 40), generator=g).tolist()


@pytest.fixture(scope="module")
def reference(ckpt, batch):
    model = load_policy(ckpt)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    total = sum(len(s) - 1 for s in batch)
    loss, info = nll_sum(model, torch.tensor(batch))
    (loss / total).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()
    return {"loss": float(loss.detach()) / total, "norm": float(norm), "experts": info["experts"], "grads": grads,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize("world", [2, 4])
def test_a_sharded_expert_parallel_step_equals_the_single_process_step(ray_cluster, ckpt, batch, reference, world):
    port = free_port()
    ranks = [Rank.remote(r, world, port) for r in range(world)]
    try:
        outs = ray.get([r.step.remote(ckpt, batch) for r in ranks], timeout=600)
    finally:
        ray.get([r.close.remote() for r in ranks])
        for r in ranks:
            ray.kill(r)
    assert all(abs(o["loss"] - reference["loss"]) < 1e-5 for o in outs)
    assert all(abs(o["norm"] - reference["norm"]) < 1e-4 for o in outs)
    assert reference["norm"] > MAX_NORM  # clipping was exercised
    # each rank routed its own rows exactly as the single process did
    for r, o in enumerate(outs):
        assert torch.equal(torch.tensor(o["experts"]), reference["experts"][:, r::world])
    grads = outs[0]["grads"]
    assert grads.keys() == reference["grads"].keys()
    for name, ref in reference["grads"].items():
        assert torch.allclose(grads[name], ref, rtol=1e-4, atol=1e-7), (name, (grads[name] - ref).abs().max())
    # updated weights: AdamW's first step is ~lr·sign(g), so a gradient entry near zero turns float
    # noise into a visible step; the tolerance is a small share of one step
    state = outs[0]["state"]
    assert state.keys() == reference["state"].keys()
    before = load_policy(ckpt).state_dict()
    for name, ref in reference["state"].items():
        assert state[name].shape == ref.shape, name
        assert torch.allclose(state[name], ref, atol=0.01 * LR), (name, (state[name] - ref).abs().max())
    moved = [n for n in before if "w_gate_EFL" in n and not torch.equal(before[n], reference["state"][n])]
    assert moved  # the expert weights were trained, and matched
