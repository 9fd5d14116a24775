"""The collective weight-sync transport (rollout/collective.py, rl/weight_sync/transport.py) with gloo standing in for
NCCL: the same group, bucketing, headers, versioning and timeouts the GPU path uses, between real
processes (Ray actors), then through the whole loop with real vLLM engines, a worker killed
between syncs included."""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch

from rollout.collective import SyncGroup, received_weights


@ray.remote
class Member:
    """A sync-group member without an engine: the sender, or a receiver that keeps what arrived."""

    def address(self) -> str:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return f"127.0.0.1:{s.getsockname()[1]}"

    def join(self, master: str, rank: int, world: int, timeout_s: float = 20.0) -> None:
        self.group = SyncGroup(master, rank, world, "gloo", timeout_s)

    def send(
        self, named, version: int, bucket_mb: float, adapter: bool = False, bf16: bool = False
    ) -> dict:
        return self.group.send(named, version, bucket_mb, adapter=adapter, bf16=bf16)

    def receive(self) -> dict:
        meta, dtypes = {}, {}
        got = {}
        for name, t in received_weights(self.group, meta):
            dtypes[name] = str(t.dtype)
            got[name] = (t.float() if t.dtype == torch.bfloat16 else t.clone()).numpy()
        return {"meta": meta, "tensors": got, "dtypes": dtypes}


def _weights() -> list[tuple[str, np.ndarray]]:
    g = np.random.default_rng(0)
    return [
        (
            "a.weight",
            g.standard_normal((64, 33)).astype(np.float32),
        ),  # 8448 bytes: not a multiple of 16
        ("a.bias", g.standard_normal(33).astype(np.float16)),
        ("steps", np.arange(7, dtype=np.int64)),
        (
            "big",
            g.standard_normal((300, 300)).astype(np.float32),
        ),  # larger than a bucket: one of its own
        ("b.weight", g.standard_normal((5, 3, 2)).astype(np.float64)),
    ]


def _group(n_receivers: int, timeout_s: float = 20.0):
    members = [Member.remote() for _ in range(n_receivers + 1)]
    master = ray.get(members[0].address.remote())
    ray.get([m.join.remote(master, r, len(members), timeout_s) for r, m in enumerate(members)])
    return members[0], members[1:]


def test_a_broadcast_version_arrives_whole_in_every_receiver(ray_cluster):
    sender, receivers = _group(2)
    named = _weights()
    got = [r.receive.remote() for r in receivers]
    sent = ray.get(sender.send.remote(named, 7, 0.1, adapter=True))
    assert sent == {
        "bytes": sum(a.nbytes for _, a in named),
        "buckets": 3,
    }  # 0.1 MiB: [a, bias, steps], [big], [b]
    for out in ray.get(got):
        assert out["meta"] == {"version": 7, "adapter": True, "bytes": sent["bytes"], "buckets": 3}
        assert list(out["tensors"]) == [n for n, _ in named]
        for name, arr in named:
            assert out["tensors"][name].dtype == arr.dtype and np.array_equal(
                out["tensors"][name], arr
            ), name


def test_bf16_bits_arrive_as_bf16_tensors(ray_cluster):
    """bf16 engines under an fp32 learner: the version travels as `to_wire`'s int16 bits and every
    receiver views them back as bf16 (integers stay integers)."""
    from rollout.weights import to_wire

    sender, receivers = _group(1)
    named = [(n, torch.from_numpy(a)) for n, a in _weights()]
    got = receivers[0].receive.remote()
    ray.get(sender.send.remote(list(to_wire(named, torch.bfloat16)), 4, 0.1, bf16=True))
    out = ray.get(got)
    assert out["dtypes"] == {
        "a.weight": "torch.bfloat16",
        "a.bias": "torch.bfloat16",
        "steps": "torch.int64",
        "big": "torch.bfloat16",
        "b.weight": "torch.bfloat16",
    }
    for name, t in named:
        want = t.to(torch.bfloat16).float() if t.is_floating_point() else t
        assert np.array_equal(out["tensors"][name], want.numpy()), name


def test_a_member_that_never_takes_part_fails_the_broadcast_in_time(ray_cluster):
    sender, receivers = _group(2, timeout_s=3.0)
    only_one = receivers[0].receive.remote()  # receiver 2 never calls receive
    with pytest.raises(ray.exceptions.RayTaskError):
        ray.get(sender.send.remote(_weights(), 1, 0.1), timeout=60)
    with pytest.raises(ray.exceptions.RayTaskError):
        ray.get(only_one, timeout=60)


def test_the_collective_transport_needs_the_synchronous_schedule_and_gpus_for_nccl():
    from conftest import REPO
    from rl.config import ConfigError, load_config

    q = REPO / "configs" / "quickstart.yaml"
    with pytest.raises(ConfigError, match="collective needs schedule.mode sync"):
        load_config(q, ["sync.transport=collective", "schedule.mode=async"])
    with pytest.raises(ConfigError, match="nccl needs the learner and the rollout workers on GPUs"):
        load_config(q, ["sync.transport=collective", "sync.backend=nccl"])
    cfg = load_config(q, ["sync.transport=collective"])
    assert cfg.sync_backend() == "gloo"
    cfg.learner.device, cfg.rollout.gpus_per_worker = "cuda", 1.0
    assert cfg.sync_backend() == "nccl"


@pytest.mark.slow
def test_the_loop_syncs_by_broadcast_and_survives_a_killed_worker(
    ray_cluster, tiny_policy, tmp_path
):
    """Two iterations of the quickstart through the collective transport (2 vLLM workers): every
    worker loads each version by broadcast, then a worker killed before the next sync is restarted
    by Ray, the group formed again, and the sync reaches everyone."""
    from conftest import started_trainer

    with started_trainer(
        "quickstart.yaml",
        [
            "iterations=2",
            f"policy.path={tiny_policy}",
            "algo.entropy_coef=0.01",
            "sync.transport=collective",
            "sync.bucket_mb=0.25",
            "rollout.max_new_tokens=16",
            "sync.timeout_s=90",
            "rollout.cpus_per_worker=0.1",
        ],
        tmp_path,
    ) as trainer:
        rows = trainer.run()
        assert [r["sync_version"] for r in rows] == [1, 2]
        assert all(r["sync_buckets"] > 1 and r["sync_workers_lost"] == 0 for r in rows)
        assert ray.get([w.version.remote() for w in trainer.workers]) == [2, 2]
        # the engines serve the learner's weights: the same log-probs for one sequence
        ids = list(range(5, 45))
        ours = np.array(trainer.learner.call("logprobs", ids))
        for w in trainer.workers:
            assert np.abs(np.array(ray.get(w.score.remote(ids))) - ours).max() < 1e-3

        ray.kill(trainer.workers[1], no_restart=False)
        batch = list(trainer.store.trajectories(trainer.store.shards()[-1]))
        # 3, on the learner only
        trainer.version = trainer.learner.call("train_step", batch)["policy_version"]
        out = trainer.sync_now()
        assert out["sync_workers_lost"] == 1 and trainer.worker_restarts == 1
        assert ray.get([w.version.remote() for w in trainer.workers]) == [3, 3]
