"""Parallelism for the `policy/` model and Hugging Face MoE checkpoints, applied from outside:
the model files know nothing of it.

    parallelize(model, group)       # the policy/ model, after init_process_group, on every rank
    parallelize_hf(lm, group)       # a transformers MoE causal LM (Qwen3-MoE / Qwen2-MoE layout)

- **Expert parallelism.** Each LatentMoE layer's routed experts are split across the ranks of the
  group in contiguous blocks (rank r owns experts [r·E/N, (r+1)·E/N)); the layer's other weights
  (router, shared expert, latent down/up projections, norms) stay whole. Its forward routes on
  each rank's own tokens, sends every (token, slot) latent to the rank that owns the chosen expert
  with one all-to-all, runs the local experts, sends the outputs back with a second all-to-all and
  combines them with the router's weights, so a token's output is exactly the single-process sum.
  Both all-to-alls are differentiable (`torch.distributed.nn.functional`), so an expert's gradient
  is the sum over every rank's tokens routed to it.
- **FSDP2.** Every block's attention and MLP, then the root (embeddings, head, norms, AttnRes
  queries, vision encoder), is `fully_shard`ed over the same ranks; the root's forward must be what
  runs (`model(...)`: FSDP gathers a unit's parameters in its forward pre-hook): parameters, gradients and optimizer state are sharded;
  the expert weights are left out (`ignored_params`: each already lives on exactly one rank).
  Gradients are summed across ranks, not averaged (`set_gradient_divide_factor(1)`): the caller
  divides each rank's loss by the global token count, so the sum is the single-process gradient.

Hugging Face models get the same two steps: the experts module's 3D-stacked `gate_up_proj` /
`down_proj` split by expert with the same dispatch (`dispatch_combine`), every decoder layer and
the root FSDP units; the routers' forward hooks (routing replay, rl/learner/routing.py) keep working.

`clip_grad_norm_` and `gather_full_state` here know both kinds of parameter: FSDP's DTensor shards
and the plain per-rank expert blocks. Data-parallel ranks equal expert-parallel ranks (one group);
tensor and pipeline parallelism are not covered. CPU with gloo and GPU with NCCL take the same path
(the mesh's device type follows the parameters).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn

from policy.model import Policy
from policy.moe import LatentMoE


def dispatch_combine(
    x_NH: torch.Tensor,
    idx_Nk: torch.Tensor,
    w_Nk: torch.Tensor,
    run_expert,
    *,
    group: dist.ProcessGroup,
    rank: int,
    local_experts: int,
) -> torch.Tensor:
    """Σ_k w[n, k] · expert_{idx[n, k]}(x[n]) for this rank's tokens, with the experts split over
    `group` in contiguous blocks of `local_experts` (this rank owns block `rank`): every (token,
    slot) row goes to its expert's owner with one all-to-all, `run_expert(e_local, rows)` runs there,
    the outputs come back with a second all-to-all and are combined with the router's weights on the
    sending rank (so the weights' gradient stays local). An expert maps H to H. Both all-to-alls are differentiable: an
    expert's gradient is the sum over every rank's tokens routed to it. Collective."""
    size = dist.get_world_size(group)
    k = idx_Nk.shape[1]
    flat_e = idx_Nk.flatten()
    order = torch.argsort(flat_e, stable=True)  # sorted by expert, hence by owning rank
    tok = order // k
    send_counts = torch.bincount(flat_e // local_experts, minlength=size)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_sizes, recv_sizes = send_counts.tolist(), recv_counts.tolist()
    recv_e = flat_e.new_empty(sum(recv_sizes))
    dist.all_to_all_single(recv_e, flat_e[order].contiguous(), recv_sizes, send_sizes, group=group)
    recv_x = dist_fn.all_to_all_single(
        x_NH.new_empty(sum(recv_sizes), x_NH.shape[1]),
        x_NH[tok],
        recv_sizes,
        send_sizes,
        group=group,
    )
    # `recv_x * 0` keeps the output on the autograd path even where nothing (or one expert's rows
    # only) arrived: every rank must run both all-to-alls' backward, or the others wait forever
    out = recv_x * 0
    local_e = recv_e - rank * local_experts
    # the rows came from every rank, each rank's sorted by expert: sorted once here, each local expert
    # runs on its contiguous slice (no pass over the rows per expert)
    perm = torch.argsort(local_e, stable=True)
    counts = torch.bincount(local_e, minlength=local_experts).tolist()
    outs = [run_expert(e, xs) for e, xs in enumerate(recv_x[perm].split(counts)) if counts[e]]
    if outs:
        out = out.index_add(0, perm, torch.cat(outs).to(out.dtype))
    back = dist_fn.all_to_all_single(
        x_NH.new_empty(len(tok), x_NH.shape[1]), out, send_sizes, recv_sizes, group=group
    )
    return torch.zeros_like(x_NH, dtype=back.dtype).index_add(
        0, tok, back * w_Nk.flatten()[order, None].to(back.dtype)
    )


class ExpertParallel:
    """Marks a module whose routed experts are split across `ep_group` (`ep_params` name its
    per-rank expert blocks, each holding experts [ep_rank·local_experts, (ep_rank+1)·local_experts))."""

    ep_group: dist.ProcessGroup
    ep_size: int
    ep_rank: int
    local_experts: int
    ep_params: tuple[str, ...]


class ExpertParallelMoE(ExpertParallel, LatentMoE):
    """A LatentMoE whose routed experts are split across `ep_group`: see the module docstring.
    Installed by `parallelize` on an existing LatentMoE (its class is swapped, its expert weights
    sliced to this rank's block); nothing else about the layer changes."""

    ep_params = ("w_gate_EFL", "w_up_EFL", "w_down_ELF")

    def forward(self, x_BTD, replay_BTk=None):
        B, T, D = x_BTD.shape
        x = x_BTD.reshape(-1, D)
        replay = replay_BTk.reshape(-1, replay_BTk.shape[-1]) if replay_BTk is not None else None
        idx_Nk, w_Nk, scores, replayed = self.router(x, replay)
        u = dispatch_combine(
            self.down(x),
            idx_Nk,
            w_Nk,
            self.expert,
            group=self.ep_group,
            rank=self.ep_rank,
            local_experts=self.local_experts,
        )
        y = self.up(self.latent_norm(u))
        if self.shared is not None:
            y = y + self.shared(x)
        load = torch.bincount(idx_Nk.flatten(), minlength=self.a.n_routed_experts)
        info = {
            "experts": idx_Nk.view(B, T, -1),
            "load": load,
            "scores": scores.detach().float(),
            "replayed": replayed,
        }
        return y.view(B, T, D), info


def _split_experts(
    module: nn.Module, names: tuple[str, ...], n_experts: int, group: dist.ProcessGroup
) -> None:
    """Keep this rank's contiguous block of each expert-stacked parameter (dim 0 = expert)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if n_experts % size:
        raise ValueError(
            f"expert parallelism: {n_experts} routed experts do not split over {size} ranks; "
            "pick a learner world size that divides the expert count"
        )
    n = n_experts // size
    with torch.no_grad():
        for name in names:
            full = getattr(module, name)
            setattr(
                module,
                name,
                nn.Parameter(
                    full[rank * n : (rank + 1) * n].clone(), requires_grad=full.requires_grad
                ),
            )
    module.ep_group, module.ep_size, module.ep_rank, module.local_experts = group, size, rank, n


def expert_params(module: ExpertParallel) -> list[nn.Parameter]:
    return [getattr(module, name) for name in module.ep_params]


def shard_experts(moe: LatentMoE, group: dist.ProcessGroup) -> ExpertParallelMoE:
    """Keep this rank's block of `moe`'s routed experts and make it dispatch across `group`."""
    _split_experts(moe, ExpertParallelMoE.ep_params, moe.a.n_routed_experts, group)
    moe.__class__ = ExpertParallelMoE
    return moe


# ---------------------------------------------------------------------------------------------
# Hugging Face MoE checkpoints (Qwen3-MoE / Qwen2-MoE layout)


def _hf_experts_forward(self, hidden_states_ND, top_k_index_Nk, top_k_weights_Nk):
    """The experts module's forward with its experts split across ranks (same math as
    transformers' eager loop: act(gate) · up, then down, per expert)."""

    def run(e, x):
        gate, up = nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])

    return dispatch_combine(
        hidden_states_ND,
        top_k_index_Nk,
        top_k_weights_Nk,
        run,
        group=self.ep_group,
        rank=self.ep_rank,
        local_experts=self.local_experts,
    ).to(hidden_states_ND.dtype)


