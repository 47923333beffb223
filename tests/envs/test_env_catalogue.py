"""The built-in environments: their rules, rewards, seeding, limits, and service over EnvServicer."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import sys
from collections import deque

import grpc
import grpc.aio
import pytest
from google.protobuf import struct_pb2

from rollwire.envs import registry
from rollwire.envs.base import InvalidAction
from rollwire.envs.games import MOVES, FrozenLake, GuessTheNumber, Sokoban
from rollwire.envs.gem import GemEnv, GemUnavailable
from rollwire.envs.server import EnvServicer
from rollwire.envs.tasks import ReasoningGymEnv
from rollwire.envs.tools import CalcError, ToolUse, calculate, format_number
from rollwire.proto.v1 import env_pb2
from rollwire.reward.scorers import ScoreInput, reasoning_gym_score
from rollwire.services.core.config import EnvServerConfig
from rollwire.services.core.structs import from_struct, to_struct

GEM_MISSING = importlib.util.find_spec("gem") is None
GEM_SKIP = (
    "gem-llm is not installed here; tests/suites/test_gem_suite.py runs the gem tests in .venv-gem "
    "(which deploy/install.sh builds: gem-llm pins its own reasoning-gym)"
)
Cell = tuple[int, int]


def json_exact(info: dict) -> dict:
    """Fails unless `info` is JSON as it stands (no str() fallback)."""
    return json.loads(json.dumps(info))


def parse_grid(observation: str) -> list[str]:
    """The grid rows of an observation: the lines before the legend that are not a message."""
    lines = observation.splitlines()
    assert lines[-1].startswith("legend:"), observation
    return [line for line in lines[:-1] if " " not in line]  # messages have spaces, grids none


# ---------------------------------------------------------------- kwargs over the wire


@pytest.mark.parametrize(
    ("env_id", "kwargs"),
    [
        ("guess_the_number", {"low": 1.0, "high": 8.0, "max_turns": 3.0}),
        ("frozen_lake", {"size": 5.0, "num_holes": 3.0, "max_turns": 12.0}),
        ("sokoban", {"size": 6.0, "num_boxes": 2.0, "max_turns": 20.0}),
        ("tool_use", {"digits": 3.0, "max_turns": 2.0, "python_memory_mb": 128.0}),
        ("digit_lock", {"dials": 3.0, "max_turns": 4.0}),
    ],
)
def test_integral_float_kwargs_are_accepted(env_id: str, kwargs: dict) -> None:
    env = registry.make(env_id, **kwargs)
    observation, info = env.reset(0)
    assert observation and json_exact(info) == info


def test_non_integral_or_non_numeric_kwargs_are_refused() -> None:
    with pytest.raises(ValueError, match=r"max_turns must be a whole number, got 2\.5"):
        GuessTheNumber(max_turns=2.5)
    with pytest.raises(TypeError, match="size must be an integer, got '4'"):
        FrozenLake(size="4")
    with pytest.raises(TypeError, match="num_boxes must be an integer, got True"):
        Sokoban(num_boxes=True)


# ---------------------------------------------------------------- FrozenLake


def lake(observation: str) -> tuple[Cell, set[Cell], Cell, int]:
    rows = parse_grid(observation)
    cells = {(r, c): ch for r, row in enumerate(rows) for c, ch in enumerate(row)}
    agent = next(cell for cell, ch in cells.items() if ch == "A")
    goal = next(cell for cell, ch in cells.items() if ch == "G")
    return agent, {cell for cell, ch in cells.items() if ch == "H"}, goal, len(rows)


def bfs_moves(size: int, blocked: set[Cell], start: Cell, goal: Cell) -> list[str] | None:
    previous: dict[Cell, tuple[Cell, str] | None] = {start: None}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if cell == goal:
            moves = []
            while previous[cell] is not None:
                cell, move = previous[cell]
                moves.append(move)
            return moves[::-1]
        for move, (dr, dc) in MOVES.items():
            nxt = (cell[0] + dr, cell[1] + dc)
            inside = 0 <= nxt[0] < size and 0 <= nxt[1] < size
            if inside and nxt not in blocked and nxt not in previous:
                previous[nxt] = (cell, move)
                queue.append(nxt)
    return None


@pytest.mark.parametrize(
    "kwargs", [{}, {"size": 6, "hole_density": 0.35}, {"size": 5, "num_holes": 16}]
)
def test_frozen_lake_maps_are_solvable_and_reaching_the_goal_pays_one(kwargs: dict) -> None:
    env = FrozenLake(**kwargs)
    for seed in range(12):
        observation, info = env.reset(seed)
        agent, holes, goal, size = lake(observation)
        assert (agent, goal, size) == ((0, 0), (size - 1, size - 1), env.size)
        assert len(holes) == env.num_holes
        moves = bfs_moves(size, holes, agent, goal)
        assert moves is not None and len(moves) <= env.max_turns, f"seed {seed} unsolvable"
        assert len(moves) == info["shortest_path"]
        for move in moves[:-1]:
            observation, reward, terminated, truncated, _ = env.step(f"I go {move}")
            assert (reward, terminated, truncated) == (0.0, False, False)
        observation, reward, terminated, truncated, info = env.step(moves[-1].upper())
        assert (reward, terminated, truncated) == (1.0, True, False)
        assert "reached the goal" in observation and info["position"] == list(goal)


def test_frozen_lake_is_seeded() -> None:
    maps = {seed: FrozenLake(size=5).reset(seed)[0] for seed in range(8)}
    assert FrozenLake(size=5).reset(3)[0] == maps[3]
    assert len(set(maps.values())) > 4


def route_into_a_hole(observation: str) -> list[str]:
    """Moves that walk the agent on ice to a hole's side and then into it."""
    agent, holes, goal, size = lake(observation)
    for hole in sorted(holes):
        for move, (dr, dc) in MOVES.items():
            beside = (hole[0] - dr, hole[1] - dc)
            if min(beside) >= 0 and max(beside) < size and beside not in holes | {goal}:
                path = bfs_moves(size, holes | {goal}, agent, beside)
                if path is not None:
                    return [*path, move]
    raise AssertionError(f"no hole can be reached in\n{observation}")


