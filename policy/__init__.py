"""Policies. Today: tiny random Hugging Face Qwen3-MoE checkpoints made locally (`tiny_hf`), with
a locally trained tokenizer and a tool-calling chat template. The project's own sparse-MoE policy
(KDA + gated MLA, LatentMoE, ...) lands here as plain PyTorch."""
