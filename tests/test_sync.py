"""Weight sync pieces on the session's local Ray: bucketing, publish → fetch round trip, and the
deadline that names a worker that never loads. (Engines loading real weights through it: test_e2e
and test_async.)"""

import sys
import time

import numpy as np
import pytest
import ray

from rl.config import ConfigError, load_config
from rl.weight_sync.transport import start_sync
from rollout.weights import Manifest, bucketize, iter_weights, publish, to_wire

# the helpers below run in Ray workers, which cannot import this test module: ship them by value
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _named(sizes):
    rng = np.random.default_rng(0)
    return [(f"w{i}", rng.standard_normal(n).astype(np.float32)) for i, n in enumerate(sizes)]


def test_buckets_are_bounded_ordered_and_cover_every_tensor_once():
    named = _named([10, 300, 5, 5, 5, 1000, 7])  # 4 bytes each: 40, 1200, 20, 20, 20, 4000, 28
    groups = list(bucketize(named, max_bytes=1024))
    assert [n for g in groups for n, _ in g] == [n for n, _ in named]
    for g in groups:
        size = sum(a.nbytes for _, a in g)
        assert size <= 1024 or len(g) == 1  # only a tensor larger than the bound sits alone over it
    assert [[n for n, _ in g] for g in groups] == [
        ["w0"],
        ["w1"],
        ["w2", "w3", "w4"],
        ["w5"],
        ["w6"],
    ]
    assert list(bucketize([], 1024)) == []


def test_buckets_are_cut_as_the_source_streams():
    """A bucket is handed on as soon as it is full: a streamed source (a sharded learner gathering
    one tensor at a time) is read only one array past the bucket being handed on."""
    pulled = []

    def source():
        for name, arr in _named([100, 100, 100, 100, 100]):  # 400 bytes each: two per 1 KiB bucket
            pulled.append(name)
            yield name, arr

    seen = []
    for g in bucketize(source(), max_bytes=1024):
        seen.append((len(pulled), [n for n, _ in g]))
    assert seen == [(3, ["w0", "w1"]), (5, ["w2", "w3"]), (5, ["w4"])]


def test_published_buckets_round_trip_through_the_object_store(ray_cluster):
    named = _named([1000, 2000, 50, 3000])

    @ray.remote(num_cpus=0)  # the session's long-lived actors may hold most CPUs
    def publisher(bucket_mb):
        return publish(named, version=7, bucket_mb=bucket_mb)

    @ray.remote(num_cpus=0)  # the session's long-lived actors may hold most CPUs
    def reader(manifest):  # what a rollout worker does: fetch bucket by bucket
        return [(n, a.copy()) for n, a in iter_weights(manifest)]

    manifest = ray.get(publisher.remote(8200 / (1 << 20)))  # [4000], [8000, 200], [12000] bytes
    assert isinstance(manifest, Manifest) and manifest.version == 7
    assert len(manifest.buckets) == 3 and manifest.nbytes == sum(a.nbytes for _, a in named)
    got = ray.get(reader.remote(manifest))
    assert [n for n, _ in got] == [n for n, _ in named]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(got, named))


