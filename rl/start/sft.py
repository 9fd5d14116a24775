"""Supervised warm start on the environments' scripted experts, with TRL's `SFTTrainer`.

A tiny random policy never reaches a sparse milestone by chance, so RL needs a starting point
that sometimes does. `demonstrations` plays each environment's scripted expert through the agent
loop (`rollout.expert.ExpertEngine`), so the demonstrations are token for token what rollouts
look like: the same chat template, the same observation rendering, the same loss mask (the
assistant's own tokens). `warm_start` trains on them with TRL's `SFTTrainer` (pre-tokenised
`input_ids` and `assistant_masks`: no re-tokenisation, loss on the assistant's tokens only) and
saves a Hugging Face checkpoint the rest of the loop loads like any other.

Demonstration seeds start at `DEMO_SEED` (below evaluation's held-out 2^31, so never evaluated on).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from rollout.agent_loop import run_episodes
from rollout.trajectory import EpisodeTask, Trajectory

DEMO_SEED = 1 << 30


def demonstrations(
    chat,
    env_id: str,
    n: int,
    *,
    env_kwargs: dict | None = None,
    max_turns: int = 8,
    max_episode_tokens: int = 4096,
    first_seed: int = DEMO_SEED,
    context=None,
    max_model_len: int = 0,
    max_new_tokens: int | None = None,
) -> list[Trajectory]:
    """`n` expert episodes of `env_id` on seeds `first_seed`, `first_seed + 1`, ... Under a `context`
    (rollout/context.py) of window or compact, with the engine's `max_model_len` and the rollouts'
    `max_new_tokens` (when a context is rebuilt depends on it), as rollouts run: the expert writes
    its summaries at the compaction turns (`ToolEnv.expert_summary`), so the warm start teaches the
    format of both. `max_new_tokens` None: a turn may take the whole context (an expert turn is then
    never cut)."""
    import envs
    from rollout.context import ContextConfig
    from rollout.expert import ExpertEngine

    kwargs = dict(env_kwargs or {})
    seeds = [first_seed + i for i in range(n)]
    expert = ExpertEngine(chat, seeds, env_id, **kwargs)
    tasks = [EpisodeTask(f"demo-{env_id}-{s}", i, s, -1) for i, s in enumerate(seeds)]
    context = context or ContextConfig()
    if max_new_tokens is None:  # the most a context allows (or the episode, when it is one context)
        max_new_tokens = max_episode_tokens if context.mode == "full" else max_model_len
    return run_episodes(
        expert,
        chat,
        lambda: envs.make(env_id, **kwargs),
        env_id,
        tasks,
        max_turns=max_turns,
        max_new_tokens=max_new_tokens,
        max_episode_tokens=max_episode_tokens,
        context=context,
        max_model_len=max_model_len,
    )


def warm_start(
    policy_path: str | Path,
    out_dir: str | Path,
    demos: list[Trajectory],
    *,
    epochs: float = 2.0,
    lr: float = 2e-3,
    batch_size: int = 8,
    seed: int = 0,
    threads: int = 2,
    log=None,
) -> dict:
    """Fine-tune `policy_path` on `demos` (expert trajectories) and save it to `out_dir`; returns
    the loss curve and timing. Only the demonstrations' generated tokens are trained on. `log`:
    where progress lines go (default: a rich console on stderr, also in a child process)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import SFTConfig, SFTTrainer

    if log is None:
        from rich.console import Console

        log = Console(stderr=True).log
    solved = [t for t in demos if t.reward > 0 and not t.infra_error]
    if not solved:
        raise ValueError(
            "no demonstration earned a reward: the scripted experts did not solve their tasks"
        )
    torch.set_num_threads(threads)
    out_dir = Path(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(policy_path))
    model = AutoModelForCausalLM.from_pretrained(str(policy_path), dtype=torch.float32)
    data = Dataset.from_dict(
        {
            "input_ids": [t.token_ids for t in solved],
            "assistant_masks": [t.loss_mask for t in solved],
        }
    )
    losses: list[float] = []

    class Curve(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))
                every = max(1, state.max_steps // 20)  # about twenty progress lines per warm start
                if state.global_step % every == 0 or state.global_step == state.max_steps:
                    log(
                        f"warm start step {state.global_step}/{state.max_steps}: loss {float(logs['loss']):.4f}"
                    )

    args = SFTConfig(
        output_dir=str(out_dir / "sft-work"),
        num_train_epochs=epochs,
        per_device_train_batch_size=batch_size,
        learning_rate=lr,
        lr_scheduler_type="cosine",
        warmup_steps=0,
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=seed,
        disable_tqdm=True,
        max_length=max(len(t.token_ids) for t in solved),
        dataloader_num_workers=0,
    )
    t0 = time.perf_counter()
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=data, processing_class=tokenizer, callbacks=[Curve()]
    )
    # it prints every log dict; `Curve` reports progress instead
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    seconds = time.perf_counter() - t0
    trainer.save_model(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    shutil.rmtree(out_dir / "sft-work", ignore_errors=True)
    return {
        "demos": len(solved),
        "steps": trainer.state.global_step,
        "losses": losses,
        "seconds": seconds,
        "tokens": sum(len(t.token_ids) for t in solved),
    }
