"""The native engine: batched incremental decoding of the project's own `policy/` model.

Same protocol as the vLLM engine (`generate`, `score`, `load_weights`, `version`), in plain
PyTorch on the model's own caches: each KDA layer keeps its O(1) recurrent and conv states, each
gated-MLA layer its latent cache (c_KV and the shared rope key: `kv_lora_rank + qk_rope_head_dim`
values per token and MLA layer). It is the oracle the vLLM plugin is checked against, and the
engine of choice when routing must be recorded: every `Generation` carries the expert ids each
token was routed to, for rollout routing replay.

Continuous batching: requests wait in a queue; up to `max_batch` decode together, one token per
step. A request joins by prefilling its prompt alone (exact, no padding) and merging its cache into
the batch; the MLA caches are left-padded to a common length (`MLACache.pad`: those slots are
masked and are not positions). A finished request leaves at once and the next one takes its row,
so a batch never waits for its longest member.

Prefix cache: when a request ends, its state (prompt and generated tokens but the last, which was
never fed back) is kept under those token ids; a later prompt that extends them (the next turn of
the same episode) prefills only the new tokens. KDA's state is O(1), so an entry costs its MLA
latents plus a few small matrices. `load_weights` drops every entry (they hold the old weights).

Sampling, per request with its own seeded generator (so a sequence samples the same tokens alone
or in any batch): temperature (0 = greedy), top-k, top-p, min_tokens, stop token ids and stop
strings, max_tokens. Log-probs are those of the distribution sampled from (after temperature,
top-k and top-p), as the vLLM engine reports them (`logprobs_mode="processed_logprobs"`); greedy
reports the unscaled distribution's. The image placeholder is input only and never sampled
(`Policy.never_generated`; the learner gives it zero probability too).

Routed experts: `Generation.routed_experts[i]` is generated token i's routing (per MoE layer, its
top-k expert ids) when it was fed back as input; the last token is never fed back and gets [].
`Generation.prompt_routed_experts` covers the prompt's tokens (the agent loop fills observation
tokens from it). Both follow the learner's positions: token p's record replays at position p.

Not covered: images in prompts (text only here; the model takes them in training), tensor or
expert parallelism, CUDA graphs or fused kernels; it runs wherever the model runs (CPU, or a GPU
with `device`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from policy.kda import KDAState
from policy.mla import MLACache
from policy.model import PolicyCache
from rollout.engines.base import Generation


@dataclass
class _Request:
    index: int
    prompt: list[int]
    max_tokens: int
    min_tokens: int
    generator: torch.Generator
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routed: list = field(default_factory=list)
    prompt_routed: list | None = None
    finish: str = ""


# ---------------------------------------------------------------------------------------------
# Batched caches: rows are sequences. KDA states stack along the batch; MLA caches are left-padded.


def _fields(st) -> list:
    """A state's tensors in field order (not `dataclasses.astuple`: it deep-copies them)."""
    return [getattr(st, f.name) for f in dataclasses.fields(st)]


def select_rows(cache: PolicyCache, rows: list[int]) -> PolicyCache:
    """The cache of a subset of rows (in that order), with common left padding trimmed."""
    idx = torch.tensor(rows, dtype=torch.long)
    layers = []
    for st in cache.layers:
        if isinstance(st, KDAState):
            layers.append(KDAState(*(t.index_select(0, idx) for t in _fields(st))))
        else:
            c_kv, k_rope, pad = (
                st.c_kv.index_select(0, idx),
                st.k_rope.index_select(0, idx),
                st.pad.index_select(0, idx),
            )
            trim = int(pad.min())
            layers.append(MLACache(c_kv[:, trim:], k_rope[:, trim:], pad - trim))
    return PolicyCache(layers)


def merge_rows(a: PolicyCache | None, b: PolicyCache) -> PolicyCache:
    """Rows of `a` then rows of `b` in one cache; MLA caches left-padded to the longer one."""
    if a is None:
        return PolicyCache([_with_pad(st) for st in b.layers])
    layers = []
    for sa, sb in zip(a.layers, b.layers):
        if isinstance(sa, KDAState):
            layers.append(KDAState(*(torch.cat([x, y]) for x, y in zip(_fields(sa), _fields(sb)))))
        else:
            sa, sb = _with_pad(sa), _with_pad(sb)
            n = max(sa.length, sb.length)
            parts = [_left_pad(s, n - s.length) for s in (sa, sb)]
            layers.append(
                MLACache(
                    torch.cat([p.c_kv for p in parts]),
                    torch.cat([p.k_rope for p in parts]),
                    torch.cat([p.pad for p in parts]),
                )
            )
    return PolicyCache(layers)


def _with_pad(st):
    if isinstance(st, MLACache) and st.pad is None:
        return MLACache(st.c_kv, st.k_rope, torch.zeros(st.c_kv.shape[0], dtype=torch.long))
    return st


def _left_pad(st: MLACache, n: int) -> MLACache:
    if n == 0:
        return st
    return MLACache(F.pad(st.c_kv, (0, 0, n, 0)), F.pad(st.k_rope, (0, 0, n, 0)), st.pad + n)


