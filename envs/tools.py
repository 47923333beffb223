"""Tool use: a calculator and a sandboxed Python the policy calls before it answers.

`calculate` is a safe arithmetic evaluator built on `ast` (no eval);
`ToolUse` is the `tool_use` environment and `tool_use_demonstrator` its
scripted player for warm-up.
"""

from __future__ import annotations

import ast
import math
import operator
import random
import re
from collections.abc import Callable, Sequence
from typing import Any

from rollwire.envs.base import Act, Env, InvalidAction, StepResult
from rollwire.envs.games import int_kwarg
from rollwire.services.core.sandbox import Limits, Sandbox

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 1000
MAX_RESULT_DIGITS = 100
"""Integer results past 10**MAX_RESULT_DIGITS are refused: they cost time and help no one."""


class CalcError(ValueError):
    """The expression is not plain arithmetic, or its result is out of bounds."""


_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


def _checked(value: int | float) -> int | float:
    if isinstance(value, int) and abs(value) >= 10**MAX_RESULT_DIGITS:
        raise CalcError("result too large")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("result too large")
    return value


def _power(base: int | float, exponent: int | float) -> int | float:
    if abs(exponent) > MAX_EXPONENT:
        raise CalcError(f"exponent {exponent} is too large (limit {MAX_EXPONENT})")
    # Estimate the size first: computing 99**999 only to refuse it wastes time.
    whole = isinstance(base, int) and isinstance(exponent, int) and exponent > 0
    if whole and (abs(base).bit_length() - 1) * exponent > MAX_RESULT_DIGITS * 3.33:
        raise CalcError("result too large")
    try:
        result = base**exponent
    except OverflowError:
        raise CalcError("result too large") from None
    if isinstance(result, complex):
        raise CalcError("a negative number to a fractional power is not a real number")
    return result


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalcError(f"unsupported value {node.value!r}; only numbers")
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _checked(_power(left, right))
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except OverflowError:
            raise CalcError("result too large") from None
    raise CalcError(
        f"unsupported syntax: {ast.unparse(node)[:40]!r}; use numbers, + - * / // % ** and ()"
    )


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression over ints and floats.

    Allowed: numbers, + - * / // % **, unary + and -, parentheses. Exponents
    are capped at MAX_EXPONENT and integer results at MAX_RESULT_DIGITS digits,
    so no expression can hang the env-server. Raises CalcError (a ValueError)
    with a short reason, or ZeroDivisionError.
    """
    text = expression.strip()
    if not text:
        raise CalcError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalcError(f"not an arithmetic expression: {text[:40]!r}") from None
    return _evaluate(tree)


def format_number(value: int | float) -> str:
    """Short text for a number: whole floats without '.0', others to 10 significant digits."""
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.10g}"
    return str(value)


def _parse_number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").replace(" ", ""))
    except ValueError:
        return None


_TOOL_CALL = re.compile(r"<(calc|python)>(.*?)</\1>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_QUESTION = re.compile(r"What is (.+?)\?")
_INTEGER = re.compile(r"-?\d+")
TOOLS = ("calc", "python")
OPS = ("+", "-", "*", "/")


class ToolUse(Env):
    """Answer an arithmetic question, calling tools first if useful.

    Call format. An action is one of:

    - a calculator call `<calc>EXPR</calc>`, e.g. `<calc>37 + 45</calc>`:
      numbers, + - * / // % **, parentheses (see `calculate`);
    - a Python call `<python>CODE</python>`: CODE runs in a fresh sandbox
      (`rollwire.services.core.sandbox`: bubblewrap with no network and no host
      files, or with `sandbox="none"` a limited child process that is only a
      guard; on an env-server the operator's `env_server.sandbox` decides, not the
      client) and what it prints comes back, so it must `print` its result;
      nothing carries over between calls; the standard library only;
    - a final answer `<answer>TEXT</answer>`, e.g. `<answer>82</answer>`.

    An `<answer>` ends the episode even if the action also holds a tool call
    (the last `<answer>` counts, as in the reward-server's scorers);
    otherwise the first tool call in the text runs, one per turn. The tool's
    output is the next observation, a short string: the result (`82`) or an
    error (`error: division by zero`). Text with neither a tool call nor an
    answer is not rejected: it gets the observation "no tool call or answer
    found; ..." with reward 0 and uses a turn.

    Reward 1.0 when the answer equals the reference as a number (commas and
    spaces ignored), else 0. Truncated after `max_turns` actions.

    Questions (`task="arithmetic"`): `a OP b` with `digits`-digit operands
    and OP drawn from `ops` (+ - * /); division questions are built so the
    answer is a whole number. The default first observation is
    "What is 37 + 45? Use <calc>...</calc> to compute, then reply <answer>N</answer>.";
    `instructions` replaces it and must contain "{question}".

    With the python tool enabled the env is `blocking`: a step may wait up to
    `python_timeout_s` on a subprocess, so the env host runs its calls in a
    thread pool instead of on the event loop that serves every other session.
    """

    blocking: bool = False

    def __init__(
        self,
        task: str = "arithmetic",
        digits: int = 2,
        ops: Sequence[str] = ("+",),
        tools: Sequence[str] = TOOLS,
        max_turns: int = 4,
        instructions: str | None = None,
        python_timeout_s: float = 2.0,
        python_memory_mb: int = 256,
        max_output_chars: int = 200,
        sandbox: str = "bwrap",
    ) -> None:
        if task != "arithmetic":
            raise ValueError(f"unknown task {task!r}; the only task is 'arithmetic'")
        self.digits = int_kwarg("digits", digits, minimum=1, maximum=9)
        self.ops = self._choices("ops", ops, OPS, allow_empty=False)
        self.tools = self._choices("tools", tools, TOOLS, allow_empty=True)
        self.blocking = "python" in self.tools
        self.max_turns = int_kwarg("max_turns", max_turns, minimum=1)
        if instructions is None:
            hint = "<calc>...</calc>" if "calc" in self.tools else "<python>...</python>"
            instructions = (
                f"What is {{question}}? Use {hint} to compute, then reply <answer>N</answer>."
                if self.tools
                else "What is {question}? Reply <answer>N</answer>."
            )
        if not isinstance(instructions, str) or "{question}" not in instructions:
            raise ValueError(
                f"instructions must be text containing {{question}}, got {instructions!r}"
            )
        self.instructions = instructions
        if isinstance(python_timeout_s, bool) or not isinstance(python_timeout_s, int | float):
            raise TypeError(f"python_timeout_s must be a number, got {python_timeout_s!r}")
        if not 0 < python_timeout_s <= 60:
            raise ValueError(f"python_timeout_s must be in (0, 60], got {python_timeout_s}")
        self.python_timeout_s = float(python_timeout_s)
        self.python_memory_mb = int_kwarg("python_memory_mb", python_memory_mb, minimum=32)
        self.max_output_chars = int_kwarg("max_output_chars", max_output_chars, minimum=16)
        # Made here, so an env-server without bubblewrap refuses the env with the fix.
        self._sandbox = Sandbox(sandbox) if "python" in self.tools else None
        self._limits = Limits(
            timeout_s=self.python_timeout_s,
            memory_mb=self.python_memory_mb,
            max_output_chars=self.max_output_chars,
        )
        self._reference: int | None = None
        self._turns = 0
        self._done = False

    @staticmethod
    def _choices(
        name: str, values: Sequence[str], known: tuple[str, ...], allow_empty: bool
    ) -> tuple[str, ...]:
        if isinstance(values, str) or not isinstance(values, Sequence):
            raise TypeError(f"{name} must be a list of strings, got {values!r}")
        unknown = [v for v in values if v not in known]
        if unknown:
            raise ValueError(f"{name} has unknown entries {unknown}; choose from {list(known)}")
        if not values and not allow_empty:
            raise ValueError(f"{name} must not be empty; choose from {list(known)}")
        return tuple(dict.fromkeys(values))

    def _question(self, rng: random.Random) -> tuple[str, int]:
        low, high = 10 ** (self.digits - 1) if self.digits > 1 else 0, 10**self.digits - 1
        op = rng.choice(self.ops)
        a, b = rng.randint(low, high), rng.randint(low, high)
        if op == "/":
            b = max(b, 1)
            return f"{a * b} / {b}", a
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return f"{a} {op} {b}", value

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        question, self._reference = self._question(random.Random(seed))
        self._turns = 0
        self._done = False
        info = {
            "reference": str(self._reference),
            "question": question,
            "enabled_tools": list(self.tools),  # not "tools": that key holds tool schemas
            "max_turns": self.max_turns,
        }
        return self.instructions.replace("{question}", question), info

    def _run_tool(self, name: str, argument: str) -> str:
        if name not in self.tools:
            available = ", ".join(f"<{t}>" for t in self.tools) or "none"
            return f"error: tool {name} is not available here; tools: {available}"
        if name == "calc":
            try:
                return format_number(calculate(argument))
            except ZeroDivisionError:
                return "error: division by zero"
            except CalcError as error:
                return f"error: {error}"
        assert self._sandbox is not None
        result = self._sandbox.run_python(argument, self._limits)
        if result.timed_out:
            return f"error: timed out after {self.python_timeout_s:g}s"
        if result.exit_code != 0:
            # The traceback's last line names the error; the rest would crowd a short context.
            last = [line for line in result.tail.splitlines() if line.strip()]
            text = f"error: {last[-1].strip()}" if last else f"error: exit code {result.exit_code}"
            return text[: self.max_output_chars]
        return result.output.strip() or "(no output; print the result)"

    def step(self, action: str) -> StepResult:
        if self._reference is None:
            raise InvalidAction("call reset before step")
        if self._done:
            raise InvalidAction("the episode has ended; call reset to start another")
        self._turns += 1
        answers = _ANSWER.findall(action)
        if answers:
            answer = answers[-1].strip()
            number = _parse_number(answer)
            correct = number is not None and math.isclose(number, self._reference, abs_tol=1e-9)
            self._done = True
            info = {"tool": None, "turn": self._turns, "answer": answer[:100], "correct": correct}
            return ("correct" if correct else "incorrect"), float(correct), True, False, info
        call = _TOOL_CALL.search(action)
        if call is None:
            hints = " or ".join([*(f"<{t}>...</{t}>" for t in self.tools), "<answer>N</answer>"])
            observation, tool = f"no tool call or answer found; use {hints}", None
        else:
            tool = call.group(1)
            observation = self._run_tool(tool, call.group(2))
        truncated = self._turns >= self.max_turns
        self._done = truncated
        return observation, 0.0, False, truncated, {"tool": tool, "turn": self._turns}


def tool_use_demonstrator(
    rng: random.Random, tool_rate: float = 0.25, off_by_one_rate: float = 0.6, **_: Any
) -> Act:
    """ToolUse's scripted player, for warm-up: either computes with the calculator and answers
    what it returned (`tool_rate` of episodes), or answers at once, off by one
    `off_by_one_rate` of the time."""
    use_tool = rng.random() < tool_rate
    state: dict[str, Any] = {"turn": 0}

    def act(observation: str, info: dict[str, Any]) -> str:
        state["turn"] += 1
        if state["turn"] == 1:
            state["reference"] = str(info.get("reference", ""))
            question = _QUESTION.search(observation)
            if use_tool and question:
                return f"<calc>{question.group(1).strip()}</calc>"
            answer = state["reference"]
            if rng.random() < off_by_one_rate and _INTEGER.fullmatch(answer):
                answer = str(int(answer) + 1)
            return f"<answer>{answer}</answer>"
        numbers = _INTEGER.findall(observation)
        return f"<answer>{numbers[-1] if numbers else state['reference']}</answer>"

    return act