def _is_hf_experts(module: nn.Module) -> bool:
    return (
        hasattr(module, "gate_up_proj")
        and hasattr(module, "down_proj")
        and hasattr(module, "num_experts")
    )


def shard_hf_experts(experts: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    """Expert parallelism for a transformers experts module that stacks its experts in 3D tensors
    (`gate_up_proj` E × 2F × D concatenated [gate; up], `down_proj` E × D × F: Qwen3-MoE, Qwen2-MoE).
    Other layouts (transposed, interleaved, with biases) are refused by name."""
    layout = {
        k: getattr(experts, k, v)
        for k, v in (
            ("is_transposed", False),
            ("is_concatenated", True),
            ("has_bias", False),
            ("has_gate", True),
        )
    }
    if layout != {
        "is_transposed": False,
        "is_concatenated": True,
        "has_bias": False,
        "has_gate": True,
    }:
        raise ValueError(
            f"expert parallelism: {type(experts).__name__} stores its experts as {layout}; "
            "only the concatenated, untransposed gate_up_proj/down_proj layout is supported"
        )
    _split_experts(experts, ("gate_up_proj", "down_proj"), experts.num_experts, group)
    cls = type(experts)
    experts.__class__ = type(
        f"ExpertParallel{cls.__name__}",
        (ExpertParallel, cls),
        {"forward": _hf_experts_forward, "ep_params": ("gate_up_proj", "down_proj")},
    )
    return experts


class HFHiddenStates(nn.Module):
    """A Hugging Face causal LM's trunk as the root FSDP unit (the `HiddenStates` of an HF model):
    forward gives the last hidden states; `lm.lm_head` stays gathered for the caller's head."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids_BT, attention_mask_BT=None):
        return self.lm.model(
            input_ids=input_ids_BT, attention_mask=attention_mask_BT
        ).last_hidden_state


def parallelize_hf(
    lm: nn.Module,
    group: dist.ProcessGroup | None = None,
    *,
    expert_parallel: bool = True,
    root: nn.Module | None = None,
) -> nn.Module:
    """Expert parallelism (3D-stacked experts, see `shard_hf_experts`), then FSDP2 on every decoder
    layer and the root (`root`: what callers run, default `HFHiddenStates(lm)`'s owner `lm`); in place."""
    from torch.distributed.fsdp import fully_shard

    group = group or dist.group.WORLD
    mesh = _mesh(group, next(lm.parameters()).device.type)
    ignored: set[nn.Parameter] = set()
    if expert_parallel:
        for experts in [m for m in lm.modules() if _is_hf_experts(m)]:
            ignored.update(expert_params(shard_hf_experts(experts, group)))
    units = list(lm.model.layers)
    for unit in units:
        fully_shard(unit, mesh=mesh, ignored_params=ignored)
    root = root if root is not None else lm
    fully_shard(root, mesh=mesh, reshard_after_forward=False, ignored_params=ignored)
    for unit in units + [root]:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return lm


class HiddenStates(nn.Module):
    """The policy's trunk as a module whose `forward` is `Policy.hidden_states`: the root FSDP unit
    for callers that project to the vocabulary themselves (the learner's chunked log-probs read
    `policy.lm_head.weight` after the forward). The root's parameters stay gathered from its
    forward until its backward, so the head can be used in between."""

    def __init__(self, policy: Policy):
        super().__init__()
        self.policy = policy

    def forward(self, input_ids_BT, images=None, routing=None):
        return self.policy.hidden_states(input_ids_BT, images, routing=routing)


def parallelize(
    model: Policy,
    group: dist.ProcessGroup | None = None,
    *,
    expert_parallel: bool = True,
    reshard_after_forward: bool = True,
    root: nn.Module | None = None,
) -> Policy:
    """Expert parallelism, then FSDP2, over `group` (default: the whole world); in place. `root`:
    the module whose forward callers run (default the policy itself; `HiddenStates(model)` for
    callers that apply the head themselves)."""
    from torch.distributed.fsdp import fully_shard

    group = group or dist.group.WORLD
    mesh = _mesh(group, next(model.parameters()).device.type)
    ignored: set[nn.Parameter] = set()
    if expert_parallel:
        for blk in model.layers:
            if blk.is_moe:
                shard_experts(blk.mlp, group)
                ignored.update(expert_params(blk.mlp))
    # Units are the modules the model calls (FSDP gathers a unit's parameters in its forward
    # pre-hook): each block's attention and MLP. The block's own small tensors (norms, AttnRes
    # queries), the embeddings, the head and the vision encoder go with the root.
    units = [m for blk in model.layers for m in (blk.attn, blk.mlp)]
    for unit in units:
        fully_shard(
            unit, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored
        )
    # the root stays gathered from its forward to its backward (its parameters are needed again
    # at once, and a head applied after the forward reads them)
    root = root if root is not None else model
    fully_shard(root, mesh=mesh, reshard_after_forward=False, ignored_params=ignored)
    for unit in units + [root]:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return model


def _mesh(group: dist.ProcessGroup, device: str):
    """A one-dimensional device mesh over `group`'s ranks."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(
        group, device, mesh=torch.tensor(dist.get_process_group_ranks(group))
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def fill_expert_grads(model: nn.Module) -> None:
    """Zero gradients for expert blocks that got none. A rank whose experts received no token in a
    step has no gradient for its block, but the single-process model's stacked expert tensor always
    has one (zeros where no token went), so AdamW still applies its momentum and weight decay there;
    call after the step's backward passes, before clipping and the optimizer step."""
    for mod in {id(m): m for m in _expert_modules(model).values()}.values():
        for p in expert_params(mod):
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)


def clip_grad_norm_(
    model: nn.Module, max_norm: float, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Clip the global gradient norm (FSDP shards and expert blocks are disjoint across ranks, so
    the squared norm is the sum of every rank's local squares); returns the norm before clipping."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    # where NCCL reaches it
    sq = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else None)
    for g in grads:
        sq += _local(g).double().pow(2).sum()
    dist.all_reduce(sq, group=group)
    norm = sq.sqrt()
    scale = max_norm / (float(norm) + 1e-6)
    if scale < 1.0:
        for g in grads:
            _local(g).mul_(scale)
    return norm.float()


def gather_full_state(
    model: nn.Module, group: dist.ProcessGroup | None = None, *, grads: bool = False
) -> dict[str, torch.Tensor]:
    """Every rank gets the full, single-process state dict (names as `Policy.state_dict()`), or
    with `grads` the full gradient of every parameter: FSDP shards all-gathered, expert blocks
    all-gathered and concatenated in rank order. For tests and small models; weight sync streams
    buckets instead."""
    experts = _expert_modules(model)
    items = (
        ((n, p.grad) for n, p in model.named_parameters() if p.grad is not None)
        if grads
        else model.state_dict().items()
    )
    return {name: _full(t, experts.get(name)).clone() for name, t in items}


def _full(t: torch.Tensor, ep_owner: ExpertParallel | None) -> torch.Tensor:
    """The whole tensor behind this rank's piece: an expert block all-gathered over its group and
    concatenated in rank order, an FSDP shard all-gathered, anything else as it is. Collective."""
    if ep_owner is not None:
        parts = [torch.empty_like(t) for _ in range(ep_owner.ep_size)]
        dist.all_gather(parts, t.detach().contiguous(), group=ep_owner.ep_group)
        return torch.cat(parts)
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


# ---------------------------------------------------------------------------------------------
# Sharded checkpoints and streamed full weights


def _expert_modules(model: nn.Module) -> dict[str, ExpertParallel]:
    """Parameter name → its expert-parallel module, for every expert block."""
    return {
        f"{name}.{p}": mod
        for name, mod in model.named_modules()
        if isinstance(mod, ExpertParallel)
        for p in mod.ep_params
    }


def _as_shards(sd: dict, experts: dict, fqn: str | None = None) -> dict:
    """Expert blocks as DTensors sharded on dim 0 over their group, so the checkpoint knows each
    rank's block is a slice of one global tensor (and can be re-cut for another world size). Keys
    are parameter names, or with `fqn` the optimizer state entries of that one parameter."""
    from torch.distributed.tensor import DTensor, Shard

    out = {}
    for k, v in sd.items():
        mod = experts.get(fqn or k)
        if (
            mod is not None
            and isinstance(v, torch.Tensor)
            and not isinstance(v, DTensor)
            and v.dim() > 0
        ):
            v = DTensor.from_local(
                v, _mesh(mod.ep_group, v.device.type), [Shard(0)], run_check=False
            )
        out[k] = v
    return out


def _sharded_state(model: nn.Module, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    experts = _expert_modules(model)
    osd = dict(osd, state={fqn: _as_shards(st, experts, fqn) for fqn, st in osd["state"].items()})
    return {"model": _as_shards(msd, experts), "optim": osd}


def save_sharded(model: nn.Module, optimizer, path: str) -> None:
    """Every rank writes its shards (torch.distributed.checkpoint): FSDP's parameter and optimizer
    shards and its expert blocks, each as a slice of the global tensor, so a run can resume on
    another number of ranks. Collective: call on every rank."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_sharded_state(model, optimizer), checkpoint_id=path)


def load_sharded(model: nn.Module, optimizer, path: str) -> None:
    """Load `save_sharded`'s checkpoint into a parallelized model and its optimizer, whatever the
    number of ranks it was saved from (each rank reads the slices it now owns). Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.tensor import DTensor

    state = _sharded_state(model, optimizer)  # initialises the optimizer state it will overwrite
    dcp.load(state, checkpoint_id=path)
    experts = _expert_modules(model)

    # the expert blocks back as this rank's plain tensors (`_as_shards` undone)
    def local(sd, fqn=None):
        return {
            k: (v.to_local() if isinstance(v, DTensor) and (fqn or k) in experts else v)
            for k, v in sd.items()
        }

    osd = dict(
        state["optim"], state={fqn: local(st, fqn) for fqn, st in state["optim"]["state"].items()}
    )
    set_state_dict(model, optimizer, model_state_dict=local(state["model"]), optim_state_dict=osd)


def iter_full_weights(model: nn.Module):
    """(name, full CPU tensor) in `state_dict` order, gathered one tensor at a time on every rank: a
    rank holds one gathered tensor beyond its shards, never the whole model. Collective: every rank
    must consume it to the end (rank 0 publishes, the others discard)."""
    experts = _expert_modules(model)
    for name, t in model.state_dict().items():
        yield name, _full(t, experts.get(name)).cpu()
