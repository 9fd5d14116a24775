"""Weight sync: seconds to deliver a new version to N vLLM rollout workers, against a plain memory
copy of the same bytes, measured in the same run.

    .venv/bin/python bench/weight_sync.py [--workers 2] [--hidden 512] [--layers 8] [--experts 16] [--repeats 5]

The sync is the real path (`rl/sync.py`): the learner publishes its state dict into Ray's object
store in buckets, every rollout worker fetches them and its vLLM engine reloads in place
(the CPU MoE experts packed straight into the engine's kernel tensors, the rest through vLLM's
reload). The limit is what the bytes alone
cost: one `memcpy` of the whole state dict into a preallocated buffer per worker (each engine
must end up with its own copy). Sync and copy alternate, so load on this noisy machine hits both
alike. Prints a Markdown table; `--json` prints the numbers.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import numpy as np
    import ray
    import torch
    import vllm

    from rl.tiny import TinyMoEDims, make_tiny_qwen3_moe
    from rl.config import AlgoConfig, EnvConfig, RayConfig, RolloutConfig
    from rl.learner_group import LearnerActor
    from rl.ray_utils import init_ray
    from rl.sync import start_sync
    from rollout.worker import RolloutWorkerActor

    dims = TinyMoEDims(hidden_size=args.hidden, num_layers=args.layers, num_experts=args.experts,
                       num_heads=8, num_kv_heads=4, head_dim=64, moe_intermediate_size=args.hidden // 2)
    path = make_tiny_qwen3_moe(Path(tempfile.mkdtemp()) / "policy", dims, seed=0)
    init_ray(RayConfig(num_cpus=2, object_store_mb=2048))
    learner = LearnerActor.remote(str(path), AlgoConfig(), seed=0)
    rollout = RolloutConfig(max_model_len=1024, max_episode_tokens=1024, kv_cache_gib=1.0)
    workers = [RolloutWorkerActor.options(num_cpus=0.5).remote(str(path), rollout, EnvConfig(), seed=i)
               for i in range(args.workers)]
    ray.get([w.version.remote() for w in workers])
    arrays = [a for _, a in ray.get(learner.weights.remote())]
    nbytes = sum(a.nbytes for a in arrays)
    src = np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays])  # the bytes, contiguous
    dst = [np.empty_like(src) for _ in range(args.workers)]
    for d in dst:  # touch the pages once so the copy measures copying, not page faults
        d.fill(0)

    syncs, copies = [], []
    start_sync(learner, workers, args.bucket_mb).finish(600)  # warm: first loads allocate
    for _ in range(args.repeats):
        syncs.append(start_sync(learner, workers, args.bucket_mb).finish(600))
        t0 = time.perf_counter()
        for d in dst:
            np.copyto(d, src)
        copies.append(time.perf_counter() - t0)

    # the engine's reload alone, in this process (the workers gone, so nothing competes for the
    # cores): vLLM's layerwise reload of every tensor against the direct expert path (vllm_ext.py)
    named = ray.get(learner.weights.remote())
    for w in workers + [learner]:
        ray.kill(w)
    from rollout.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(str(path), max_model_len=1024, kv_cache_gib=1.0)
    reload = {False: [], True: []}
    for direct in (False, True):  # warm both
        engine.llm.collective_rpc("lh_reload_weights", args=(iter(named),), kwargs={"direct_experts": direct})
    for _ in range(args.repeats):
        for direct in (False, True):
            t0 = time.perf_counter()
            engine.llm.collective_rpc("lh_reload_weights", args=(iter(named),), kwargs={"direct_experts": direct})
            reload[direct].append(time.perf_counter() - t0)
    layerwise, direct = statistics.median(reload[False]), statistics.median(reload[True])

    wall = statistics.median(s["sync_wall_s"] for s in syncs)
    publish = statistics.median(s["sync_publish_s"] for s in syncs)
    load = statistics.median(s["sync_load_s_max"] for s in syncs)
    copy = statistics.median(copies)
    one_copy = copy / args.workers
    result = {"bytes": nbytes, "workers": args.workers, "buckets": syncs[0]["sync_buckets"],
              "sync_s": wall, "publish_s": publish, "load_s_max": load, "memcpy_s": copy, "ratio": wall / copy,
              "reload_layerwise_s": layerwise, "reload_direct_s": direct, "memcpy_one_s": one_copy,
              "versions": {"torch": torch.__version__, "vllm": vllm.__version__, "ray": ray.__version__,
                           "python": platform.python_version()}, "repeats": args.repeats}
    if args.json:
        print(json.dumps(result))
        return
    print(f"# weight sync: {nbytes / 2**20:.0f} MiB of fp32 weights (Qwen3-MoE, hidden {args.hidden}, "
          f"{args.layers} layers, {args.experts} experts) to {args.workers} vLLM workers, "
          f"{result['buckets']} buckets of ≤ {args.bucket_mb:g} MiB; median of {args.repeats}")
    print(f"# torch {torch.__version__}, vllm {vllm.__version__}, ray {ray.__version__}, {platform.machine()}\n")
    print("| what | seconds | vs memcpy |")
    print("| --- | ---: | ---: |")
    print(f"| memcpy of the same bytes, once per worker | {copy:.3f} | 1.0× |")
    print(f"| sync: publish into the object store | {publish:.3f} | {publish / copy:.1f}× |")
    print(f"| sync: slowest worker's fetch + in-place reload | {load:.3f} | {load / copy:.1f}× |")
    print(f"| sync, end to end (driver's wall clock) | {wall:.3f} | {wall / copy:.1f}× |")
    print(f"\nThe engine's reload alone (one engine in this process, the workers gone; against one copy, "
          f"{one_copy:.3f} s): vLLM's layerwise reload of every tensor {layerwise:.3f} s ({layerwise / one_copy:.1f}×), "
          f"the experts loaded straight into their packed tensors {direct:.3f} s ({direct / one_copy:.1f}×): "
          f"{layerwise / direct:.2f}× faster.")


if __name__ == "__main__":
    main()
