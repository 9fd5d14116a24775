"""A multi-turn verifiers taskset with a tool: the agent adds with `calc_add`, then answers."""

import verifiers.v1 as vf

from lh_tool_sum.tools import AddToolset


class SumData(vf.TaskData):
    answer: int


class SumTask(vf.Task[SumData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return float(str(self.data.answer) in (trace.last_reply or ""))

    @vf.reward(weight=0.5)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(any(node.message.role == "tool" for node in trace.nodes))


class SumConfig(vf.TasksetConfig):
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()
    num_tasks: int = 20


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    @classmethod
    def toolsets(cls, config: SumConfig) -> list[vf.Toolset]:
        return [AddToolset(config.tools)]

    def load(self) -> list[SumTask]:
        return [
            SumTask(
                SumData(idx=i, prompt=f"Use the add tool: what is {i} + 7?", answer=i + 7),
                self.config.task,
            )
            for i in range(self.config.num_tasks)
        ]


__all__ = ["SumTaskset"]
