"""The taskset's tool, an MCP server verifiers starts (`python -m lh_tool_sum.tools`)."""

import verifiers.v1 as vf


class AddToolset(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


if __name__ == "__main__":
    AddToolset.run()
