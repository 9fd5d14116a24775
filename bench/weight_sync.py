"""Weight sync: seconds to deliver a new version to the rollout workers, against a plain memory
copy of the same bytes, measured in the same run.

    .venv/bin/python bench/weight_sync.py [--cases compute real-bf16] [--hidden 512] [--layers 8] [--repeats 5] [--json]

Two cases, each in a fresh process (a process holds one vLLM engine), each synced four ways: through
Ray's object store or the learner's shared memory (`sync.shared_memory`, the default where the
learner and the workers share a node), and whole (every bucket published before the loads start)
or streamed (`sync.publish`: the workers load the first buckets while the learner still casts and
writes the next):
- compute: a Qwen3-MoE of hidden `--hidden`, `--layers` layers, 16 experts, fp32 learner and fp32
  engines, to 2 workers;
- real-bf16: the real policy (SmolLM2-135M-Instruct upcycled to 4 experts top-1, what the demo and
  row 12 train), fp32 learner, one bf16 engine (`rollout.dtype: bfloat16`: the sync sends bf16).

The sync is the real path (`rl/weight_sync/transport.py`): the learner publishes its weights (cast to the engines'
dtype; its actor started with the trainer's malloc, rl/learner/allocator.py) into Ray's object store in
buckets, or into its shared-memory slab (the cast is the one copy; the experts stay in the learner's
fused blocks, which the engine packs from without staging them), and every rollout worker's vLLM
engine loads in place (every tensor straight where the engine reads it: the CPU MoE experts packed into the
engine's kernel tensors, each linear layer packed again from its checkpoint shards, norms and the
embedding written in place; rollout/engines/vllm_ext.py). The limit is what the bytes alone cost: one `memcpy` of the bytes sent into
a preallocated buffer per worker (each engine must end up with its own copy). Sync and copy
alternate, so load on this noisy machine hits both alike. The engine's reload is then timed alone
(the workers gone), vLLM's layerwise reload of every tensor against the direct path.
Prints a Markdown table; `--json` prints the numbers.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODES = [
    ("object store", "whole"),
    ("object store", "streamed"),
    ("shared memory", "whole"),
    ("shared memory", "streamed"),
]
CASES = {
    "compute": dict(workers=2, engine_dtype="float32"),
    "real-bf16": dict(workers=1, engine_dtype="bfloat16", pretrained=True),
}


def model_path(case: str, args) -> str:
    if CASES[case].get("pretrained"):
        from rl.start.pretrained import policy

        return str(policy("smollm2-135m-instruct", 4, 1))
    from rl.start.tiny import TinyMoEDims, make_tiny_qwen3_moe

    dims = TinyMoEDims(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_experts=16,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        moe_intermediate_size=args.hidden // 2,
    )
    return str(make_tiny_qwen3_moe(Path(tempfile.mkdtemp()) / "policy", dims, seed=0))


def run_case(case: str, args) -> dict:
    """One case, in this process: syncs through Ray, then the engine's reload alone."""
    import numpy as np
    import ray
    import torch

    from rl.config import AlgoConfig, EnvConfig, RayConfig, RolloutConfig
    from rl.learner.allocator import actor_env
    from rl.learner.learner_group import LearnerActor
    from rl.ray_utils import init_ray
    from rl.weight_sync.transport import start_sync
    from rollout.weights import from_wire, to_wire
    from rollout.worker import RolloutWorkerActor

    spec = CASES[case]
    path, engine_dtype, n_workers = model_path(case, args), spec["engine_dtype"], spec["workers"]
    init_ray(RayConfig(num_cpus=2, object_store_mb=2048))
    # the learner's malloc as the trainer starts it (tcmalloc where installed)
    env = actor_env("auto")
    learner = LearnerActor.options(**({"runtime_env": {"env_vars": env}} if env else {})).remote(
        path, AlgoConfig(), seed=0, engine_dtype=engine_dtype
    )
    rollout = RolloutConfig(
        max_model_len=1024, max_episode_tokens=1024, kv_cache_gib=1.0, dtype=engine_dtype
    )
    workers = [
        RolloutWorkerActor.options(num_cpus=0.5).remote(path, rollout, EnvConfig(), seed=i)
        for i in range(n_workers)
    ]
    dtype_of = lambda e: str(e.llm.llm_engine.model_config.dtype)  # noqa: E731
    served = ray.get(
        [w.__ray_call__.remote(lambda self: self.engine.call(dtype_of)) for w in workers]
    )
    assert served == [f"torch.{engine_dtype}"] * n_workers, (
        f"the workers' engines serve {served}, not {engine_dtype}"
    )
    malloc = ray.get(learner.allocator.remote())
    # what a sync sends, as the engines receive it, in this process's own memory: arrays read from
    # the object store would pin the learner's fp32 weights there (1.4 GiB of the real policy), and
    # the syncs below would spill to disk
    named = [
        (n, from_wire(a, engine_dtype == "bfloat16"))
        for n, a in to_wire(
            ((n, torch.from_numpy(a.copy())) for n, a in ray.get(learner.weights.remote())),
            getattr(torch, engine_dtype),
        )
    ]
    nbytes = sum(a.nbytes for _, a in named)
    src = np.concatenate(
        [
            np.asarray(a.view(torch.int16) if isinstance(a, torch.Tensor) else a)
            .reshape(-1)
            .view(np.uint8)
            for _, a in named
        ]
    )  # the bytes, contiguous
    dst = [np.empty_like(src) for _ in range(n_workers)]
    for d in dst:  # touch the pages once so the copy measures copying, not page faults
        d.fill(0)

    syncs, copies = {m: [] for m in MODES}, []
    for shared in (
        False,
        True,
    ):  # warm: first loads allocate, the first shared publish maps its slab
        start_sync(learner, workers, args.bucket_mb, shared=shared).finish(600)
    for _ in range(args.repeats):
        for mode in MODES:
            transport, publish = mode
            out = start_sync(
                learner,
                workers,
                args.bucket_mb,
                stream=publish == "streamed",
                shared=transport == "shared memory",
            ).finish(600)
            assert out["sync_shared"] == (transport == "shared memory"), out
            syncs[mode].append(out)
        t0 = time.perf_counter()
        for d in dst:
            np.copyto(d, src)
        copies.append(time.perf_counter() - t0)

    # the engine's reload alone, in this process (the workers gone, so nothing competes for the
    # cores): vLLM's layerwise reload of every tensor against the direct path (vllm_ext.py)
    for w in workers + [learner]:
        ray.kill(w)
    from rollout.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(path, max_model_len=1024, kv_cache_gib=1.0, dtype=engine_dtype)
    reload = {False: [], True: []}
    for direct in (False, True):  # warm both
        engine.llm.collective_rpc(
            "lh_reload_weights", args=(iter(named),), kwargs={"direct": direct}
        )
    for _ in range(args.repeats):
        for direct in (False, True):
            t0 = time.perf_counter()
            engine.llm.collective_rpc(
                "lh_reload_weights", args=(iter(named),), kwargs={"direct": direct}
            )
            reload[direct].append(time.perf_counter() - t0)

    copy = statistics.median(copies)
    first = syncs[MODES[0]][0]

    def modes(key):
        return {" ".join(m): statistics.median(s[key] for s in syncs[m]) for m in MODES}

    return {
        "case": case,
        "malloc": malloc,
        "bytes": nbytes,
        "workers": n_workers,
        "engine_dtype": engine_dtype,
        "buckets": first["sync_buckets"],
        "tensors": first.get("sync_tensors"),
        "direct_tensors": first.get("sync_direct_tensors"),
        "unstaged": {" ".join(m): syncs[m][0].get("sync_unstaged_expert_layers") for m in MODES},
        "sync_s": modes("sync_wall_s"),
        "publish_s": modes("sync_publish_s"),
        "load_s_max": modes("sync_load_s_max"),
        "memcpy_s": copy,
        "memcpy_one_s": copy / n_workers,
        "reload_layerwise_s": statistics.median(reload[False]),
        "reload_direct_s": statistics.median(reload[True]),
    }


