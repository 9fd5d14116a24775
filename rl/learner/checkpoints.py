"""Learner checkpoints: one directory per saved version.

- weights in the model's own format (Hugging Face `save_pretrained`, or the `policy/` format) with
  the tokenizer, so the engines and `longhorizon eval` load a checkpoint alone;
- `trainer_state.pt`: version, RNG, value head, the driver's `extra` (its iteration), and the
  optimizer state of a single learner;
- a learner group's `sharded/` (torch.distributed.checkpoint): every rank's parameter and
  optimizer shards, readable by another number of ranks; rank 0 writes the full weights beside it;
- under LoRA (rl/learner/lora.py): the weights are the adapted model merged, and `adapters/adapters.safetensors`
  holds the adapters alone, which a resumed run puts back on its base policy (the optimizer state
  is the adapters'). In a directory of their own: vLLM loads every `*.safetensors` beside config.json
  as the model's weights, and the adapters' names are not the model's.

Written to `.NAME.tmp` and renamed, so a kill mid-save leaves the previous checkpoints as they were
and never a partial one under the final name. Read without unpickling code: `trainer_state.pt` is
loaded with `weights_only=True` (tensors, numbers, strings and containers only: a crafted file that
would run code is refused), and `checkpoint_problem` finds a missing, truncated or overwritten file
before a resume starts anything. A single learner's checkpoint does not resume on a
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


def save_learner(learner, path: str, extra: dict | None = None, optimizer: bool = True) -> str:
    """Save `learner` (a `rl.learner.learner.Learner`) to `path`; collective in a group (every rank calls).
    `optimizer` False: a single learner's optimiser state is left out (loading it then starts a fresh one)."""
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
        from rl.learner.lora import merged_state

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
        trainer_state = {
            "version": learner.version,
            "torch_rng": torch.get_rng_state(),
            "value_head": learner.value_head.state_dict()
            if learner.value_head is not None
            else None,
            **(extra or {}),
        }
        if learner.world > 1:
            trainer_state["sharded_world_size"] = learner.world
        elif optimizer:
            trainer_state["optimizer"] = learner.opt.state_dict()
        torch.save(trainer_state, tmp / "trainer_state.pt")
        if learner.lora is not None:
            from safetensors.torch import save_file

            from rl.learner.lora import adapter_state

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


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message names the file and what is wrong."""


def _safetensors_problem(path: Path) -> str | None:
    """Whether a safetensors file is whole: its header parses and its size is what the header says."""
    import json
    import struct

    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return "truncated (no header)"
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100 << 20):
            return "not a safetensors file (its header length is beyond the file)"
        try:
            header = json.loads(fh.read(n))
            end = max(
                (v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0
            )
        except (ValueError, TypeError, KeyError, IndexError):
            return "not a safetensors file (its header is not a tensor index)"
    if size < 8 + n + end:
        return f"truncated ({size:,} bytes of {8 + n + end:,})"
    return None


def checkpoint_problem(path: str | Path) -> str | None:
    """What makes the checkpoint at `path` unusable, naming the file, or None. Reads headers and the
    trainer state's structure (memory-mapped, its tensors not read), never the weights themselves."""
    import json

    path = Path(path)
    config = path / "config.json"
    if not config.is_file():
        return f"{config}: missing"
    try:
        json.loads(config.read_text())
    except (ValueError, UnicodeDecodeError):
        return f"{config}: not JSON"
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        return f"{path / 'model.safetensors'}: missing (no weights in the checkpoint)"
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            return f"{index}: not a safetensors index"
        missing = sorted(n for n in names if not (path / n).is_file())
        if missing:
            return f"{path / missing[0]}: missing (named in {index.name})"
    for w in weights + ([path / ADAPTERS] if (path / ADAPTERS).exists() else []):
        why = _safetensors_problem(w)
        if why:
            return f"{w}: {why}"
    state = path / "trainer_state.pt"
    if not state.is_file():
        return f"{state}: missing"
    try:
        loaded = torch.load(state, weights_only=True, map_location="cpu", mmap=True)
    except Exception as exc:  # a crafted pickle is refused here, as a truncated or garbled zip is
        return f"{state}: cannot be loaded safely ({type(exc).__name__}: {' '.join(str(exc).split())[:160]})"
    if not (
        isinstance(loaded, dict)
        and isinstance(loaded.get("version"), int)
        and "iteration" in loaded
    ):
        return f"{state}: not a trainer state (no version and iteration)"
    return None


def checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's checkpoint directories, oldest first (`checkpoints/version-*`, whole or not)."""
    return sorted(p for p in (Path(run_dir) / "checkpoints").glob("version-*") if p.is_dir())


def resume_point(run_dir: str | Path, name: str | None = None) -> Path:
    """The checkpoint a resume starts from: `name` (e.g. version-000008), else the newest. A
    checkpoint with a problem raises `CheckpointError` naming the file, what is wrong, and the
    newest intact one with the command that resumes from it. Nothing is moved or deleted."""
    run_dir = Path(run_dir)
    found = checkpoints(run_dir)
    if not found:
        raise CheckpointError(f"nothing to resume in {run_dir}: no checkpoints/version-*")
    if name is not None:
        chosen = run_dir / "checkpoints" / name
        if chosen not in found:
            raise CheckpointError(
                f"--checkpoint {name}: no such checkpoint in {run_dir / 'checkpoints'} "
                f"(there: {', '.join(p.name for p in found)})"
            )
    else:
        chosen = found[-1]
    problem = checkpoint_problem(chosen)
    if problem is None:
        return chosen
    intact = next(
        (p for p in reversed(found) if p != chosen and checkpoint_problem(p) is None), None
    )
    then = (
        f"the newest intact checkpoint is {intact.name}: resume from it with `longhorizon train --resume "
        f"{run_dir} --checkpoint {intact.name}`"
        if intact is not None
        else "no other checkpoint is intact: start a new run"
    )
    raise CheckpointError(
        f"cannot resume from {chosen.name}: {problem}; {then} (nothing was changed)"
    )


def load_learner(learner, path: str) -> dict:
    """Restore weights, optimiser state, version and RNG; a group reads `sharded/` whatever number
    of ranks wrote it. Returns the rest of `trainer_state.pt` (version, the driver's extra)."""
    # to the CPU first: optimizer.load_state_dict moves each state to its parameter's device
    state = torch.load(Path(path) / "trainer_state.pt", weights_only=True, map_location="cpu")
    saved_by = state.get("sharded_world_size")
    if learner.world > 1:
        if not saved_by:
            raise ValueError(
                f"{path} was saved by a single learner: its optimizer state cannot be sharded "
                "here; resume with learner.world_size=1, or start a new run from its weights "
                "(policy.path)"
            )
        from policy.parallelize import load_sharded

        load_sharded(learner.model, learner.opt, str(Path(path) / "sharded"))
    else:
        if saved_by:
            raise ValueError(
                f"{path} was saved by a learner group of {saved_by} ranks (optimizer state in "
                "sharded/): resume with learner.world_size > 1, or start a new run from its "
                "weights (policy.path)"
            )
        # the base again, the adapters on top (the saved model has them merged)
        if learner.lora is not None:
            from safetensors.torch import load_file

            from rl.learner.lora import load_adapter_state

            learner._load(learner.base_path)
            saved = Path(path) / ADAPTERS
            load_adapter_state(
                learner.model, load_file(saved if saved.exists() else Path(path) / LEGACY_ADAPTERS)
            )
        else:
            learner._load(path)
        if "optimizer" in state:  # else the fresh optimiser `_load` made
            learner.opt.load_state_dict(state["optimizer"])
    if learner.value_head is not None and state.get("value_head"):
        learner.value_head.load_state_dict(state["value_head"])
    torch.set_rng_state(state["torch_rng"])
    learner.version = state["version"]
    return {k: v for k, v in state.items() if k not in ("optimizer", "torch_rng", "value_head")}
