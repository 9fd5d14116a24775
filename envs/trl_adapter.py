"""A longhorizon tool environment as a TRL `environment_factory`: the same tasks, tools and milestone
rewards inside TRL's `GRPOTrainer` multi-turn tool loop.

    from envs.trl_adapter import trl_environment
    GRPOTrainer(..., environment_factory=trl_environment("tools/calculator-v0", max_turns=4),
                train_dataset=Dataset.from_dict(trl_prompts("tools/calculator-v0", seeds)))

TRL's protocol (trl 1.16, experimental there): the factory makes one instance per rollout; each
public method is a tool, described to the model by its signature and Google-style docstring;
`reset(**row)` is called with the dataset row before generation; `get_reward()` scores the finished
rollout. Here every tool method writes the call as the model would have (`<tool_call>` JSON) and
passes it to the wrapped environment's `step`, so argument checking, error observations, milestones
and the episode's end are the environment's own, and the tool results the model reads are the
strings our agent loop would show it. The tools' schemas are the environment's `ToolSpec`s, so a
template renders the same tool list as our loop's prompt (tested).

What differs, and stays TRL's: TRL ends a rollout at the first turn without a tool call (our loop
answers it with a reminder and goes on, up to `max_turns`), cuts it after
`max_tool_calling_iterations` rounds of calls, and calls the tools of one turn one by one (one
`step` each here, so a turn with two calls counts as two of the environment's turns). A call after
the episode ended returns an error string and pays nothing.

Not covered: sandboxed environments whose `step` needs a host (it works, one sandbox per instance,
but TRL never closes the instances), images, agent programs (they are not tool environments).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import envs
from envs.tool_calls import format_tool_call

_TYPES = {
    "string": str,
    "number": float,
    "integer": int,
    "boolean": bool,
    "array": list,
    "object": dict,
}


def _tool_method(spec) -> Callable:
    """A method `spec.name(self, **arguments) -> str` whose signature and docstring give back the
    spec's JSON schema through transformers' `get_json_schema` (what TRL renders the tools from)."""
    props = (spec.parameters or {}).get("properties", {})
    required = set((spec.parameters or {}).get("required", props))

    def method(self, **arguments):
        return self._call(spec.name, arguments)

    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations = {}
    for name, s in props.items():
        kind = _TYPES.get(s.get("type"), str)
        default = inspect.Parameter.empty if name in required else None
        params.append(
            inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, annotation=kind, default=default
            )
        )
        annotations[name] = kind
    annotations["return"] = str
    method.__name__ = method.__qualname__ = spec.name
    method.__signature__ = inspect.Signature(params, return_annotation=str)
    method.__annotations__ = annotations
    args = "".join(f"    {name}: {s.get('description') or name}\n" for name, s in props.items())
    method.__doc__ = spec.description + (f"\n\nArgs:\n{args}" if args else "")
    return method


def trl_environment(env_id: str, **env_kwargs) -> type:
    """A class to pass as TRL's `environment_factory`: each instance wraps `envs.make(env_id, **env_kwargs)`.
    Its `reset(seed=...)` takes the dataset row's `seed` (see `trl_prompts`)."""
    cls = envs.env_class(env_id)
    specs = list(cls.tools)

    def __init__(self):
        self.env = envs.make(env_id, **env_kwargs)
        self.reward, self.done = 0.0, True

    def reset(self, seed: int, **_row) -> None:
        self.env.reset(seed=int(seed))
        self.reward, self.done = 0.0, False
        return None  # the task is already the prompt's user message (trl_prompts)

    def _call(self, name: str, arguments: dict) -> str:
        if self.done:
            return "error: the episode is over"
        observation, reward, terminated, truncated, _ = self.env.step(
            format_tool_call(name, **arguments)
        )
        self.reward += reward
        self.done = terminated or truncated
        return observation

    def get_reward(self) -> float:
        return self.reward

    body = {
        "__init__": __init__,
        "reset": reset,
        "_call": _call,
        "get_reward": get_reward,
        "__doc__": f"{env_id} for TRL's GRPOTrainer (envs/trl_adapter.py)",
    }
    body.update({s.name: _tool_method(s) for s in specs})
    return type(cls.__name__ + "ForTRL", (), body)


def trl_prompts(env_id: str, seeds, **env_kwargs) -> dict:
    """Dataset columns for TRL: `prompt` (the task as the user message, as our loop's first prompt
    has it) and `seed` (which `reset` replays the task from)."""
    env = envs.make(env_id, **env_kwargs)
    prompts = [[{"role": "user", "content": env.reset(seed=int(s))[0]}] for s in seeds]
    return {"prompt": prompts, "seed": [int(s) for s in seeds]}
