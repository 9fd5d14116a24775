"""How the ranks of a learner group share one update, and the few collectives it needs.

Every rank holds the whole batch (its advantages need whole groups) and computes the same plan:
each minibatch's episodes are dealt to ranks by tokens (longest first, to the least-loaded rank),
then each rank packs its own share into micro-batches. Every rank must run the same number of
forwards (each is full of collectives: FSDP's all-gathers, the experts' all-to-alls), so a rank
with fewer micro-batches runs zero-loss dummy ones (`None` in its slots).

With one rank every function here is the identity and nothing is communicated.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def deal_by_tokens(idx: list[int], lengths: list[int], ranks: int) -> list[list[int]]:
    """`idx` dealt to `ranks` shares of near-equal token counts (greedy, longest first; ties go to
    the lower rank, so every rank computes the same deal)."""
    shares: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for i in sorted(idx, key=lambda i: (-lengths[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += lengths[i]
    return shares


def minibatch_shares(
    lengths: list[int], minibatch_episodes: int, microbatch_tokens: int, ranks: int
) -> list[list[list[list[int]]]]:
    """Per minibatch (`minibatch_episodes` episodes, one optimiser step), per rank, that rank's
    micro-batches: the minibatch's episodes dealt to the ranks by tokens, each share packed on its
    own so a micro-batch's padded size stays within `microbatch_tokens` (an episode longer than the
    budget gets one of its own). With one rank, the share is the whole minibatch."""
    out = []
    for s in range(0, len(lengths), minibatch_episodes):
        idx = list(range(s, min(s + minibatch_episodes, len(lengths))))
        out.append(
            [
                pack(share, lengths, microbatch_tokens)
                for share in deal_by_tokens(idx, lengths, ranks)
            ]
        )
    return out


def pack(idx: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """`idx` in micro-batches, shortest first, each with (longest episode × episodes) <= `budget`."""
    micro, longest, packed = [], 0, []
    for i in sorted(idx, key=lambda i: (lengths[i], i)):
        n = lengths[i]
        if micro and max(longest, n) * (len(micro) + 1) > budget:
            packed.append(micro)
            micro, longest = [], 0
        micro.append(i)
        longest = max(longest, n)
    if micro:
        packed.append(micro)
    return packed


def padded_slots(per_rank: list[list], rank: int) -> list:
    """This rank's micro-batches followed by `None` (a dummy) up to the most any rank has."""
    width = max(len(m) for m in per_rank)
    return list(per_rank[rank]) + [None] * (width - len(per_rank[rank]))


def world() -> tuple[int, int]:
    """(rank, world size), (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather_objects(obj) -> list:
    """Every rank's `obj` (picklable), in rank order; [obj] without a process group."""
    _, size = world()
    if size == 1:
        return [obj]
    out = [None] * size
    dist.all_gather_object(out, obj)
    return out


def _on_comm_device(t: torch.Tensor) -> torch.Tensor:
    """`t` where the group's backend can reach it: NCCL moves only GPU tensors (the bookkeeping
    here, loads and histograms, lives on the CPU)."""
    if dist.get_backend() == "nccl" and t.device.type != "cuda":
        return t.to(torch.device("cuda", torch.cuda.current_device()))
    return t


def all_gather_rows(t_NE: torch.Tensor) -> torch.Tensor:
    """Every rank's rows concatenated in rank order (row counts may differ), on `t_NE`'s device."""
    _, size = world()
    if size == 1:
        return t_NE
    home, t_NE = t_NE.device, _on_comm_device(t_NE)
    n = torch.tensor([t_NE.shape[0]], device=t_NE.device)
    counts = [torch.zeros_like(n) for _ in range(size)]
    dist.all_gather(counts, n)
    width = int(max(c.item() for c in counts))
    padded = torch.zeros((width, *t_NE.shape[1:]), dtype=t_NE.dtype, device=t_NE.device)
    padded[: t_NE.shape[0]] = t_NE
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat([p[: int(c.item())] for p, c in zip(parts, counts)]).to(home)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """In place; the tensor itself without a process group."""
    if world()[1] > 1:
        on = _on_comm_device(t)
        dist.all_reduce(on)
        if on is not t:
            t.copy_(on)
    return t
