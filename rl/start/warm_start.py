"""The warm start: supervised steps on the scripted experts' demonstrations, on the run's own learner,
round after round until held-out success on validation seeds stops improving.

A tiny random policy never reaches a sparse milestone by chance, and a pretrained one rarely follows
a tool format it has never seen, so RL starts from a policy that imitated the environment's scripted
expert. Each round plays `warm_start.demos` fresh expert episodes per environment through the agent
loop (rl/start/sft.py `demonstrations`: the rollouts' chat format, context management and token
bookkeeping, so what is imitated is token for token what rollouts look like, summaries included),
takes `epochs` passes over them in steps of `batch_size` (Learner.imitate: the mean negative
log-likelihood of the generated tokens, the same forward as RL), publishes the weights to the rollout
workers as a new policy version and, with `patience`, measures held-out success on validation seeds
(rl/loop/evaluate.py). The best round is kept as a checkpoint (RUN_DIR/warm-start, what `longhorizon
eval`/`serve` load as the warm start); after `patience` rounds in a row without a new best, or
`rounds` rounds, the learner goes back to the best, its optimiser is reset, and RL starts there:
from the best warm start, not from one stopped early so that RL has room (the evaluation protocol
of `longhorizon demo`).

`more(seconds)` continues from the best for a wall time (no validation): the demo's "more warm start
for the same wall time as RL" baseline. Each round's loss, seconds and validation success go to
RUN_DIR/warm-start/warm_start.json, its validation episodes to the store RUN_DIR/warm-start-validation
(beside the checkpoint, which each new best replaces; `longhorizon inspect` reads it).

Not covered: a learner group (imitation runs on a single learner) and agent programs (no scripted
expert: name an environment of the same task in `warm_start.envs`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rl.start.sft import DEMO_SEED, demonstrations


@dataclass
class Source:
    """Where demonstrations come from: an environment, its kwargs, and the agent loop's settings."""

    env_id: str
    kwargs: dict
    loop: dict
    """`demonstrations` keywords: max_turns, max_episode_tokens, context, max_model_len, max_new_tokens."""


def run_sources(env_ids: list[str], env, rollout) -> list[Source]:
    """The demonstrations' sources of a run: each of `env_ids` (the training environment, `env`,
    with its kwargs; another with none), played under the rollouts' turn and token limits and
    context management (`rollout`, a RolloutConfig)."""
    # where a rebuilt context starts depends on a turn's room; in a full context an expert turn is
    # never cut (as before contexts were managed)
    loop = dict(
        max_turns=rollout.max_turns,
        max_episode_tokens=rollout.max_episode_tokens,
        context=rollout.context,
        max_model_len=rollout.max_model_len,
        max_new_tokens=None if rollout.context.mode == "full" else rollout.max_new_tokens,
    )
    return [Source(e, dict(env.kwargs) if e == env.id else {}, loop) for e in env_ids]


def better(a: dict | None, b: dict | None) -> bool:
    """Whether validation result `a` beats `b`: higher success, then higher mean reward."""
    if a is None:
        return False
    return b is None or (a["success"], a["reward_mean"]) > (b["success"], b["reward_mean"])


