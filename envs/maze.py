"""`vision/maze-v0`: walk a grid maze shown as an image, with waypoints on the way to the exit.

The maze (`size`×`size` cells, a perfect maze carved from the seed) is shown after every turn as an
RGB image in `info["images"]` (walls black, visited cells grey, waypoints blue, the exit green, the
walker red; `cell_px` pixels a cell) and, for text-only policies, as the walker's position and open
directions. Tools: `move(direction)` with up/down/left/right; several moves per turn are allowed.

Milestones (sparse): `waypoint_1` and `waypoint_2` (0.25 each; cells one and two thirds along the
shortest path, paid when stepped on) and `exit` (0.5, ends the episode).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from envs.base import ToolEnv, ToolFailure, ToolSpec
from envs.tool_calls import format_tool_call as call
from rewards.milestones import Milestone

MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


class MazeEnv(ToolEnv):
    tools = [
        ToolSpec(
            "move",
            "Move one cell: up, down, left or right.",
            {
                "type": "object",
                "properties": {"direction": {"type": "string", "enum": list(MOVES)}},
                "required": ["direction"],
            },
        ),
    ]

    @classmethod
    def succeeded(cls, milestones, reward) -> bool:
        return any(m["name"] == "exit" for m in milestones)

    milestones = (
        Milestone(
            "waypoint_*",
            0.25,
            "stepped on the cell one (waypoint_1) or two (waypoint_2) thirds along the "
            "shortest path",
        ),
        Milestone("exit", 0.5, "reached the exit (ends the episode)"),
    )

    def __init__(self, size: int = 6, cell_px: int = 8, max_turns: int = 12):
        super().__init__()
        if not 2 <= size <= 64:
            raise ValueError("size must be in [2, 64]")
        self.size, self.cell_px, self.max_turns = size, cell_px, max_turns

    def _reset_task(self) -> str:
        rng, n = self.np_random, self.size
        self.open: dict[tuple, set] = {(r, c): set() for r in range(n) for c in range(n)}
        seen, stack = {(0, 0)}, [(0, 0)]
        while stack:  # randomized depth-first carving: one path between any two cells
            cell = stack[-1]
            nbrs = [
                (d, (cell[0] + dr, cell[1] + dc))
                for d, (dr, dc) in MOVES.items()
                if (cell[0] + dr, cell[1] + dc) in self.open
                and (cell[0] + dr, cell[1] + dc) not in seen
            ]
            if not nbrs:
                stack.pop()
                continue
            d, nxt = nbrs[int(rng.integers(len(nbrs)))]
            self.open[cell].add(nxt)
            self.open[nxt].add(cell)
            seen.add(nxt)
            stack.append(nxt)
        self.pos, self.exit = (0, 0), (n - 1, n - 1)
        path = self.shortest_path(self.pos, self.exit)
        self.waypoints = [path[len(path) // 3], path[2 * len(path) // 3]]
        self.visited = {self.pos}
        self.show_image(self.render())
        return (
            f"You are in a {n}x{n} maze at the top-left cell (row 0, column 0); the exit is the bottom-right "
            f"cell. Blue cells are waypoints. Move with the move tool. {self._where()}"
        )

    def shortest_path(self, start, goal) -> list[tuple]:
        prev, queue = {start: None}, deque([start])
        while queue:
            cell = queue.popleft()
            for nxt in self.open[cell]:
                if nxt not in prev:
                    prev[nxt] = cell
                    queue.append(nxt)
        path, cell = [], goal
        while cell is not None:
            path.append(cell)
            cell = prev[cell]
        return path[::-1]

    def _where(self) -> str:
        dirs = [
            d
            for d, (dr, dc) in MOVES.items()
            if (self.pos[0] + dr, self.pos[1] + dc) in self.open[self.pos]
        ]
        return f"Position (row {self.pos[0]}, column {self.pos[1]}); open: {', '.join(dirs)}."

    def render(self) -> np.ndarray:
        n, p = self.size, self.cell_px
        img = np.zeros((n * p + 1, n * p + 1, 3), dtype=np.uint8)
        for (r, c), nbrs in self.open.items():
            color = (255, 255, 255)
            if (r, c) in self.visited:
                color = (200, 200, 200)
            if (r, c) in self.waypoints:
                color = (60, 90, 255)
            if (r, c) == self.exit:
                color = (40, 200, 60)
            if (r, c) == self.pos:
                color = (230, 30, 30)
            img[r * p + 1 : (r + 1) * p, c * p + 1 : (c + 1) * p] = color
            if (r + 1, c) in nbrs:  # knock the wall down between open neighbours
                img[(r + 1) * p, c * p + 1 : (c + 1) * p] = 255
            if (r, c + 1) in nbrs:
                img[r * p + 1 : (r + 1) * p, (c + 1) * p] = 255
        return img

    def tool_functions(self):
        return {"move": self._move}

    def _move(self, direction: str) -> str:
        if direction not in MOVES:
            raise ToolFailure(f"direction must be one of {', '.join(MOVES)}")
        dr, dc = MOVES[direction]
        nxt = (self.pos[0] + dr, self.pos[1] + dc)
        if nxt not in self.open[self.pos]:
            return f"blocked. {self._where()}"
        self.pos = nxt
        self.visited.add(nxt)
        for i, w in enumerate(self.waypoints):
            if nxt == w:
                self.reach(f"waypoint_{i + 1}", 0.25, self._events)
        if nxt == self.exit:
            self.reach("exit", 0.5, self._events)
            self.finish()
        # the picture of this turn's final position replaces the previous ones
        self._images[:] = [self.render()]
        return f"moved {direction}. " + (
            "You reached the exit." if nxt == self.exit else self._where()
        )

    def expert_turns(self) -> list[str]:
        path = self.shortest_path(self.pos, self.exit)
        steps = [
            next(d for d, (dr, dc) in MOVES.items() if (a[0] + dr, a[1] + dc) == b)
            for a, b in zip(path, path[1:])
        ]
        third = max(1, len(steps) // 3)
        chunks = [steps[i : i + third] for i in range(0, len(steps), third)]
        return ["".join(call("move", direction=d) for d in chunk) for chunk in chunks]
