"""An engine that plays the environments' scripted experts, as token ids.

Every built-in environment has a scripted expert (`env.expert_turns()`, the turns that solve the
task of its current seed). `ExpertEngine` serves them through the engine protocol, so the agent
loop records expert episodes exactly as it records the policy's (the same chat format, prompt,
observation and loss-mask bookkeeping): what the warm start (rl/sft.py) trains on is token for
token what rollouts look like. Tests use it to drive the loop down paths a random model never
reaches (rewards, milestones, solved tasks).

Each context is matched to its task by its prompt, and its turn by what it extends: a context is
the prompt (turn 0) or an earlier served context plus the turn served for it plus an observation
(one turn further). Seeds that draw the same prompt can see different observations (the shell
task's prompt names only the log level; its files vary), so neither the prompt nor the context's
length alone says which turn comes next.
"""

from __future__ import annotations

import envs
from rollout.engines.base import Generation


class ExpertEngine:
    version = 0

    def __init__(self, chat, seeds, env_id: str = "tools/calculator-v0", turns: list[str] | None = None,
                 **env_kwargs):
        self.chat = chat
        self.tasks = []
        for s in seeds:
            env = envs.make(env_id, **env_kwargs)
            obs, info = env.reset(seed=s)
            prompt = chat.prompt_ids([{"role": "user", "content": obs}], info["tools"])
            self.tasks.append((prompt, turns or env.expert_turns()))
            env.close()
        self._served: dict[tuple, int] = {}  # a served context followed by its reply -> that reply's turn

    def generate(self, prompts, *, max_tokens, temperature=1.0, top_p=1.0, stop_token_ids=None, seeds=None,
                 min_tokens=0):
        out = []
        for p in prompts:
            prompt, turns = next(t for t in self.tasks if p[: len(t[0])] == t[0])
            turn = 0 if len(p) == len(prompt) else 1 + max(
                (t for k, t in self._served.items() if len(k) < len(p) and tuple(p[: len(k)]) == k), default=-1)
            if turn >= len(turns):
                raise ValueError(f"the scripted expert has {len(turns)} turns; asked for turn {turn + 1}")
            ids = self.chat.encode(turns[turn]) + [self.chat.eot_id]
            self._served[tuple(p) + tuple(ids)] = turn
            out.append(Generation(ids, [-0.5] * len(ids), "stop"))
        return out