def test_frozen_lake_hole_edge_and_the_move_rule() -> None:
    env = FrozenLake(size=4, num_holes=4)
    route = route_into_a_hole(env.reset(0)[0])
    for move in route[:-1]:
        assert env.step(move)[1:4] == (0.0, False, False)
    observation, reward, terminated, truncated, _ = env.step(f"maybe left, no: {route[-1]}")
    assert (reward, terminated, truncated) == (0.0, True, False)
    assert "fell into a hole" in observation
    with pytest.raises(InvalidAction, match="episode has ended"):
        env.step("up")

    env.reset(0)
    observation, reward, terminated, truncated, info = env.step("UP!")
    assert "edge" in observation and info["hit_edge"] and info["position"] == [0, 0]
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert lake(observation)[0] == (0, 0)
    with pytest.raises(InvalidAction, match="include one of up, down, left, right"):
        env.step("upright and downward")  # whole words only
    assert env.step("Left? No. Down.")[4]["move"] == "down"
    with pytest.raises(InvalidAction, match="call reset"):
        FrozenLake().step("up")


def test_frozen_lake_truncates_and_slips_reproducibly() -> None:
    env = FrozenLake(size=4, max_turns=6)
    env.reset(1)
    for turn in range(1, 7):
        _, reward, terminated, truncated, info = env.step("up")  # stays on the top edge
        assert (reward, terminated, truncated) == (0.0, False, turn == 6)
        assert info["turn"] == turn
    with pytest.raises(InvalidAction):
        env.step("up")

    def slippery_episode(seed: int) -> list[tuple]:
        slippery = FrozenLake(size=6, num_holes=0, slippery=True, max_turns=30)
        slippery.reset(seed)
        return [slippery.step("right")[4]["moved"] for _ in range(10)]

    first = slippery_episode(7)
    assert first == slippery_episode(7)
    assert set(first) - {"right"}, "ten slippery moves never slipped"
    assert first != slippery_episode(8)


def test_frozen_lake_refuses_impossible_settings() -> None:
    with pytest.raises(ValueError, match="not both"):
        FrozenLake(num_holes=2, hole_density=0.1)
    with pytest.raises(ValueError, match="num_holes must be at most 9"):
        FrozenLake(size=4, num_holes=10)
    with pytest.raises(ValueError, match="below the 6 moves"):
        FrozenLake(size=4, max_turns=5)


# ---------------------------------------------------------------- Sokoban


