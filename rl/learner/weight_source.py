"""What a learner hands the weight sync (rl/weight_sync/transport.py): its weights in the engines' names, format and
dtype, published into Ray's object store (whole, or streamed bucket by bucket) or broadcast to the
sync group.

A mixin of `rl.learner.learner.Learner`, kept apart because it is one job: it reads the learner's `model`,
`lm` (rl/learner/logprobs.py `CausalLM`), `lora`, `engine_factors`, `engine_dtype`, `version`, `rank` and
`world`, and never trains. Imports Ray only inside calls (rollout/weights.py where it puts buckets;
the placement of a shared-memory sync).
"""

from __future__ import annotations

import time

import numpy as np
import torch


class WeightSource:
    """The learner's weight-sync surface (its Ray actor's `publish`, `plan_publish`, `publish_bucket`,
    `broadcast_weights`, ...)."""

    _shared = (
        None  # rl/learner/shared_weights.py SharedPublisher, made at the first shared-memory sync
    )
    _outgoing = None

    @torch.no_grad()
    def weights(self) -> list[tuple[str, np.ndarray]]:
        """The current weights as (HF name, numpy array) in the learner's dtype (fp32: bf16 has no
        numpy type; a sync sends `to_wire`'s arrays). In a group: gathered, on rank 0 (collective;
        the other ranks return nothing)."""
        named = self.engine_tensors()
        if self.rank == 0:
            return [(n, t.numpy()) for n, t in named]
        for _ in named:  # take part in every gather; only rank 0's copy is renamed and kept
            pass
        return []

    @torch.no_grad()
    def engine_tensors(self, dtype: torch.dtype | None = None):
        """(name, CPU tensor) of the current weights as the checkpoint on disk names them, which is
        what the engines load (`CausalLM.checkpoint_names`); with LoRA the adapters folded in. Lazy.
        In a group gathered one tensor at a time on every rank (collective: every rank consumes it).
        `dtype`: floating tensors cast to it before they are renamed, so the renaming's copies
        (transformers 5 splits Mixtral's fused experts into one copied tensor per expert) move the
        engine's bytes, not the learner's: a bf16 sync of the real policy copied 850 MB of fp32 there.

        A tensor tied to one already listed (SmolLM2's `lm_head.weight` is its embedding) is left
        out, as `save_pretrained` leaves it out of the checkpoint: the engine ties it the same way
        from the model's config, and sending it twice cost the real policy's sync 7% more bytes."""
        if self.world > 1:
            return self.lm.checkpoint_names(_cast(self.full_weights(), dtype))
        # the adapters folded into their weights, under the original names
        if self.lora is not None:
            from rl.learner.lora import merged_state

            state = merged_state(self.model)
        else:
            state = self.model.state_dict()
        return self.lm.checkpoint_names(
            _cast(_untied((n, t.detach().cpu()) for n, t in state.items()), dtype)
        )

    def full_weights(self):
        """In a group: (name, full CPU tensor), gathered one tensor at a time on every rank (collective)."""
        from torch.distributed.fsdp import FSDPModule

        from policy.parallelize import iter_full_weights

        for m in self.lm.root.modules():  # the root stays gathered after a forward without backward
            if isinstance(m, FSDPModule):
                m.reshard()
        return iter_full_weights(self.model)

    def _sync_source(self):
        """(the pairs a weight sync sends, whether they are LoRA factors, whether they are bf16 bits),
        lazily: the adapters' factors (fp32: the worker adds them to its base weights), or the
        weights in the engines' format and dtype (rollout/weights.py `to_wire`). In a group every
        rank must consume them (the gathers inside are collective); only rank 0's are sent."""
        from rollout.weights import to_wire

        if self.lora is not None:
            return self.engine_factors(), True, False
        return (
            to_wire(self.engine_tensors(self.engine_dtype), self.engine_dtype),
            False,
            self.engine_dtype == torch.bfloat16,
        )

    def publish(self, bucket_mb: float, shared: str | None = None):
        """Put what a sync sends into Ray's object store in buckets (rl/weight_sync/transport.py); the manifest names
        this version. In a group every rank gathers tensor by tensor and rank 0 puts the buckets as
        they fill, so no rank holds a full copy of the model (the others return None). `shared`: write
        it into a shared-memory slab instead, for workers of this node (`plan_publish`)."""
        from rollout.weights import Manifest, publish

        plan = self._plan_shared(bucket_mb, shared) if shared and self.world == 1 else None
        if plan is not None:
            buckets = [self.publish_bucket(i) for i in range(len(plan["names"]))]
            return Manifest(
                version=plan["version"],
                buckets=buckets,
                bucket_bytes=plan["bytes"],
                names=plan["names"],
                shared=plan["shared"],
                shared_node=plan["shared_node"],
            )
        named, adapter, bf16 = self._sync_source()
        if self.rank == 0:
            return publish(named, self.version, bucket_mb, adapter=adapter, bf16=bf16)
        for _ in named:  # take part in every gather
            pass
        return None

    def plan_publish(self, bucket_mb: float, shared: str | None = None) -> dict | None:
        """Start publishing the current version bucket by bucket (`publish_bucket`, rl/weight_sync/transport.py): its
        plan, from the tensors' sizes alone. None in a group, which publishes whole (`publish`): its
        gathers are collective, so a plan would cost a gather of the whole model.

        `shared` (rl/weight_sync/transport.py `shared_memory_kind`: "host", every worker on this node; "cuda", every
        worker's engine on this learner's GPU): the buckets are written into a shared-memory slab, in
        host or GPU memory, and name where their tensors lie in it (rl/learner/shared_weights.py), unless the
        weights are LoRA factors or every slab is still held by a version in flight; the plan then
        says `shared` (the slab's address) and `shared_node`."""
        from rollout.weights import Outgoing, wire_nbytes

        if self.world > 1:
            return None
        plan = self._plan_shared(bucket_mb, shared) if shared else None
        if plan is not None:
            return plan
        named, adapter, bf16 = self._sync_source()
        if adapter:  # the factors are megabytes: computed once, sized and sent from the same list
            named = list(named)
            sizes = [(n, a.nbytes) for n, a in named]
        else:  # sized from views, without casting: the cast happens as each bucket is cut
            sizes = [(n, wire_nbytes(t, self.engine_dtype)) for n, t in self.engine_tensors()]
        self._outgoing = Outgoing(sizes, named, self.version, bucket_mb, adapter=adapter, bf16=bf16)
        return self._outgoing.plan

    def publish_bucket(self, index: int) -> list:
        """Bucket `index` of the planned version, cut from the weights as they are now; its return
        value is what goes into the object store (on the shared path: where its tensors lie in the
        slab). Ray runs one caller's calls in order, so every bucket is cut before the driver's next
        training step reaches this actor."""
        return self._outgoing.take(index)

    def publish_seconds(self) -> float:
        """Seconds since the plan: called right after the last bucket (Ray runs them in order), the
        streamed publish's share of a sync, the buckets' copies into the object store included."""
        return time.perf_counter() - self._outgoing.started

    def placement(self) -> dict:
        """This learner's Ray node and, when it trains on a GPU, that GPU's UUID (rl/weight_sync/transport.py `placements`)."""
        import ray

        from rollout.shared_memory import gpu_uuid

        gpus = [gpu_uuid(self.device.index or 0)] if self.device.type == "cuda" else []
        return {"node": ray.get_runtime_context().get_node_id(), "gpus": gpus}

    def release_shared(self, version: int) -> None:
        """The driver saw every load of `version` finish: its shared-memory slab may be reused."""
        if self._shared is not None:
            self._shared.release(version)

    def _plan_shared(self, bucket_mb: float, kind: str) -> dict | None:
        """The shared-memory plan of the current version (its slab taken, on this learner's GPU when
        `kind` is "cuda"), or None: LoRA factors (megabytes, through the object store), or every slab
        still held by a version in flight."""
        self._outgoing = None
        if self.lora is not None:
            return None
        device = self.device if kind == "cuda" else None
        plan = self._shared_publisher().plan(self.version, bucket_mb, self._shared_source(), device)
        if plan is None:
            return None
        import ray

        self._outgoing = self._shared
        return {**plan, "shared_node": ray.get_runtime_context().get_node_id()}

    def _shared_state(self):
        state = self.model.state_dict()
        return _untied((n, t.detach()) for n, t in state.items())

    def _shared_publisher(self):
        if self._shared is None:
            from rl.learner.shared_weights import SharedPublisher, layout

            self._shared = SharedPublisher(
                layout(self.lm, list(self._shared_state()), self.engine_dtype)
            )
        return self._shared

    def _shared_source(self):
        """The tensors the shared layout's regions hold, in its order: the learner's own, or, for a
        model whose renaming is more than slicing, the renamed ones (rl/learner/shared_weights.py)."""
        if self._shared.layout.views:
            return self._shared_state()
        return self.lm.checkpoint_names(self._shared_state())

    def join_sync_group(self, master: str, world: int, backend: str, timeout_s: float) -> None:
        """Rank 0 joins the weight-sync process group as its sender (`sync.transport: collective`,
        rollout/collective.py); the other ranks of a learner group are not members."""
        if self.rank == 0:
            from rollout.collective import SyncGroup

            self.sync_group = None  # a group formed again replaces the old one
            self.sync_group = SyncGroup(master, 0, world, backend, timeout_s)

    def broadcast_weights(self, bucket_mb: float) -> dict | None:
        """Broadcast what a sync sends to the sync group's rollout workers, bucket by bucket (rank 0;
        the others take part in the gathers and return None)."""
        named, adapter, bf16 = self._sync_source()
        if self.rank != 0:
            for _ in named:
                pass
            return None
        t0 = time.perf_counter()
        out = self.sync_group.send(named, self.version, bucket_mb, adapter=adapter, bf16=bf16)
        return {**out, "version": self.version, "send_s": time.perf_counter() - t0}


def _untied(named):
    """`named` without the tensors that are the very same memory as an earlier one (tied weights)."""
    seen = set()
    for name, t in named:
        key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if t.numel() and key in seen:
            continue
        seen.add(key)
        yield name, t


def _cast(named, dtype: torch.dtype | None):
    """`named` with its floating tensors in `dtype` (None: as they are)."""
    for name, t in named:
        yield name, t.to(dtype) if dtype is not None and t.is_floating_point() else t