def test_bf16_engines_are_sent_bf16_bits_and_load_bf16_tensors(ray_cluster):
    """An fp32 learner syncing bf16 engines (`rollout.dtype: bfloat16`): floating tensors travel cast
    to bf16 as int16 bit patterns (half the bytes; numpy has no bfloat16) and come out of the object
    store as bf16 tensors equal to the learner's rounded to bf16; integer tensors travel unchanged.
    An fp32 sync sends the learner's arrays as they are."""
    import torch

    g = torch.Generator().manual_seed(0)
    named = [
        ("a.weight", torch.randn(64, 33, generator=g)),
        ("steps", torch.arange(7)),
        ("b.weight", torch.randn(300, 3, generator=g, dtype=torch.float64)),
    ]
    wire = list(to_wire(named, torch.bfloat16))
    assert [a.dtype for _, a in wire] == [np.int16, np.int64, np.int16]
    assert wire[0][1].nbytes == named[0][1].numel() * 2

    @ray.remote(num_cpus=0)
    def reader(manifest):
        return [
            (
                n,
                t.dtype,
                t.float().numpy()
                if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16
                else t.copy(),
            )
            for n, t in iter_weights(manifest)
        ]

    manifest = publish(wire, version=2, bucket_mb=0.01, bf16=True)
    assert manifest.bf16 and manifest.nbytes == 64 * 33 * 2 + 7 * 8 + 300 * 3 * 2
    got = ray.get(reader.remote(manifest))
    assert [(n, d) for n, d, _ in got] == [
        ("a.weight", torch.bfloat16),
        ("steps", np.int64),
        ("b.weight", torch.bfloat16),
    ]
    for (name, t), (_, _, arr) in zip(named, got):
        want = t.to(torch.bfloat16).float().numpy() if t.is_floating_point() else t.numpy()
        assert np.array_equal(arr, want), name
    assert all(
        np.array_equal(a, t.numpy())
        for (_, a), (_, t) in zip(to_wire(named[:2], torch.float32), named[:2])
    )
    with pytest.raises(ValueError, match="x is an int16 tensor"):
        list(to_wire([("x", torch.zeros(3, dtype=torch.int16))], torch.bfloat16))


@ray.remote(num_cpus=0)
class _Learner:
    """Publishes whole, as a learner group does (no plan)."""

    version = 3

    def plan_publish(self, bucket_mb):
        return None

    def publish(self, bucket_mb):
        return publish(_named([100]), self.version, bucket_mb)


@ray.remote(num_cpus=0)
class _StreamingLearner:
    """Streams as a single `Learner` does (the same `Outgoing`), `delay_s` to cut each bucket; or
    cuts bucket `fail_at` from weights that no longer match the plan."""

    def __init__(self, sizes, delay_s=0.0, fail_at=None):
        import rollout.weights  # noqa: F401  (imports torch: not on the clock of the first sync)

        self.named, self.delay_s, self.fail_at = _named(sizes), delay_s, fail_at
        self.cut_at = []

    def plan_publish(self, bucket_mb):
        from rollout.weights import Outgoing

        named = (
            self.named
            if self.fail_at is None
            else self.named[: self.fail_at] + [("renamed", self.named[-1][1])]
        )
        self.out = Outgoing([(n, a.nbytes) for n, a in self.named], iter(named), 5, bucket_mb)
        return self.out.plan

    def publish_bucket(self, index):
        time.sleep(self.delay_s)
        self.cut_at.append(time.time())
        return self.out.take(index)

    def publish_seconds(self):
        return time.perf_counter() - self.out.started

    def cuts(self):
        return self.cut_at


@ray.remote(num_cpus=0)
class _Reader:
    """A rollout worker's fetch: when each bucket's arrays arrived, and what they were."""

    def load_weights(self, manifest):
        got, at = [], []
        for name, arr in iter_weights(manifest):
            got.append((name, arr.copy()))
            at.append(time.time())
        return {
            "version": manifest.version,
            "load_s": 0.0,
            "bytes": manifest.nbytes,
            "buckets": len(manifest.buckets),
            "got": got,
            "at": at,
        }


def test_a_single_learner_streams_its_buckets_to_the_workers(ray_cluster):
    """The streamed publish (rl/weight_sync/transport.py `start_sync`, rollout/weights.py `Outgoing`): the workers get
    every tensor exactly, in order, and start on the first bucket while the learner still cuts the
    later ones; the metrics count the learner's own seconds."""
    sizes = [1000, 2000, 50, 3000, 500]  # float32: 4000, 8000, 200, 12000, 2000 bytes
    learner, readers = (
        _StreamingLearner.remote(sizes, delay_s=0.5),
        [_Reader.remote() for _ in range(2)],
    )
    assert ray.get(learner.cuts.remote()) == []  # started, torch imported
    pending = start_sync(learner, readers, 8200 / (1 << 20))
    assert pending.publish_s < 0.5  # the driver did not wait for the buckets
    metrics = pending.finish(timeout_s=60)
    cuts = ray.get(learner.cuts.remote())
    assert len(cuts) == 4 and metrics["sync_buckets"] == 4 and metrics["sync_version"] == 5
    assert metrics["sync_publish_s"] >= 4 * 0.5
    for out in ray.get(list(pending.futures)):
        assert [n for n, _ in out["got"]] == [n for n, _ in _named(sizes)]
        assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(out["got"], _named(sizes)))
        # bucket 0 loaded while buckets 2 and 3 were still to cut
        assert out["at"][0] < cuts[-1] - 1.0


