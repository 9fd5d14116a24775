"""The shared-memory weight sync (rollout/shared_memory.py, rl/learner/shared_weights.py): the slab layout
read back from each model's own renaming, checked against the renaming itself; a version written by
the learner and read by another process in place; a slab rewritten under a reader; and the real
path end to end, a learner actor syncing a vLLM rollout worker, against the object store's."""

import sys

import pytest
import ray
import torch

from rl.learner.logprobs import CausalLM
from rl.learner.shared_weights import SharedPublisher, layout, renamed_layout
from rl.learner.weight_source import _untied
from rl.weight_sync.transport import shared_memory_kind
from rollout.shared_memory import CudaIpc, SlabReader, view, written_version
from rollout.weights import Manifest, iter_weights

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=3,
        num_experts_per_tok=1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return MixtralForCausalLM(cfg)


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg)


def _named(model):
    return list(_untied((n, t.detach()) for n, t in model.state_dict().items()))


def _publish(lm, named, dtype, version=3, bucket_mb=0.01, lay=None):
    pub = SharedPublisher(lay or layout(lm, named, dtype))
    plan = pub.plan(
        version, bucket_mb, iter(named) if pub.layout.views else lm.checkpoint_names(iter(named))
    )
    buckets = [pub.take(i) for i in range(len(plan["names"]))]
    return pub, plan, buckets