def _unpadded_row(cache: PolicyCache, row: int) -> PolicyCache:
    """One row's cache without its padding (what the prefix cache keeps)."""
    one = select_rows(cache, [row])
    return PolicyCache(
        [
            st if isinstance(st, KDAState) else MLACache(st.c_kv, st.k_rope, None)
            for st in one.layers
        ]
    )


def _clone(cache: PolicyCache) -> PolicyCache:
    return PolicyCache(
        [type(st)(*(None if t is None else t.clone() for t in _fields(st))) for st in cache.layers]
    )


# ---------------------------------------------------------------------------------------------
# Sampling


def processed_logprobs(
    logits_BV: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    banned_ids: list[int] | None = None,
) -> torch.Tensor:
    """Log-probs of the distribution sampled from: banned tokens removed, temperature, then top-k,
    then top-p (the smallest set of most likely tokens whose mass reaches top_p), renormalised;
    -inf elsewhere."""
    x = logits_BV.float()
    if banned_ids:
        x = x.clone()
        x[:, banned_ids] = -torch.inf
    if temperature > 0:
        x = x / temperature
    if top_k and 0 < top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, -torch.inf)
    if top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the strictly more likely tokens
        drop_sorted = before >= top_p  # the first token is always kept (before = 0)
        x = x.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), -torch.inf)
    return x.log_softmax(-1)


