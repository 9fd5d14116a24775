"""Rollout tokens/s: our vLLM rollout path against Hugging Face `generate` (what TRL uses without
vLLM), on the same MoE checkpoint, prompts and sampling settings, measured in the same run.

    .venv/bin/python bench/rollout_throughput.py [--sizes tiny compute] [--repeats 3] [--json]

Three models, because on a tiny model per-call overhead can hide everything:
- tiny: the test model (hidden 64, 2 layers, 8 experts), 16 sequences × 128 new tokens;
- compute: hidden 512, 8 layers, 16 experts (top-2), 64 sequences × 256 new tokens;
- real and real-bf16: the real policy (SmolLM2-135M-Instruct upcycled to 4 experts top-1, what the
  demo and row 2 train), 24 sequences × 128 new tokens (row 2's batch of episodes), in fp32 and in
  bf16 (both sides: vLLM `dtype=bfloat16`, the HF model loaded in bf16).
Every sequence gets a 64-token random prompt (seeded), temperature 1, top-p 1, and exactly the
requested number of new tokens on both sides (vLLM `min_tokens`, HF `min_new_tokens`), so the
work is identical. Ours is `VLLMEngine.generate` (the call the agent loop makes: one batched
request, per-token log-probs on); HF is `model.generate(do_sample=True)` on the whole batch with
the KV cache, all cores, in the row's dtype. Each measurement runs in a fresh process (engine start-up and a
warm-up call excluded), the two sides alternating, median of `--repeats`.

The limit beside them: decode at these batch sizes is bound by memory, not arithmetic. A step reads
every weight its tokens route to, and with these batches nearly every expert of every layer is hit
(24 tokens over 4 experts top 1, 64 over 16 top 2: an expert sits idle only where the router
concentrates), so a step costs about the model's weight bytes (the input embedding excepted, which
a step only looks up; a tied one is read whole as the output head) over this machine's memory read
bandwidth (a sum over a 1 GiB array, measured in the same run). Sequences / that time is about the
most tokens/s any implementation gets at this batch size here (a step that leaves experts idle
reads less; the KV cache's reads, small at these lengths, are left out).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SIZES = {
    "tiny": dict(dims={}, sequences=16, new_tokens=128),
    "compute": dict(
        dims=dict(
            hidden_size=512,
            num_layers=8,
            num_experts=16,
            num_heads=8,
            num_kv_heads=4,
            head_dim=64,
            moe_intermediate_size=256,
        ),
        sequences=64,
        new_tokens=256,
    ),
    "real": dict(pretrained=True, sequences=24, new_tokens=128),
    "real-bf16": dict(pretrained=True, sequences=24, new_tokens=128, dtype="bfloat16"),
}
PROMPT = 64


def prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(8, vocab) for _ in range(PROMPT)] for _ in range(n)]


def run_ours(path: str, n: int, new: int, dtype: str) -> dict:
    from rollout.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(path, max_model_len=PROMPT + new + 8, kv_cache_gib=1, dtype=dtype)
    vocab = engine.llm.get_tokenizer().vocab_size
    batch = prompts(vocab, n)
    engine.generate(batch[:2], max_tokens=8, seeds=[0, 1])  # warm-up
    t0 = time.perf_counter()
    gens = engine.generate(batch, max_tokens=new, min_tokens=new, seeds=list(range(n)))
    dt = time.perf_counter() - t0
    return {"tokens": sum(len(g.token_ids) for g in gens), "seconds": dt}


def run_hf(path: str, n: int, new: int, dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    vocab = AutoTokenizer.from_pretrained(path).vocab_size
    ids = torch.tensor(prompts(vocab, n))
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0)
    with torch.inference_mode():
        # warm-up
        model.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), max_new_tokens=8, **kw)
        t0 = time.perf_counter()
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, **kw
        )
        dt = time.perf_counter() - t0
    return {"tokens": int((out.shape[1] - PROMPT) * n), "seconds": dt}


def weight_bytes_per_step(path: str, dtype: str) -> int:
    """Bytes of weights one decode step reads when every expert is hit (see the module docstring)."""
    from safetensors import safe_open

    config = json.loads((Path(path) / "config.json").read_text())
    size = {"float32": 4, "bfloat16": 2}[dtype]
    total, embed = 0, 0
    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        for name in f.keys():
            nbytes = math.prod(f.get_slice(name).get_shape()) * size
            total += nbytes
            if name.endswith("embed_tokens.weight"):
                embed = nbytes
    return total if config.get("tie_word_embeddings") else total - embed


def read_bandwidth() -> float:
    """Bytes/s this machine reads from memory: a sum over a 1 GiB fp32 array, all threads, median of 5."""
    import torch

    x = torch.ones(1 << 28)
    x.sum()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times)


def child(args) -> None:
    fn = run_ours if args.child == "ours" else run_hf
    print(json.dumps(fn(args.path, args.sequences, args.new_tokens, args.dtype)))


def measure(side: str, path: str, n: int, new: int, dtype: str) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        side,
        "--path",
        path,
        "--sequences",
        str(n),
        "--new-tokens",
        str(new),
        "--dtype",
        dtype,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"{side} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", choices=["ours", "hf"], help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--sequences", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--new-tokens", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    import torch
    import transformers
    import vllm

    from rl.start.pretrained import policy
    from rl.start.tiny import TinyMoEDims, make_tiny_qwen3_moe

    rows = []
    bandwidth = read_bandwidth()
    for size in args.sizes:
        spec = SIZES[size]
        if spec.get("pretrained"):
            path = str(policy("smollm2-135m-instruct", 4, 1))
        else:
            path = str(
                make_tiny_qwen3_moe(
                    Path(tempfile.mkdtemp()) / size, TinyMoEDims(**spec["dims"]), seed=0
                )
            )
        dtype = spec.get("dtype", "float32")
        ours, hf = [], []
        for _ in range(args.repeats):  # alternate, so load on this noisy machine hits both alike
            ours.append(measure("ours", path, spec["sequences"], spec["new_tokens"], dtype))
            hf.append(measure("hf", path, spec["sequences"], spec["new_tokens"], dtype))
        o = statistics.median(m["tokens"] / m["seconds"] for m in ours)
        h = statistics.median(m["tokens"] / m["seconds"] for m in hf)
        step_bytes = weight_bytes_per_step(path, dtype)
        limit = spec["sequences"] / (step_bytes / bandwidth)
        rows.append(
            {
                "size": size,
                "sequences": spec["sequences"],
                "new_tokens": spec["new_tokens"],
                "ours_tok_s": o,
                "hf_tok_s": h,
                "ratio": o / h,
                "repeats": args.repeats,
                "weight_bytes_per_step": step_bytes,
                "read_bytes_s": bandwidth,
                "limit_tok_s": limit,
            }
        )
    versions = {
        "torch": torch.__version__,
        "vllm": vllm.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    if args.json:
        print(json.dumps({"rows": rows, "versions": versions}))
        return
    print(
        f"# rollout throughput: vLLM rollout path vs HF generate, same checkpoint/prompts/sampling, "
        f"median of {args.repeats}"
    )
    print(
        f"# torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}; "
        f"memory read bandwidth {bandwidth / 1e9:.1f} GB/s\n"
    )
    print(
        "| model | sequences × new tokens | ours tok/s | HF generate tok/s | ratio | weights read per step MiB "
        "| weight-streaming limit tok/s | ours / limit | HF / limit |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        lim = r["limit_tok_s"]
        print(
            f"| {r['size']} | {r['sequences']} × {r['new_tokens']} | {r['ours_tok_s']:.0f} | {r['hf_tok_s']:.0f} | "
            f"{r['ratio']:.2f}× | {r['weight_bytes_per_step'] / 2**20:.0f} | {lim:.0f} | "
            f"{r['ours_tok_s'] / lim:.0%} | {r['hf_tok_s'] / lim:.0%} |"
        )


if __name__ == "__main__":
    main()
