"""`longhorizon serve RUN_DIR|CHECKPOINT`: a trained policy behind the OpenAI-compatible chat API
(rollout/openai_api.py), for evaluation with any OpenAI-compatible harness (wired in by
`longhorizon.cli`).

    longhorizon serve RUN_DIR|CHECKPOINT [--host H] [--port P] [--api-key KEY] [--model NAME]

A run directory serves its newest checkpoint (or, before the first, the policy it started from)
with its rollout settings; a checkpoint serves with the defaults. Loopback by default; another
address needs `--api-key` (or LONGHORIZON_API_KEY). Every call's tokens are recorded in memory per
session (`/sessions/ID/v1`) like in training; this command keeps none of them.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from longhorizon.errors import message


def initial_policy(cfg, run_dir: Path) -> Path:
    """The policy a run started RL from: its warm start, the pretrained model it names (cached,
    upcycled), its `policy.path`, or the tiny model it made."""
    if (run_dir / "warm-start" / "config.json").exists():
        return run_dir / "warm-start"
    if cfg.policy.pretrained:
        from rl.start.pretrained import for_config

        return for_config(cfg.policy)
    return Path(cfg.policy.path or run_dir / "policy-init")


def policy_of(target: str):
    """(policy directory, its rollout settings, the run's config or None) of a run directory (its
    newest checkpoint, or the policy it started from) or a checkpoint."""
    from rl.config import RolloutConfig, load_config

    src, cfg = Path(target), None
    rollout, policy = RolloutConfig(), src
    if (src / "config.yaml").exists():  # a run directory: its settings, its newest weights
        cfg = load_config(src / "config.yaml", [])
        rollout = cfg.rollout
        rollout.dtype = rollout.engine_dtype(cfg.policy.dtype)  # the engines the run itself used
        ckpts = sorted((src / "checkpoints").glob("version-*/config.json"))
        policy = ckpts[-1].parent if ckpts else initial_policy(cfg, src)
    if not (policy / "config.json").exists():
        raise FileNotFoundError(
            f"{target}: neither a run directory nor a checkpoint (no config.json at {policy})"
        )
    if (policy / "adapters.safetensors").exists():  # an engine would load it as model weights
        raise ValueError(
            f"{policy} holds adapters.safetensors beside the model (a LoRA checkpoint written before "
            f"adapters moved to adapters/): move it to {policy / 'adapters'}/ to load the checkpoint"
        )
    if cfg is None:  # a bare checkpoint: the engine that serves its kind
        from policy.checkpoint import is_policy_checkpoint

        rollout.engine = "native" if is_policy_checkpoint(str(policy)) else "vllm"
    return policy, rollout, cfg


def serve(args) -> int:
    from rl.config import ConfigError
    from rollout.openai_api import LOOPBACK

    key = args.api_key or os.environ.get("LONGHORIZON_API_KEY", "")
    try:
        policy, rollout, _ = policy_of(args.target)
        if key and not key.strip():
            raise ValueError(
                "the API key is blank (only whitespace): give a real token, or none on loopback"
            )
        if args.host not in LOOPBACK and not key:
            raise ValueError(
                f"--host {args.host} is not loopback: give --api-key (or LONGHORIZON_API_KEY), the bearer "
                "token every request must then carry"
            )
        if args.max_request_tokens < 1 or not args.request_timeout > 0:
            raise ValueError("--max-request-tokens must be >= 1 and --request-timeout > 0")
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port must be from 0 to 65535, got {args.port}")
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    from rollout.engines import make_engine
    from rollout.engines.shared import SharedEngine
    from rollout.openai_api import OpenAIServer

    # made on, and driven by, a thread of its own (rollout/engines/shared.py): requests join its running
    # batch, and a client that leaves has its prompts aborted
    engine = SharedEngine(
        lambda: make_engine(
            rollout.engine,
            str(policy),
            seed=args.seed,
            max_model_len=rollout.max_model_len,
            kv_cache_gib=rollout.kv_cache_gib,
            enforce_eager=rollout.enforce_eager,
            max_batch=rollout.max_batch,
            dtype=rollout.engine_dtype(),
        )
    )
    name = args.model or policy.name
    server = OpenAIServer(
        engine,
        AutoTokenizer.from_pretrained(str(policy)),
        name,
        max_model_len=rollout.max_model_len,
        default_max_tokens=rollout.max_new_tokens,
        api_key=key,
        own_thread=False,
        max_request_tokens=args.max_request_tokens,
        request_timeout_s=args.request_timeout,
    )
    try:
        url = server.start(args.host, args.port)
    except (OSError, RuntimeError) as exc:
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    print(
        f"serving {policy} as {name!r} at {url}/v1 (one session per agent: {url}/sessions/ID/v1); Ctrl-C stops",
        file=sys.stderr,
        flush=True,
    )

    # Ctrl-C and SIGTERM stop it, however it was started: a process started in the background by a
    # non-interactive shell (or by a parent that ignores SIGINT) inherits SIGINT ignored, and would
    # otherwise serve on through every Ctrl-C
    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        # a second Ctrl-C must not cut the shutdown short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        server.stop()
        engine.close()
    return 0
