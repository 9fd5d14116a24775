"""Learner: the policy in torch, its optimiser, and one GRPO update per batch of trajectories.

A plain class; `LearnerActor` is its Ray shell. Loads Hugging Face causal LMs (the tiny
Qwen3-MoE here; the project's own `policy/` model plugs in through the same interface later).

Not covered yet (issue 5): PPO/critic, milestone credit, chunked log-probs for long
trajectories, routing replay, checkpoint resume of the optimiser state.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import ray
import torch

from rl.config import AlgoConfig
from rl.grpo import group_advantages, policy_loss, token_entropy, token_logprobs, truncated_is_weights
from rl.trajectory import Trajectory


def _pad(rows: list[list], value) -> list[list]:
    width = max(len(r) for r in rows)
    return [list(r) + [value] * (width - len(r)) for r in rows]


def usable_episodes(batch: list[Trajectory]) -> tuple[list[Trajectory], dict]:
    """Episodes that may enter group statistics: infrastructure failures are left out (they are
    not reward 0), and so is every group left with fewer than two episodes to compare."""
    ok = [t for t in batch if not t.infra_error and t.num_generated > 0]
    sizes: dict[int, int] = {}
    for t in ok:
        sizes[t.group_id] = sizes.get(t.group_id, 0) + 1
    kept = [t for t in ok if sizes[t.group_id] >= 2]
    groups = {t.group_id for t in batch}
    return kept, {"infra_errors": sum(1 for t in batch if t.infra_error),
                  "groups_dropped": len(groups) - len({t.group_id for t in kept})}


class Learner:
    def __init__(self, policy_path: str, algo: AlgoConfig, *, seed: int = 0, dtype: str = "float32",
                 temperature: float = 1.0, max_generated_tokens: int | None = None):
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(algo.threads)
        torch.manual_seed(seed)
        self.cfg = algo
        self.temperature = temperature
        self.dtype = getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(policy_path, dtype=self.dtype)
        self.model.train()
        self.max_generated_tokens = max_generated_tokens
        self.ref_model = None
        if algo.kl_beta:  # frozen copy of the starting policy
            self.ref_model = AutoModelForCausalLM.from_pretrained(policy_path, dtype=self.dtype).eval().requires_grad_(False)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=algo.lr, weight_decay=algo.weight_decay)
        self.version = 0
        self._tokenizer_path = policy_path

    def _minibatch(self, mb: list[Trajectory]):
        """Learner log-probs of every next token, with the loss mask and rollout log-probs aligned
        to them (targets are tokens 1..T-1, so the per-token records shift by one)."""
        ids = torch.tensor(_pad([t.token_ids for t in mb], 0))
        attn = torch.tensor(_pad([[1] * len(t.token_ids) for t in mb], 0))  # right padding
        logits = self.model(input_ids=ids, attention_mask=attn).logits
        logp = token_logprobs(logits, ids, self.temperature)
        mask = torch.tensor(_pad([t.loss_mask for t in mb], 0))[:, 1:].float()
        rollout = torch.tensor(_pad([t.rollout_logprobs for t in mb], 0.0))[:, 1:].float()
        return ids, attn, logits, logp, mask, rollout

    def _minibatches(self, n: int) -> list[list[int]]:
        step = self.cfg.minibatch_episodes
        return [list(range(s, min(s + step, n))) for s in range(0, n, step)]

    def train_step(self, batch: list[Trajectory]) -> dict:
        """One GRPO update over `batch` (one optimiser step per minibatch, `epochs` passes).

        Before any step, the learner's own log-probs of the batch (`old`) are computed once: the
        clipped ratio is taken against them, truncated importance weights min(old/rollout, cap)
        correct for the engine having sampled from slightly different numbers, and their gap to
        the rollout log-probs is reported (a broken sync shows up here first)."""
        t0 = time.perf_counter()
        c = self.cfg
        batch, dropped = usable_episodes(batch)
        if not batch:  # nothing to learn from; the version still advances so the loop stays uniform
            self.version += 1
            return {**dropped, "policy_version": self.version, "skipped_update": 1, "train_s": time.perf_counter() - t0}
        rewards = torch.tensor([t.reward for t in batch])
        groups = torch.tensor([t.group_id for t in batch])
        adv = group_advantages(rewards, groups, scale=c.scale_rewards)
        mbs = self._minibatches(len(batch))
        olds, refs, diffs = [], [], []
        with torch.no_grad():
            for idx in mbs:
                ids, attn, _, logp, mask, rollout = self._minibatch([batch[i] for i in idx])
                olds.append(logp)
                diffs.append((logp - rollout).abs()[mask.bool()])
                if c.kl_beta:
                    refs.append(token_logprobs(self.ref_model(input_ids=ids, attention_mask=attn).logits, ids, self.temperature))
        d = torch.cat(diffs)
        out = {**dropped, "rollout_logprob_diff_mean": float(d.mean()), "rollout_logprob_diff_max": float(d.max())}
        stats: dict[str, list[float]] = {}
        for _ in range(c.epochs):
            for j, idx in enumerate(mbs):
                _, _, logits, logp, mask, rollout = self._minibatch([batch[i] for i in idx])
                loss, m = policy_loss(
                    logp, olds[j], adv[idx], mask,
                    clip_low=c.clip_low, clip_high=c.clip_high, aggregation=c.loss_aggregation,
                    ratio_level=c.ratio_level, max_tokens=self.max_generated_tokens, dual_clip=c.dual_clip,
                    is_weight_BT=truncated_is_weights(olds[j], rollout, c.tis_cap) if c.tis_cap else None,
                    kl_beta=c.kl_beta, ref_logp_BT=refs[j] if c.kl_beta else None, kl_estimator=c.kl_estimator,
                    entropy_BT=token_entropy(logits, self.temperature) if c.entropy_coef else None,
                    entropy_coef=c.entropy_coef,
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

    def save_checkpoint(self, path: str, extra: dict | None = None) -> str:
        """A Hugging Face checkpoint plus `trainer_state.pt` (optimiser, version, RNG, `extra`).

        Written to a temporary directory and renamed, so a kill mid-save leaves the previous
        checkpoints as they were and never a partial one under the final name."""
        from transformers import AutoTokenizer

        out = Path(path)
        tmp = out.with_name(f".{out.name}.tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        self.model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(self._tokenizer_path).save_pretrained(tmp)
        state = {"optimizer": self.opt.state_dict(), "version": self.version, "torch_rng": torch.get_rng_state(),
                 **(extra or {})}
        torch.save(state, tmp / "trainer_state.pt")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        return str(out)

    def load_checkpoint(self, path: str) -> dict:
        """Restore weights, optimiser state, version and RNG from `save_checkpoint`'s directory."""
        from transformers import AutoModelForCausalLM

        state = torch.load(Path(path) / "trainer_state.pt", weights_only=False)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        self.opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        self.version = state["version"]
        return {k: v for k, v in state.items() if k not in ("optimizer", "torch_rng")}


LearnerActor = ray.remote(Learner)
