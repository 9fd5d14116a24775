"""GPU check for issue 8 (run by hand when a GPU machine is lent; CI never runs it): the tiny
`policy/` config served through vLLM and the project's plugin on whatever device vLLM uses (CUDA on
a GPU machine; CPU here, where it is a dry run), its sampled tokens' log-probs compared with the
learner's code path on CPU (fp32). Prints one JSON line; exits 1 past the tolerance.

    python bench/gpu_vllm_plugin_check.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from policy.args import load_model_args
    from rl.learner.logprobs import chunked_logprobs, load_causal_lm
    from rl.start.tiny import make_tiny_policy
    from rollout.engines.vllm_engine import VLLMEngine

    path = str(
        make_tiny_policy(
            Path(tempfile.mkdtemp()) / "policy", load_model_args("configs/policy/debug.yaml")
        )
    )
    engine = VLLMEngine(path, max_model_len=1024, seed=0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 33, 200, 700)]
    gens = engine.generate(prompts, max_tokens=32, temperature=0.7, seeds=[0, 1, 2, 3])
    lm = load_causal_lm(path, torch.float32)
    worst = 0.0
    for p, gen in zip(prompts, gens):
        ids = torch.tensor([p + gen.token_ids])
        with torch.no_grad():
            lp, _ = chunked_logprobs(
                lm.hidden(ids), lm.head, ids, temperature=0.7, banned_ids=lm.banned_ids
            )
        worst = max(worst, (lp[0, len(p) - 1 :] - torch.tensor(gen.logprobs)).abs().max().item())
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    ok = worst < 1e-3
    print(
        json.dumps(
            {
                "check": "vllm plugin vs learner log-probs",
                "device": device,
                "sequences": len(prompts),
                "tokens": sum(len(x.token_ids) for x in gens),
                "max_abs_logprob_diff": worst,
                "tolerance": 1e-3,
                "ok": ok,
            }
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
