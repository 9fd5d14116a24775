"""`agents/calculator-openai-v0`: the calculator task solved by an agent written with the official
`openai` client and its tool-calling API, as an agent program (envs/agent_program.py).

This is what a user's existing agent looks like: it poses the task, offers its tools through
`tools=`, runs each `tool_calls` entry itself and sends the results back as `tool` messages, until
it submits or runs out of turns. The task, the tools and the milestones are `tools/calculator-v0`'s
(the agent drives that environment), so a run on this id is comparable with one on the environment.
"""

from __future__ import annotations

import json

from envs.agent_program import AgentResult, AgentTask
from envs.calculator import CalculatorEnv
from envs.tool_calls import format_tool_call


def calculator_agent(task: AgentTask, max_turns: int = 4, max_tokens: int = 64) -> AgentResult:
    env = CalculatorEnv(max_turns=max_turns)
    problem, info = env.reset(seed=task.seed)
    client = task.client(max_retries=0)
    messages: list[dict] = [{"role": "user", "content": problem}]
    milestones: list[dict] = []
    for _ in range(max_turns):
        reply = (
            client.chat.completions.create(
                model=task.model, messages=messages, tools=info["tools"], max_tokens=max_tokens
            )
            .choices[0]
            .message
        )
        sent = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            sent["tool_calls"] = [tc.model_dump() for tc in reply.tool_calls]
        messages.append(sent)
        if not reply.tool_calls:
            messages.append(
                {"role": "user", "content": "No tool call found. Call one of the tools."}
            )
            continue
        ended = False
        for tc in reply.tool_calls:
            try:
                arguments = json.loads(tc.function.arguments)
            except ValueError:
                arguments = {}
            # the environment checks the call as it would a model's text, and answers it
            obs, _, terminated, truncated, step = env.step(
                format_tool_call(
                    tc.function.name, **(arguments if isinstance(arguments, dict) else {})
                )
            )
            milestones += [{"name": m["name"], "reward": m["reward"]} for m in step["milestones"]]
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": obs})
            ended = terminated or truncated
            if ended:
                break
        if ended:
            break
    return AgentResult(milestones=milestones, task=problem)
