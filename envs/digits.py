"""`text/digits-v0`: the smallest environment — one turn, no tools, a dense score.

The task asks for a reply made of digits; the reward is the share of the reply's non-space
characters that are digits (0 to 1), paid as the milestone `digits` when it ends. A tiny random
policy starts near 0 and GRPO raises it within minutes on a CPU, which is what it is for: smoke
tests of the whole loop, and the side-by-side benchmark against TRL's GRPOTrainer (whose reward
function is `digit_share`, the same code). It does not test tool use or long horizons.

`expert_slips` makes the scripted expert an imperfect demonstrator: on that share of the tasks
(drawn from the seed) its reply ends with a word, so a policy that imitates it succeeds on the rest
only, and RL, which sees the reward, can go beyond it (the demo protocol's test uses this).
"""

from __future__ import annotations

from envs.base import ToolEnv
from envs.tool_calls import parse_tool_calls
from rewards.milestones import Milestone

PROMPTS = [
    "Reply with a number of at least {n} digits.",
    "Write {n} digits and nothing else.",
    "Give me a number with {n} digits or more.",
]


def digit_share(text: str) -> float:
    """Share of the non-space characters of `text` that are digits (0 when there are none)."""
    chars = [c for c in text if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


class DigitsEnv(ToolEnv):
    tools = []
    milestones = (
        Milestone(
            "digits",
            None,
            "paid when the reply ends: the share of its non-space characters that "
            "are digits (0 to 1)",
        ),
    )
    max_turns = 1

    def __init__(self, expert_slips: float = 0.0):
        super().__init__()
        self.expert_slips = expert_slips

    @classmethod
    def kwargs_problem(cls, kwargs: dict) -> str | None:
        slips = kwargs.get("expert_slips", 0.0)
        if not (
            isinstance(slips, (int, float)) and not isinstance(slips, bool) and 0 <= slips <= 1
        ):
            return f"expert_slips must be a share from 0 to 1, not {slips!r}"
        return None

    @classmethod
    def succeeded(cls, milestones, reward) -> bool:  # a reply of digits only
        return reward >= 1.0 - 1e-9

    def _reset_task(self) -> str:
        rng = self.np_random
        task = PROMPTS[int(rng.integers(len(PROMPTS)))].format(n=int(rng.integers(4, 40)))
        self.slips = bool(rng.random() < self.expert_slips)
        return task

    def tool_functions(self):
        return {}

    def step(self, action: str):
        if self._done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        self._done = True
        self._turn += 1
        score = digit_share(action)
        events = [{"name": "digits", "reward": score}]
        # there are no tools: any call, well formed or not, is an error
        calls, errors = parse_tool_calls(action)
        return (
            "",
            score,
            True,
            False,
            {"messages": [], "milestones": events, "tool_errors": len(calls) + len(errors)},
        )

    def expert_turns(self) -> list[str]:
        return ["1234567890 ok" if self.slips else "1234567890"]