def measure(case: str, args) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        case,
        "--hidden",
        str(args.hidden),
        "--layers",
        str(args.layers),
        "--repeats",
        str(args.repeats),
        "--bucket-mb",
        str(args.bucket_mb),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"{case} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", choices=list(CASES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_case(args.child, args)))
        return

    import ray
    import torch
    import vllm

    rows = [measure(case, args) for case in args.cases]
    versions = {
        "torch": torch.__version__,
        "vllm": vllm.__version__,
        "ray": ray.__version__,
        "python": platform.python_version(),
    }
    if args.json:
        print(json.dumps({"rows": rows, "versions": versions, "repeats": args.repeats}))
        return
    print(
        f"# weight sync: learner → vLLM rollout workers through Ray's object store or the learner's shared memory, buckets of ≤ "
        f"{args.bucket_mb:g} MiB, median of {args.repeats}; against one memcpy of the bytes sent per worker. "
        f"compute: Qwen3-MoE hidden {args.hidden}, {args.layers} layers, 16 experts, fp32; real-bf16: "
        "SmolLM2-135M upcycled to 4 experts, fp32 learner, bf16 engine; learner's malloc: "
        + ", ".join(sorted({r["malloc"] for r in rows}))
    )
    print(
        f"# torch {torch.__version__}, vllm {vllm.__version__}, ray {ray.__version__}, {platform.machine()}\n"
    )
    print(
        "| model | engines | transport | publish | MiB sent | memcpy s | publish s | slowest load s | end to end s | vs memcpy |"
    )
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        c = r["memcpy_s"]
        for transport, publish in MODES:
            mode = f"{transport} {publish}"
            p, load, wall = r["publish_s"][mode], r["load_s_max"][mode], r["sync_s"][mode]
            print(
                f"| {r['case']} | {r['workers']} × {r['engine_dtype']} | {transport} | {publish} | {r['bytes'] / 2**20:.0f} | "
                f"{c:.3f} | {p:.3f} ({p / c:.1f}×) | {load:.3f} ({load / c:.1f}×) | {wall:.3f} | {wall / c:.1f}× |"
            )
    print(
        "\nThe engine's reload alone (one engine, the workers gone), against one copy of the bytes:\n"
    )
    print("| model | one copy s | vLLM's layerwise reload s | direct load s | tensors direct |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        one = r["memcpy_one_s"]
        print(
            f"| {r['case']} | {one:.3f} | {r['reload_layerwise_s']:.3f} ({r['reload_layerwise_s'] / one:.1f}×) | "
            f"{r['reload_direct_s']:.3f} ({r['reload_direct_s'] / one:.1f}×) | {r['direct_tensors']} of {r['tensors']} |"
        )


if __name__ == "__main__":
    main()