def room(observation: str) -> tuple[set[Cell], set[Cell], set[Cell], Cell]:
    walls, boxes, targets, player = set(), set(), set(), None
    for r, row in enumerate(parse_grid(observation)):
        for c, ch in enumerate(row):
            cell = (r, c)
            if ch == "#":
                walls.add(cell)
            if ch in "$*":
                boxes.add(cell)
            if ch in ".*+":
                targets.add(cell)
            if ch in "@+":
                player = cell
    assert player is not None
    return walls, boxes, targets, player


def solve_sokoban(observation: str) -> list[str] | None:
    """Breadth-first search over (player, boxes): the shortest solution, or None."""
    walls, boxes, targets, player = room(observation)
    start = (player, frozenset(boxes))
    previous: dict = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        player, boxes = state
        if boxes == targets:
            moves = []
            while previous[state] is not None:
                state, move = previous[state]
                moves.append(move)
            return moves[::-1]
        for move, (dr, dc) in MOVES.items():
            ahead = (player[0] + dr, player[1] + dc)
            if ahead in walls:
                continue
            moved = boxes
            if ahead in boxes:
                beyond = (ahead[0] + dr, ahead[1] + dc)
                if beyond in walls or beyond in boxes:
                    continue
                moved = (boxes - {ahead}) | {beyond}
            nxt = (ahead, moved)
            if nxt not in previous:
                previous[nxt] = (state, move)
                queue.append(nxt)
    return None


@pytest.mark.parametrize(
    "kwargs", [{}, {"num_boxes": 2}, {"size": 7, "num_boxes": 2, "max_turns": 40}]
)
def test_sokoban_rooms_are_solvable_and_rewards_follow_the_boxes(kwargs: dict) -> None:
    env = Sokoban(**kwargs)
    for seed in range(6):
        observation, info = env.reset(seed)
        _, boxes, targets, _ = room(observation)
        assert len(boxes) == len(targets) == env.num_boxes and boxes != targets
        assert info["boxes_on_target"] == len(boxes & targets)
        moves = solve_sokoban(observation)
        assert moves is not None and len(moves) <= env.max_turns, f"seed {seed} unsolvable"
        on_target = info["boxes_on_target"]
        for index, move in enumerate(moves):
            observation, reward, terminated, truncated, info = env.step(move)
            if index < len(moves) - 1:
                expected = round(0.1 * (info["boxes_on_target"] - on_target), 6)
                assert (reward, terminated, truncated) == (expected, False, False)
                on_target = info["boxes_on_target"]
        assert (reward, terminated, truncated) == (1.0, True, False)
        assert "solved" in observation and info["boxes_on_target"] == env.num_boxes


def test_sokoban_push_rewards_by_hand() -> None:
    env = Sokoban()
    env.reset(0)
    # An empty 4x4 room set by hand: @ at (2, 1), boxes at (2, 2) and (4, 3), targets (2, 3), (3, 3).
    env._walls = frozenset(
        {(r, c) for r in range(6) for c in range(6) if r in (0, 5) or c in (0, 5)}
    )
    env._targets = frozenset({(2, 3), (3, 3)})
    env._boxes, env._player = {(2, 2), (4, 3)}, (2, 1)
    observation, reward, terminated, _, info = env.step("right")  # a box onto (2, 3)
    assert (reward, terminated, info["pushed"], info["boxes_on_target"]) == (0.1, False, True, 1)
    assert parse_grid(observation)[2] == "#_@*_#"
    observation, reward, terminated, _, info = env.step("right")  # and off it, to (2, 4)
    assert (reward, terminated, info["boxes_on_target"]) == (-0.1, False, 0)
    assert parse_grid(observation)[2] == "#__+$#"
    observation, reward, _, _, info = env.step("right")  # that box is against the wall
    assert (reward, info["pushed"]) == (0.0, False) and "cannot move" in observation
    assert parse_grid(observation)[2] == "#__+$#"
    env.step("up")
    observation, reward, _, _, _ = env.step("up")  # (0, 3) is the wall
    assert reward == 0.0 and "wall blocks" in observation
    assert parse_grid(observation)[1] == "#__@_#"


