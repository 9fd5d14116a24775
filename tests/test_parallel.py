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
pytestmark = pytest.mark.slow

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
    """One rank: the policy parallelized over the group, its AdamW, and the collective calls the
    test drives (every rank gets the same call)."""

    def __init__(self, rank: int, world: int, port: int, ckpt: str):
        import torch.distributed as dist

        from policy.parallelize import parallelize

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        self.rank, self.world = rank, world
        self.model = parallelize(load_policy(ckpt))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, foreach=False)

    def step(self, batch: list[list[int]]) -> dict:
        """One AdamW step on this rank's share of `batch` (sequences rank, rank + world, ...), the
        loss scaled by the global token count; returns the global loss, the gradient norm before
        clipping, this rank's routing and (rank 0) the full gradients."""
        import torch.distributed as dist

        from policy.parallelize import clip_grad_norm_, gather_full_state

        self.opt.zero_grad()
        total = sum(len(s) - 1 for s in batch)
        loss, info = nll_sum(self.model, torch.tensor(batch[self.rank :: self.world]))
        (loss / total).backward()
        grads = gather_full_state(self.model, grads=True)
        norm = clip_grad_norm_(self.model, MAX_NORM)
        self.opt.step()
        loss = loss.detach() / total
        dist.all_reduce(loss)
        return {
            "loss": float(loss),
            "norm": float(norm),
            "experts": info["experts"].tolist(),
            "grads": grads if self.rank == 0 else None,
        }

    def head_apart_step(self, ckpt: str, batch: list[list[int]]) -> dict:
        """The learner's way: a fresh model whose root unit is its trunk (`HiddenStates`), the
        log-probs projected by `rl.learner.logprobs.chunked_logprobs` with the head read after the forward
        (small chunks, recomputed in backward); returns the full gradients (rank 0)."""
        from policy.parallelize import HiddenStates, gather_full_state, parallelize
        from rl.learner.logprobs import chunked_logprobs

        policy = load_policy(ckpt)
        trunk = HiddenStates(policy)
        parallelize(policy, root=trunk)
        total = sum(len(s) - 1 for s in batch)
        ids = torch.tensor(batch[self.rank :: self.world])
        h, _ = trunk(ids)
        lp, _ = chunked_logprobs(h, policy.lm_head, ids, chunk_tokens=8)
        (-lp.sum() / total).backward()
        grads = gather_full_state(trunk, grads=True)
        return {k.removeprefix("policy."): v for k, v in grads.items()} if self.rank == 0 else None

    def state(self):
        from policy.parallelize import gather_full_state

        state = gather_full_state(self.model)
        return state if self.rank == 0 else None

    def save(self, path: str):
        from policy.parallelize import save_sharded

        save_sharded(self.model, self.opt, path)

    def load(self, path: str):
        from policy.parallelize import load_sharded

        load_sharded(self.model, self.opt, path)

    def publish(self, bucket_mb: float):
        from policy.parallelize import iter_full_weights
        from rollout.weights import publish

        if self.rank == 0:
            return publish(((n, t.numpy()) for n, t in iter_full_weights(self.model)), 1, bucket_mb)
        for _ in iter_full_weights(self.model):
            pass

    def close(self):
        import torch.distributed as dist

        dist.destroy_process_group()


class Group:
    """`world` Rank actors in one process group; `call` runs a method on all and returns their results."""

    def __init__(self, world: int, ckpt: str):
        port = free_port()
        self.ranks = [Rank.remote(r, world, port, ckpt) for r in range(world)]

    def call(self, method: str, *args):
        return ray.get([getattr(r, method).remote(*args) for r in self.ranks], timeout=600)

    def close(self):
        self.call("close")
        for r in self.ranks:
            ray.kill(r)


def single_process_steps(ckpt, batches):
    model = load_policy(ckpt)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    outs = []
    for batch in batches:
        opt.zero_grad()
        total = sum(len(s) - 1 for s in batch)
        loss, info = nll_sum(model, torch.tensor(batch))
        (loss / total).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        outs.append(
            {
                "loss": float(loss.detach()) / total,
                "norm": float(norm),
                "experts": info["experts"],
                "grads": grads,
                "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            }
        )
    return outs


def assert_state_close(state, ref, atol, grads=None):
    """Every tensor within `atol`. With the reference's `grads` (one AdamW step from the same start),
    entries whose gradient is near zero only have to stay within one step: Adam's first step is
    lr·g/(|g| + eps), so where |g| is within a few orders of eps, gradient noise the gradient check
    allows (atol 1e-7) moves the step by several per cent of lr, whatever the kernels' rounding."""
    assert state.keys() == ref.keys()
    for name, r in ref.items():
        assert state[name].shape == r.shape, name
        diff = (state[name] - r).abs()
        tiny = (
            grads[name].abs() < 1e-5
            if grads is not None and name in grads
            else torch.zeros_like(diff, dtype=torch.bool)
        )
        assert bool((diff[~tiny] <= atol).all()), (name, diff[~tiny].max())
        assert bool((diff[tiny] <= 2 * LR).all()), (
            name,
            diff[tiny].max(),
        )  # within one step (|Adam step| <= lr)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    args = load_model_args("configs/policy/debug.yaml")
    args = dataclasses.replace(
        args, vision=dataclasses.replace(args.vision, enabled=False), vocab_size=256
    )
    torch.manual_seed(0)
    model = Policy(args)
    with torch.no_grad():
        for r in model.routers():
            r.bias.normal_(0.0, 0.1)
    return str(save_policy(model, tmp_path_factory.mktemp("parallel-policy")))


@pytest.fixture(scope="module")
def batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (8, 40), generator=g).tolist() for _ in range(2)]


