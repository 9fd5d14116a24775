"""The calculator agent (envs/calculator_agent.py) as a program of its own, the way an external
agent command runs (envs/agent_command.py): it reads its session from OPENAI_BASE_URL,
OPENAI_API_KEY and OPENAI_MODEL and its task from LONGHORIZON_SEED, and prints its result as one
JSON line.

    OPENAI_BASE_URL=... OPENAI_MODEL=... LONGHORIZON_SEED=3 python -m envs.calculator_command
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from envs.agent_program import AgentTask
from envs.calculator_agent import calculator_agent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    env = os.environ
    task = AgentTask(
        env.get("LONGHORIZON_EPISODE_ID", "cli"),
        int(env["LONGHORIZON_SEED"]),
        env["OPENAI_BASE_URL"],
        env.get("OPENAI_MODEL", "policy"),
        env.get("OPENAI_API_KEY", "unused"),
    )
    result = calculator_agent(task, max_turns=args.max_turns, max_tokens=args.max_tokens)
    print(json.dumps(dataclasses.asdict(result)))


if __name__ == "__main__":
    main()