def test_sokoban_is_seeded_and_truncates() -> None:
    rooms = {seed: Sokoban().reset(seed)[0] for seed in range(8)}
    assert Sokoban().reset(5)[0] == rooms[5]
    assert len(set(rooms.values())) > 4
    for seed in range(50):  # a room where the player stands against a wall
        env = Sokoban(max_turns=3)
        observation, _ = env.reset(seed)
        walls, _, _, player = room(observation)
        blocked = [m for m, (dr, dc) in MOVES.items() if (player[0] + dr, player[1] + dc) in walls]
        if blocked:
            break
    assert blocked
    for turn in (1, 2, 3):
        observation, reward, terminated, truncated, _ = env.step(blocked[0])
        assert (reward, terminated, truncated) == (0.0, False, turn == 3)
    assert "Out of moves" in observation
    env.reset(0)
    with pytest.raises(InvalidAction, match="no move"):
        env.step("north")
    with pytest.raises(ValueError, match="num_boxes must be at most 4"):
        Sokoban(size=6, num_boxes=5)


# ---------------------------------------------------------------- tool use


def test_calculator() -> None:
    assert calculate("37 + 45") == 82
    assert calculate("(2 + 3) * 4 - 6 / 3") == 18.0
    assert calculate("-3 ** 2") == -9 and calculate("7 // 2") == 3 and calculate("7 % 3") == 1
    assert format_number(calculate("10 / 4")) == "2.5" and format_number(calculate("8 / 2")) == "4"
    with pytest.raises(ZeroDivisionError):
        calculate("1 / (2 - 2)")
    for expression, reason in [
        ("2 ** 5000", "exponent 5000 is too large"),
        ("99 ** 999", "result too large"),
        ("10.0 ** 400", "result too large"),
        ("__import__('os').system('true')", "unsupported syntax"),
        ("x + 1", "unsupported syntax: 'x'"),
        ("'a' * 3", "unsupported value 'a'"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 201, "longer than 200"),
    ]:
        with pytest.raises(CalcError, match=re.escape(reason)):
            calculate(expression)


def test_tool_use_default_prompt_answers_and_rewards() -> None:
    env = ToolUse()
    observation, info = env.reset(0)
    question = info["question"]
    assert re.fullmatch(r"\d\d \+ \d\d", question)
    assert observation == (
        f"What is {question}? Use <calc>...</calc> to compute, then reply <answer>N</answer>."
    )
    assert info["reference"] == str(sum(int(n) for n in question.split(" + ")))
    assert json_exact(info) == info
    assert env.step(f"<calc>{question}</calc>") == (
        info["reference"],
        0.0,
        False,
        False,
        {"tool": "calc", "turn": 1},
    )
    observation, reward, terminated, truncated, step_info = env.step(
        f"<calc>1+1</calc> so <answer> {info['reference']}.0 </answer>"
    )
    assert (observation, reward, terminated, truncated) == ("correct", 1.0, True, False)
    assert step_info["tool"] is None and step_info["turn"] == 2
    with pytest.raises(InvalidAction, match="episode has ended"):
        env.step("<answer>1</answer>")

    env.reset(0)
    wrong = int(info["reference"]) + 1
    assert env.step(f"<answer>{wrong}</answer>")[1:4] == (0.0, True, False)
    env.reset(0)
    assert env.step("<answer>eighty</answer>")[1:4] == (0.0, True, False)
    assert ToolUse().reset(0) == ToolUse().reset(0)
    assert len({ToolUse().reset(seed)[1]["question"] for seed in range(10)}) > 5


