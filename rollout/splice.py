"""Token-exact prompts for conversations that an agent sends back whole on every call.

An OpenAI-style client sends the whole conversation each time; rendering it again with the chat
template gives text, and tokenising that text rarely gives back the ids the policy sampled (a byte
BPE merges differently; a template renders an assistant's tool calls in its own layout). Training
on such a re-rendering trains on tokens the policy never produced. `Splicer` prompts each call with
the ids the session actually had wherever it can:

1. message level: the conversation's last assistant message is one this endpoint returned (same
   content and tool calls, arguments compared as JSON) and everything before it renders to exactly
   the text that call was prompted with: the prompt is that call's prompt + sampled ids, then the
   tokens of what the template renders after the assistant's end-of-turn token (a tool result, the
   next user turn, the generation header). The template's own rendering of the assistant message
   is never tokenised.
2. text level: the rendered text begins with an earlier call's prompt + completion, decoded
   (an agent that sends back raw text): that call's ids, then the rest tokenised.
3. otherwise the rendering, tokenised: the history was rewritten (edited messages, a template
   that drops earlier reasoning), and the call's prompt does not extend the earlier ids, which is
   how the trajectory assembly (rollout/program_episodes.py) sees it.

Needs a template that renders assistant messages as the generation header followed by the message
and the end-of-turn token (every Hermes/ChatML-style template does).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

from rollout.chat import ChatFormat


def message_key(content, tool_calls) -> tuple:
    """An assistant message as compared: stripped content, and each tool call's name and arguments
    (parsed JSON, so a client that re-serialises them still matches)."""
    calls = []
    for tc in tool_calls or ():
        fn = tc.get("function", tc) if isinstance(tc, dict) else tc
        name, args = fn.get("name"), fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        calls.append((name, json.dumps(args, sort_keys=True)))
    return ((content or "").strip(), tuple(calls))


@dataclass
class _Sampled:
    prompt_text: str
    """The rendered conversation the call was prompted for."""
    ids: list[int]
    """Its prompt ids and the ids sampled."""
    text: str
    """`ids` decoded (for the text-level splice)."""
    key: tuple
    """The assistant message returned for it (`message_key`)."""
    eot: bool
    """The completion ended with the end-of-turn token."""


class Splicer:
    def __init__(self, chat: ChatFormat):
        self.chat = chat
        self._sessions: dict[str, list[_Sampled]] = {}
        self._lock = threading.Lock()

    def add(
        self,
        session: str,
        prompt_text: str,
        prompt_ids: list[int],
        completion_ids: list[int],
        key: tuple,
    ) -> None:
        ids = list(prompt_ids) + list(completion_ids)
        entry = _Sampled(
            prompt_text,
            ids,
            self.chat.tok.decode(ids, skip_special_tokens=False),
            key,
            bool(completion_ids) and completion_ids[-1] == self.chat.eot_id,
        )
        with self._lock:
            self._sessions.setdefault(session, []).append(entry)

    def forget(self, session: str) -> None:
        with self._lock:
            self._sessions.pop(session, None)

    def prompt(
        self, session: str, messages: list[dict], tools: list | None
    ) -> tuple[list[int], str]:
        """(ids to prompt with, the rendered text they stand for); see the module doc."""
        chat = self.chat
        full = chat.text(messages, tools, gen=True)
        with self._lock:
            entries = list(self._sessions.get(session, ()))
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if entries and last is not None:
            key = message_key(messages[last].get("content"), messages[last].get("tool_calls"))
            before = chat.text(messages[:last], tools, gen=True)
            ours = next(
                (e for e in reversed(entries) if e.key == key and e.prompt_text == before), None
            )
            if ours is not None:
                head = chat.text(messages[: last + 1], tools, gen=False)
                cut = head.rfind(chat.eot_text)
                if head.startswith(before) and full.startswith(head) and cut >= len(before):
                    tail = head[cut + len(chat.eot_text) :] if ours.eot else head[cut:]
                    return ours.ids + chat.encode(tail + full[len(head) :]), full
        for e in sorted(entries, key=lambda e: -len(e.ids)):
            if full.startswith(e.text):
                return e.ids + chat.encode(full[len(e.text) :]), full
        return chat.encode(full), full
