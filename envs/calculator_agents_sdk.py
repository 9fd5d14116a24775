"""`agents/calculator-agents-sdk-v0`: the calculator task solved by an agent written with the OpenAI
Agents SDK (`openai-agents`), unchanged but for its model: an `OpenAIChatCompletionsModel` on the
episode's session client (envs/agent_program.py).

The SDK runs its own loop (the model's tool calls run the `@function_tool`s below, their results go
back as `tool` messages) until the model answers without a tool call or `max_turns` runs out; the
environment behind the tools pays the milestones. Tracing is off: it would send every run to
OpenAI's servers.
"""

from __future__ import annotations

from envs.agent_program import AgentResult, AgentTask
from envs.calculator import CalculatorEnv
from envs.tool_calls import format_tool_call


async def calculator_agents_sdk(
    task: AgentTask, max_turns: int = 4, max_tokens: int = 64
) -> AgentResult:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.exceptions import MaxTurnsExceeded

    set_tracing_disabled(True)
    env = CalculatorEnv(max_turns=max_turns)
    problem, _ = env.reset(seed=task.seed)
    milestones: list[dict] = []

    def step(name: str, **arguments) -> str:
        obs, *_, info = env.step(format_tool_call(name, **arguments))
        milestones.extend({"name": m["name"], "reward": m["reward"]} for m in info["milestones"])
        return obs

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression with + - * / // % and parentheses."""
        return step("calculator", expression=expression)

    @function_tool
    def submit(answer: float) -> str:
        """Submit the final answer; ends the episode."""
        return step("submit", answer=answer)

    agent = Agent(
        name="calculator",
        instructions=None,
        tools=[calculator, submit],
        model=OpenAIChatCompletionsModel(
            model=task.model, openai_client=task.async_client(max_retries=0)
        ),
        model_settings=ModelSettings(max_tokens=max_tokens),
    )
    try:
        await Runner.run(agent, problem, max_turns=max_turns)
    except MaxTurnsExceeded:
        pass  # out of turns: the episode ends with what it reached
    return AgentResult(milestones=milestones, task=problem)