def test_a_bucket_cut_otherwise_than_planned_fails_the_sync_naming_the_learner(ray_cluster):
    learner = _StreamingLearner.remote([100, 100, 100], fail_at=2)
    with pytest.raises(
        RuntimeError, match=r"version 5: the learner failed to publish it: .*bucket 2 was planned"
    ):
        start_sync(learner, [_Reader.remote()], 500 / (1 << 20)).finish(timeout_s=60)


@ray.remote(num_cpus=0)
class _Worker:
    """Stands in for a rollout worker whose engine hangs, or reports the wrong version."""

    def __init__(self, delay_s, version_offset=0):
        self.delay_s, self.offset = delay_s, version_offset

    def load_weights(self, manifest):
        list(iter_weights(manifest))
        time.sleep(self.delay_s)
        return {
            "version": manifest.version + self.offset,
            "load_s": self.delay_s,
            "bytes": manifest.nbytes,
            "buckets": len(manifest.buckets),
        }


def test_a_worker_that_does_not_load_in_time_is_named(ray_cluster):
    learner = _Learner.remote()
    workers = [_Worker.remote(0.0), _Worker.remote(30.0)]
    with pytest.raises(
        TimeoutError, match=r"version 3: rollout worker 1 did not load it within 2s"
    ):
        start_sync(learner, workers, 1.0).finish(timeout_s=2)
    metrics = start_sync(learner, workers[:1], 1.0).finish(timeout_s=30)
    assert (
        metrics["sync_version"] == 3
        and metrics["sync_bytes"] == 400
        and metrics["sync_buckets"] == 1
    )
    assert metrics["sync_wall_s"] >= metrics["sync_publish_s"] > 0
    for a in workers:
        ray.kill(a)


def test_a_worker_reporting_another_version_is_named(ray_cluster):
    learner = _Learner.remote()
    workers = [_Worker.remote(0.0), _Worker.remote(0.0, version_offset=-1)]
    with pytest.raises(RuntimeError, match=r"rollout worker 1 reports version 2, expected 3"):
        start_sync(learner, workers, 1.0).finish(timeout_s=30)


@ray.remote(num_cpus=0)  # it only sleeps: placed whatever the session's other actors hold
class _LoadTurn:
    """What a rollout worker's load does around the engine's load, in a process of its own."""

    def ready(self) -> bool:
        import rollout.worker  # noqa: F401  (imported before the clock starts)

        return True

    def hold(self, gpus: float, serial: bool, hold_s: float) -> tuple[float, float]:
        """Hold the engine's load turn `hold_s`; when it was held."""
        from types import SimpleNamespace

        from rollout.config import RolloutConfig
        from rollout.worker import RolloutWorker

        stand_in = SimpleNamespace(cfg=RolloutConfig(gpus_per_worker=gpus, serial_cpu_loads=serial))
        with RolloutWorker._node_load_turn(stand_in):
            start = time.time()
            time.sleep(hold_s)
            return start, time.time()


@pytest.mark.parametrize(
    "gpus,serial,overlap", [(0.0, True, False), (0.0, False, True), (1.0, True, True)]
)
def test_cpu_engines_of_a_node_load_one_at_a_time(ray_cluster, gpus, serial, overlap):
    """Two workers' loads in two processes of one node: on CPU they take turns (each engine's threads
    use every core), unless `serial_cpu_loads` is off; GPU engines never wait for each other. The two
    processes are started first and reserve no CPU: late in a loaded test session two such tasks ran
    one after the other (a new process slower to start than one hold, or no CPU left to place it),
    which made loads that may overlap look serial."""
    holders = [_LoadTurn.remote() for _ in range(2)]
    try:
        assert ray.get([h.ready.remote() for h in holders], timeout=120) == [True, True]
        (a0, a1), (b0, b1) = sorted(
            ray.get([h.hold.remote(gpus, serial, 2.5) for h in holders], timeout=120)
        )
    finally:
        for h in holders:
            ray.kill(h)
    assert (b0 < a1) == overlap, ((a0, a1), (b0, b1))


