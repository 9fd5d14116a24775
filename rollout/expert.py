"""An engine that plays the environments' scripted experts, as token ids.

Every built-in environment has a scripted expert (`env.expert_turns()`, the turns that solve the
task of its current seed, and `env.expert_summary(done)`, what it writes at a compaction turn after
its first `done` turns). `ExpertEngine` serves them through the engine protocol, so the agent loop
records expert episodes exactly as it records the policy's (the same chat format, prompt,
observation and loss-mask bookkeeping, the same context management): what the warm start
(rl/start/sft.py) trains on is token for token what rollouts look like. Tests use it to drive the loop
down paths a random model never reaches (rewards, milestones, solved tasks, compaction).

Each context is matched to its task by the task's first message, and its turn by what it extends: a
context is the prompt (turn 0) or an earlier served context plus the turn served for it plus an
observation (one turn further). Seeds that draw the same prompt can see different observations (the
shell task's prompt names only the log level; its files vary), so neither the prompt nor the
context's length alone says which turn comes next. A context that ends with the compaction
instruction asks for the summary after the turns served so far; a rebuilt context (rollout/context.py)
extends nothing served, and the expert reads its progress from it: the latest of its own turns, or of
its own summaries, that the context shows (its turns must then differ from each other).
"""

from __future__ import annotations

import envs
from rollout.context import COMPACT_INSTRUCTION
from rollout.engines.base import Generation


class _Task:
    def __init__(self, chat, env, obs: str, tools):
        messages = [{"role": "user", "content": obs}]
        self.prompt = chat.prompt_ids(messages, tools)
        # a rebuilt context starts with it too
        self.head = chat.encode(chat.text(messages, tools, gen=False))
        self.turns = env.expert_turns()
        # after the last: no turn left
        self.summaries = [env.expert_summary(done) for done in range(len(self.turns))]


class ExpertEngine:
    version = 0

    def __init__(
        self,
        chat,
        seeds,
        env_id: str = "tools/calculator-v0",
        turns: list[str] | None = None,
        **env_kwargs,
    ):
        self.chat = chat
        self.tasks: list[_Task] = []
        for s in seeds:
            env = envs.make(env_id, **env_kwargs)
            obs, info = env.reset(seed=s)
            task = _Task(chat, env, obs, info["tools"])
            if turns is not None:
                task.turns = list(turns)
            self.tasks.append(task)
            env.close()
        # a served context followed by its reply -> that reply's turn
        self._served: dict[tuple, int] = {}
        # what a context asking for a summary ends with: the instruction and the assistant's header
        asks = chat.observation_ids([{"role": "user", "content": COMPACT_INSTRUCTION}])
        self._asks = chat.tok.decode(asks, skip_special_tokens=False).lstrip("\n")
        self._tail = len(asks) + 8  # tokens of a context's end that hold it

    def generate(
        self,
        prompts,
        *,
        max_tokens,
        temperature=1.0,
        top_p=1.0,
        stop_token_ids=None,
        seeds=None,
        min_tokens=0,
    ):
        out = []
        limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        for p, limit in zip(prompts, limits):
            task = next(t for t in self.tasks if p[: len(t.head)] == t.head)
            text = self.chat.tok.decode(p[-self._tail :], skip_special_tokens=False)
            turn = self._turn(task, p)
            if text.endswith(self._asks):
                reply = task.summaries[min(turn, len(task.summaries) - 1)]
            else:
                if turn >= len(task.turns):
                    raise ValueError(
                        f"the scripted expert has {len(task.turns)} turns; asked for turn {turn + 1}"
                    )
                reply = task.turns[turn]
            ids = self.chat.encode(reply) + [self.chat.eot_id]
            # cut, as an engine would
            ids, finish = (ids, "stop") if len(ids) <= limit else (ids[:limit], "length")
            # after a summary the context is rebuilt: nothing extends it
            if not text.endswith(self._asks):
                self._served[tuple(p) + tuple(ids)] = turn
            out.append(Generation(ids, [-0.5] * len(ids), finish))
        return out

    def _turn(self, task: _Task, p: list[int]) -> int:
        """How many of its turns the expert has played before this context."""
        if p == task.prompt:
            return 0
        extended = [
            t for k, t in self._served.items() if len(k) < len(p) and tuple(p[: len(k)]) == k
        ]
        if extended:
            return 1 + max(extended)
        text = self.chat.tok.decode(p, skip_special_tokens=False)  # a rebuilt context
        shown = [i + 1 for i, turn in enumerate(task.turns) if turn in text]
        shown += [
            done for done, summary in enumerate(task.summaries) if done and summary.strip() in text
        ]
        if not shown:
            raise ValueError(
                "the scripted expert cannot tell its progress from this context: it shows none of "
                "its turns or summaries"
            )
        return max(shown)