@pytest.mark.parametrize("make", [_mixtral, _qwen3_moe], ids=["mixtral", "qwen3-moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_views_equal_the_renamed_checkpoint_tensors(make, dtype):
    """Every checkpoint tensor the engines load, read as a view of the slab, equals the model's own
    renaming of its weights cast to the engines' dtype (the object-store path's tensors), names and
    order included; the fused experts are sent once, as slices (no region per expert)."""
    model = make()
    lm, named = CausalLM(model, "hf"), _named(model)
    lay = layout(lm, named, dtype)
    # per-expert names are slices
    assert lay.views and len(lay.regions) == len(named) < len(lay.entries)
    pub, plan, buckets = _publish(lm, named, dtype, lay=lay)
    slab = pub.slabs[0]
    assert (
        written_version(slab.bytes) == 3
        and plan["shared"] == slab.address
        and len(plan["names"]) > 1
    )
    want = list(
        lm.checkpoint_names((n, t.to(dtype) if t.is_floating_point() else t) for n, t in named)
    )
    got = [(n, view(slab.bytes, ref)) for b in buckets for n, ref in b]
    assert [n for n, _ in got] == [n for n, _ in want] == [n for b in plan["names"] for n in b]
    for (name, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    # a tied head is not sent (the engine ties it from the config), an untied one is
    assert ("lm_head.weight" in dict(got)) == (not model.config.tie_word_embeddings)


def test_a_renaming_that_is_not_slicing_falls_back_to_renamed_regions():
    """A model whose checkpoint tensors are not slices of its own (here one reversed) gets a layout of
    the renamed tensors, written by the renaming at every sync, and still reads back exactly."""
    model = _qwen3_moe()
    lm, named = CausalLM(model, "hf"), _named(model)

    class Reversing:
        def checkpoint_names(self, items):
            for n, t in lm.checkpoint_names(items):
                yield n, (t.flip(-1) if n.endswith("o_proj.weight") else t)

    lay = layout(Reversing(), named, torch.float32)
    assert not lay.views and lay.entries and lay.nbytes >= sum(t.numel() * 4 for _, t in named)
    assert lay.entries == renamed_layout(Reversing(), named, torch.float32).entries
    pub, _, buckets = _publish(Reversing(), named, torch.float32, lay=lay)
    want = dict(Reversing().checkpoint_names(iter(named)))
    for b in buckets:
        for name, ref in b:
            assert torch.equal(view(pub.slabs[0].bytes, ref), want[name]), name


def test_slabs_are_reused_only_once_released():
    model = _mixtral()
    lm, named = CausalLM(model, "hf"), _named(model)
    pub = SharedPublisher(layout(lm, named, torch.float32), max_slabs=2)
    first = pub.plan(1, 1.0, iter(named))
    for i in range(len(first["names"])):
        pub.take(i)
    second = pub.plan(2, 1.0, iter(named))
    assert second["shared"] != first["shared"]  # version 1 still in flight: a second slab
    assert pub.plan(3, 1.0, iter(named)) is None  # both held: this version takes the object store
    pub.release(1)
    assert pub.plan(3, 1.0, iter(named))["shared"] == first["shared"]


def test_a_learner_whose_tensors_changed_fails_by_name():
    model = _mixtral()
    lm, named = CausalLM(model, "hf"), _named(model)
    pub = SharedPublisher(layout(lm, named, torch.float32))
    plan = pub.plan(1, 1e-9, iter(named[:1] + [("other.weight", named[1][1])] + named[2:]))
    with pytest.raises(
        RuntimeError, match=r"learner's tensor 1 is other.weight .*layout expects model.layers.0"
    ):
        for i in range(len(plan["names"])):
            pub.take(i)


@ray.remote(num_cpus=0)
def _read(manifest, rewrite_to=None, publisher=None):
    """A rollout worker's read: every tensor of the manifest through `iter_weights`, copied out."""
    out = []
    for i, (name, t) in enumerate(iter_weights(manifest)):
        out.append((name, t.clone()))
        # the learner starts the next version in this slab meanwhile
        if i == 0 and publisher is not None:
            ray.get(publisher.rewrite.remote(rewrite_to))
    return out


@ray.remote(num_cpus=0)
class _Publisher:
    """A learner's shared publish in its own process."""

    def __init__(self):
        model = _mixtral()
        self.lm, self.named = CausalLM(model, "hf"), _named(model)
        self.pub = SharedPublisher(layout(self.lm, self.named, torch.bfloat16), max_slabs=1)

    def publish(self, version):
        plan = self.pub.plan(version, 1.0, iter(self.named))
        buckets = [self.pub.take(i) for i in range(len(plan["names"]))]
        return Manifest(
            version,
            buckets,
            plan["bytes"],
            plan["names"],
            shared=plan["shared"],
            shared_node=ray.get_runtime_context().get_node_id(),
        )

    def rewrite(self, version):
        self.pub.release(version - 1)
        self.publish(version)

    def expected(self):
        return list(self.lm.checkpoint_names((n, t.to(torch.bfloat16)) for n, t in self.named))


def test_another_process_reads_a_version_in_place_and_a_rewrite_under_it_fails(ray_cluster):
    pub = _Publisher.remote()
    manifest = ray.get(pub.publish.remote(4))
    got, want = ray.get(_read.remote(manifest)), ray.get(pub.expected.remote())
    assert [n for n, _ in got] == [n for n, _ in want]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, want))
    with pytest.raises(
        ray.exceptions.RayTaskError,
        match=r"version 4: the learner's shared-memory slab now holds version 5",
    ):
        ray.get(_read.remote(manifest, 5, pub))


def test_a_slab_outside_reach_is_a_clear_error():
    with pytest.raises(
        RuntimeError, match=r"cannot open the learner's shared-memory slab /proc/1/fd/999999"
    ):
        SlabReader().open("/proc/1/fd/999999")


def test_a_gpu_slab_on_a_gpu_this_process_lacks_is_a_clear_error():
    """A CUDA IPC address names its GPU by UUID; a worker that does not see that GPU says so (here: no
    GPU at all) instead of mapping another device's memory."""
    address = CudaIpc("GPU-0a1b", (None, (None,) * 15))
    with pytest.raises(
        RuntimeError, match=r"slab lies on GPU GPU-0a1b, which this rollout worker does not see"
    ):
        SlabReader().open(address)


@pytest.mark.parametrize(
    "learner, workers, kind",
    [
        (
            {"node": "a", "gpus": []},
            [{"node": "a", "gpus": []}] * 2,
            "host",
        ),  # CPU learner and engines
        (
            {"node": "a", "gpus": ["G0"]},
            [{"node": "a", "gpus": ["G0"]}],
            "cuda",
        ),  # one GPU shared (one_gpu.yaml)
        (
            {"node": "a", "gpus": ["G0"]},
            [{"node": "a", "gpus": ["G0"]}, {"node": "a", "gpus": ["G1"]}],
            "host",
        ),
        (
            {"node": "a", "gpus": ["G0"]},
            [{"node": "a", "gpus": []}],
            "host",
        ),  # CPU engines beside a GPU learner
        (
            {"node": "a", "gpus": []},
            [{"node": "a", "gpus": []}, {"node": "b", "gpus": []}],
            None,
        ),  # a worker elsewhere
        ({"node": "a", "gpus": ["G0"]}, [{"node": "b", "gpus": ["G0"]}], None),
        (
            None,
            [{"node": "a", "gpus": []}],
            None,
        ),  # a learner group publishes through the object store
    ],
)
def test_which_memory_a_shared_sync_uses(learner, workers, kind):
    assert shared_memory_kind(learner, workers) == kind


@pytest.mark.slow
def test_a_real_learner_syncs_a_vllm_worker_through_shared_memory(ray_cluster, tiny_policy):
    """The real path: a learner actor writes its moved weights into shared memory (streamed and
    whole), a vLLM rollout worker on its node loads them in place, packing its experts straight from
    the learner's fused blocks, and then scores exactly what it scores after the same version sent
    through the object store; the slab is handed back after each sync and reused."""
    import numpy as np

    from rl.config import AlgoConfig, EnvConfig, RolloutConfig
    from rl.learner.learner_group import LearnerActor
    from rl.weight_sync.transport import placements, start_sync
    from rollout.worker import RolloutWorkerActor

    learner = LearnerActor.options(num_cpus=0).remote(
        tiny_policy, AlgoConfig(), seed=0, engine_dtype="bfloat16"
    )
    rollout = RolloutConfig(
        max_model_len=512, max_episode_tokens=512, kv_cache_gib=0.25, dtype="bfloat16"
    )
    worker = RolloutWorkerActor.options(num_cpus=0).remote(
        tiny_policy, rollout, EnvConfig(), seed=0
    )
    try:
        # a version unlike the checkpoint the worker started from
        ray.get(learner.__ray_call__.remote(_move_weights))
        assert shared_memory_kind(*placements(learner, [worker])) == "host"
        ids = list(range(5, 45))
        got = {}
        for shared, stream in ((False, False), (True, True), (True, False)):
            out = start_sync(learner, [worker], 0.05, stream=stream, shared=shared).finish(120)
            assert (
                out["sync_shared"] == shared and out["sync_direct_tensors"] == out["sync_tensors"]
            )
            assert out["sync_shared_gpu"] is False  # CPU: the slab is host memory
            # the tiny policy's MoE layers
            assert out["sync_unstaged_expert_layers"] == (2 if shared else 0)
            got[shared, stream] = np.array(ray.get(worker.score.remote(ids)))
            if shared:  # handed back: the next shared sync reuses the one slab
                assert ray.get(
                    learner.__ray_call__.remote(lambda s: [x.version for x in s._shared.slabs])
                ) == [None]
        assert np.array_equal(got[True, True], got[False, False]) and np.array_equal(
            got[True, False], got[False, False]
        )
        start = np.array(ray.get(learner.logprobs.remote(ids)))
        # the engine serves the learner's weights (bf16)
        assert np.abs(got[True, True] - start).max() < 0.1
    finally:
        ray.kill(worker)
        ray.kill(learner)


def _move_weights(learner):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in learner.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)


def test_the_gpu_ipc_check_runs_through_host_memory():
    """bench/gpu_ipc_check.py (the CUDA IPC sync, for a lent GPU) as a dry run through a host slab: a
    second process maps the slab, loads every tensor bit for bit, and sees a rewrite begin."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "gpu_ipc_check.py"
    r = subprocess.run(
        [
            sys.executable,
            str(script),
            "--cpu",
            "--hidden",
            "128",
            "--layers",
            "2",
            "--experts",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert (
        "tensors whose bits differ: 0; header read 2 (want 2), after the learner began version 3: -1"
        in r.stdout
    )
