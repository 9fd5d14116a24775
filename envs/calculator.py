"""`tools/calculator-v0`: two-step arithmetic word problems solved with a calculator tool.

Each task is `a * b - c` dressed as a word problem, with numbers large enough that the answer is
not guessed. Tools: `calculator(expression)` evaluates arithmetic (parsed with `ast`, never
`eval`), `submit(answer)` ends the episode. Solving needs at least two tool calls.

Milestones (sparse: the only rewards):
- `product` (0.25): a calculator result equals `a * b`, the first intermediate value;
- `solved` (1.0): the submitted answer is right.

Deterministic given the reset seed. No sandbox: the calculator runs no model-written code.
"""

from __future__ import annotations

import ast
import operator
import time

from envs.base import ToolEnv, ToolFailure, ToolSpec
from envs.tool_calls import format_tool_call as call
from rewards.milestones import Milestone

_STORIES = [
    "A warehouse holds {a} crates with {b} bottles in each. {c} bottles are shipped out. "
    "How many bottles are left?",
    "A library has {a} shelves of {b} books each. {c} books are lent out. "
    "How many books remain on the shelves?",
    "A farm plants {a} rows of {b} trees. {c} trees are sold. How many trees does the farm keep?",
]

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_MAX_ABS = 10**15  # bounds hostile inputs like 9*9*9*... before they get expensive


def evaluate(expression: str) -> int | float:
    """Evaluate `+ - * / // %`, parentheses and numbers; anything else is a `ToolFailure`."""
    if not isinstance(expression, str) or len(expression) > 200:
        raise ToolFailure("expression must be a string of at most 200 characters")
    try:
        # " 2 * 3" is what a person would accept too
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolFailure(f"cannot parse expression {expression!r}") from None

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            try:
                v = _OPS[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ToolFailure("division by zero") from None
            if abs(v) > _MAX_ABS:
                raise ToolFailure("result too large")
            return v
        raise ToolFailure(
            f"unsupported syntax in {expression!r}: only numbers and + - * / // % ( )"
        )

    value = ev(tree)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value


class CalculatorEnv(ToolEnv):
    tools = [
        ToolSpec(
            "calculator",
            "Evaluate an arithmetic expression with + - * / // % and parentheses.",
            {
                "type": "object",
                "properties": {
                    "expression": {"type": "string", "description": "e.g. 12 * (3 + 4)"}
                },
                "required": ["expression"],
            },
        ),
        ToolSpec(
            "submit",
            "Submit the final answer; ends the episode.",
            {
                "type": "object",
                "properties": {"answer": {"type": "number"}},
                "required": ["answer"],
            },
        ),
    ]

    milestones = (
        Milestone(
            "product", 0.25, "a calculator result equals a * b, the first intermediate value"
        ),
        Milestone("solved", 1.0, "the submitted answer is right"),
    )

    def __init__(self, max_turns: int = 4, step_latency_s: float = 0.0):
        super().__init__()
        self.max_turns = max_turns
        # A calculator answers in microseconds; real tool backends (a remote sandbox, a browser, a
        # test suite) take seconds. This stands in for them where that matters: benchmarking
        # asynchronous rollouts against synchronous ones.
        self.step_latency_s = float(step_latency_s)

    def step(self, action: str):
        if self.step_latency_s > 0:
            time.sleep(self.step_latency_s)
        return super().step(action)

    def _reset_task(self) -> str:
        rng = self.np_random
        self.a = int(rng.integers(12, 100))
        self.b = int(rng.integers(12, 100))
        self.c = int(rng.integers(100, self.a * self.b))
        self.answer = self.a * self.b - self.c
        story = _STORIES[int(rng.integers(len(_STORIES)))]
        self.task = story.format(a=self.a, b=self.b, c=self.c)
        return self.task + " Use the calculator, then submit the answer."

    def tool_functions(self):
        return {"calculator": self._calculator, "submit": self._submit}

    def _calculator(self, expression: str) -> str:
        value = evaluate(expression)
        if value == self.a * self.b:
            self.reach("product", 0.25, self._events)
        return str(value)

    def _submit(self, answer) -> str:
        self.finish()
        try:
            ok = float(answer) == self.answer
        except (TypeError, ValueError):
            ok = False
        if ok:
            self.reach("solved", 1.0, self._events)
            return "correct"
        return "incorrect"

    def expert_turns(self) -> list[str]:
        """A scripted expert's assistant turns that solve the current task (tests, demonstrations)."""

        product = self.a * self.b
        return [
            f"First {self.a} * {self.b}.\n" + call("calculator", expression=f"{self.a} * {self.b}"),
            f"Then subtract {self.c}.\n" + call("calculator", expression=f"{product} - {self.c}"),
            call("submit", answer=self.answer),
        ]
