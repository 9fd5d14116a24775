"""Token-level chat format for the agent loop: the initial prompt, and the tokens an observation
appends after a generated turn, both rendered with the checkpoint's own chat template.

The template must be prefix-preserving (rendering more messages only appends text); `ChatFormat`
checks this on construction and refuses a template that is not, since the agent loop would then
train on a context that differs from what a full render gives at inference time.
"""

from __future__ import annotations


class ChatFormat:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.eot_id = tokenizer.eos_token_id
        if self.eot_id is None:
            raise ValueError(
                "tokenizer has no eos_token (the end-of-turn token the agent loop stops on)"
            )
        self.eot_text = tokenizer.convert_ids_to_tokens(self.eot_id)
        self._base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        base = self.text(self._base, gen=False)
        cut = base.rfind(self.eot_text)
        if cut < 0:
            raise ValueError(f"chat template does not end assistant turns with {self.eot_text!r}")
        self._base_text = base[: cut + len(self.eot_text)]

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def text(self, messages: list[dict], tools: list[dict] | None = None, *, gen: bool) -> str:
        """The conversation rendered (`gen`: ending with the assistant generation header)."""
        return self.tok.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=gen
        )

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The episode's first prompt, ending with the assistant generation header."""
        return self.encode(self.text(messages, tools, gen=True))

    def observation_ids(self, messages: list[dict]) -> list[int]:
        """Tokens to append after a turn that ended with the end-of-turn token.

        Rendered as the template would render `messages` after an assistant turn, followed by
        the next assistant header, minus everything up to and including the end-of-turn token.
        """
        full = self.text(self._base + list(messages), gen=True)
        if not full.startswith(self._base_text):
            raise ValueError(
                "chat template is not prefix-preserving for these observation messages"
            )
        return self.encode(full[len(self._base_text) :])

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids, tool tags kept, the trailing end-of-turn token dropped."""
        if ids and ids[-1] == self.eot_id:
            ids = ids[:-1]
        return self.tok.decode(ids, skip_special_tokens=False)