def test_tool_use_turns_errors_and_settings() -> None:
    env = ToolUse(max_turns=3, tools=["calc"])
    env.reset(4)
    observation, reward, terminated, truncated, info = env.step("I think it is big")
    assert observation.startswith("no tool call or answer found; use <calc>...</calc>")
    assert (reward, terminated, truncated, info) == (0.0, False, False, {"tool": None, "turn": 1})
    assert env.step("<calc>1/0</calc>")[0] == "error: division by zero"
    observation, _, _, truncated, info = env.step("<python>print(1)</python>")
    assert observation.startswith("error: tool python is not available here")
    assert truncated and info == {"tool": "python", "turn": 3}

    observation, info = ToolUse(ops=["/"], digits=2, tools=[]).reset(2)
    assert observation == f"What is {info['question']}? Reply <answer>N</answer>."
    dividend, divisor = (int(n) for n in info["question"].split(" / "))
    assert dividend == divisor * int(info["reference"])
    custom = ToolUse(instructions="Q: {question}", ops=["-", "*"])
    assert custom.reset(1)[0].startswith("Q: ")
    for bad, message in [
        ({"ops": ["^"]}, "ops has unknown entries ['^']"),
        ({"tools": ["shell"]}, "tools has unknown entries ['shell']"),
        ({"instructions": "What?"}, "must be text containing {question}"),
        ({"task": "chess"}, "unknown task 'chess'"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            ToolUse(**bad)


# ---------------------------------------------------------------- reasoning-gym


@pytest.fixture(scope="module")
def chain_sums() -> ReasoningGymEnv:
    return ReasoningGymEnv(dataset="chain_sum", size=20, dataset_seed=3)


def test_reasoning_gym_env_feeds_the_reward_servers_scorer(chain_sums: ReasoningGymEnv) -> None:
    env = chain_sums
    question, reset_info = env.reset(25)
    assert env.reset(5) == (question, reset_info)  # 25 % 20
    assert env.reset(6)[0] != question
    observation, _ = env.reset(25)
    _, reward, terminated, truncated, info = env.step("<answer>whatever</answer>")
    assert (reward, terminated, truncated) == (0.0, True, False)
    assert info["metadata"]["source_dataset"] == "chain_sum"
    # As the orchestrator receives it from a remote env-server.
    wire = from_struct(to_struct(info))
    assert wire == json_exact(info)

    def score(answer: str) -> float:
        item = ScoreInput(
            response=f"Adding up: <answer>{answer}</answer>",
            reference=str(wire["reference"]),
            prompt=observation,
            metadata=wire["metadata"],
        )
        return reasoning_gym_score(item).reward

    assert score(wire["reference"]) == 1.0
    assert score(str(int(wire["reference"]) + 1)) == 0.0
    with pytest.raises(InvalidAction, match="episode has ended"):
        env.step("again")


def test_reasoning_gym_env_refuses_a_bad_dataset() -> None:
    with pytest.raises(ValueError, match="no_such_dataset"):
        ReasoningGymEnv(dataset="no_such_dataset", size=5)
    with pytest.raises(ValueError, match=r"must be text containing \{question\}"):
        ReasoningGymEnv(size=5, template="Solve it")


# ---------------------------------------------------------------- GEM


def test_gem_adapter_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gem", None)  # makes `import gem` fail as if not installed
    with pytest.raises(GemUnavailable, match=r"needs gem-llm.*rollwire\[gem\]") as caught:
        registry.make("gem", gem_env_id="game:GuessTheNumber-v0-easy")
    assert isinstance(caught.value, ImportError) and isinstance(caught.value, ValueError)


@pytest.mark.gem
@pytest.mark.skipif(GEM_MISSING, reason=GEM_SKIP)
def test_gem_adapter_plays_a_gem_game() -> None:
    root_handlers = list(logging.getLogger().handlers)
    env = GemEnv("game:GuessTheNumber-v0-easy")
    assert logging.getLogger().handlers == root_handlers  # gem's basicConfig is undone
    observation, info = env.reset(3)
    assert "Guess The Number" in observation and json_exact(info) == info
    assert GemEnv("game:GuessTheNumber-v0-easy").reset(3)[0] == observation
    low, high = 1, 10
    for _ in range(4):  # binary search over 10 numbers needs at most 4 guesses
        guess = (low + high) // 2
        observation, reward, terminated, truncated, info = env.step(f"\\boxed{{{guess}}}")
        assert isinstance(reward, float) and json_exact(info) == info
        if terminated:
            break
        low, high = (guess + 1, high) if "is higher" in observation else (low, guess - 1)
    assert terminated and not truncated and reward == 1.0
    with pytest.raises(ValueError):
        GemEnv("game:NoSuchGame-v0")


# ---------------------------------------------------------------- served by EnvServicer


class Context:
    """Stands in for a gRPC context: abort raises, as the real one does."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise grpc.aio.AbortError(f"{code.name}: {details}")


SERVED = [
    ("frozen_lake", {"size": 4, "num_holes": 0}, ["down"] * 3 + ["right"] * 3, 1.0),
    ("sokoban", {}, None, 1.0),
    ("tool_use", {"tools": ["calc"]}, ["<calc>2 + 2</calc>", "<answer>{reference}</answer>"], 1.0),
    pytest.param(
        "tool_use",
        {},  # with the python tool: a blocking env, stepped in the host's thread pool
        ["<python>print(2 + 2)</python>", "<answer>{reference}</answer>"],
        1.0,
        marks=pytest.mark.integration,
        id="tool_use-python",
    ),
    ("reasoning_gym", {"size": 10}, ["<answer>{reference}</answer>"], 0.0),
    pytest.param(
        "gem", {"gem_env_id": "game:GuessTheNumber-v0-easy"}, None, None, marks=pytest.mark.gem
    ),
]


@pytest.mark.parametrize(("env_id", "kwargs", "actions", "last_reward"), SERVED)
async def test_each_env_is_served_by_the_env_servicer(
    env_id: str, kwargs: dict, actions: list[str] | None, last_reward: float | None
) -> None:
    if env_id == "gem" and GEM_MISSING:
        pytest.skip(GEM_SKIP)
    servicer = EnvServicer(EnvServerConfig())
    try:
        await play_served(servicer, env_id, kwargs, actions, last_reward)
    finally:
        await servicer.close()


async def play_served(
    servicer: EnvServicer,
    env_id: str,
    kwargs: dict,
    actions: list[str] | None,
    last_reward: float | None,
) -> None:
    struct = struct_pb2.Struct()
    struct.update(kwargs)
    reply = await servicer.Reset(
        env_pb2.ResetRequest(env_id=env_id, seed=2, env_kwargs=struct), Context()
    )
    info = from_struct(reply.info)
    if env_id == "sokoban":
        actions = solve_sokoban(reply.observation)
    elif env_id == "gem":
        actions = [f"\\boxed{{{n}}}" for n in range(1, 11)]
    reference = info.get("reference", "")
    for action in actions:
        step = await servicer.Step(
            env_pb2.StepRequest(
                session_id=reply.session_id, action=action.replace("{reference}", reference)
            ),
            Context(),
        )
        if step.terminated or step.truncated:
            break
    assert step.terminated
    if last_reward is not None:
        assert step.reward == last_reward
    if env_id == "reasoning_gym":  # what the orchestrator hands the reward-server
        scored = from_struct(step.info)
        assert scored["reference"] and scored["metadata"]["source_dataset"] == "chain_sum"
    with pytest.raises(grpc.aio.AbortError, match="episode has ended"):
        await servicer.Step(
            env_pb2.StepRequest(session_id=reply.session_id, action="up"), Context()
        )


async def test_env_servicer_lists_the_catalogue_and_refuses_bad_kwargs() -> None:
    servicer = EnvServicer(EnvServerConfig())
    listing = await servicer.ListEnvs(env_pb2.ListEnvsRequest(), Context())
    specs = {spec.env_id: spec for spec in listing.envs}
    assert {"frozen_lake", "sokoban", "tool_use", "reasoning_gym", "gem"} <= set(specs)
    assert specs["reasoning_gym"].domain == "reasoning_gym"
    assert not specs["reasoning_gym"].gives_reward
    assert specs["tool_use"].domain == "tool" and specs["sokoban"].domain == "game"
    struct = struct_pb2.Struct()
    struct.update({"size": 4.5})
    with pytest.raises(grpc.aio.AbortError, match="INVALID_ARGUMENT.*whole number"):
        await servicer.Reset(
            env_pb2.ResetRequest(env_id="frozen_lake", env_kwargs=struct), Context()
        )


# ---------------------------------------------------------------- the python tool


@pytest.mark.integration
def test_tool_env_runs_python_and_survives_tool_errors() -> None:
    env = ToolUse(python_timeout_s=0.5)
    _, info = env.reset(9)
    observation = env.step("<python>print(1/0)</python>")[0]
    assert observation == "error: ZeroDivisionError: division by zero"
    observation = env.step("<python>while True: pass</python>")[0]
    assert observation == "error: timed out after 0.5s"
    question = info["question"]
    assert env.step(f"<python>print({question})</python>")[0] == info["reference"]
    assert env.step(f"<answer>{info['reference']}</answer>")[1:3] == (1.0, True)


def test_grid_games_name_their_states_for_step_level_advantages() -> None:
    """Equal grids are equal states (GiGPO groups turns by `state_key`), whatever the path."""
    lake = FrozenLake(size=4, num_holes=0)
    _, start = lake.reset(3)
    assert lake.step("up")[4]["state_key"] == start["state_key"]  # the edge: still the start
    right = lake.step("right")[4]["state_key"]
    assert right != start["state_key"] and lake.step("left")[4]["state_key"] == start["state_key"]
    room = Sokoban()
    observation, info = room.reset(5)
    assert info["state_key"] == observation


def play(env: GuessTheNumber, seed: int) -> tuple[int, list[str]]:
    """Binary search; returns (guesses used, hints)."""
    _, info = env.reset(seed)
    low, high, hints = info["low"], info["high"], []
    for turn in range(1, env.max_turns + 1):
        guess = (low + high) // 2
        hint, reward, terminated, truncated, _ = env.step(f"my guess is {guess}")
        hints.append(hint)
        if terminated:
            assert reward == 1.0
            return turn, hints
        assert reward == 0.0
        low, high = (guess + 1, high) if hint == "higher" else (low, guess - 1)
        if truncated:
            break
    return -1, hints


def test_guess_the_number_rules() -> None:
    env = GuessTheNumber(low=1, high=100, max_turns=7)
    turns, hints = play(env, seed=3)
    assert 1 <= turns <= 7  # binary search over 100 values needs at most 7 guesses
    assert hints[-1] == "correct"
    # Same seed, same episode.
    assert play(GuessTheNumber(max_turns=7), seed=3) == (turns, hints)


def test_guess_the_number_truncates_and_rejects_bad_actions() -> None:
    env = GuessTheNumber(low=1, high=1000, max_turns=2)
    env.reset(seed=0)
    with pytest.raises(InvalidAction, match="no integer"):
        env.step("no idea")
    target = env._target
    wrong = 1 if target != 1 else 2
    assert env.step(str(wrong))[3] is False
    observation, reward, terminated, truncated, _ = env.step(str(wrong))
    assert (reward, terminated, truncated) == (0.0, False, True)
    assert observation in ("higher", "lower")
    with pytest.raises(ValueError, match="must not exceed"):
        GuessTheNumber(low=5, high=1)


# ---------------------------------------------------------------- DigitLock


def test_digit_lock_opens_dial_by_dial_and_holds_out_its_pictures() -> None:
    from rollwire.envs.base import InvalidAction, Observation
    from rollwire.envs.pictures import DigitLock
    from rollwire.services.core.datasets import DIGITS_TRAIN

    env = DigitLock(dials=2, max_turns=3)
    first, info = env.reset(4)
    assert isinstance(first, Observation) and first.text == "dial 1/2?"
    again = DigitLock(dials=2, max_turns=3)
    assert again.reset(4) == (first, info)  # seeded: the same pictures
    label = int(info["reference"])
    with pytest.raises(InvalidAction, match="no digit in the action"):
        env.step("seven")
    shown, reward, terminated, truncated, _ = env.step(f"{(label + 1) % 10}")
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert shown == Observation("no. dial 1/2?", first.images)  # the same dial again
    shown, reward, *_, info = env.step(f"I read {label}")  # the last digit counts
    assert reward == 0.5 and shown.text == "open. dial 2/2?" and shown.images != first.images
    wrong = (int(info["reference"]) + 1) % 10
    last, reward, terminated, truncated, _ = env.step(str(wrong))
    assert (reward, terminated, truncated) == (0.0, False, True)  # three tries in all
    assert isinstance(last, Observation)
    with pytest.raises(InvalidAction, match="the episode has ended"):
        env.step("1")
    # Every dial opened at once: the lock's whole reward, and an end without a picture.
    lock = DigitLock(dials=3)
    _, info = lock.reset(9)
    for _ in range(3):
        shown, reward, terminated, _, info = lock.step(str(info.get("reference")))
    assert terminated and shown == "open. all 3 open."
    held_out, train = DigitLock(dials=8, split="held_out"), DigitLock(dials=8)
    held_out.reset(1)
    train.reset(1)
    assert min(held_out.shown) >= DIGITS_TRAIN > max(train.shown)


def test_digit_lock_refuses_impossible_settings() -> None:
    from rollwire.envs.pictures import DigitLock

    with pytest.raises(ValueError, match="dials must be at least 1"):
        DigitLock(dials=0)
    with pytest.raises(ValueError, match="max_turns must be at least 3"):
        DigitLock(dials=3, max_turns=2)
    with pytest.raises(ValueError, match="a digits split is train or held_out"):
        DigitLock(split="test")
