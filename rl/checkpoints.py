"""Learner checkpoints: one directory per saved version.

- weights in the model's own format (Hugging Face `save_pretrained`, or the `policy/` format) with
  the tokenizer, so the engines and `longhorizon eval` load a checkpoint alone;
- `trainer_state.pt`: version, RNG, value head, the driver's `extra` (its iteration), and the
  optimizer state of a single learner;
- a learner group's `sharded/` (torch.distributed.checkpoint): every rank's parameter and
  optimizer shards, readable by another number of ranks; rank 0 writes the full weights beside it;
- under LoRA (rl/lora.py): the weights are the adapted model merged, and `adapters/adapters.safetensors`
  holds the adapters alone, which a resumed run puts back on its base policy (the optimizer state
  is the adapters'). In a directory of their own: vLLM loads every `*.safetensors` beside config.json
  as the model's weights, and the adapters' names are not the model's.

Written to `.NAME.tmp` and renamed, so a kill mid-save leaves the previous checkpoints as they were
and never a partial one under the final name. A single learner's checkpoint does not resume on a
group or the reverse (the optimizer state's layout differs): the error says to start a new run from
its weights instead.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

ADAPTERS = "adapters/adapters.safetensors"
LEGACY_ADAPTERS = "adapters.safetensors"  # checkpoints written before (no engine could load those)

def save_learner(learner, path: str, extra: dict | None = None) -> str:
    """Save `learner` (a `rl.learner.Learner`) to `path`; collective in a group (every rank calls)."""
    out = Path(path)
    tmp = out.with_name(f".{out.name}.tmp")
    state = None
    if learner.world > 1:
        import torch.distributed as dist

        from policy.parallelize import save_sharded

        if learner.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / "sharded").mkdir(parents=True)
        dist.barrier()
        save_sharded(learner.model, learner.opt, str(tmp / "sharded"))
        full = dict(learner.full_weights())
        if learner.rank != 0:
            dist.barrier()  # rank 0 renames the directory
            return str(out)
        state = full
    elif tmp.exists():
        shutil.rmtree(tmp)
    if learner.lora is not None:  # the adapters folded in: a whole model that loads alone
        from rl.lora import merged_state

        state = {n: t.detach().cpu() for n, t in merged_state(learner.model).items()}
    try:
        if learner.lm.kind == "policy":
            from policy.checkpoint import save_policy

            save_policy(learner.model, tmp, state)
        else:
            learner.model.save_pretrained(tmp, state_dict=state)
        # with its tokenizer, so engines and `longhorizon eval` load the checkpoint alone (a
        # `policy/` checkpoint may come without one)
        if (Path(learner._tokenizer_path) / "tokenizer_config.json").exists():
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(learner._tokenizer_path).save_pretrained(tmp)
        trainer_state = {"version": learner.version, "torch_rng": torch.get_rng_state(),
                         "value_head": learner.value_head.state_dict() if learner.value_head is not None else None,
                         **(extra or {})}
        if learner.world > 1:
            trainer_state["sharded_world_size"] = learner.world
        else:
            trainer_state["optimizer"] = learner.opt.state_dict()
        torch.save(trainer_state, tmp / "trainer_state.pt")
        if learner.lora is not None:
            from safetensors.torch import save_file

            from rl.lora import adapter_state

            (tmp / ADAPTERS).parent.mkdir()
            save_file(adapter_state(learner.model), tmp / ADAPTERS)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if learner.world > 1:
            import torch.distributed as dist

            dist.barrier()
    return str(out)

def load_learner(learner, path: str) -> dict:
    """Restore weights, optimiser state, version and RNG; a group reads `sharded/` whatever number
    of ranks wrote it. Returns the rest of `trainer_state.pt` (version, the driver's extra)."""
    # to the CPU first: optimizer.load_state_dict moves each state to its parameter's device
    state = torch.load(Path(path) / "trainer_state.pt", weights_only=False, map_location="cpu")
    saved_by = state.get("sharded_world_size")
    if learner.world > 1:
        if not saved_by:
            raise ValueError(f"{path} was saved by a single learner: its optimizer state cannot be sharded "
                             "here; resume with learner.world_size=1, or start a new run from its weights "
                             "(policy.path)")
        from policy.parallelize import load_sharded

        load_sharded(learner.model, learner.opt, str(Path(path) / "sharded"))
    else:
        if saved_by:
            raise ValueError(f"{path} was saved by a learner group of {saved_by} ranks (optimizer state in "
                             "sharded/): resume with learner.world_size > 1, or start a new run from its "
                             "weights (policy.path)")
        if learner.lora is not None:  # the base again, the adapters on top (the saved model has them merged)
            from safetensors.torch import load_file

            from rl.lora import load_adapter_state

            learner._load(learner.base_path)
            saved = Path(path) / ADAPTERS
            load_adapter_state(learner.model, load_file(saved if saved.exists() else Path(path) / LEGACY_ADAPTERS))
        else:
            learner._load(path)
        learner.opt.load_state_dict(state["optimizer"])
    if learner.value_head is not None and state.get("value_head"):
        learner.value_head.load_state_dict(state["value_head"])
    torch.set_rng_state(state["torch_rng"])
    learner.version = state["version"]
    return {k: v for k, v in state.items() if k not in ("optimizer", "torch_rng", "value_head")}