class WarmStart:
    def __init__(
        self,
        cfg,
        sources: list[Source],
        chat,
        learner,
        publish: Callable[[], None],
        validate: Callable[..., dict] | None,
        out: Path,
        log: Callable[[str], None],
    ):
        """`cfg`: the run's `warm_start` section; `learner`: the learner group (`call`); `publish`:
        sync the learner's weights to the rollout workers; `validate(keep=)`: held-out success on
        validation seeds with the weights published last, its episodes stored where `keep` says (None:
        no validation); `out`: RUN_DIR/warm-start."""
        self.cfg, self.sources, self.chat, self.learner = cfg, sources, chat, learner
        self.publish, self.validate, self.out, self.log = publish, validate, Path(out), log
        self.rounds: list[dict] = []
        self.best: int | None = None
        self._demo_round = 0  # demonstrations are fresh every round, also in `more`

    def demonstrations(self) -> list:
        n, r = self.cfg.demos, self._demo_round
        self._demo_round += 1
        out = []
        for s in self.sources:
            demos = demonstrations(
                self.chat, s.env_id, n, env_kwargs=s.kwargs, first_seed=DEMO_SEED + r * n, **s.loop
            )
            out += [t for t in demos if t.reward > 0 and not t.infra_error]
        if not out:
            raise ValueError(
                "no demonstration earned a reward: the scripted experts did not solve their tasks "
                "under the run's rollout settings (turn and token limits, context)"
            )
        return out

    def train_round(self) -> dict:
        """One round: fresh demonstrations, `epochs` passes in steps of `batch_size`, a new version published."""
        t0 = time.perf_counter()
        demos = self.demonstrations()
        steps, losses = (
            max(1, round(self.cfg.epochs * math.ceil(len(demos) / self.cfg.batch_size))),
            [],
        )
        tokens = sum(len(t.token_ids) for t in demos)
        self.log(
            f"warm start: {len(demos)} demonstrations ({tokens:,} tokens) in {time.perf_counter() - t0:.0f} s; "
            f"{steps} supervised steps"
        )
        order = list(range(len(demos)))
        for k in range(steps):
            start = (k * self.cfg.batch_size) % len(demos)
            batch = [
                demos[order[(start + j) % len(demos)]]
                for j in range(min(self.cfg.batch_size, len(demos)))
            ]
            losses.append(self.learner.call("imitate", batch, self.cfg.lr)["sft_loss"])
            if (k + 1) % max(1, steps // 4) == 0 or k + 1 == steps:
                self.log(
                    f"warm start step {k + 1}/{steps}: loss {losses[-1]:.4f} ({time.perf_counter() - t0:.0f} s)"
                )
        self.learner.call("next_version")
        self.publish()
        return {
            "demos": len(demos),
            "steps": steps,
            "losses": losses,
            "train_s": time.perf_counter() - t0,
            "tokens": sum(len(t.token_ids) for t in demos),
        }

    def run(self) -> dict:
        """Rounds until validation stops improving (or `rounds`); the learner left at the best."""
        c = self.cfg
        for r in range(c.rounds):
            info = self.train_round()
            t0 = time.perf_counter()
            info["validation"] = (
                self.validate(keep=f"warm-start-validation/round-{r + 1:02d}")
                if self.validate and c.patience
                else None
            )
            info["validation_s"] = time.perf_counter() - t0
            self.rounds.append(info)
            v = info["validation"]
            best = self.rounds[self.best]["validation"] if self.best is not None else None
            self.log(
                f"warm start round {r + 1}: loss {info['losses'][0]:.3f} → {info['losses'][-1]:.3f}"
                + (
                    f", validation success {v['success']:.3f} [{v['ci95'][0]:.3f}, {v['ci95'][1]:.3f}]"
                    if v
                    else ""
                )
            )
            if v is None or better(v, best):
                self.best = r
                self.learner.call(
                    "save_checkpoint",
                    str(self.out),
                    {"iteration": -1, "warm_start_round": r},
                    optimizer=False,
                )
            elif r - self.best >= c.patience:
                break
        if self.best != len(self.rounds) - 1:  # back to the best round's weights, as a new version
            self.restore()
        self.learner.call("reset_optimizer")
        self.write()
        return self.summary()

    def restore(self) -> None:
        """The learner back at the best round's weights, published as a version newer than any sent."""
        newest = self.learner.call("next_version")
        self.learner.call("load_checkpoint", str(self.out))
        self.learner.call("next_version", newest)
        self.publish()

    def more(self, seconds: float) -> dict:
        """From the best warm start, more rounds on fresh demonstrations for `seconds` of wall time
        (whole rounds: the last one may run past it), then published; no validation."""
        self.restore()
        self.learner.call("reset_optimizer")
        t0, rounds = time.perf_counter(), []
        while time.perf_counter() - t0 < seconds:
            rounds.append(self.train_round())
            self.log(
                f"more warm start: round {len(rounds)}, {time.perf_counter() - t0:.0f} of {seconds:.0f} s"
            )
        info = {"rounds": rounds, "seconds": time.perf_counter() - t0, "target_s": seconds}
        (self.out.parent / "warm_start_more.json").write_text(json.dumps(info))
        return info

    def summary(self) -> dict:
        best = self.rounds[self.best] if self.best is not None else {}
        return {
            "rounds": len(self.rounds),
            "best_round": self.best,
            "validation": best.get("validation"),
            "seconds": sum(r["train_s"] + r["validation_s"] for r in self.rounds),
            "demos": sum(r["demos"] for r in self.rounds),
        }

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "warm_start.json").write_text(
            json.dumps({**self.summary(), "per_round": self.rounds})
        )