@pytest.fixture(scope="module")
def reference(ckpt, batches):
    return single_process_steps(ckpt, batches)


@pytest.fixture(scope="module")
def first_steps(ray_cluster, ckpt, batches):
    """A 2-rank and a 4-rank group (started once: actor start-up is most of the cost), each after
    one step on the first batch from the same initial weights."""
    groups = {world: Group(world, ckpt) for world in (2, 4)}
    try:
        yield {
            world: (g, g.call("step", batches[0]), g.call("state")[0])
            for world, g in groups.items()
        }
    finally:
        for g in groups.values():
            g.close()


@pytest.mark.parametrize("world", [2, 4])
def test_a_sharded_expert_parallel_step_equals_the_single_process_step(
    ckpt, first_steps, reference, world
):
    _, outs, state = first_steps[world]
    ref = reference[0]
    assert all(abs(o["loss"] - ref["loss"]) < 1e-5 for o in outs)
    assert all(abs(o["norm"] - ref["norm"]) < 1e-4 for o in outs)
    assert ref["norm"] > MAX_NORM  # clipping was exercised
    for r, o in enumerate(outs):  # each rank routed its own rows exactly as the single process did
        assert torch.equal(torch.tensor(o["experts"]), ref["experts"][:, r::world])
    grads = outs[0]["grads"]
    assert grads.keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        assert torch.allclose(grads[name], g, rtol=1e-4, atol=1e-7), (
            name,
            (grads[name] - g).abs().max(),
        )
    # updated weights: AdamW's first step is ~lr·sign(g), so a gradient entry near zero turns float
    # noise into a visible step; the tolerance is a small share of one step
    assert_state_close(state, ref["state"], atol=0.01 * LR, grads=ref["grads"])
    before = load_policy(ckpt).state_dict()
    # experts trained
    assert any(not torch.equal(before[n], ref["state"][n]) for n in before if "w_gate_EFL" in n)


def test_a_sharded_checkpoint_resumes_on_another_number_of_ranks_and_publishes_full_weights(
    first_steps, batches, reference, tmp_path
):
    """The 2-rank group's state after step 1, saved sharded, loaded by the 4-rank group (parameters
    and AdamW moments re-cut, its own step 1 overwritten); step 2 there equals two single-process
    steps. Then the 4 ranks publish their weights through the sync path, gathered a tensor at a
    time, and a rollout worker's view equals them."""
    from rollout.weights import iter_weights

    two, _, saved = first_steps[2]
    four = first_steps[4][0]
    two.call("save", str(tmp_path / "sharded"))
    assert len(list((tmp_path / "sharded").glob("*.distcp"))) == 2  # one file of shards per rank
    four.call("load", str(tmp_path / "sharded"))
    assert_state_close(four.call("state")[0], saved, atol=0)  # exactly what was saved
    out = four.call("step", batches[1])
    assert abs(out[0]["loss"] - reference[1]["loss"]) < 1e-4
    state = four.call("state")[0]
    # near-zero gradients of step 2 move Adam's step by their noise (see assert_state_close)
    assert_state_close(state, reference[1]["state"], atol=0.02 * LR, grads=reference[1]["grads"])
    manifest = four.call("publish", 0.01)[0]
    assert len(manifest.buckets) > 3
    published = {n: torch.from_numpy(a.copy()) for n, a in iter_weights(manifest)}
    assert_state_close(published, state, atol=0)


def test_the_head_applied_apart_from_the_sharded_trunk_gets_the_single_process_gradients(
    first_steps, ckpt, batches, reference
):
    """The learner projects hidden states to log-probs itself (chunked, outside the model's forward):
    with the trunk as the root unit, every gradient still equals the single-process one."""
    grads = first_steps[2][0].call("head_apart_step", ckpt, batches[0])[0]
    ref = reference[0]["grads"]
    assert grads.keys() == ref.keys()
    for name, g in ref.items():
        assert torch.allclose(grads[name], g, rtol=1e-4, atol=1e-7), (
            name,
            (grads[name] - g).abs().max(),
        )
