"""An engine that plays the environments' scripted experts, as token ids.

Every built-in environment has a scripted expert (`env.expert_turns()`, the turns that solve the
task of its current seed). `ExpertEngine` serves them through the engine protocol, so the agent
loop records expert episodes exactly as it records the policy's (the same chat format, prompt,
observation and loss-mask bookkeeping): what the warm start (rl/sft.py) trains on is token for
token what rollouts look like. Tests use it to drive the loop down paths a random model never
reaches (rewards, milestones, solved tasks).

Each context is matched to its task by its prompt, so the tasks' prompts must differ (distinct
seeds), and every episode of a task is served its turns in order.
"""

from __future__ import annotations

import envs
from rollout.vllm_engine import Generation


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
            self.tasks.append((prompt, turns or env.expert_turns(), [0]))
            env.close()

    def generate(self, prompts, *, max_tokens, temperature=1.0, top_p=1.0, stop_token_ids=None, seeds=None,
                 min_tokens=0):
        out = []
        for p in prompts:
            _, turns, served = next(t for t in self.tasks if p[: len(t[0])] == t[0])
            ids = self.chat.encode(turns[served[0]]) + [self.chat.eot_id]
            served[0] += 1
            out.append(Generation(ids, [-0.5] * len(ids), "stop"))
        return out