def test_schedule_and_sync_settings_are_validated():
    with pytest.raises(ConfigError, match="schedule.max_staleness must be >= 1 in async mode"):
        load_config(None, ["schedule.mode=async", "schedule.max_staleness=0"])
    with pytest.raises(ConfigError, match="schedule.mode must be one of 'sync', 'async'"):
        load_config(None, ["schedule.mode=eventually"])
    with pytest.raises(ConfigError, match="sync.bucket_mb must be > 0"):
        load_config(None, ["sync.bucket_mb=0"])
    assert (
        load_config(
            None, ["schedule.mode=async", "schedule.max_staleness=2"]
        ).schedule.max_staleness
        == 2
    )
    # streamed syncs: on GPUs by default, not where the learner and the engines share a node's CPUs
    assert not load_config(None, []).sync_streams()
    assert load_config(None, ["rollout.gpus_per_worker=1"]).sync_streams()
    assert load_config(None, ["sync.publish=streamed"]).sync_streams()
    assert not load_config(None, ["sync.publish=whole", "rollout.gpus_per_worker=1"]).sync_streams()
    with pytest.raises(ConfigError, match="sync.publish must be one of"):
        load_config(None, ["sync.publish=sometimes"])


@pytest.mark.slow
def test_the_loop_trains_fp32_and_rolls_out_with_bf16_engines(ray_cluster, tiny_policy, tmp_path):
    """`rollout.dtype: bfloat16` under an fp32 policy: the engines load the checkpoint in bf16, each
    sync sends half the bytes of the learner's fp32 weights, the engines then serve those weights
    rounded to bf16 (their log-probs within bf16's error of the learner's, far closer than the
    version they started from), and the gap is measured
    in the metrics: larger than fp32 engines' (~1e-6), corrected by `algo.rollout_is`."""
    from conftest import started_trainer

    with started_trainer(
        "quickstart.yaml",
        [
            "iterations=2",
            f"policy.path={tiny_policy}",
            "algo.entropy_coef=0.01",
            "rollout.dtype=bfloat16",
            "sync.bucket_mb=0.25",
            "rollout.max_new_tokens=16",
            "rollout.cpus_per_worker=0.1",
            "sync.publish=streamed",
        ],
        tmp_path,
    ) as trainer:  # the real learner's streamed publish (auto: whole on CPU)
        ids = list(range(5, 45))
        before = np.array(trainer.learner.call("logprobs", ids))
        rows = trainer.run()
        weights = trainer.learner.call("weights")
        fp32_bytes = sum(a.nbytes for _, a in weights)
        assert [r["sync_version"] for r in rows] == [1, 2]
        # every tensor of the tiny policy is a float
        assert all(r["sync_bytes"] == fp32_bytes // 2 for r in rows)
        # the bf16 engines' tensors (experts packed by x86 AMX's kernel where the CPU has it) are
        # loaded straight where the engine reads them, as fp32 engines' are, not through vLLM's reload
        assert all(r["sync_direct_tensors"] == r["sync_tensors"] == len(weights) for r in rows)
        # bf16 engines, not fp32 ones
        assert all(r["rollout_logprob_diff_max"] > 1e-4 for r in rows)
        ours = np.array(trainer.learner.call("logprobs", ids))
        # what two updates changed: an engine still at version 0 is this far
        moved = np.abs(ours - before).mean()
        for w in trainer.workers:
            got = np.array(ray.get(w.score.remote(ids)))
            assert 1e-4 < np.abs(got - ours).mean() < 0.1 * moved  # measured: 8e-4 against 0.055
