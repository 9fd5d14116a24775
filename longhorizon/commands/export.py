"""`longhorizon export`: a run's trajectories as JSON lines or a Hugging Face `datasets` directory."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from longhorizon.errors import message, report_skipped
from longhorizon.terminal import visible


def run(args) -> int:
    from rl.store import TrajectoryStore

    store = TrajectoryStore(args.run_dir)
    if not store.shards():
        print(f"error: {args.run_dir} holds no trajectory shards", file=sys.stderr)
        return 2
    strict = not args.skip_corrupt
    bad = store.unreadable() if strict else []
    if bad:  # before anything is written
        print(
            visible(f"error: {bad[0]} ({len(bad)} in all; --skip-corrupt leaves them out)"),
            file=sys.stderr,
        )
        return 2
    import warnings

    from rl.store import CorruptShard

    default = "trajectories-dataset" if args.format == "datasets" else "trajectories.jsonl"
    out = Path(args.out or Path(args.run_dir) / default)
    if not out.parent.is_dir():
        print(f"error: --out {out}: its directory {out.parent} does not exist", file=sys.stderr)
        return 2
    # reported below, once
    warnings.filterwarnings("ignore", message="skipping corrupt trajectory shard")
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        if args.format == "datasets":  # a `datasets` directory: datasets.load_from_disk(OUT)
            import tempfile

            from datasets import Dataset, Features
            from datasets.exceptions import DatasetGenerationError

            from rl.store import SCHEMA

            # a private cache: datasets would otherwise reuse an earlier export of the same store, stale
            with tempfile.TemporaryDirectory() as cache:
                # the store's own column types (int32 ids, int8 mask, float32 log-probs, nested expert
                # ids): inferred from Python values they would widen to int64/float64, and an all-None
                # column to null
                try:
                    ds = Dataset.from_generator(
                        store.rows,
                        gen_kwargs={"strict": strict},
                        cache_dir=cache,
                        features=Features.from_arrow_schema(SCHEMA),
                    )
                except DatasetGenerationError as exc:  # datasets wraps what the generator raised
                    if isinstance(exc.__cause__, CorruptShard):
                        raise exc.__cause__ from None
                    raise
                # only once every row was read: a failure leaves OUT as it was
                ds.save_to_disk(str(out))
            n = len(ds)
        else:
            n = 0
            with open(tmp, "w") as fh:  # renamed into place only when complete
                for row in store.rows(strict=strict):
                    fh.write(json.dumps(row) + "\n")
                    n += 1
            tmp.replace(out)
    except CorruptShard as exc:  # a shard whose ids read but whose other columns do not
        tmp.unlink(missing_ok=True)
        print(f"error: {message(exc)} (--skip-corrupt leaves it out)", file=sys.stderr)
        return 2
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        print(f"error: --out {out}: {message(exc)}", file=sys.stderr)
        return 2
    report_skipped(store)
    print(
        f"wrote {n} episodes to {out}"
        + (" (datasets.load_from_disk)" if args.format == "datasets" else "")
    )
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export", help="write the run's trajectories as JSON lines or a datasets directory"
    )
    p.add_argument("run_dir")
    p.add_argument(
        "--out", help="output file or directory (default RUN_DIR/trajectories.jsonl or -dataset)"
    )
    p.add_argument(
        "--skip-corrupt",
        action="store_true",
        help="leave out unreadable shards (default: stop, naming them)",
    )
    p.add_argument(
        "--format",
        choices=["jsonl", "datasets"],
        default="jsonl",
        help="JSON lines (default) or a Hugging Face `datasets` directory",
    )
    p.set_defaults(fn=run)
