"""The environment API: a Gymnasium `Env` whose actions are model turns and whose tools the chat
template can render.

- `reset(seed, options)` -> `(observation, info: ResetInfo)`; the observation is the task text.
- `step(action)` -> `(observation, reward, terminated, truncated, info: StepInfo)`; the action is
  the model's whole turn (text with zero or more `<tool_call>` blocks).

`ResetInfo` and `StepInfo` below are the contract between an environment and the agent loop
(rollout/agent_loop.py): what each key means is said there, once.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypedDict

import gymnasium as gym

from envs.sandbox import Limits, SandboxError, backend_status, open_sandbox, options_problem
from envs.tool_calls import ToolCall, ToolCallError, argument_problem, parse_tool_calls
from rewards.milestones import Milestone, MilestoneLedger, solved, step_reward


class _ResetInfoRequired(TypedDict):
    tools: list[dict]
    """The tools, as OpenAI function schemas: the chat template renders them into the prompt."""


class ResetInfo(_ResetInfoRequired, total=False):
    """What `reset` tells the agent loop beside the task text (`tools` always; the rest may be absent)."""

    images: list
    """Images the task shows (H×W×3 uint8 arrays), for environments that show them."""
    infra_error: str
    """Set by an EnvWorker that could not build the environment: the episode ends as an infra error."""


class _StepInfoRequired(TypedDict):
    messages: list[dict]
    """The chat messages the observation adds (role "tool" per tool result, or a "user" nudge), so
    the agent loop renders them with the chat template."""
    milestones: list[dict]
    """Milestone events reached this step, each `{"name", "reward"}`; the step's reward is their
    sum (sparse: nothing is paid between milestones)."""
    tool_errors: int
    """How many tool calls in this turn were malformed or failed."""


class StepInfo(_StepInfoRequired, total=False):
    """What `step` tells the agent loop beside the observation and the reward (the first three
    keys always; the rest may be absent). `envs check` holds an environment to it."""

    failures: list[str]
    """What went wrong in this turn, one entry per problem (rollout.trajectory.TURN_FAILURES)."""
    infra_error: str
    """Set when the environment's own machinery failed (a sandbox that could not start, an engine
    that went away): not the policy's fault, so the learner keeps the episode out of its
    statistics. A tool raises `SandboxError` (or `InfraError`) for that."""
    sandbox_events: list[str]
    """Limits hit and clean-ups done by sandboxed tools this step."""
    images: list
    """Images the observation adds (H×W×3 uint8 arrays), for environments that show them."""


@dataclass(frozen=True)
class ToolSpec:
    """A tool as the chat template shows it (OpenAI function format)."""

    name: str
    description: str
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})

    def to_openai(self) -> dict:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


class AnyText(gym.spaces.Text):
    """Any string up to `max_length` characters, empty included: a task text or a tool-call turn
    (Gymnasium's `Text` admits only its charset, by default letters and digits, so `check_env` would
    find every real observation outside the declared space). Samples stay letters and digits."""

    def __init__(self, max_length: int = 1 << 20):
        super().__init__(max_length, min_length=0)

    def contains(self, x) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"AnyText({self.max_length})"


class ToolEnv(gym.Env):
    """Base class: subclasses set `tools` and `milestones`, and define `_reset_task()` (the task
    text of a new episode, drawn from `self.np_random`), `tool_functions()` and `expert_turns()`.

    A tool function receives the parsed arguments as keywords, once they match its `ToolSpec`'s
    JSON schema (`check_arguments`), and returns the text result. It may
    raise `ToolFailure` for a clear error observation; any other exception is also turned into an
    error observation (and counted, and recorded as the turn's `tool_error`), never raised out of
    `step`. It pays a milestone with `self.reach(name, reward)` and ends the episode with
    `self.finish()`.
    """

    metadata = {"render_modes": []}
    tools: list[ToolSpec] = []
    check_arguments: bool = True
    """Check each call's arguments against its tool's JSON schema before the tool runs (a missing,
    unknown or mistyped argument is answered with the tool's signature, a `tool_error`). Replay turns
    it off for records written before the check existed, whose observations came without it."""
    milestones: tuple[Milestone, ...] = ()
    """The milestones `reach` may pay, declared for `envs show` and checked by `envs check`."""
    max_turns: int = 8

    def __init__(self):
        self.observation_space = AnyText()
        self.action_space = AnyText()
        self._turn = 0
        self._done = False
        self._ledger = MilestoneLedger()
        self._events: list[dict] = []
        self._sandbox_events: list[str] = []
        self._images: list = []
        self._failures: list[str] = []

    @classmethod
    def kwargs_problem(cls, kwargs: dict) -> str | None:
        """Why these constructor arguments' values cannot work, or None. `envs.config_problem` asks
        (after checking the names against the signature), so a run stops when its config loads,
        not in every episode. Subclasses with arguments of their own extend it."""
        turns = kwargs.get("max_turns", 1)
        if not (isinstance(turns, int) and not isinstance(turns, bool) and turns >= 1):
            return f"max_turns must be an integer >= 1, not {turns!r}"
        return None

    # --- subclass hooks ---
    def _reset_task(self) -> str:
        """The new episode's task text (the first observation), drawn from `self.np_random`, which
        `reset(seed=...)` has just seeded: the same seed must give the same task."""
        raise NotImplementedError

    def tool_functions(self) -> dict[str, Callable[..., str]]:
        raise NotImplementedError

    def expert_summary(self, done: int) -> str:
        """What the scripted expert writes at a compaction turn (rollout/context.py) after its first
        `done` turns: everything the rest of its turns need. The default names its progress and the
        next call; an environment whose later turns depend on what earlier ones found says that.
        Needs `expert_turns()`, the scripted expert's turns for the current task."""
        turns = self.expert_turns()
        if done >= len(turns):
            return f"I have made all {len(turns)} tool calls of my plan."
        from envs.tool_calls import parse_tool_calls

        calls, _ = parse_tool_calls(turns[done])
        nxt = f" Next I call {calls[0].name}." if calls else ""
        return f"I have made {done} of the {len(turns)} tool calls of my plan.{nxt}"

    def judge_reference(self) -> str:
        """The answer a good episode of the current task carries, for judge rubric parts
        (rewards/judge.py) to compare with; "" (the default): the environment has none."""
        return ""

    # --- milestones ---
    def reach(self, name: str, reward: float, events: list[dict] | None = None) -> None:
        """Record milestone `name` for this step (paid once per episode: rewards/milestones.py)."""
        self._ledger.reach(name, reward, self._events if events is None else events)

    def show_image(self, image) -> None:
        """Attach an image (H×W×3 uint8 array) to the current observation."""
        self._images.append(image)

    def record_sandbox(self, result) -> None:
        """Keep a sandboxed call's notable events (limits hit) for `info["sandbox_events"]`."""
        if result.resource:
            self._sandbox_events.append(f"{result.backend}: {result.resource} limit reached")
            self._failures.append("sandbox_limit")
        self._sandbox_events += [f"{result.backend}: {e}" for e in result.events]

    # --- gym API ---
    def reset(
        self, *, seed: int | None = None, options: dict | None = None
    ) -> tuple[str, ResetInfo]:
        super().reset(seed=seed)
        self._turn = 0
        self._done = False
        self._ledger = MilestoneLedger()
        self._events, self._sandbox_events, self._images, self._failures = [], [], [], []
        task = self._reset_task()
        info: ResetInfo = {"tools": [t.to_openai() for t in self.tools]}
        if self._images:
            info["images"], self._images = self._images, []
        return task, info

    def step(self, action: str) -> tuple[str, float, bool, bool, StepInfo]:
        if self._done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        # what a model wrote, as bytes: undecodable bytes become U+FFFD
        if isinstance(action, (bytes, bytearray)):
            action = bytes(action).decode("utf-8", errors="replace")
        if not isinstance(action, str):
            raise TypeError(
                f"an action is the text of a model turn (str), got {type(action).__name__}"
            )
        self._turn += 1
        self._events, self._sandbox_events, self._images, self._failures = [], [], [], []
        infra_error = ""
        calls, errors = parse_tool_calls(action)
        messages: list[dict[str, Any]] = []
        for err in errors:
            messages.append(
                {"role": "tool", "content": f"error: malformed tool call: {err.message}"}
            )
            self._failures.append("malformed_call")
        functions = self.tool_functions()
        specs = {t.name: t for t in self.tools}
        for call in calls:
            fn = functions.get(call.name)
            spec = specs.get(call.name)
            wrong = (
                argument_problem(call.name, spec.parameters, call.arguments)
                if spec and self.check_arguments
                else None
            )
            if fn is None:
                self._failures.append("unknown_tool")
                result = f"error: unknown tool {call.name!r}; available: {', '.join(functions)}"
            elif wrong:  # the tool never sees arguments its schema does not admit
                self._failures.append("tool_error")
                result = f"error: {call.name}: {wrong}"
            else:
                try:
                    result = fn(**call.arguments)
                except ToolFailure as exc:
                    self._failures.append("tool_error")
                    result = f"error: {exc}"
                except (
                    SandboxError,
                    InfraError,
                ) as exc:  # the environment's failure, not the policy's
                    infra_error = f"{call.name}: {exc}"
                    result = f"error: the tool could not run ({exc})"
                except Exception as exc:  # model-written arguments must never crash the worker
                    self._failures.append("tool_error")
                    result = f"error: {call.name} failed: {type(exc).__name__}: {exc}"
            messages.append({"role": "tool", "content": str(result)})
            if self._done or infra_error:
                break
        if not calls and not errors:
            messages.append(
                {"role": "user", "content": "No tool call found. Call one of the tools."}
            )
            self._failures.append("no_tool_call")
        terminated = self._done
        truncated = not terminated and self._turn >= self.max_turns
        self._done = terminated or truncated
        reward = step_reward(self._events)
        observation = "\n".join(m["content"] for m in messages)
        # what went wrong in this turn, one entry per problem (rollout.trajectory.TURN_FAILURES); the
        # tool errors are the calls that went wrong (not a turn without one, not a limit a call hit)
        n_errors = sum(
            f in ("malformed_call", "unknown_tool", "tool_error") for f in self._failures
        )
        info: StepInfo = {
            "messages": messages,
            "milestones": list(self._events),
            "tool_errors": n_errors,
            "failures": list(self._failures),
        }
        if infra_error:
            info["infra_error"] = infra_error
        if self._sandbox_events:
            info["sandbox_events"] = list(self._sandbox_events)
        if self._images:
            info["images"] = list(self._images)
        return observation, reward, terminated, truncated, info

    def finish(self) -> None:
        """Called by a tool that ends the episode (e.g. `submit`)."""
        self._done = True

    @classmethod
    def succeeded(cls, milestones: list[dict], reward: float) -> bool:
        """Whether an episode that reached `milestones` (and earned `reward`) solved its task, for
        evaluation's success rate. Default: it reached the milestone `solved`."""
        return solved(milestones)


class SandboxedEnv(ToolEnv):
    """A ToolEnv whose tools run model-written code: each episode gets a fresh sandbox and workspace
    (`new_sandbox()` in `_reset_task`), closed at the next reset or by `close()`."""

    def __init__(
        self, max_turns: int, backend: str = "bwrap", timeout_s: float = 10.0, **sandbox_options
    ):
        super().__init__()
        self.max_turns = max_turns
        self.backend, self.sandbox_options = backend, sandbox_options
        self.limits = Limits.within(timeout_s)
        self.sandbox = None

    @classmethod
    def kwargs_problem(cls, kwargs: dict) -> str | None:
        """Why these constructor arguments cannot work, or None (`envs.config_problem` asks, so a
        mistyped sandbox option stops a run when its config loads, not in every episode's reset)."""
        problem = super().kwargs_problem(kwargs)
        if problem:
            return problem
        named = set(inspect.signature(cls).parameters) - {"sandbox_options"}
        if "timeout_s" in kwargs and not (
            isinstance(kwargs["timeout_s"], (int, float)) and kwargs["timeout_s"] > 0
        ):
            return f"timeout_s must be a number of seconds > 0, not {kwargs['timeout_s']!r}"
        problem = options_problem(
            kwargs.get("backend", "bwrap"), {k: v for k, v in kwargs.items() if k not in named}
        )
        return f"{problem} (the environment's own: {', '.join(sorted(named))})" if problem else None

    @classmethod
    def host_problem(cls, kwargs: dict) -> str | None:
        """Why this machine cannot run the sandbox these arguments ask for (no bwrap, no Docker
        engine), or None. Only for runs whose environments run here (a local run)."""
        return backend_status(kwargs.get("backend", "bwrap"), kwargs.get("docker_host"))

    def new_sandbox(self):
        self.close()
        self.sandbox = open_sandbox(self.backend, limits=self.limits, **self.sandbox_options)
        return self.sandbox

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None


class ToolFailure(Exception):
    """A tool's clear, expected failure; its message becomes the observation."""


class InfraError(RuntimeError):
    """The environment's machinery failed (not the policy): the episode ends as an infra error."""


__all__ = [
    "ToolEnv",
    "SandboxedEnv",
    "ToolSpec",
    "ToolFailure",
    "InfraError",
    "ToolCall",
    "ToolCallError",
]
