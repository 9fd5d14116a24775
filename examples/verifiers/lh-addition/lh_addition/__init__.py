"""A single-turn verifiers taskset, written with verifiers' own classes: what is a + b?

Two reward functions: `correct` (the reply's last number is the sum) and `number_only` (0.25 more
when the reply is that number and nothing else).
"""

import re

import verifiers.v1 as vf


class AdditionData(vf.TaskData):
    answer: int


class AdditionTask(vf.Task[AdditionData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply or "")
        return float(bool(numbers) and numbers[-1] == str(self.data.answer))

    @vf.reward(weight=0.25)
    async def number_only(self, trace: vf.Trace) -> float:
        return float((trace.last_reply or "").strip() == str(self.data.answer))


class AdditionConfig(vf.TasksetConfig):
    num_tasks: int = 20


class AdditionTaskset(vf.Taskset[AdditionTask, AdditionConfig]):
    def load(self) -> list[AdditionTask]:
        return [
            AdditionTask(
                AdditionData(
                    idx=i,
                    prompt=f"What is {i} + {i + 3}? Reply with the number only.",
                    answer=2 * i + 3,
                ),
                self.config.task,
            )
            for i in range(self.config.num_tasks)
        ]


__all__ = ["AdditionTaskset"]