class NativeEngine:
    """Generate with per-token log-probs and routed experts, score fixed sequences, load new
    weights in place; see the module docstring."""

    def __init__(
        self,
        model_path: str,
        *,
        seed: int = 0,
        max_model_len: int = 4096,
        dtype: str = "float32",
        max_batch: int = 32,
        prefix_cache_entries: int = 64,
        threads: int | None = None,
    ):
        from policy.checkpoint import load_policy

        # every core this process may use (default): Ray starts an actor reserving under one CPU
        # with OMP_NUM_THREADS=1, which would leave the engine on one thread
        torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
        self.model_path = model_path
        self.version = 0
        self.seed = seed
        self.max_model_len = max_model_len
        self.max_batch = max_batch
        self.model = load_policy(model_path, dtype=getattr(torch, dtype)).eval()
        self._banned = self.model.never_generated()  # the image placeholder: input only
        self._has_moe = any(blk.is_moe for blk in self.model.layers)
        self.tokenizer = None
        if (Path(model_path) / "tokenizer_config.json").exists():
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.prefix_cache_entries = prefix_cache_entries
        self._prefixes: OrderedDict[tuple, PolicyCache] = OrderedDict()
        self.stats = {
            "prefill_tokens": 0,
            "prefix_hit_tokens": 0,
            "prefill_s": 0.0,
            "decode_steps": 0,
            "decode_s": 0.0,
            "generated_tokens": 0,
        }

    # -- protocol ------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_tokens: int | list[int],
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_token_ids: list[int] | None = None,
        stop: list[str] | None = None,
        seeds: list[int] | None = None,
        min_tokens: int = 0,
    ) -> list[Generation]:
        """One completion per prompt (token ids in, token ids out), continuously batched."""
        if isinstance(max_tokens, int):
            max_tokens = [max_tokens] * len(prompts)
        if stop and self.tokenizer is None:
            raise ValueError(f"stop strings need a tokenizer; {self.model_path} has none")
        stop_ids = set(stop_token_ids or [])
        reqs = []
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if len(p) >= self.max_model_len:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; max_model_len is {self.max_model_len}"
                )
            g = torch.Generator().manual_seed(
                int(seeds[i]) if seeds is not None else self.seed * 1_000_003 + i
            )
            n = min(int(max_tokens[i]), self.max_model_len - len(p))
            reqs.append(_Request(i, list(p), n, min(min_tokens, n), g))
        pending = deque(r for r in reqs if r.max_tokens > 0)
        for r in reqs:
            if r.max_tokens <= 0:
                r.finish = "length"
        active: list[_Request] = []
        cache: PolicyCache | None = None
        sample = dict(
            temperature=temperature, top_k=top_k, top_p=top_p, stop_ids=stop_ids, stop=stop or []
        )

        while pending or active:
            # admit: prefill alone, then join the batch
            while pending and len(active) < self.max_batch:
                r = pending.popleft()
                logits_V, row = self._prefill(r)
                self._sample([r], logits_V[None], **sample)
                if r.finish:
                    self._remember(r, row)
                else:
                    cache = merge_rows(cache, row)
                    active.append(r)
            if not active:
                break
            t0 = time.perf_counter()
            x_B1 = torch.tensor([[r.out[-1]] for r in active])
            logits, cache, info = self.model(x_B1, cache=cache)
            experts = info["experts"]  # L × B × 1 × k, or None without MoE layers
            for b, r in enumerate(active):
                r.routed.append(experts[:, b, 0].tolist() if experts is not None else [])
            self._sample(active, logits[:, -1], **sample)
            self.stats["decode_steps"] += 1
            self.stats["decode_s"] += time.perf_counter() - t0
            if any(r.finish for r in active):
                keep = [b for b, r in enumerate(active) if not r.finish]
                for b, r in enumerate(active):
                    if r.finish:
                        self._remember(r, _unpadded_row(cache, b))
                active = [active[b] for b in keep]
                cache = select_rows(cache, keep) if keep else None

        out = []
        for r in reqs:
            self.stats["generated_tokens"] += len(r.out)
            routed = (r.routed + [[]])[: len(r.out)] if self._has_moe else None
            out.append(
                Generation(
                    r.out,
                    r.logprobs,
                    r.finish or "length",
                    routed,
                    r.prompt_routed if self._has_moe else None,
                )
            )
        return out

    @torch.no_grad()
    def score(self, token_ids: list[int]) -> list[float]:
        """log p(token_ids[i] | token_ids[:i]) for i >= 1 (unscaled), one full forward."""
        logits, _, _ = self.model(torch.tensor([token_ids]))
        lp = processed_logprobs(logits[0, :-1], 1.0, 0, 1.0, self._banned)
        return lp.gather(-1, torch.tensor(token_ids[1:])[:, None])[:, 0].tolist()

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable, version: int) -> dict:
        """Copy (name, array) pairs into the served model in place (the learner's `weights()`
        names: parameters and buffers, router biases included); drop the prefix cache. Every
        tensor goes straight into the served one (`direct`, as in the vLLM engine's answer)."""
        state = self.model.state_dict()
        count = 0
        for name, value in named_tensors:
            count += 1
            if name not in state:
                raise KeyError(f"load_weights: {name!r} is not a tensor of this policy")
            t = torch.as_tensor(value)
            if tuple(t.shape) != tuple(state[name].shape):
                raise ValueError(
                    f"load_weights: {name!r} has shape {tuple(t.shape)}, the model's is {tuple(state[name].shape)}"
                )
            state[name].copy_(t)
        self._prefixes.clear()
        self.version = version
        return {"tensors": count, "direct": count}

    # -- internals -----------------------------------------------------------------------------

    def _prefill(self, r: _Request) -> tuple[torch.Tensor, PolicyCache]:
        """Run the prompt (after the longest cached prefix of it) into a fresh one-row cache;
        returns the last position's logits and the cache."""
        t0 = time.perf_counter()
        hit, cache = self._lookup(r.prompt)
        new = r.prompt[hit:]
        logits, cache, info = self.model(torch.tensor([new]), cache=cache)
        self.stats["prefill_s"] += time.perf_counter() - t0
        self.stats["prefill_tokens"] += len(new)
        self.stats["prefix_hit_tokens"] += hit
        experts = info["experts"]
        if experts is not None:
            r.prompt_routed = [[] for _ in range(hit)] + experts[:, 0].transpose(0, 1).tolist()
        return logits[0, -1], cache

    def _lookup(self, prompt: list[int]) -> tuple[int, PolicyCache]:
        best, best_key = 0, None
        for key in self._prefixes:
            n = len(key)
            # a strict prefix: at least one new token must be run to get the next logits
            if best < n < len(prompt) and tuple(prompt[:n]) == key:
                best, best_key = n, key
        if best_key is None:
            return 0, self.model.new_cache()
        self._prefixes.move_to_end(best_key)
        return best, _clone(self._prefixes[best_key])

    def _remember(self, r: _Request, row: PolicyCache) -> None:
        if not self.prefix_cache_entries or not r.out:
            return
        key = tuple(r.prompt + r.out[:-1])  # the last token was sampled, never run
        self._prefixes[key] = row
        self._prefixes.move_to_end(key)
        while len(self._prefixes) > self.prefix_cache_entries:
            self._prefixes.popitem(last=False)

    def _sample(
        self,
        reqs: list[_Request],
        logits_BV: torch.Tensor,
        *,
        temperature,
        top_k,
        top_p,
        stop_ids,
        stop,
    ):
        lp_BV = processed_logprobs(logits_BV, temperature, top_k, top_p, self._banned)
        for b, r in enumerate(reqs):
            lp = lp_BV[b]
            if len(r.out) < r.min_tokens and stop_ids:
                lp = lp.clone()
                lp[list(stop_ids)] = -torch.inf
                lp = lp.log_softmax(-1)
            if temperature > 0:
                tok = int(torch.multinomial(lp.exp(), 1, generator=r.generator))
            else:
                tok = int(lp.argmax())
            r.out.append(tok)
            r.logprobs.append(float(lp[tok]))
            if len(r.out) >= r.min_tokens and (tok in stop_ids or self._stop_string(r, stop)):
                r.finish = "stop"
            elif len(r.out) >= r.max_tokens:
                r.finish = "length"

    def _stop_string(self, r: _Request, stop: list[str]) -> bool:
        if not stop:
            return False
        # the tail is enough: every stop string fits in its last len(s) + 8 tokens' text
        tail = self.tokenizer.decode(r.out[-(max(map(len, stop)) + 8) :], skip_special_tokens=False)
        return any(s in tail for s in stop)
