"""Learner: the policy in torch, its optimiser, and one GRPO update per batch of trajectories.

A plain class (it imports no Ray: it also runs in a process of its own, e.g. on a GPU machine
without Ray); `rl.learner.learner_group.LearnerActor` is its Ray shell. Trains Hugging Face causal LMs (the tiny
Qwen3-MoE of the quickstart) and the project's own `policy/` checkpoints through one adapter
(`rl.learner.logprobs.CausalLM`). Memory per step is bounded for long trajectories: episodes are packed
into micro-batches by a token budget, the output projection runs a chunk of positions at a time,
and layers can be recomputed in the backward pass (activation checkpointing).

For the project's policy, every optimiser step also updates each MoE router's selection bias
(quantile balancing, its histogram estimator or the sign update, per `moe.balance`) from the
step's router scores, and reports the worst layer's max/mean expert load.

Credit: `algo.credit = "milestone"` gives each turn's tokens its own advantage (rl/learner/credit.py).
Advantages are an episode's; an episode stored as several samples (an agent program whose history
was rewritten, `Trajectory.sample_starts`) runs each as its own sequence with its slice of them.

PPO (`algo.name = "ppo"`): a value head on the shared trunk, GAE over tokens or turns, the clipped
value loss added with `vf_coef` (rl/learner/ppo.py).

Rollout routing replay (`algo.routing_replay`, `policy/` checkpoints): where the trajectories carry
the engine's routed expert ids per token, every forward of the update (the pre-update log-probs and
the trained ones) takes them as the MoE selection, with weights from the current router, so the
learner scores the tokens with the experts that generated them and the router still learns; the
share of recorded decisions the learner's router would have made differently is
`router_decisions_differ`. Hugging Face MoE checkpoints replay through hooks on their routers
(`rl/learner/routing.py`, Qwen3-MoE-style top-k routers).

LoRA (`lora.enabled`, rl/learner/lora.py): peft adapters on the attention projections and every routed
expert; only they train (the optimiser holds only them), a sync sends only their factors, and a
checkpoint is the merged model plus the adapters.

What the learner hands the weight sync (publish, stream, broadcast) is rl/learner/weight_source.py.

Learner group (`learner.world_size` > 1, driven by rl/learner/learner_group.py): each rank is one of these,
`join`ed to a process group, its model sharded (FSDP2 + expert parallelism); every rank gets the
whole batch and trains on its token share of each minibatch (rl/learner/shares.py), the losses scaled by the
minibatch's global counts so the summed gradients are the single learner's. The pre-update
log-probs, the balancing scores and the metrics are gathered, so every rank takes the same
decisions and rank 0 reports what a single learner would.
"""

from __future__ import annotations

import resource
import time

import numpy as np
import torch

from policy.kda import FP32_PARAMS
from rl.config import AlgoConfig, LearnerConfig, LoraConfig
from rl.learner import device as devices
from rl.learner.batch import (
    Row,
    annotations,
    episode_values,
    pad,
    recorded_routing,
    token_versions,
    training_rows,
    usable_episodes,
)
from rl.learner.credit import token_advantages
from rl.learner.grpo import group_advantages, mismatch_metrics, policy_loss, rollout_is_weights
from rl.learner.hf_experts import casts_cached_over
from rl.learner.logprobs import chunked_logprobs, load_causal_lm
from rl.learner.ppo import ValueHead, episode_targets, value_loss
from rl.learner.routing import (
    HFRouterBalance,
    RouterStats,
    balance_policy_routers,
    balance_terms,
    hf_load_metrics,
)
from rl.learner.shares import (
    all_gather_objects,
    all_reduce_sum,
    minibatch_shares,
    pack,
    padded_slots,
)
from rl.learner.weight_source import WeightSource
from rollout.trajectory import Trajectory


