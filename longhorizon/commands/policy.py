"""`longhorizon policy info|upcycle|pretrained`: the project's policy and the packaged pretrained one."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from longhorizon.errors import message
from longhorizon.terminal import SafeConsole


def _policy_info(args) -> int:
    from policy.args import load_model_args
    from policy.info import human, policy_info
    from rl.config import ConfigError

    try:
        info = policy_info(load_model_args(args.config))
    except ConfigError as exc:
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    from rich.table import Table

    table = Table(title=f"policy {info['name']} ({args.config})", show_header=False)
    rows = [
        (
            "layers",
            f"{info['layers']} ({info['kda_layers']} KDA, {info['mla_layers']} MLA; "
            f"{info['dense_layers']} dense, {info['moe_layers']} MoE)",
        ),
        ("pattern", info["layer_pattern"]),
        ("total parameters", human(info["total_params"])),
        ("active parameters / token", human(info["active_params"])),
        ("cache bytes / token (MLA, bf16)", f"{info['cache_bytes_per_token']:,}"),
        ("state bytes / sequence (KDA)", f"{info['state_bytes_per_sequence']:,}"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    SafeConsole().print(table)
    return 0


def _policy_upcycle(args) -> int:
    """Dense Llama-family checkpoint (or a packaged pretrained model's name) → sparse-MoE Mixtral."""
    from rl.start.pretrained import PRETRAINED, PretrainedError, dense, upcycle

    out = Path(args.out)
    try:
        if out.exists():
            raise PretrainedError(f"--out {out} already exists (choose a new directory)")
        src = dense(args.src) if args.src in PRETRAINED else Path(args.src)
        result = upcycle(src, out, args.experts, args.top_k, seed=args.seed, mode=args.mode)
    except (PretrainedError, OSError) as exc:
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    summary = {
        "path": str(result.path),
        "source": str(src),
        "experts": args.experts,
        "top_k": args.top_k,
        "mode": args.mode,
        "total_params": result.total_params,
        "active_params": result.active_params,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"wrote {result.path}: {args.experts} experts ({args.mode}), top-{args.top_k}, "
            f"{result.total_params / 1e6:.1f}M total / {result.active_params / 1e6:.1f}M active parameters"
        )
    return 0


def _policy_pretrained(args) -> int:
    """Convert a packaged pretrained model into the local cache (what `make install` runs)."""
    from rl.start.pretrained import PretrainedError, policy

    try:
        path = policy(args.name, args.experts, args.top_k)  # experts 0: the dense model alone
    except (PretrainedError, OSError) as exc:
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    print(path)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("policy", help="the project's sparse-MoE policy")
    psub = p.add_subparsers(dest="policy_command", required=True)
    pi = psub.add_parser(
        "info", help="layer pattern, parameter counts and cache sizes of a flavour (built on meta)"
    )
    pi.add_argument("config", help="policy config, e.g. configs/policy/k3.yaml")
    pi.add_argument("--json", action="store_true")
    pi.set_defaults(fn=_policy_info)
    pu = psub.add_parser(
        "upcycle",
        help="a dense Llama-family checkpoint as a sparse MoE (Mixtral): every MLP copied into "
        "experts behind a new router (--mode copy), or its neurons shared out among them (split)",
    )
    pu.add_argument(
        "src", help="checkpoint directory, or a packaged model's name (smollm2-135m-instruct)"
    )
    pu.add_argument("--experts", type=int, required=True)
    pu.add_argument("--top-k", type=int, default=1)
    pu.add_argument("--seed", type=int, default=0, help="seeds the new routers")
    pu.add_argument(
        "--mode",
        choices=["copy", "split"],
        default="copy",
        help="copy: identical experts (top-1 is the dense model); split: each expert a slice of "
        "the MLP's neurons (top-k = experts is the dense model, fewer is sparse)",
    )
    pu.add_argument("--out", required=True, help="new directory for the upcycled checkpoint")
    pu.add_argument("--json", action="store_true")
    pu.set_defaults(fn=_policy_upcycle)
    pp = psub.add_parser(
        "pretrained",
        help="convert a packaged pretrained model into the local cache; prints its path",
    )
    pp.add_argument("name", help="e.g. smollm2-135m-instruct")
    pp.add_argument(
        "--experts", type=int, default=0, help="also upcycle it (0: the dense model only)"
    )
    pp.add_argument("--top-k", type=int, default=1)
    pp.set_defaults(fn=_policy_pretrained)
