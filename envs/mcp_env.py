"""Any MCP server's tools as an environment: the `mcp` and `mcp_scored` envs.

An episode is a task: a question, the MCP servers whose tools may answer it, its
fixture (files laid down in the episode's own folder before its servers start, and
tool calls made once they have, to insert records and the like), and how the
episode is judged. The first observation is the question;
`info["tools"]` holds the tools' schemas (JSON text), which the orchestrator renders the way
the policy's chat template expects (`tools=`) or as plain text.

Each action either calls tools, in the Hermes / Qwen format

    <tool_call>{"name": "calculate", "arguments": {"expression": "347 * 86"}}</tool_call>

(several calls in one turn run in order, at most `max_calls` of them), and their
results are the next observation (`info["observation_role"] == "tool"`), or
answers: a turn without a tool call ends the episode, and its answer is the text
of its `<answer>...</answer>` (else the whole turn). A call that is not JSON,
names no tool the servers offer, or that the server refuses, is answered with an
`error: ...` observation the policy learns from; it never fails the episode. A
server that exits or hangs (`env_server.mcp.call_timeout_s`) is restarted and the
episode starts again from its seed on a fresh one (`EpisodeAborted`).

The `mcp` env judges the episode itself (reward 1 or 0): `answer` compares the
answer with the reference (as numbers when both are numbers, else as text);
`contains` looks for the reference in it; `file` reads a file of the episode's
folder after the episode (did the policy write what it should?); `tool` calls a
tool after the episode and looks for text in its result (a memory graph, a
database). The `mcp_scored` env gives no reward: the reward-server scores the last
turn against `reference` in the task's `domain` (math by default).

Tasks come from a generator (`task="arithmetic"`: products beyond a small model's
reach, for a calculator; `task="files"`: a code written in a file, for a file
reader) or from `tasks`, a JSON-lines file or a list of rows:

    {"question": "...", "answer": "...", "servers": ["files"],
     "fixture": {"files": {"notes/a.txt": "..."},
                 "calls": [{"name": "remember", "arguments": {"key": "k", "value": "v"}}]},
     "judge": {"type": "file", "path": "out.txt", "contains": "42"},
     "demo": [{"name": "write_file", "arguments": {"path": "out.txt", "content": "42"}}]}

`demo` is what the scripted demonstrator calls before it answers, for warm-up.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollwire.envs.base import Act, Env, EpisodeAborted, InvalidAction, StepResult
from rollwire.envs.games import int_kwarg
from rollwire.envs.mcp_hub import EpisodeServers, McpHub, McpServerLost, McpUnavailable, result_text

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
JUDGES = ("answer", "contains", "file", "tool")
MAX_FIXTURE_BYTES = 1 << 20
WORDS = ("amber", "birch", "cedar", "delta", "ember", "fjord", "grove", "harbor", "iris", "juniper")


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """One call in the format this env reads."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def parse_calls(text: str) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """The tool calls in `text` as (name, arguments), and an error for each call that is
    not a JSON object with a string `name` and object `arguments`."""
    calls, errors = [], []
    for body in _CALL.findall(text):
        try:
            value = json.loads(body)
        except json.JSONDecodeError as error:
            errors.append(f"the tool call is not valid JSON ({error.msg} at {error.pos})")
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            errors.append('a tool call must be {"name": ..., "arguments": {...}}')
            continue
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            with contextlib.suppress(json.JSONDecodeError):
                arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            errors.append(f"the arguments of {value['name']!r} must be a JSON object")
            continue
        calls.append((value["name"], arguments))
    return calls, errors


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def _same(answer: str, reference: str) -> bool:
    a, b = _number(answer), _number(reference)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    return " ".join(answer.split()).casefold() == " ".join(reference.split()).casefold()


def _rows(tasks: str | Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(tasks, str):
        path = Path(tasks)
        if not path.is_file():
            raise ValueError(f"tasks file {tasks!r} does not exist")
        rows = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise ValueError(f"{tasks}:{number}: not JSON: {error.msg}") from None
    else:
        rows = list(tasks)
    if not rows:
        raise ValueError("tasks is empty")
    for index, row in enumerate(rows):
        where = f"task {index}"
        if not isinstance(row, dict) or not isinstance(row.get("question"), str):
            raise ValueError(f"{where}: a task is an object with a `question` string")
        servers = row.get("servers")
        if not isinstance(servers, list) or not all(isinstance(s, str) for s in servers):
            raise ValueError(f"{where}: `servers` must be a list of MCP server names")
        judge = row.setdefault("judge", {"type": "answer"})
        if not isinstance(judge, dict) or judge.get("type") not in JUDGES:
            raise ValueError(f"{where}: judge type must be one of {list(JUDGES)}, got {judge!r}")
        if judge["type"] in ("answer", "contains") and "answer" not in row:
            raise ValueError(f"{where}: judge {judge['type']!r} needs the task's `answer`")
        if judge["type"] == "file" and not isinstance(judge.get("path"), str):
            raise ValueError(f"{where}: judge 'file' needs a `path` in the episode's folder")
        if judge["type"] == "tool" and not isinstance(judge.get("tool"), str):
            raise ValueError(f"{where}: judge 'tool' needs the `tool` to call")
        files = (row.get("fixture") or {}).get("files", {})
        if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
            raise ValueError(f"{where}: fixture.files maps relative paths to text")
        calls = (row.get("fixture") or {}).get("calls", [])
        if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls
        ):
            raise ValueError(f"{where}: fixture.calls is a list of {{name, arguments}} tool calls")
    return rows


class McpEnv(Env):
    """Tasks answered with MCP servers' tools (see the module's docstring).

    `mcp` is the env-server's hub of the servers its operator configured
    (`env_server.mcp`); the env host passes it, never a client.
    """

    blocking = True
    judges_itself = True

    def __init__(
        self,
        mcp: McpHub | None = None,
        task: str = "arithmetic",
        tasks: str | Sequence[dict[str, Any]] | None = None,
        servers: Sequence[str] | None = None,
        digits: int = 3,
        tool: str | None = None,
        max_turns: int = 4,
        max_calls: int = 4,
        instructions: str | None = None,
        domain: str = "math",
    ) -> None:
        if mcp is None:
            raise McpUnavailable(
                "the mcp env needs the env-server's MCP servers (env_server.mcp.servers)"
            )
        if tasks is None and task not in ("arithmetic", "files"):
            raise ValueError(f"unknown task {task!r}; choose arithmetic or files, or give tasks")
        self.hub = mcp
        self.task = task
        self.rows = _rows(tasks) if tasks is not None else None
        self.servers = list(servers) if servers is not None else None
        self.digits = int_kwarg("digits", digits, minimum=1, maximum=12)
        self.tool = tool
        self.max_turns = int_kwarg("max_turns", max_turns, minimum=1)
        self.max_calls = int_kwarg("max_calls", max_calls, minimum=1)
        if instructions is not None and "{question}" not in instructions:
            raise ValueError("instructions must contain {question}")
        self.instructions = (
            instructions or "{question} Use the tools, then reply <answer>...</answer>."
        )
        self.domain = domain
        self._episode: EpisodeServers | None = None
        self._row: dict[str, Any] = {}
        self._workdir: Path | None = None
        self._turns = 0
        self._done = False

    # -- tasks -----------------------------------------------------------------------------

    def _generated(self, rng: random.Random) -> dict[str, Any]:
        if self.task == "arithmetic":
            low = 10 ** (self.digits - 1)
            a, b = rng.randint(low, 10 * low - 1), rng.randint(10, 99)
            expression = f"{a} * {b}"
            tool = self.tool or "calculate"
            return {
                "question": f"What is {expression}?",
                "answer": str(a * b),
                "servers": self.servers or ["calculator"],
                "demo": [{"name": tool, "arguments": {"expression": expression}}],
            }
        word, code = rng.choice(WORDS), str(rng.randint(10**5, 10**6 - 1))
        name = f"notes/{word}.txt"
        return {
            "question": f"What is the code in {name}?",
            "answer": code,
            "servers": self.servers or ["files"],
            "fixture": {"files": {name: f"The code is {code}.\n"}},
            "demo": [{"name": self.tool or "read_text_file", "arguments": {"path": name}}],
        }

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.close()
        rng = random.Random(seed)
        if self.rows is None:
            row = self._generated(rng)
        else:
            row = self.rows[(seed if seed is not None else rng.randrange(1 << 30)) % len(self.rows)]
        self._row = row
        workdir, _ = self.hub.episode_folder()
        self._workdir = workdir
        for name, text in ((row.get("fixture") or {}).get("files") or {}).items():
            path = (workdir / name).resolve()
            if workdir.resolve() not in path.parents:
                raise ValueError(f"fixture file {name!r} leaves the episode's folder")
            if len(text.encode()) > MAX_FIXTURE_BYTES:
                raise ValueError(f"fixture file {name!r} is larger than {MAX_FIXTURE_BYTES} bytes")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        self._episode = EpisodeServers(self.hub, list(row["servers"]), workdir)
        try:
            self._episode.open()
        except McpServerLost as error:
            raise EpisodeAborted(str(error)) from None
        for call in (row.get("fixture") or {}).get("calls") or []:
            # Records to insert and the like: done through the servers' own tools.
            result = self._call(call["name"], dict(call.get("arguments") or {}))
            if result.startswith("error:"):
                raise ValueError(f"fixture call {call['name']!r} failed: {result[:200]}")
        self._turns, self._done = 0, False
        info = {
            "tools": json.dumps([tool.schema() for tool in self._episode.tools.values()]),
            "question": row["question"],
            "reference": str(row.get("answer", "")),
            "demo": row.get("demo", []),
            "max_turns": self.max_turns,
        }
        if not self.judges_itself:
            info["domain"] = row.get("domain", self.domain)
        return self.instructions.replace("{question}", row["question"]), info

    # -- steps -----------------------------------------------------------------------------

    def _call(self, name: str, arguments: dict[str, Any]) -> str:
        assert self._episode is not None
        if name not in self._episode.tools:
            offered = ", ".join(self._episode.tools) or "none"
            return f"error: there is no tool {name!r}; the tools are: {offered}"
        try:
            result = self._episode.call(name, arguments)
        except McpServerLost as error:
            raise EpisodeAborted(str(error)) from None
        if isinstance(result, Exception):  # the server refused the call
            return f"error: {result}"
        text, failed = result_text(result, self.hub.config.max_result_chars)
        return f"error: {text}" if failed else text

    def _judge(self, answer: str) -> bool:
        judge, row = self._row.get("judge", {"type": "answer"}), self._row
        kind = judge["type"]
        if kind == "answer":
            return _same(answer, str(row["answer"]))
        if kind == "contains":
            return str(row["answer"]).casefold() in answer.casefold()
        if kind == "file":
            assert self._workdir is not None
            path = (self._workdir / judge["path"]).resolve()
            if self._workdir.resolve() not in path.parents or not path.is_file():
                return False
            text = path.read_text(encoding="utf-8", errors="replace")
            if "equals" in judge:
                return text.strip() == str(judge["equals"]).strip()
            return str(judge.get("contains", row.get("answer", ""))) in text
        observation = self._call(judge["tool"], dict(judge.get("arguments", {})))
        return (
            not observation.startswith("error:")
            and str(judge.get("contains", row.get("answer", ""))) in observation
        )

    def step(self, action: str) -> StepResult:
        if self._episode is None:
            raise InvalidAction("call reset before step")
        if self._done:
            raise InvalidAction("the episode has ended; call reset to start another")
        self._turns += 1
        calls, errors = parse_calls(action)
        if not calls and not errors:
            answers = _ANSWER.findall(action)
            answer = (answers[-1] if answers else action).strip()
            self._done = True
            info: dict[str, Any] = {"turn": self._turns, "answer": answer[:200]}
            if not self.judges_itself:
                info.update(reference=str(self._row.get("answer", "")))
                info["domain"] = self._row.get("domain", self.domain)
                return "answered", 0.0, True, False, info
            correct = self._judge(answer)
            info["correct"] = correct
            return ("correct" if correct else "incorrect"), float(correct), True, False, info
        results = [f"error: {error}" for error in errors]
        for name, arguments in calls[: self.max_calls]:
            results.append(self._call(name, arguments))
        if len(calls) > self.max_calls:
            results.append(f"error: at most {self.max_calls} tool calls run per turn")
        truncated = self._turns >= self.max_turns
        self._done = truncated
        info = {
            "observation_role": "tool",
            "tools_called": [n for n, _ in calls],
            "turn": self._turns,
        }
        return "\n".join(results), 0.0, False, truncated, info

    def close(self) -> None:
        episode, self._episode = self._episode, None
        if episode is not None:
            episode.close()
        if self._workdir is not None:
            shutil.rmtree(self._workdir.parent, ignore_errors=True)
            self._workdir = None


class McpScoredEnv(McpEnv):
    """`McpEnv` whose final answer the reward-server scores (in the task's `domain`)."""

    judges_itself = False


def mcp_demonstrator(
    rng: random.Random, tool_rate: float = 0.5, wrong_rate: float = 0.6, **_: Any
) -> Act:
    """The mcp env's scripted player, for warm-up: either makes the task's `demo` calls and
    then answers the reference (`tool_rate` of episodes), or answers at once, wrongly
    (a number off by one, a word left out) `wrong_rate` of the time."""
    use_tools = rng.random() < tool_rate
    state: dict[str, Any] = {"turn": 0}

    def act(observation: Any, info: dict[str, Any]) -> str:
        state["turn"] += 1
        if state["turn"] == 1:
            state["reference"] = str(info.get("reference", ""))
            demo = info.get("demo") or []
            if use_tools and demo:
                return "".join(tool_call_text(c["name"], c.get("arguments", {})) for c in demo)
            answer = state["reference"]
            if rng.random() < wrong_rate:
                number = _number(answer)
                answer = str(int(number) + rng.choice((-1, 1))) if number is not None else ""
            return f"<answer>{answer}</answer>"
        return f"<answer>{state['reference']}</answer>"

    return act