class Learner(WeightSource):
    def __init__(
        self,
        policy_path: str,
        algo: AlgoConfig,
        system: LearnerConfig | None = None,
        *,
        seed: int = 0,
        dtype: str = "float32",
        temperature: float = 1.0,
        max_generated_tokens: int | None = None,
        max_staleness: int | None = None,
        device: str = "cpu",
        lora: LoraConfig | None = None,
        engine_dtype: str | None = None,
    ):
        """`algo`: what is optimised; `system`: how it is computed (micro-batches, threads,
        precision); `device`: where, resolved by the caller (a rank placed by Ray knows whether it
        got a GPU; `learner.device` auto does not say)."""
        self.system = system = system or LearnerConfig()
        torch.set_num_threads(system.threads)
        torch.manual_seed(seed)
        self.device = devices.resolve(device)
        self.precision = system.precision
        # an unknown precision fails here, not mid-step
        devices.autocast(self.device, self.precision)
        self.cfg = algo
        self.temperature = temperature
        self.dtype = getattr(torch, dtype)
        # what the rollout engines compute in: a weight sync sends the weights cast to it (fp32 master
        # weights here, bf16 engines: half the bytes)
        self.engine_dtype = getattr(torch, engine_dtype or dtype)
        self.max_generated_tokens = max_generated_tokens
        self.max_staleness = max_staleness
        self._tokenizer_path = policy_path
        # rl/learner/lora.py: adapters on policy_path
        self.lora = lora if lora is not None and lora.enabled else None
        self.base_path = policy_path
        self.value_head = None
        self._load(policy_path)
        self.rank, self.world = 0, 1
        self.ref = None
        if algo.kl_beta:  # frozen copy of the starting policy
            self.ref = load_causal_lm(policy_path, self.dtype)
            self.ref.shared_prefix_tokens = system.shared_prefix_tokens
            self.ref.module.to(self.device).eval().requires_grad_(False)
        self.version = 0

    def _load(self, path: str) -> None:
        self.lm = load_causal_lm(path, self.dtype)
        self.lm.shared_prefix_tokens = self.system.shared_prefix_tokens
        self.model = self.lm.module.to(self.device)
        # a Hugging Face MoE's routers balanced by folding a bias into their weights (routing.py)
        self.hf_balance = (
            HFRouterBalance(self.lm.hf_replay, self.cfg.router_balance_rate)
            if self.cfg.router_balance == "quantile"
            and self.lm.kind == "hf"
            and self.lm.hf_replay.supported
            else None
        )
        self.model.train()
        if self.system.activation_checkpointing:
            if self.lm.kind == "policy":
                self.model.activation_checkpointing = True
            else:
                self.model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
        if self.lora is not None:
            from rl.learner.lora import EngineFactors, add_adapters

            if self.lm.kind == "policy":
                raise ValueError(
                    f"lora.enabled needs a Hugging Face policy; {path} is a policy/ checkpoint"
                )
            add_adapters(self.model, self.lora)
            self.engine_factors = EngineFactors(self.lm, self.model)
        if self.cfg.name == "ppo":  # value head on the shared trunk
            self.value_head = ValueHead(self.lm.head.in_features).to(self.device, self.dtype)
        self._make_optimizer()

    def _make_optimizer(self) -> None:
        """AdamW over what trains (the model, or its adapters under LoRA, and the value head); after
        `join`, over the sharded parameters."""
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        params = [p for n, p in named if n.rsplit(".", 1)[-1] not in FP32_PARAMS]
        if self.value_head is not None:
            params += list(self.value_head.parameters())
        no_decay = [p for n, p in named if n.rsplit(".", 1)[-1] in FP32_PARAMS]  # KDA's decay rates
        groups = [{"params": params}] + (
            [{"params": no_decay, "weight_decay": 0.0}] if no_decay else []
        )
        # sharded (after `join`): DTensors and plain expert blocks mixed, which torch 2.11's multi-tensor
        # (foreach) AdamW refuses (seen on the GPU check), so the per-tensor update there
        self.opt = torch.optim.AdamW(
            groups,
            lr=self.cfg.lr,
            weight_decay=self.cfg.weight_decay,
            **({"foreach": False} if getattr(self, "world", 1) > 1 else {"fused": True}),
        )

    # --- learner group (rl/learner/learner_group.py) ---
    def address(self) -> str:
        """host:port on this rank's node for the group's rendezvous (rank 0 is asked)."""
        import socket

        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            return f"{host}:{s.getsockname()[1]}"

    def join(
        self,
        master: str,
        rank: int,
        world_size: int,
        *,
        expert_parallel: bool = True,
        backend: str = "gloo",
    ) -> None:
        """Join the group's process group (`backend`) at `master` as `rank` and shard the model over it;
        the optimizer is rebuilt over the shards. The frozen reference model (KL) stays whole on
        every rank: it only runs forwards on the rank's own micro-batches."""
        import torch.distributed as dist

        backend = devices.backend(backend, self.device)  # auto: nccl on GPUs, gloo on CPU
        dist.init_process_group(
            backend, init_method=f"tcp://{master}", rank=rank, world_size=world_size
        )
        self.rank, self.world = rank, world_size
        self.lm.parallelize(expert_parallel=expert_parallel)
        self._make_optimizer()

    @property
    def ref_model(self):
        return self.ref.module if self.ref is not None else None

    # --- batching ---
    def _tensors(self, mb: list[Trajectory]):
        """Padded ids and attention mask, and the loss mask and rollout log-probs aligned to the
        next-token targets (tokens 1..T-1, so the per-token records shift by one)."""
        ids = torch.tensor(pad([t.token_ids for t in mb], 0))
        attn = torch.tensor(pad([[1] * len(t.token_ids) for t in mb], 0))  # right padding
        mask = torch.tensor(pad([t.loss_mask for t in mb], 0))[:, 1:].float()
        rollout = torch.tensor(pad([t.rollout_logprobs for t in mb], 0.0))[:, 1:].float()
        return (
            ids.to(self.device),
            attn.to(self.device),
            mask.to(self.device),
            rollout.to(self.device),
        )

    def _routing(self, mb: list[Trajectory], width: int) -> torch.Tensor | None:
        """The recorded expert ids of a micro-batch (rl/learner/batch.py `recorded_routing`), for rollout routing
        replay; None when off or for a model that cannot replay."""
        shape = self.lm.moe_shape()
        if self.cfg.routing_replay == "never" or shape is None:
            return None
        out = recorded_routing(mb, width, *shape)
        return None if out is None else out.to(self.device)

    def _logprobs(
        self,
        lm,
        ids,
        attn,
        with_entropy: bool = False,
        routing_out=None,
        routing=None,
        replayed: list | None = None,
        hf_routers: list | None = None,
        only=None,
        temperature: float | None = None,
    ):
        """(log-probs, entropies or None, values or None), all aligned to next-token targets.
        `routing_out` (a RouterStats) takes the policy's router scores, `hf_routers` a Hugging Face MoE's router
        logits and choices (both for balancing), `replayed` the routing-replay counts; `only`: the
        loss mask, to run the head on the generated tokens alone (0 elsewhere); `temperature`: the
        sampling temperature's by default."""
        # bf16: forward (and its backward) in bf16
        with devices.autocast(self.device, self.precision):
            h, router_info = lm.hidden_and_routing(
                ids, attn, routing, capture=hf_routers is not None
            )
        if replayed is not None and router_info is not None:
            replayed.append(router_info["replayed"])
        valid = attn.reshape(-1).bool()  # padding takes no part in balancing
        if routing_out is not None and router_info is not None and router_info["scores"]:
            # counted now, the scores let go
            routing_out.add([s[valid] for s in router_info["scores"]])
        if hf_routers is not None and router_info is not None and router_info["hf_routers"]:
            hf_routers.append((router_info["hf_routers"], valid))
        # the head's matmul in bf16; log-softmax in fp32
        with devices.autocast(self.device, self.precision):
            logp, ent = chunked_logprobs(
                h,
                lm.head,
                ids,
                temperature=temperature or self.temperature,
                chunk_tokens=self.system.logprob_chunk_tokens,
                with_entropy=with_entropy,
                banned_ids=lm.banned_ids,
                only_BT=only,
            )
            # the value of the state before token p comes from the hidden state at p-1, like its logits
            values = (
                self.value_head(h[:, :-1])
                if (self.value_head is not None and lm is self.lm)
                else None
            )
        return (
            logp.float(),
            None if ent is None else ent.float(),
            None if values is None else values.float(),
        )

    def fuses_old_logprobs(self, n_minibatches: int) -> bool:
        """Whether the pre-update log-probs come from the training forward itself: GRPO with a single
        optimiser step per batch (one epoch, one minibatch), nothing else needing them before it (no
        reference model, no value head) and a single rank, and `learner.fuse_old_logprobs` on."""
        c = self.cfg
        return (
            self.system.fuse_old_logprobs
            and c.name == "grpo"
            and c.epochs == 1
            and n_minibatches == 1
            and not c.kl_beta
            and self.world == 1
        )

    def plan(self, seqs: list[Trajectory]) -> list[list[list[int]]]:
        """Minibatches of `minibatch_episodes` sequences (one optimiser step each; a split episode's
        samples count one each), each packed into micro-batches whose padded size stays within
        `microbatch_tokens` (a sequence longer than the budget gets a micro-batch of its own). In a
        learner group: every rank's micro-batches."""
        return [[m for share in mb for m in share] for mb in self.shares(seqs)]

    def shares(self, seqs: list[Trajectory]) -> list[list[list[list[int]]]]:
        """Per minibatch, per rank, that rank's micro-batches (rl/learner/shares.py `minibatch_shares`)."""
        return minibatch_shares(
            [len(t.token_ids) for t in seqs],
            self.cfg.minibatch_episodes,
            self.system.microbatch_tokens,
            self.world,
        )

    def _advantages(self, batch, rows: list[Row], old_v):
        """(advantages for a micro-batch's row indices, PPO returns per row {position in the row: R},
        mean |A|): computed per episode (a split episode's samples share its advantages), then
        sliced per row."""
        c = self.cfg
        returns: dict = {}
        if c.name == "ppo" or c.credit == "milestone":
            if c.name == "ppo":
                # values[i][p - 1]: value before token p
                values = episode_values(rows, batch, old_v)
                per_token, ep_returns = [], []
                for i, t in enumerate(batch):
                    adv, ret = episode_targets(
                        t, [0.0] + values[i], level=c.ppo_level, gamma=c.gamma, lam=c.gae_lambda
                    )
                    per_token.append(adv)
                    ep_returns.append(ret)
                for k, row in enumerate(rows):
                    end = row.start + len(row.seq.token_ids)
                    returns[k] = {
                        p - row.start: r
                        for p, r in ep_returns[row.episode].items()
                        if row.start <= p < end
                    }
                if c.whiten_advantages:
                    vals = torch.tensor(
                        [
                            a
                            for i, t in enumerate(batch)
                            for a, m in zip(per_token[i], t.loss_mask)
                            if m
                        ]
                    )
                    mu, sd = float(vals.mean()), float(vals.std()) if vals.numel() > 1 else 1.0
                    per_token = [[(a - mu) / (sd + 1e-8) for a in row] for row in per_token]
            else:
                per_token = token_advantages(
                    batch,
                    gamma=c.gamma,
                    baseline=c.baseline,
                    scale="group" if c.scale_rewards == "group" else "none",
                )
            adv_abs = float(
                np.mean(
                    [
                        abs(a)
                        for i, t in enumerate(batch)
                        for a, m in zip(per_token[i], t.loss_mask)
                        if m
                    ]
                )
            )

            def of_rows(micro):
                cut = [
                    per_token[rows[i].episode][
                        rows[i].start : rows[i].start + len(rows[i].seq.token_ids)
                    ]
                    for i in micro
                ]
                return torch.tensor(pad(cut, 0.0))[:, 1:].float()

            return of_rows, returns, adv_abs
        rewards = torch.tensor([t.reward for t in batch])
        groups = torch.tensor([t.group_id for t in batch])
        adv = group_advantages(rewards, groups, scale=c.scale_rewards)
        return (
            (lambda micro: adv[[rows[i].episode for i in micro]]),
            returns,
            float(adv.abs().mean()),
        )

    def _kl_in_reward(self, batch, rows: list[Row], old, ref) -> tuple[list[Trajectory], float]:
        """The batch with the KL penalty in its rewards: for each turn, β·Σ KL(π_old ‖ π_ref) over the
        turn's generated tokens (the configured estimator) is a `kl_penalty` milestone of minus that
        at the turn, and comes off the episode's reward. Returns the batch and the mean penalty."""
        import dataclasses

        c, out, total = self.cfg, list(batch), []
        kl = {}
        for key in old:
            d = ref[key] - old[key]  # aligned to next-token targets: token p at p - 1
            kl[key] = torch.exp(d) - d - 1 if c.kl_estimator == "k3" else -d
        kl_ep = episode_values(rows, batch, kl)
        for i, t in enumerate(batch):
            events = []
            for n, turn in enumerate(t.turns):
                lo, hi = max(turn.gen_start, 1), turn.gen_end
                pen = c.kl_beta * float(
                    sum(k * m for k, m in zip(kl_ep[i][lo - 1 : hi - 1], t.loss_mask[lo:hi]))
                )
                events.append({"name": "kl_penalty", "reward": -pen, "turn": n, "token": hi - 1})
            penalty = -sum(e["reward"] for e in events)
            total.append(penalty)
            out[i] = dataclasses.replace(
                t, reward=t.reward - penalty, milestones=list(t.milestones) + events
            )
        return out, float(np.mean(total)) if total else 0.0

    def _value_loss(self, values, old_values, returns, micro, mb) -> torch.Tensor:
        """Clipped value loss over the micro-batch's decision points, normalised by the minibatch's."""
        rows, cols, targets = [], [], []
        for row, i in enumerate(micro):
            for p, r in returns[i].items():
                rows.append(row)
                cols.append(p - 1)  # values are aligned to next-token targets
                targets.append(r)
        n_points = sum(len(returns[i]) for m in mb for i in m)
        if not rows:
            return values.sum() * 0.0
        r, c_ = torch.tensor(rows), torch.tensor(cols)
        r, c_ = r.to(values.device), c_.to(values.device)
        return value_loss(
            values[r, c_],
            old_values[r, c_],
            torch.tensor(targets, device=values.device),
            self.cfg.value_clip,
        ) / max(n_points, 1)

    def train_step(self, batch: list[Trajectory]) -> dict:
        """One GRPO update over `batch`: one optimiser step per minibatch, `epochs` passes, gradients
        accumulated over its micro-batches (their losses add up to the minibatch's loss).

        Before any step, the learner's own log-probs of the batch (`old`) are computed once: the
        clipped ratio is taken against them, truncated importance weights min(old/rollout, cap)
        correct for the engine having sampled from slightly different numbers, and their gap to
        the rollout log-probs is reported (a broken sync shows up here first)."""
        t0 = time.perf_counter()
        c = self.cfg
        min_version = None if self.max_staleness is None else self.version - self.max_staleness
        batch, dropped = usable_episodes(batch, min_version)
        if not batch:  # nothing to learn from; the version still advances so the loop stays uniform
            self.version += 1
            return {
                **dropped,
                "policy_version": self.version,
                "skipped_update": 1,
                "train_s": time.perf_counter() - t0,
            }
        rows = training_rows(batch)  # what the forwards run: episodes, or a split episode's samples
        seqs = [row.seq for row in rows]
        shares = self.shares(seqs)
        plan = [[m for share in mb for m in share] for mb in shares]
        # this rank's micro-batches, None: a dummy
        mine = [padded_slots(mb, self.rank) for mb in shares]
        old, old_v, ref, replays, replayed = {}, {}, {}, {}, []
        # One optimiser step on the weights that would score `old`: the training forward's own
        # log-probs, detached, are the pre-update ones (the same weights on the same micro-batches),
        # so the separate no-grad pass over the whole batch is skipped.
        fused = self.fuses_old_logprobs(len(plan))
        with torch.no_grad():
            for micro in (m for slots in mine for m in slots) if not fused else ():
                if micro is None:
                    self._dummy()
                    continue
                ids, attn, mask, _ = self._tensors([seqs[i] for i in micro])
                key = tuple(micro)
                # the recorded experts, built once and replayed in every forward of this micro-batch
                replays[key] = self._routing([seqs[i] for i in micro], ids.shape[1])
                old[key], _, old_v[key] = self._logprobs(
                    self.lm, ids, attn, routing=replays[key], replayed=replayed, only=mask
                )
                if self.ref is not None:
                    ref[key], _, _ = self._logprobs(self.ref, ids, attn, only=mask)
        # every rank needs every micro-batch's numbers (advantages, KL, annotations)
        if self.world > 1:
            parts = all_gather_objects((old, old_v, ref, replayed))
            for part in parts:
                for own, theirs in zip((old, old_v, ref), part[:3]):
                    own.update(theirs)
            replayed = [r for part in parts for r in part[3]]
        out = dict(dropped)
        if c.kl_beta and c.kl_in == "reward":
            batch, penalty = self._kl_in_reward(batch, rows, old, ref)
            out["kl_reward_penalty_mean"] = penalty
        adv_of, returns, adv_abs = self._advantages(batch, rows, old_v)
        stats: dict[str, list[float]] = {}
        for _ in range(c.epochs):
            for mb, slots in zip(plan, mine):
                n_tokens = sum(seqs[i].num_generated for m in mb for i in m)
                n_seqs = sum(len(m) for m in mb)
                self.opt.zero_grad(set_to_none=True)
                total = 0.0
                # this step's router statistics, a micro-batch at a time
                routing = RouterStats(self.lm)
                hf_loads: list = []  # per micro-batch, per MoE layer, tokens per expert (Hugging Face MoE)
                if self.hf_balance is not None:
                    self.hf_balance.begin()
                mb_tokens = sum(len(seqs[i].token_ids) for m in mb for i in m)
                # one bf16 cast of the experts per optimizer step
                for micro in casts_cached_over(slots):
                    if micro is None:
                        self._dummy(backward=True)
                        continue
                    key = tuple(micro)
                    ids, attn, mask, rollout = self._tensors([seqs[i] for i in micro])
                    if fused:
                        replays[key] = self._routing([seqs[i] for i in micro], ids.shape[1])
                    hf_routers = [] if self.lm.kind == "hf" else None
                    logp, ent, values = self._logprobs(
                        self.lm,
                        ids,
                        attn,
                        with_entropy=bool(c.entropy_coef),
                        routing_out=routing,
                        routing=replays[key],
                        hf_routers=hf_routers,
                        replayed=replayed if fused else None,
                        only=mask,
                    )
                    if fused:
                        old[key] = logp.detach()
                    loss, m = policy_loss(
                        logp,
                        old[key],
                        adv_of(micro).to(self.device),
                        mask,
                        clip_low=c.clip_low,
                        clip_high=c.clip_high,
                        aggregation=c.loss_aggregation,
                        ratio_level=c.ratio_level,
                        max_tokens=self.max_generated_tokens,
                        dual_clip=c.dual_clip,
                        is_weight_BT=self._is_weights(old[key], rollout, mask),
                        kl_beta=c.kl_beta if c.kl_in == "loss" else 0.0,
                        ref_logp_BT=ref.get(key),
                        kl_estimator=c.kl_estimator,
                        entropy_BT=ent,
                        entropy_coef=c.entropy_coef,
                        num_tokens=n_tokens,
                        num_seqs=n_seqs,
                    )
                    if self.value_head is not None:
                        vl = self._value_loss(values, old_v[key], returns, micro, mb)
                        m["value_loss"] = vl.item()
                        loss = loss + c.vf_coef * vl
                    if hf_routers:  # the micro-batch's share of the minibatch's load-balancing loss
                        aux, loads = balance_terms(*hf_routers[0])
                        hf_loads.append([load.cpu() for load in loads])
                        if self.hf_balance is not None:
                            self.hf_balance.add(*hf_routers[0])
                        m["router_aux_loss"] = float(aux.detach())
                        if c.router_aux_coef:
                            loss = loss + c.router_aux_coef * aux * (int(attn.sum()) / mb_tokens)
                    loss.backward()
                    total += loss.item()
                    for k, v in m.items():
                        stats.setdefault(k, []).append(v)
                grad_norm = self._clip_and_step()
                if self.hf_balance is not None:  # after the optimiser: its update is not undone
                    self.hf_balance.step()
                for k, v in balance_policy_routers(self.lm, routing, self.world).items():
                    stats.setdefault(k, []).append(v)
                for k, v in hf_load_metrics(self.lm, hf_loads).items():
                    stats.setdefault(k, []).append(v)
                stats.setdefault("loss", []).append(
                    float(all_reduce_sum(torch.tensor(total, dtype=torch.float64)))
                )
                stats.setdefault("grad_norm", []).append(grad_norm)
        out.update(self._rollout_gap(seqs, plan, old))
        n_replayed, n_differ = (sum(r[j] for r in replayed) for j in (0, 1))
        if n_replayed:  # token × MoE-layer decisions taken from the rollout engine's record
            out.update(
                routing_replay_decisions=n_replayed, router_decisions_differ=n_differ / n_replayed
            )
        if self.rank == 0:
            out["annotations"] = annotations(batch, rows, plan, old, adv_of)
        # per-micro-batch metrics from every rank, as one learner would average them
        if self.world > 1:
            merged: dict[str, list[float]] = {}
            for part in all_gather_objects(stats):
                for k, v in part.items():
                    merged.setdefault(k, []).extend(v)
            stats = merged
        self.version += 1
        # the steps' mean: of numbers, and of each layer's expert shares (router_load, nested)
        out.update(
            {
                k: np.mean(v, axis=0).round(6).tolist() if k == "router_load" else float(np.mean(v))
                for k, v in stats.items()
            }
        )
        out.update(
            policy_version=self.version,
            trainable_params=sum(p.numel() for g in self.opt.param_groups for p in g["params"]),
            # the learner process's peak resident memory so far (and the GPU's peak on cuda)
            learner_peak_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            **(
                {"learner_gpu_peak_mib": torch.cuda.max_memory_allocated(self.device) / 2**20}
                if self.device.type == "cuda"
                else {}
            ),
            adv_abs_mean=adv_abs,
            microbatches=sum(len(mb) for mb in plan),
            train_s=time.perf_counter() - t0,
        )
        return out

    def imitate(self, batch: list[Trajectory], lr: float) -> dict:
        """One supervised step on demonstrations (the warm start, rl/start/warm_start.py): minimise the mean
        negative log-likelihood of their generated tokens (the loss mask; temperature 1, as a
        demonstration is the target itself), one optimiser step over the whole batch at learning rate
        `lr`, gradients accumulated over micro-batches of `microbatch_tokens`. Uses the same forward
        as RL (precision, chunked head on the generated tokens only, shared prefixes); a split
        episode's samples each count. A single learner only (a group's ranks would need its shares)."""
        if self.world > 1:
            raise NotImplementedError(
                "the warm start runs on a single learner (learner.world_size 1)"
            )
        t0 = time.perf_counter()
        seqs = [row.seq for row in training_rows(batch)]
        micro_batches = pack(
            list(range(len(seqs))), [len(t.token_ids) for t in seqs], self.system.microbatch_tokens
        )
        n_tokens = sum(t.num_generated for t in seqs)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for micro in casts_cached_over(micro_batches):
            ids, attn, mask, _ = self._tensors([seqs[i] for i in micro])
            logp, _, _ = self._logprobs(self.lm, ids, attn, only=mask, temperature=1.0)
            loss = -(logp * mask).sum() / max(n_tokens, 1)
            loss.backward()
            total += loss.item()
        grad_norm = self._clip_and_step()
        for group in self.opt.param_groups:
            group["lr"] = self.cfg.lr
        return {
            "sft_loss": total,
            "grad_norm": grad_norm,
            "tokens": n_tokens,
            "seconds": time.perf_counter() - t0,
        }

    def next_version(self, after: int = -1) -> int:
        """A new policy version for weights changed outside `train_step` (the warm start's rounds),
        newer than `after` too; returns it."""
        self.version = max(self.version, after) + 1
        return self.version

    def policy_version(self) -> int:
        return self.version

    def reset_optimizer(self) -> None:
        """A fresh optimiser (its moments zero): RL after the warm start does not inherit the
        supervised steps' moments."""
        self._make_optimizer()

    def _is_weights(self, old_BT, rollout_BT, mask_BT) -> torch.Tensor | None:
        c = self.cfg
        return (
            rollout_is_weights(
                old_BT, rollout_BT, mask_BT, mode=c.rollout_is, low=c.is_low, high=c.tis_cap
            )
            if c.tis_cap
            else None
        )

    def _rollout_gap(self, seqs, plan, old) -> dict:
        """How far the engine's log-probs are from the weights about to be trained, and what the
        importance weights that correct it (`algo.rollout_is`) did (rl/learner/grpo.py `mismatch_metrics`)."""
        logr, weights, lags, seqs_dropped, n_seqs = [], [], [], 0, 0
        for micro in (m for mb in plan for m in mb):
            _, _, mask, rollout = self._tensors([seqs[i] for i in micro])
            gen, lp = mask.bool(), old[tuple(micro)]
            logr.append((lp - rollout)[gen])  # log π_learner/π_engine per generated token
            w = self._is_weights(lp, rollout, mask)
            w = torch.ones_like(lp) if w is None else w
            weights.append(w[gen])
            seqs_dropped += int((((w == 0) | ~gen).all(-1) & gen.any(-1)).sum())
            n_seqs += int(gen.any(-1).sum())
            versions = torch.tensor(pad([token_versions(seqs[i]) for i in micro], -1))[:, 1:].to(
                self.device
            )
            lags.append((self.version - versions)[gen])
        return mismatch_metrics(
            torch.cat(logr), torch.cat(weights), torch.cat(lags), seqs_dropped, n_seqs
        )

    def _dummy(self, backward: bool = False) -> None:
        """A two-token forward (and backward of zero loss) for a rank with fewer micro-batches than
        another: the collectives inside must run on every rank. Its gradients are zeros."""
        ids = torch.zeros(1, 2, dtype=torch.long, device=self.device)
        logp, _, values = self._logprobs(self.lm, ids, torch.ones_like(ids))
        if backward:
            loss = logp.sum() * 0.0
            if values is not None:
                loss = loss + values.sum() * 0.0
            loss.backward()

    def _clip_and_step(self) -> float:
        """Clip the global gradient norm and step; in a group, the value head's (unsharded)
        gradients are summed first and the norm covers every rank's shards."""
        c = self.cfg
        if self.world == 1:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.max_grad_norm)
        else:
            from policy.parallelize import clip_grad_norm_, fill_expert_grads

            fill_expert_grads(self.model)
            for p in self.value_head.parameters() if self.value_head is not None else []:
                if p.grad is not None:
                    all_reduce_sum(p.grad)
            grad_norm = clip_grad_norm_(self.model, c.max_grad_norm)
        self.opt.step()
        return float(grad_norm)

    @torch.no_grad()
    def logprobs(self, token_ids: list[int]) -> list[float]:
        """The learner's log p(token_ids[i] | token_ids[:i]) for i >= 1 (temperature 1)."""
        ids = torch.tensor([token_ids], device=self.device)
        h = self.lm.hidden(ids)
        return chunked_logprobs(
            h,
            self.lm.head,
            ids,
            chunk_tokens=self.system.logprob_chunk_tokens,
            banned_ids=self.lm.banned_ids,
        )[0][0].tolist()

    def allocator(self) -> str:
        """The malloc this learner process runs with (rl/learner/allocator.py)."""
        from rl.learner.allocator import in_use

        return in_use()

    def save_checkpoint(self, path: str, extra: dict | None = None, optimizer: bool = True) -> str:
        """A checkpoint directory (rl/learner/checkpoints.py: weights, tokenizer, `trainer_state.pt`, and a
        group's `sharded/`), written under a temporary name and renamed; `optimizer` False leaves the
        optimiser state out (a warm start's, which RL does not continue)."""
        from rl.learner.checkpoints import save_learner

        return save_learner(self, path, extra, optimizer=optimizer)

    def load_checkpoint(self, path: str) -> dict:
        """Restore weights, optimiser state, version and RNG from `save_checkpoint`'s directory."""
        from rl.learner.checkpoints import load_learner

        return load_learner(self, path)
