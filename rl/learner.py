"""Learner: the policy in torch, its optimiser, and one GRPO update per batch of trajectories.

A plain class; `LearnerActor` is its Ray shell. Loads Hugging Face causal LMs (the tiny
Qwen3-MoE here; the project's own `policy/` model plugs in through the same interface later).

Not covered yet (issue 5): PPO/critic, KL to a reference, chunked log-probs for long
trajectories, routing replay, checkpoint resume of the optimiser state.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import ray
import torch

from rl.config import AlgoConfig
from rl.grpo import group_advantages, policy_loss, token_entropy, token_logprobs
from rl.trajectory import Trajectory


def _pad(rows: list[list], value) -> list[list]:
    width = max(len(r) for r in rows)
    return [list(r) + [value] * (width - len(r)) for r in rows]


class Learner:
    def __init__(self, policy_path: str, algo: AlgoConfig, *, seed: int = 0, dtype: str = "float32",
                 temperature: float = 1.0):
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(algo.threads)
        torch.manual_seed(seed)
        self.cfg = algo
        self.temperature = temperature
        self.dtype = getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(policy_path, dtype=self.dtype)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=algo.lr, weight_decay=algo.weight_decay)
        self.version = 0
        self._tokenizer_path = policy_path

    def _minibatch(self, mb: list[Trajectory]):
        """Learner log-probs of every next token, with the mask and rollout log-probs aligned to them
        (targets are tokens 1..T-1, so the per-token records shift by one)."""
        ids = torch.tensor(_pad([t.token_ids for t in mb], 0))
        attn = torch.tensor(_pad([[1] * len(t.token_ids) for t in mb], 0))  # right padding
        logits = self.model(input_ids=ids, attention_mask=attn).logits
        logp = token_logprobs(logits, ids, self.temperature)
        mask = torch.tensor(_pad([t.loss_mask for t in mb], 0))[:, 1:].float()
        old = torch.tensor(_pad([t.rollout_logprobs for t in mb], 0.0))[:, 1:].float()
        return logits, logp, mask, old

    @torch.no_grad()
    def mismatch(self, batch: list[Trajectory]) -> dict:
        """Learner vs rollout-engine log-probs on the generated tokens, before any update.

        Large values mean the engine serves other weights than the learner holds (a broken
        sync) or computes differently (dtype, kernels, MoE routing)."""
        diffs = []
        for start in range(0, len(batch), self.cfg.minibatch_episodes):
            _, logp, mask, old = self._minibatch(batch[start : start + self.cfg.minibatch_episodes])
            diffs.append((logp - old).abs()[mask.bool()])
        d = torch.cat(diffs) if diffs else torch.zeros(1)
        return {"rollout_logprob_diff_mean": float(d.mean()), "rollout_logprob_diff_max": float(d.max())}

    def train_step(self, batch: list[Trajectory]) -> dict:
        """One GRPO update over `batch` (several optimiser steps if it exceeds a minibatch)."""
        t0 = time.perf_counter()
        c = self.cfg
        out = self.mismatch(batch)
        rewards = torch.tensor([t.reward for t in batch])
        groups = torch.tensor([t.group_id for t in batch])
        adv = group_advantages(rewards, groups, scale=c.scale_rewards)
        stats: dict[str, list[float]] = {}
        for _ in range(c.epochs):
            for start in range(0, len(batch), c.minibatch_episodes):
                idx = list(range(start, min(start + c.minibatch_episodes, len(batch))))
                logits, logp, mask, old = self._minibatch([batch[i] for i in idx])
                ent = token_entropy(logits, self.temperature) if c.entropy_coef else None
                loss, m = policy_loss(
                    logp, old, adv[idx], mask,
                    clip_low=c.clip_low, clip_high=c.clip_high, aggregation=c.loss_aggregation,
                    entropy_BT=ent, entropy_coef=c.entropy_coef,
                )
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.max_grad_norm)
                self.opt.step()
                m.update(loss=float(loss), grad_norm=float(grad_norm))
                for k, v in m.items():
                    stats.setdefault(k, []).append(v)
        self.version += 1
        out.update({k: float(np.mean(v)) for k, v in stats.items()})
        out.update(
            policy_version=self.version,
            adv_abs_mean=float(adv.abs().mean()),
            train_s=time.perf_counter() - t0,
        )
        return out

    @torch.no_grad()
    def logprobs(self, token_ids: list[int]) -> list[float]:
        """The learner's log p(token_ids[i] | token_ids[:i]) for i >= 1."""
        ids = torch.tensor([token_ids])
        logits = self.model(input_ids=ids).logits
        return token_logprobs(logits, ids, 1.0)[0].tolist()

    @torch.no_grad()
    def weights(self) -> list[tuple[str, np.ndarray]]:
        """The current weights as (HF name, numpy array): Ray stores numpy zero-copy, so every
        rollout worker on the node reads the same shared-memory buffers."""
        return [(name, p.detach().cpu().numpy()) for name, p in self.model.state_dict().items()]

    def save_checkpoint(self, path: str) -> str:
        from transformers import AutoTokenizer

        out = Path(path)
        self.model.save_pretrained(out)
        AutoTokenizer.from_pretrained(self._tokenizer_path).save_pretrained(out)
        (out / "policy_version").write_text(str(self.version))
        return str(out)


LearnerActor = ray.remote(Learner)
