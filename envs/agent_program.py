"""Agent programs as environments: train an agent that already exists, written against the OpenAI
chat API, without rewriting it as a `ToolEnv`.

An agent program is a plain function, sync or async:

    def agent(task: AgentTask, **kwargs) -> float | AgentResult | dict

It gets one episode's `AgentTask` — its seed, and the OpenAI `base_url` of a session on the
rollout worker's engine (rollout/openai_api.py), from which `task.client()` makes an `openai.OpenAI`
client — runs its agent however it likes, and returns the episode's reward, or an `AgentResult`
with the milestones it reached (names and rewards, as a `ToolEnv` pays them) and the task text for
the record. It is registered like every environment (`envs.register(id, "module:function")`, or the
`longhorizon.envs` entry-point group) and checked the same way: `config_problem` binds its kwargs.

Every call the agent makes through the session is recorded with its exact tokens; the rollout
worker turns them into the episode's trajectory (rollout/program_episodes.py).

An agent that runs as its own process (another language, its own environment) is an external
command: envs/agent_command.py (`agents/command-v0`) hands it the session through OPENAI_BASE_URL.

Not covered here: per-call milestones (an agent program's milestones count at its last call).
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field


@dataclass(frozen=True)
class AgentTask:
    """What an agent program is given for one episode."""

    episode_id: str
    seed: int
    """The task's seed: the same seed must give the same task."""
    base_url: str
    """The session's OpenAI base URL (`.../sessions/EPISODE_ID/v1`)."""
    model: str
    """The model name the endpoint answers to."""
    api_key: str = "unused"

    def client(self, **kwargs):
        """An `openai.OpenAI` client for this session."""
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)

    def async_client(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)


@dataclass
class AgentResult:
    """What an agent program returns (a bare number is `AgentResult(reward=...)`)."""

    milestones: list[dict] = field(default_factory=list)
    """Milestones reached, `{"name", "reward"}` each (paid once per name, like a ToolEnv's)."""
    reward: float | None = None
    """The episode's reward; None: the sum of the milestones' rewards."""
    task: str = ""
    """The task as the agent posed it, for inspect and the viewer."""

    def total(self) -> float:
        return (
            float(sum(m["reward"] for m in self.milestones))
            if self.reward is None
            else float(self.reward)
        )


def is_agent_program(obj) -> bool:
    """A registered entry point that is a function (an agent program), not a `ToolEnv` class."""
    return callable(obj) and not inspect.isclass(obj)


def result_of(value) -> AgentResult:
    """An agent program's return value as an `AgentResult`; anything else is a `TypeError` naming it."""
    if isinstance(value, AgentResult):
        out = value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        out = AgentResult(reward=float(value))
    elif isinstance(value, dict):
        unknown = set(value) - {"milestones", "reward", "task"}
        if unknown:
            raise TypeError(
                f"an agent program's dict result takes milestones, reward, task; not {sorted(unknown)}"
            )
        out = AgentResult(**value)
    else:
        raise TypeError(
            f"an agent program returns a number, an AgentResult or a dict, not {type(value).__name__}"
        )
    seen = set()
    for m in out.milestones:
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("name"), str)
            or isinstance(m.get("reward"), bool)
            or not isinstance(m.get("reward"), (int, float))
        ):
            raise TypeError(f"a milestone is {{'name': str, 'reward': number}}, not {m!r}")
        if m["name"] in seen:
            raise TypeError(
                f"milestone {m['name']!r} reached twice (each is paid once per episode)"
            )
        seen.add(m["name"])
    total = out.total()
    if total != total:
        raise TypeError("an agent program's reward is NaN")
    return out


def run_program(program, task: AgentTask, kwargs: dict) -> AgentResult:
    """Run one episode of `program` (a coroutine function runs in its own event loop)."""
    value = program(task, **kwargs)
    if inspect.isawaitable(value):

        async def wait():
            return await value

        value = asyncio.run(wait())
    return result_of(value)
