"""Text games: GuessTheNumber (with its scripted demonstrator), FrozenLake and Sokoban.

Every game draws its randomness from a private `random.Random(seed)` made in
`reset`, so the same seed and the same actions replay the same episode, and
sessions sharing one env-server process never disturb each other.
"""

from __future__ import annotations

import random
import re
from collections import deque
from collections.abc import Iterable
from typing import Any

from rollwire.envs.base import Act, Env, InvalidAction, StepResult

_NUMBER = re.compile(r"-?\d+")
_MOVE_WORD = re.compile(r"\b(up|down|left|right)\b", re.IGNORECASE)
MOVES: dict[str, tuple[int, int]] = {
    "up": (-1, 0),
    "down": (1, 0),
    "left": (0, -1),
    "right": (0, 1),
}
"""Direction word -> (row step, column step)."""

Cell = tuple[int, int]
_REVERSE_WALKS = 8
"""Backward walks tried per Sokoban room; the hardest state found is kept."""


def int_kwarg(
    name: str, value: object, minimum: int | None = None, maximum: int | None = None
) -> int:
    """`value` as an int, accepting integral floats.

    Env kwargs sent over gRPC travel in a `google.protobuf.Struct`, which holds
    every number as a double, so a client that does not restore ints sends
    `size=4.0`; that must mean 4, while 4.5 or "4" stays an error.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"{name} must be a whole number, got {value!r}")
        value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {value}")
    return value


def parse_move(action: str) -> str:
    """The last of the words up/down/left/right in `action`, whole words, any case.

    The last one counts so that a policy may reason in words ("not left, so
    right") and end with its move.
    """
    found = _MOVE_WORD.findall(action)
    if not found:
        raise InvalidAction(
            f"no move in the action {action[:80]!r}; include one of up, down, left, right"
        )
    return found[-1].lower()


def distances(size: int, blocked: Iterable[Cell], start: Cell) -> dict[Cell, int]:
    """Moves from `start` to every cell reachable on a size x size grid without entering `blocked`."""
    walls = set(blocked)
    distance = {start: 0}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        for row_step, col_step in MOVES.values():
            nxt = (cell[0] + row_step, cell[1] + col_step)
            inside = 0 <= nxt[0] < size and 0 <= nxt[1] < size
            if inside and nxt not in walls and nxt not in distance:
                distance[nxt] = distance[cell] + 1
                queue.append(nxt)
    return distance


def shortest_path(size: int, blocked: Iterable[Cell], start: Cell, goal: Cell) -> int | None:
    """Moves on a size x size grid from start to goal avoiding `blocked`; None if unreachable."""
    return distances(size, blocked, start).get(goal)


class GuessTheNumber(Env):
    """Find a hidden integer in [low, high] within `max_turns` guesses.

    Each action must contain an integer (the last one in the text is the
    guess). The reply is "higher", "lower" or "correct". Reward 1 for finding
    it, 0 otherwise; the episode is truncated after `max_turns` guesses.
    """

    def __init__(self, low: int = 1, high: int = 100, max_turns: int = 10) -> None:
        low, high = int_kwarg("low", low), int_kwarg("high", high)
        max_turns = int_kwarg("max_turns", max_turns, minimum=1)
        if low > high:
            raise ValueError(f"low ({low}) must not exceed high ({high})")
        self.low, self.high, self.max_turns = low, high, max_turns
        self._target: int | None = None
        self._turns = 0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self._target = random.Random(seed).randint(self.low, self.high)
        self._turns = 0
        prompt = (
            f"I am thinking of an integer between {self.low} and {self.high}. "
            f"You have {self.max_turns} guesses. Answer with a single number."
        )
        return prompt, {"low": self.low, "high": self.high, "max_turns": self.max_turns}

    def step(self, action: str) -> StepResult:
        if self._target is None:
            raise InvalidAction("call reset before step")
        numbers = _NUMBER.findall(action)
        if not numbers:
            raise InvalidAction(f"no integer in the action {action[:80]!r}")
        guess = int(numbers[-1])
        self._turns += 1
        info = {"guess": guess, "turn": self._turns}
        if guess == self._target:
            return "correct", 1.0, True, False, info
        hint = "higher" if guess < self._target else "lower"
        return hint, 0.0, False, self._turns >= self.max_turns, info


def guess_the_number_demonstrator(rng: random.Random, bisect_rate: float = 0.3, **_: Any) -> Act:
    """GuessTheNumber's scripted player, for warm-up: guesses inside the range the answers so
    far allow, the midpoint `bisect_rate` of the time and anywhere in it otherwise."""
    bounds: dict[str, int] = {}

    def act(observation: str, info: dict[str, Any]) -> str:
        if not bounds:
            bounds.update(low=int(info.get("low", 1)), high=int(info.get("high", 100)))
        elif "last" in bounds:
            if "higher" in observation:
                bounds["low"] = bounds["last"] + 1
            elif "lower" in observation:
                bounds["high"] = bounds["last"] - 1
        low, high = bounds["low"], max(bounds["low"], bounds["high"])
        guess = (low + high) // 2 if rng.random() < bisect_rate else rng.randint(low, high)
        bounds["last"] = guess
        return str(guess)

    return act


def require_episode(started: bool, done: bool) -> None:
    """The games' rule for `step`: only between `reset` and the episode's end."""
    if not started:
        raise InvalidAction("call reset before step")
    if done:
        raise InvalidAction("the episode has ended; call reset to start another")


class FrozenLake(Env):
    """Walk from the top-left corner to the goal G in the bottom-right without falling into a hole H.

    The map is drawn from the reset seed and always has a path to the goal of
    at most `max_turns` moves (checked by breadth-first search). Holes are
    `num_holes` exactly, or else `hole_density` (default 0.2) of the cells.

    Observation: an optional message line, the grid (A marks the agent; it
    hides the cell under it), and a legend line. An action is any text; the
    LAST of the words up/down/left/right in it (whole word, any case) is the
    move; text with none raises InvalidAction. Walking into the edge leaves the
    agent in place and the message says so. With `slippery`, a move goes the
    intended way with probability 1/3 and to either side otherwise.

    Reward 1 on reaching the goal (terminated), 0 on falling into a hole
    (terminated) and 0 otherwise; truncated after `max_turns` moves
    (default 4 * size).
    """

    LEGEND = "legend: A you, . ice, H hole, G goal. Move up, down, left or right."

    def __init__(
        self,
        size: int = 4,
        num_holes: int | None = None,
        hole_density: float | None = None,
        slippery: bool = False,
        max_turns: int | None = None,
    ) -> None:
        self.size = int_kwarg("size", size, minimum=2, maximum=16)
        if not isinstance(slippery, bool):
            raise TypeError(f"slippery must be true or false, got {slippery!r}")
        self.slippery = slippery
        self.max_turns = int_kwarg("max_turns", 4 * self.size if max_turns is None else max_turns)
        fewest_moves = 2 * (self.size - 1)
        if self.max_turns < fewest_moves:
            raise ValueError(
                f"max_turns ({self.max_turns}) is below the {fewest_moves} moves any {self.size}x{self.size} map needs"
            )
        # A monotone corner-to-corner path has 2*size-1 cells; holes beyond the
        # rest of the grid could block every path.
        most_holes = self.size * self.size - (2 * self.size - 1)
        if num_holes is not None and hole_density is not None:
            raise ValueError("give num_holes or hole_density, not both")
        if num_holes is not None:
            self.num_holes = int_kwarg("num_holes", num_holes, minimum=0, maximum=most_holes)
        else:
            density = 0.2 if hole_density is None else hole_density
            if isinstance(density, bool) or not isinstance(density, int | float):
                raise TypeError(f"hole_density must be a number, got {density!r}")
            if not 0.0 <= density < 1.0:
                raise ValueError(f"hole_density must be in [0, 1), got {density}")
            self.num_holes = min(round(density * (self.size * self.size - 2)), most_holes)
        self.start: Cell = (0, 0)
        self.goal: Cell = (self.size - 1, self.size - 1)
        self._holes: frozenset[Cell] = frozenset()
        self._position: Cell | None = None
        self._rng = random.Random()
        self._turns = 0
        self._done = False

    def _draw_holes(self) -> frozenset[Cell]:
        cells = [
            (row, col)
            for row in range(self.size)
            for col in range(self.size)
            if (row, col) not in (self.start, self.goal)
        ]
        for _ in range(200):
            holes = frozenset(self._rng.sample(cells, self.num_holes))
            length = shortest_path(self.size, holes, self.start, self.goal)
            if length is not None and length <= self.max_turns:
                return holes
        # Dense maps rarely leave a path by chance: keep a random monotone path clear.
        steps = ["down"] * (self.size - 1) + ["right"] * (self.size - 1)
        self._rng.shuffle(steps)
        path, cell = {self.start}, self.start
        for move in steps:
            cell = (cell[0] + MOVES[move][0], cell[1] + MOVES[move][1])
            path.add(cell)
        return frozenset(self._rng.sample([c for c in cells if c not in path], self.num_holes))

    def render(self) -> str:
        """The grid and the legend, as the policy sees them."""
        rows = []
        for row in range(self.size):
            line = []
            for col in range(self.size):
                cell = (row, col)
                if cell == self._position:
                    line.append("A")
                elif cell in self._holes:
                    line.append("H")
                elif cell == self.goal:
                    line.append("G")
                else:
                    line.append(".")
            rows.append("".join(line))
        return "\n".join([*rows, self.LEGEND])

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self._rng = random.Random(seed)
        self._holes = self._draw_holes()
        self._position = self.start
        self._turns = 0
        self._done = False
        info = {
            "size": self.size,
            "num_holes": self.num_holes,
            "slippery": self.slippery,
            "max_turns": self.max_turns,
            "shortest_path": shortest_path(self.size, self._holes, self.start, self.goal),
            "state_key": self.render(),
        }
        return self.render(), info

    def step(self, action: str) -> StepResult:
        require_episode(self._position is not None, self._done)
        intended = parse_move(action)
        self._turns += 1
        moved = intended
        if self.slippery:
            sideways = ["left", "right"] if intended in ("up", "down") else ["up", "down"]
            moved = self._rng.choice([intended, *sideways])
        row, col = self._position
        target = (row + MOVES[moved][0], col + MOVES[moved][1])
        hit_edge = not (0 <= target[0] < self.size and 0 <= target[1] < self.size)
        message = f"You slipped {moved}." if moved != intended else f"You went {moved}."
        if hit_edge:
            message += " The edge stops you; you stay in place."
        else:
            self._position = target
        reward, terminated = 0.0, False
        if self._position == self.goal:
            reward, terminated = 1.0, True
            message += " You reached the goal!"
        elif self._position in self._holes:
            terminated = True
            message += " You fell into a hole."
        truncated = not terminated and self._turns >= self.max_turns
        if truncated:
            message += " Out of moves."
        self._done = terminated or truncated
        info = {
            "move": intended,
            "moved": moved,
            "hit_edge": hit_edge,
            "position": list(self._position),
            "turn": self._turns,
            "state_key": self.render(),
        }
        return f"{message}\n{self.render()}", reward, terminated, truncated, info


class Sokoban(Env):
    """Push every box onto a target in a small walled room.

    Symbols: # wall, _ floor, @ you, $ box, . target, * box on target,
    + you on target. Moves are read as in FrozenLake (the last of
    up/down/left/right in the text). Walking into a wall, or pushing a box
    into a wall or another box, leaves everything in place and the message
    says so; the move still counts.

    Rooms are `size` x `size` including the outer wall, with a few inner walls,
    and are made from the seed by playing backwards from the solved state
    (pulling boxes off their targets), so every room is solvable within
    `max_turns` moves: the forward solution is that walk reversed.

    Reward +0.1 when a push puts a box on a target, -0.1 when it takes one
    off, and 1.0 (in all, for that step) when the last box lands and the room
    is solved, which terminates; truncated after `max_turns` moves.
    """

    LEGEND = "legend: # wall, _ floor, @ you, $ box, . target, * box on target, + you on target."

    def __init__(self, size: int = 6, num_boxes: int = 1, max_turns: int = 30) -> None:
        self.size = int_kwarg("size", size, minimum=5, maximum=12)
        inner = (self.size - 2) ** 2
        self.num_boxes = int_kwarg("num_boxes", num_boxes, minimum=1, maximum=max(1, inner // 4))
        self.max_turns = int_kwarg("max_turns", max_turns, minimum=1)
        self._walls: frozenset[Cell] = frozenset()
        self._targets: frozenset[Cell] = frozenset()
        self._boxes: set[Cell] = set()
        self._player: Cell | None = None
        self._turns = 0
        self._done = False

    def _generate(self, rng: random.Random) -> None:
        border = {
            (row, col)
            for row in range(self.size)
            for col in range(self.size)
            if row in (0, self.size - 1) or col in (0, self.size - 1)
        }
        for _ in range(100):
            walls = set(border)
            inside = sorted(
                (row, col) for row in range(1, self.size - 1) for col in range(1, self.size - 1)
            )
            for cell in rng.sample(inside, rng.randint(0, len(inside) // 6)):
                walls.add(cell)
                floor = [c for c in inside if c not in walls]
                if len(distances(self.size, walls, floor[0])) < len(floor):
                    walls.discard(cell)  # an inner wall must not split the room
            floor = [c for c in inside if c not in walls]
            targets = rng.sample(floor, self.num_boxes)
            found = self._pull_boxes(rng, frozenset(walls), targets, floor)
            if found is not None:
                self._walls, self._targets = frozenset(walls), frozenset(targets)
                self._boxes, self._player = found
                return
        raise RuntimeError(f"no solvable {self.size}x{self.size} room found; try other settings")

    def _pull_boxes(
        self, rng: random.Random, walls: frozenset[Cell], targets: list[Cell], floor: list[Cell]
    ) -> tuple[set[Cell], Cell] | None:
        """Walks backwards from the solved room; returns the visited state furthest from solved.

        A backward step moves the player and may pull the box behind it along;
        each is the exact reverse of a legal forward move or push, so the
        forward solution is the walk reversed, at most `max_turns` long. Several
        walks are tried and the state with the most boxes off their targets
        (then the largest total distance to a target) wins, so that rooms need
        real work rather than one push.
        """
        best: tuple[set[Cell], Cell] | None = None
        best_score = (0, 0)
        directions = sorted(MOVES.values())
        for _ in range(_REVERSE_WALKS):
            boxes = set(targets)
            player = rng.choice([c for c in floor if c not in boxes])
            moves = 0
            for _ in range(10 * self.max_turns):
                if moves >= self.max_turns:
                    break
                # Half the time, walk away from a neighbouring box so that it gets pulled.
                beside = [d for d in directions if (player[0] + d[0], player[1] + d[1]) in boxes]
                if beside and rng.random() < 0.5:
                    row_step, col_step = (-x for x in rng.choice(beside))
                else:
                    row_step, col_step = rng.choice(directions)
                ahead = (player[0] + row_step, player[1] + col_step)
                if ahead in walls or ahead in boxes:
                    continue
                behind = (player[0] - row_step, player[1] - col_step)
                if behind in boxes and rng.random() < 0.8:
                    boxes.remove(behind)
                    boxes.add(player)
                player, moves = ahead, moves + 1
                off_target = len(boxes - set(targets))
                distance = sum(
                    min(abs(b[0] - t[0]) + abs(b[1] - t[1]) for t in targets) for b in boxes
                )
                if (off_target, distance) > best_score:
                    best, best_score = (set(boxes), player), (off_target, distance)
        return best

    def render(self) -> str:
        """The room and the legend, as the policy sees them."""
        rows = []
        for row in range(self.size):
            line = []
            for col in range(self.size):
                cell = (row, col)
                on_target = cell in self._targets
                if cell in self._walls:
                    line.append("#")
                elif cell == self._player:
                    line.append("+" if on_target else "@")
                elif cell in self._boxes:
                    line.append("*" if on_target else "$")
                else:
                    line.append("." if on_target else "_")
            rows.append("".join(line))
        return "\n".join([*rows, self.LEGEND])

    @property
    def boxes_on_target(self) -> int:
        return len(self._boxes & self._targets)

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self._generate(random.Random(seed))
        self._turns = 0
        self._done = False
        info = {
            "size": self.size,
            "num_boxes": self.num_boxes,
            "max_turns": self.max_turns,
            "boxes_on_target": self.boxes_on_target,
            "state_key": self.render(),
        }
        return self.render(), info

    def step(self, action: str) -> StepResult:
        require_episode(self._player is not None, self._done)
        move = parse_move(action)
        self._turns += 1
        row_step, col_step = MOVES[move]
        ahead = (self._player[0] + row_step, self._player[1] + col_step)
        reward, pushed = 0.0, False
        if ahead in self._walls:
            message = f"A wall blocks the way {move}; you stay in place."
        elif ahead in self._boxes:
            beyond = (ahead[0] + row_step, ahead[1] + col_step)
            if beyond in self._walls or beyond in self._boxes:
                message = f"The box cannot move {move}; nothing moves."
            else:
                self._boxes.remove(ahead)
                self._boxes.add(beyond)
                self._player, pushed = ahead, True
                if beyond in self._targets and ahead not in self._targets:
                    reward = 0.1
                elif ahead in self._targets and beyond not in self._targets:
                    reward = -0.1
                message = f"You pushed a box {move}."
        else:
            self._player = ahead
            message = f"You went {move}."
        terminated = self._boxes == self._targets
        if terminated:
            reward = 1.0
            message += " Every box is on a target: solved!"
        truncated = not terminated and self._turns >= self.max_turns
        if truncated:
            message += " Out of moves."
        self._done = terminated or truncated
        info = {
            "move": move,
            "pushed": pushed,
            "boxes_on_target": self.boxes_on_target,
            "turn": self._turns,
            "state_key": self.render(),
        }
        return f"{message}\n{self.render()}", reward, terminated, truncated, info
