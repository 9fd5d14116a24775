"""`reasoning/gym-v0`: any reasoning-gym dataset as a multi-step tool task.

reasoning-gym (`reasoning_gym`, installed by `make install`) generates procedural problems (over a
hundred datasets: arithmetic, algebra, logic, puzzles, games) and scores answers with each
dataset's own `score_answer`. Here each episode is one of its problems: the task is its question,
the tools are a `calculator` (the arithmetic of `tools/calculator-v0`, parsed, never `eval`ed) and
`submit(answer)`, and the reward is what reasoning-gym's scorer gives the submitted answer.

Keyword arguments (`env.kwargs`), checked when a run's config loads (`kwargs_problem` builds the
dataset once, so a misspelt dataset or a bad config value stops the run before anything starts):
- `dataset`: a reasoning-gym dataset name (`reasoning_gym.factory.DATASETS`), e.g. `leg_counting`;
- `config`: that dataset's own settings (its config dataclass's fields, e.g. `{min_animals: 2}`);
- `max_turns`: turns before the episode is cut.

Milestones: `solved` (1.0) when the scorer gives full marks; `partial` (the score, below 1) when it
gives part (reasoning-gym scores some answers between 0 and 1). Deterministic given the reset seed:
the seed is the problem's (reasoning-gym draws the problem from it). The scripted expert submits
the dataset's reference answer (for the warm start and `envs check`).
"""

from __future__ import annotations

from envs.base import ToolEnv, ToolFailure, ToolSpec
from envs.calculator import CalculatorEnv, evaluate
from envs.tool_calls import format_tool_call as call
from rewards.milestones import Milestone


def datasets() -> list[str]:
    """reasoning-gym's dataset names."""
    import reasoning_gym

    return sorted(reasoning_gym.factory.DATASETS)


def problem(dataset: str, config: dict, seed: int) -> tuple[object, dict]:
    """(the dataset, its problem for `seed`): a one-problem dataset drawn from the seed."""
    import reasoning_gym

    data = reasoning_gym.create_dataset(dataset, size=1, seed=seed, **config)
    return data, data[0]


class ReasoningGymEnv(ToolEnv):
    tools = [
        CalculatorEnv.tools[0],
        ToolSpec(
            "submit",
            "Submit the final answer, as text; ends the episode.",
            {
                "type": "object",
                "properties": {"answer": {"type": "string"}},
                "required": ["answer"],
            },
        ),
    ]
    milestones = (
        Milestone("solved", 1.0, "reasoning-gym's scorer gave the submitted answer full marks"),
        Milestone("partial", 1.0, "the scorer's partial credit (below 1) for the submitted answer"),
    )

    def __init__(
        self, dataset: str = "leg_counting", config: dict | None = None, max_turns: int = 4
    ):
        super().__init__()
        self.dataset, self.config, self.max_turns = dataset, dict(config or {}), max_turns
        self.data = self.entry = None
        self.problem_seed = 0  # reasoning-gym's seed of the current problem

    @classmethod
    def kwargs_problem(cls, kwargs: dict) -> str | None:
        name, config = kwargs.get("dataset", "leg_counting"), kwargs.get("config") or {}
        try:
            known = datasets()
        except ImportError:
            return "reasoning-gym is not installed (make install installs it)"
        if name not in known:
            import difflib

            near = difflib.get_close_matches(str(name), known, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else f" ({len(known)} datasets)"
            return f"dataset {name!r} is not a reasoning-gym dataset{hint}"
        if not isinstance(config, dict):
            return f"config must be a mapping of {name}'s settings, not {type(config).__name__}"
        try:  # the dataset's own checks of its settings, on one problem
            problem(name, config, 0)
        except Exception as exc:  # noqa: BLE001  (its config's complaint, named)
            return f"config {config!r} for {name}: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        return super().kwargs_problem(kwargs)

    def _reset_task(self) -> str:
        self.problem_seed = int(self.np_random.integers(2**31 - 1))
        self.data, self.entry = problem(self.dataset, self.config, self.problem_seed)
        return (
            f"{self.entry['question']}\n\nUse the calculator for arithmetic if it helps, then "
            "submit your final answer."
        )

    def tool_functions(self):
        return {"calculator": self._calculator, "submit": self._submit}

    def _calculator(self, expression: str) -> str:
        return str(evaluate(expression))

    def _submit(self, answer: str) -> str:
        if not isinstance(answer, str):
            raise ToolFailure("answer must be a string")
        self.finish()
        score = float(self.data.score_answer(answer=answer.strip(), entry=self.entry) or 0.0)
        if score >= 1.0:
            self.reach("solved", 1.0)
            return "correct"
        if score > 0.0:
            self.reach("partial", score)
            return f"partly correct (score {score:.2f})"
        return "incorrect"

    def judge_reference(self) -> str:
        return str(self.entry["answer"])

    def expert_turns(self) -> list[str]:
        return [call("submit", answer=str(self.entry["answer"]))]
