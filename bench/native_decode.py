"""Decode speed and cache size of both engines serving the policy/ model vs full recompute, at long contexts.

    .venv/bin/python bench/native_decode.py [--flavour configs/policy/debug.yaml] [--contexts 1024 8192 65536]

For each context length L, one random prompt of L tokens on a random `policy/` model:
- native: `NativeEngine.generate` (incremental decoding on KDA states and the MLA latent cache);
  decode tokens/s from the engine's own timing of its decode steps (each a forward of one token
  per sequence plus sampling; the prefill is timed apart);
- full recompute (the baseline, what decoding costs with no cache at all): one full forward over
  the whole sequence per generated token, timed over a few tokens;
- cache bytes per token: the engine's cache after the prefill (every KDA state and every MLA latent
  tensor, summed) over L, next to what a plain multi-head softmax KV cache of the same layers and
  head widths would hold (K and V per head per layer, fp32).
- vLLM: the rollout worker's `VLLMEngine` serving the same checkpoint through the project's plugin
  (rollout/engines/vllm_plugin.py); vLLM reports no prefill/decode split, so decode tokens/s is
  (N − 1) / (time to generate N tokens − time to generate 1), and its cache bytes per token are the
  expanded per-head K/V of each MLA layer (fp32, padded to the CPU kernel's head size) plus the KDA
  state slots (fixed per sequence) over L — logical sizes: vLLM pads a state slot's page to the
  attention page (it logs by how much).
Prints a Markdown table; ratios are ours over the baseline, from the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def tensor_bytes(cache) -> int:
    total = 0
    for st in cache.layers:
        for f in dataclasses.fields(st):
            t = getattr(st, f.name)
            if t is not None and hasattr(t, "element_size") and t.dim() > 1:
                total += t.numel() * t.element_size()
    return total


def main() -> None:
    import torch

    from policy.args import load_model_args
    from policy.checkpoint import save_policy
    from policy.model import Policy
    from rollout.engines.native import NativeEngine

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flavour", default="configs/policy/debug.yaml")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 65536])
    ap.add_argument(
        "--decode", type=int, default=33, help="tokens the native engine generates per context"
    )
    ap.add_argument(
        "--recompute", type=int, default=2, help="tokens the full-recompute baseline generates"
    )
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    args = load_model_args(a.flavour)
    args = dataclasses.replace(
        args,
        vision=dataclasses.replace(args.vision, enabled=False),
        vocab_size=1024,
        max_seq_len=max(args.max_seq_len, max(a.contexts) + a.decode + 8),
    )
    torch.manual_seed(0)
    model = Policy(args).eval()
    path = save_policy(model, tempfile.mkdtemp())
    from rl.start.tiny import build_tokenizer, default_corpus

    build_tokenizer(default_corpus()).save_pretrained(path)  # vLLM loads one (the prompts are ids)
    eng = NativeEngine(
        str(path), max_model_len=max(a.contexts) + a.decode + 8, prefix_cache_entries=0
    )
    from rollout.engines.vllm_engine import VLLMEngine
    from rollout.engines.vllm_plugin import mla_head_size

    vllm = VLLMEngine(str(path), max_model_len=max(a.contexts) + a.decode + 8, kv_cache_gib=2.0)
    kda, n_kda = args.kda, args.layer_kinds().count("kda")
    kda_state_bytes = (
        n_kda
        * 4
        * (3 * kda.n_heads * kda.head_dim * (kda.conv_size - 1) + kda.n_heads * kda.head_dim**2)
    )
    vllm_kv_bytes = args.layer_kinds().count("mla") * 2 * args.mla.n_heads * mla_head_size(args) * 4
    mla = args.mla
    n_mla = args.layer_kinds().count("mla")
    mha_bytes = (
        args.n_layers
        * mla.n_heads
        * (mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim)
        * 4
    )

    print(
        f"# native decode vs full recompute — flavour {args.name} (dim {args.dim}, {args.n_layers} layers, "
        f"{n_mla} MLA), {a.threads} threads, torch {torch.__version__}, {platform.processor() or platform.machine()}\n"
    )
    print(
        "| context | native decode tok/s | full recompute tok/s | speed-up | prefill s | cache bytes/token | "
        "MHA KV bytes/token | cache / MHA | vLLM plugin decode tok/s | vLLM vs recompute | "
        "vLLM cache bytes/token | vLLM cache / MHA |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    vllm.generate([list(range(1, 64))], max_tokens=8, temperature=0.0)  # its first call warms up
    g = torch.Generator().manual_seed(0)
    for L in a.contexts:
        prompt = torch.randint(0, 1024, (L,), generator=g).tolist()
        before = dict(eng.stats)
        out = eng.generate([prompt], max_tokens=a.decode, temperature=0)[0]
        steps = eng.stats["decode_steps"] - before["decode_steps"]
        assert steps == len(out.token_ids) - 1
        native = steps / (eng.stats["decode_s"] - before["decode_s"])
        t_one = eng.stats["prefill_s"] - before["prefill_s"]
        with torch.no_grad():
            cache = model.new_cache()
            model(torch.tensor([prompt]), cache=cache)
            per_token = tensor_bytes(cache) / L
            seq, t0 = list(prompt), time.perf_counter()
            for _ in range(a.recompute):
                logits, _, _ = model(torch.tensor([seq]))
                seq.append(int(logits[0, -1].argmax()))
            recompute = a.recompute / (time.perf_counter() - t0)
        timed = {}
        for n in (1, a.decode):
            t0 = time.perf_counter()
            (gen,) = vllm.generate([prompt], max_tokens=n, temperature=0.0, min_tokens=n)
            timed[n] = time.perf_counter() - t0
            assert len(gen.token_ids) == n
        assert gen.token_ids == out.token_ids  # the same greedy tokens as the native engine
        v_decode = (a.decode - 1) / (timed[a.decode] - timed[1])
        v_bytes = vllm_kv_bytes + kda_state_bytes / L
        print(
            f"| {L} | {native:.1f} | {recompute:.3f} | {native / recompute:.0f}× | {t_one:.1f} | {per_token:.0f} | "
            f"{mha_bytes} | {per_token / mha_bytes:.3f}× | {v_decode:.1f} | {v_decode / recompute:.0f}× | "
            f"{v_bytes:.0f} | {v_bytes / mha_bytes:.3f}× |",
            flush=True,
        )


if __name__ == "__main__":
    main()
