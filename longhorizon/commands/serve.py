"""`longhorizon serve`: a trained policy behind an OpenAI-compatible chat API (longhorizon/serve.py)."""

from __future__ import annotations

from longhorizon.serve import serve


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve", help="a trained policy behind an OpenAI-compatible chat API (/v1/chat/completions)"
    )
    p.add_argument("target", metavar="RUN_DIR|CHECKPOINT")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (not loopback: --api-key required)"
    )
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    p.add_argument(
        "--api-key",
        default="",
        help="bearer token every request must carry (default: LONGHORIZON_API_KEY)",
    )
    p.add_argument(
        "--model",
        default="",
        help="the model name the API reports (default: the checkpoint's folder name)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-request-tokens",
        type=int,
        default=1 << 15,
        help="the most tokens one request may ask for (n × max_tokens); more is a 400",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds a request may generate before it is cancelled (a 504)",
    )
    p.set_defaults(fn=serve)
