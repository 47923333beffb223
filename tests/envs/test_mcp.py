"""MCP servers' tools as environments: the call format, sessions that match the server,
servers that hang or die, the sandbox, every transport, and servers nobody here wrote."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rollwire.envs.base import EpisodeAborted, offered_tools
from rollwire.envs.client import LocalEnvs
from rollwire.envs.host import EnvCallError, SessionHost
from rollwire.envs.mcp_env import McpEnv, parse_calls, tool_call_text
from rollwire.envs.mcp_hub import McpHub, McpUnavailable
from rollwire.envs.pool import EnvPool
from rollwire.services.core.config import EnvServerConfig, McpConfig
from rollwire.services.core.metrics import COUNTERS
from rollwire.services.core.sandbox import bwrap_path

ROOT = Path(__file__).resolve().parents[2]
HELPERS = ROOT / "tests" / "helpers"
SERVER = str(HELPERS / "mcp_server.py")
NODE_BIN = ROOT / "deploy" / "mcp-servers" / "node_modules" / ".bin"
CALCULATOR_PYTHON = ROOT / ".venv-mcp-servers" / "bin" / "python"
INSTALL = "deploy/install.sh installs it"

needs_bwrap = pytest.mark.skipif(bwrap_path() is None, reason=f"bubblewrap is missing; {INSTALL}")
needs_node_servers = pytest.mark.skipif(
    not (NODE_BIN / "mcp-server-filesystem").exists(),
    reason=f"the npm MCP servers are not installed (deploy/mcp-servers); {INSTALL}",
)


def stdio(**settings: Any) -> dict[str, Any]:
    """The test server over stdio, as a plain child process unless told otherwise."""
    return {"command": sys.executable, "args": [SERVER], "sandbox": "none", **settings}


@pytest.fixture
def hubs():
    """Makes hubs and stops every server they started."""
    made: list[McpHub] = []

    def make(servers: dict[str, Any], **settings: Any) -> McpHub:
        hub = McpHub(McpConfig(servers=servers, **settings))
        made.append(hub)
        return hub

    yield make
    for hub in made:
        hub.close()


@pytest.fixture
def in_process(monkeypatch):
    monkeypatch.syspath_prepend(str(HELPERS))
    return {"module": "mcp_server:server"}


def tasks(*rows: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"servers": ["test"], **row} for row in rows]


def test_tool_calls_are_read_in_the_hermes_format() -> None:
    text = (
        'let me add <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
        '<tool_call>{"name": "recall", "arguments": "{\\"key\\": \\"k\\"}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>"
        '<tool_call>{"name": "add", "arguments": 7}</tool_call>'
    )
    calls, errors = parse_calls(text)
    assert calls == [("add", {"a": 2, "b": 3}), ("recall", {"key": "k"})]
    assert len(errors) == 3
    assert "not valid JSON" in errors[0] and '{"name"' in errors[1] and "'add'" in errors[2]
    assert parse_calls(tool_call_text("add", {"a": 1})) == ([("add", {"a": 1})], [])

    # `info["tools"]` is JSON text of schemas; another env's list of names there is not.
    schema = {"type": "function", "function": {"name": "add", "parameters": {}}}
    assert offered_tools({"tools": json.dumps([schema])}) == [schema]
    assert offered_tools({"tools": ["calc"]}) is offered_tools({"tools": "[1]"}) is None


def test_an_in_process_server_answers_and_every_mistake_is_an_observation(hubs, in_process) -> None:
    hub = hubs({"test": in_process})
    env = McpEnv(mcp=hub, tasks=tasks({"question": "What is 2 + 3?", "answer": "5"}))
    observation, info = env.reset(0)
    assert observation.startswith("What is 2 + 3?")
    offered = json.loads(info["tools"])
    names = [tool["function"]["name"] for tool in offered]
    assert {"add", "remember", "recall", "fail", "sleep", "crash"} <= set(names)
    add = next(t for t in offered if t["function"]["name"] == "add")["function"]
    assert add["parameters"]["required"] == ["a", "b"] and "Adds" in add["description"]
    result = env.step(tool_call_text("add", {"a": 2, "b": 3}))
    assert result[:4] == ("5", 0.0, False, False) and result[4]["observation_role"] == "tool"
    failed = env.step(tool_call_text("fail", {"message": "no luck"}))[0]
    assert failed.startswith("error:") and "fail" in failed, failed  # the server's own words
    env2 = McpEnv(mcp=hub, max_turns=8, tasks=tasks({"question": "q", "answer": "5"}))
    env2.reset(0)
    assert "no tool 'nope'" in env2.step(tool_call_text("nope", {}))[0]
    assert "not valid JSON" in env2.step("<tool_call>{</tool_call>")[0]
    refused = env2.step(tool_call_text("add", {"a": "x"}))[0]
    assert refused.startswith("error:"), refused  # the server's own validation
    observation, reward, terminated, _truncated, info = env2.step("<answer> 5 </answer>")
    assert (reward, terminated, info["correct"]) == (1.0, True, True)
    env.close()
    env2.close()


def test_a_stateful_server_gets_its_own_process_each_episode_and_a_shared_one_does_not(
    hubs,
) -> None:
    hub = hubs({"own": stdio(session="episode"), "shared": stdio(session="shared", prefix="s_")})
    rows = [{"question": "q", "answer": "x", "servers": ["own", "shared"]}]
    first, second = McpEnv(mcp=hub, tasks=rows), McpEnv(mcp=hub, tasks=rows)
    first.reset(0)
    first.step(
        tool_call_text("remember", {"key": "k", "value": "one"})
        + tool_call_text("s_remember", {"key": "k", "value": "both"})
    )
    second.reset(1)
    answer = second.step(
        tool_call_text("recall", {"key": "k"}) + tool_call_text("s_recall", {"key": "k"})
    )[0]
    assert answer.split("\n") == ["nothing", "both"]
    first.close()
    second.close()


def test_a_server_that_hangs_or_dies_is_restarted_and_the_episode_aborted(hubs) -> None:
    hub = hubs({"test": stdio()}, call_timeout_s=1.0)
    rows = tasks({"question": "q", "answer": "5"})
    hung, died = (COUNTERS.get("env_mcp_lost", server="test", why=w) for w in ("hang", "exit"))
    restarts = COUNTERS.get("env_mcp_restarts", server="test")
    for call in (
        tool_call_text("sleep", {"seconds": 30}),
        tool_call_text("crash", {}),
    ):
        env = McpEnv(mcp=hub, tasks=rows)
        env.reset(0)
        started = time.monotonic()
        with pytest.raises(EpisodeAborted, match="MCP server 'test'"):
            env.step(call)
        assert time.monotonic() - started < 10
        env.close()
        # The next episode runs on a fresh server.
        env = McpEnv(mcp=hub, tasks=rows)
        env.reset(1)
        assert env.step(tool_call_text("add", {"a": 2, "b": 3}))[0] == "5"
        env.close()
    assert COUNTERS.get("env_mcp_lost", server="test", why="hang") == hung + 1
    assert COUNTERS.get("env_mcp_lost", server="test", why="exit") == died + 1
    assert COUNTERS.get("env_mcp_restarts", server="test") == restarts + 2


def test_per_episode_servers_are_bounded(hubs, in_process) -> None:
    # In-process sessions start at once, so a short start limit is only the wait for a slot.
    own = {**in_process, "session": "episode"}
    hub = hubs({"own": own}, max_episode_servers=1, start_timeout_s=1.0)
    rows = [{"question": "q", "answer": "x", "servers": ["own"]}]
    first, second = McpEnv(mcp=hub, tasks=rows), McpEnv(mcp=hub, tasks=rows)
    first.reset(0)
    with pytest.raises(McpUnavailable, match="max_episode_servers"):
        second.reset(1)
    first.close()
    second.reset(1)
    assert second.step(tool_call_text("add", {"a": 1, "b": 1}))[0] == "2"
    second.close()


@needs_bwrap
def test_a_sandboxed_server_sees_its_episode_folder_and_not_the_host(hubs, tmp_path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    server = stdio(session="episode", sandbox="bwrap", read_only=[str(HELPERS)])
    hub = hubs({"test": server})
    rows = tasks(
        {
            "question": "q",
            "answer": "x",
            "fixture": {"files": {"notes/a.txt": "laid down"}},
            "judge": {"type": "file", "path": "out.txt", "contains": "42"},
        }
    )
    env = McpEnv(mcp=hub, tasks=rows)
    env.reset(0)
    assert env.step(tool_call_text("read", {"path": "notes/a.txt"}))[0] == "laid down"
    assert env.step(tool_call_text("read", {"path": str(secret)}))[0].startswith("cannot read")
    assert env.step("<answer>x</answer>")[1] == 0.0  # the file judge: out.txt was not written
    env.close()


@pytest.mark.parametrize("transport", ["streamable-http", "sse"])
def test_a_server_over_http_with_a_token(hubs, tmp_path, monkeypatch, transport) -> None:
    ready = tmp_path / "url"
    flag = "--http" if transport == "streamable-http" else "--sse"
    process = subprocess.Popen(
        [sys.executable, SERVER, flag, str(ready)],
        env={**os.environ, "MCP_TEST_TOKEN": "sesame"},
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert process.poll() is None, "the HTTP server exited"
            assert time.monotonic() < deadline, "the HTTP server did not start in 60 s"
            time.sleep(0.05)
        monkeypatch.setenv("TEST_MCP_TOKEN", "sesame")
        server = {"url": ready.read_text(), "transport": transport, "token_env": "TEST_MCP_TOKEN"}
        hub = hubs({"test": server})
        env = McpEnv(mcp=hub, tasks=tasks({"question": "q", "answer": "9"}))
        env.reset(0)
        assert env.step(tool_call_text("add", {"a": 4, "b": 5}))[0] == "9"
        assert env.step("<answer>9</answer>")[1] == 1.0
        env.close()
        monkeypatch.setenv("TEST_MCP_TOKEN", "wrong")
        refused = hubs({"test": server}, start_timeout_s=10.0)
        with pytest.raises(McpUnavailable, match="failed to start"):
            McpEnv(mcp=refused, tasks=tasks({"question": "q", "answer": "9"})).reset(0)
        monkeypatch.delenv("TEST_MCP_TOKEN")
        unset = hubs({"test": server})
        with pytest.raises(McpUnavailable, match="TEST_MCP_TOKEN"):
            McpEnv(mcp=unset, tasks=tasks({"question": "q", "answer": "9"})).reset(0)
    finally:
        process.terminate()
        process.wait(10)


def test_the_env_server_owns_the_servers_and_says_what_is_wrong(in_process) -> None:
    config = EnvServerConfig(mcp=McpConfig(servers={"test": in_process}))
    host = SessionHost(config)
    with pytest.raises(EnvCallError) as refused:
        host.reset("mcp", 0, {"mcp": "mine", "tasks": tasks({"question": "q", "answer": "1"})})
    assert refused.value.code == "PERMISSION_DENIED"
    with pytest.raises(EnvCallError) as unknown:
        host.reset("mcp", 0, {"servers": ["calc"]})
    assert unknown.value.code == "FAILED_PRECONDITION"
    assert (
        "no MCP server 'calc'" in unknown.value.message
        and "configured: test" in unknown.value.message
    )
    _session, _, info = host.reset("mcp", 0, {"tasks": tasks({"question": "q", "answer": "1"})})
    assert info["tools"]
    host.close_all()


@pytest.fixture(scope="module")
def tokenizer():
    from rollwire.services.core.tiny import build_tokenizer

    return build_tokenizer()


def scripted(tokenizer: Any, actions: list[str]):
    """Stands in for the rollout-server: each turn's answer is the next scripted text."""
    from rollwire.proto.v1 import rollout_pb2

    async def generate(prompt, max_new_tokens, temperature, images=()):
        ids = [*tokenizer(actions.pop(0), add_special_tokens=False)["input_ids"]]
        ids.append(tokenizer.eos_token_id)
        return rollout_pb2.GenerateResponse(
            token_ids=ids, logprobs=[-0.5] * len(ids), policy_versions=[1] * len(ids)
        )

    return generate


def test_a_lost_tool_server_restarts_the_episode_on_the_same_env_server(tokenizer) -> None:
    from rollwire.rollout.orchestrator.agent import EpisodeRunner
    from rollwire.services.core.config import AgentConfig, EnvDataset
    from rollwire.services.core.datasets import EnvTasks

    config = EnvServerConfig(mcp=McpConfig(servers={"test": stdio()}))
    pool = EnvPool([LocalEnvs(config)])
    rows = tasks({"question": "What is 2 + 3?", "answer": "5"})
    task = EnvTasks(EnvDataset(env_id="mcp", env_kwargs={"tasks": rows}, seed=0))[0]
    actions = [
        tool_call_text("crash", {}),
        tool_call_text("add", {"a": 2, "b": 3}),
        "<answer>5</answer>",
    ]

    async def unscored(*_: Any):
        raise AssertionError("the mcp env judges itself")

    async def go():
        specs = await pool.specs()
        runner = EpisodeRunner(
            pool, specs, tokenizer, AgentConfig(max_episode_tokens=1024), 64, False,
            scripted(tokenizer, actions), unscored,
        )  # fmt: skip
        return runner, await runner.run(task, 0, 1.0)

    runner, trajectory = asyncio.run(go())
    assert runner.restarts == 1 and trajectory.reward == 1.0
    assert pool.lost_count == 0  # the env-server stayed in the pool
    text = tokenizer.decode(trajectory.token_ids.tolist())
    assert "Tools:\nadd(a: integer, b: integer): Adds two integers." in text
    assert text.count("crash") == 1  # in the tool list only: the restarted episode is fresh
    assert runner.drifts == 0
    pool.backends[0].host.close_all()


QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n"
    "{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m.content }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A chat template that renders tools and tool turns the way Qwen's does."""


def test_a_template_that_takes_tools_renders_them_and_the_tool_turns(tokenizer) -> None:
    from transformers import PreTrainedTokenizerFast

    from rollwire.rollout.orchestrator.agent import ChatTurns, token_drift

    chat = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|im_end|>", pad_token="<pad>"
    )
    chat.add_special_tokens({"eos_token": "<|im_end|>"})
    chat.chat_template = QWEN_LIKE
    tools = [{"type": "function", "function": {"name": "add", "description": "Adds.",
              "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]  # fmt: skip
    turns = ChatTurns(chat, None)
    ids, _ = turns.first("What is 2 + 3?", tools)
    text = chat.decode(ids)
    assert text.startswith("<|im_start|>system\n# Tools\n<tools>{") and '"name": "add"' in text
    action = tool_call_text("add", {"a": 2, "b": 3})
    ids += chat(action, add_special_tokens=False)["input_ids"] + [chat.eos_token_id]
    following, _ = turns.then(action, True, "5", role="tool")
    assert (
        chat.decode(following)
        == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    ids += following
    ids += chat("<answer>5</answer>", add_special_tokens=False)["input_ids"] + [chat.eos_token_id]
    assert token_drift(chat, turns.transcript("<answer>5</answer>", True), ids) is None
    # Tokens the template would not give back are found, at their position.
    drifted = [*ids[:-3], chat.convert_tokens_to_ids("<"), *ids[-2:]]
    assert token_drift(chat, turns.transcript("<answer>5</answer>", True), drifted) == len(ids) - 3


def test_a_template_without_tools_gets_the_plain_tool_prompt(tokenizer) -> None:
    from rollwire.rollout.orchestrator.agent import PlainTurns, token_drift, tool_lines

    tools = [{"type": "function", "function": {"name": "read", "description": "Reads  a file.",
              "parameters": {"properties": {"path": {"type": "string"}, "tail": {}}}}}]  # fmt: skip
    assert tool_lines(tools) == "read(path: string, tail: any): Reads a file."
    turns = PlainTurns(tokenizer, "{observation}\n")
    ids, _ = turns.first("Q?", tools)
    assert tokenizer.decode(ids).startswith(
        "Tools:\nread(path: string, tail: any): Reads a file.\n"
    )
    ids += tokenizer("<answer>1</answer>", add_special_tokens=False)["input_ids"]
    ids.append(tokenizer.eos_token_id)
    assert token_drift(tokenizer, turns.transcript("<answer>1</answer>", True), ids) is None


def test_servers_nobody_here_wrote(hubs) -> None:
    """mcp-server-everything and mcp-server-filesystem (npm, Node, stdio, sandboxed) and
    mcp-server-calculator (PyPI, its own virtual environment: it needs mcp<2)."""
    if not (NODE_BIN / "mcp-server-filesystem").exists() or not CALCULATOR_PYTHON.exists():
        pytest.skip(f"the MCP servers of deploy/install.sh are missing; {INSTALL}")
    modules = str(ROOT / "deploy" / "mcp-servers")
    hub = hubs(
        {
            "everything": {
                "command": str(NODE_BIN / "mcp-server-everything"),
                "args": ["stdio"],
                "read_only": [modules],
                "tools": ["echo", "get-sum"],
            },
            "files": {
                "command": str(NODE_BIN / "mcp-server-filesystem"),
                "args": ["{workdir}"],
                "session": "episode",
                "read_only": [modules],
                "tools": ["read_text_file", "write_file", "list_directory"],
            },
            "calculator": {
                "command": str(CALCULATOR_PYTHON),
                "args": ["-m", "mcp_server_calculator"],
            },
        }
    )
    env = McpEnv(mcp=hub, servers=["everything"], tasks=tasks({"question": "q", "answer": "x"}))
    env.rows[0]["servers"] = ["everything"]
    env.reset(0)
    observation = env.step(
        tool_call_text("get-sum", {"a": 2, "b": 3}) + tool_call_text("echo", {"message": "hi"})
    )[0]
    assert observation == "The sum of 2 and 3 is 5.\nEcho: hi"
    env.close()

    files = McpEnv(mcp=hub, task="files")
    question, info = files.reset(4)
    path = info["demo"][0]["arguments"]["path"]
    assert path in question and {t["function"]["name"] for t in json.loads(info["tools"])} == {
        "read_text_file", "write_file", "list_directory"}  # fmt: skip
    assert (
        f"The code is {info['reference']}."
        in files.step(tool_call_text("read_text_file", {"path": path}))[0]
    )
    assert "denied" in files.step(tool_call_text("read_text_file", {"path": "/etc/hostname"}))[0]
    assert files.step(f"<answer>{info['reference']}</answer>")[1] == 1.0
    files.close()

    written = McpEnv(mcp=hub, tasks=[{"question": "Write 42 to out.txt.", "servers": ["files"],
                                      "judge": {"type": "file", "path": "out.txt", "equals": "42"}}])  # fmt: skip
    written.reset(0)
    assert (
        "Success"
        in written.step(tool_call_text("write_file", {"path": "out.txt", "content": "42"}))[0]
    )
    assert written.step("done")[1] == 1.0
    written.close()

    product = McpEnv(mcp=hub, task="arithmetic", digits=3)
    question, info = product.reset(9)
    expression = info["demo"][0]["arguments"]["expression"]
    assert (
        product.step(tool_call_text("calculate", {"expression": expression}))[0]
        == info["reference"]
    )
    assert "error" in product.step(tool_call_text("calculate", {"expression": "1/0"}))[0].lower()
    product.close()


@pytest.mark.integration
async def test_env_check_checks_an_mcp_env_and_its_tools(start_service, in_process) -> None:
    from rollwire.envs.check import CheckOptions, run_checks
    from rollwire.envs.server import registrations

    config = EnvServerConfig(mcp=McpConfig(servers={"test": in_process}))
    runtime = await start_service(registrations(config))
    options = CheckOptions(
        env_id="mcp", env_kwargs={"tasks": tasks({"question": "q", "answer": "1"})}, sessions=8
    )
    report = await run_checks(runtime.address, options)
    assert report.passed, report.results
    assert report.result("tool_calls").outcome == "pass"
    assert "add" in report.result("tool_calls").detail


def test_a_judge_can_ask_the_server_about_its_state(hubs, in_process) -> None:
    """A fixture's calls set the server up before the episode; `judge: tool` calls a tool
    after it: here, was the value stored?"""
    hub = hubs({"test": in_process})
    fixture = {"calls": [{"name": "remember", "arguments": {"key": "shape", "value": "cube"}}]}
    seeded = McpEnv(mcp=hub, tasks=tasks({"question": "q", "answer": "x", "fixture": fixture}))
    seeded.reset(0)
    assert seeded.step(tool_call_text("recall", {"key": "shape"}))[0] == "cube"
    seeded.close()
    judge = {"type": "tool", "tool": "recall", "arguments": {"key": "colour"}, "contains": "teal"}
    rows = tasks({"question": "Store teal under colour.", "judge": judge})
    for value, reward in (("teal", 1.0), ("grey", 0.0)):
        env = McpEnv(mcp=hub, tasks=rows)
        env.reset(0)
        env.step(tool_call_text("remember", {"key": "colour", "value": value}))
        assert env.step("stored")[1] == reward
        env.close()


def test_the_scored_env_leaves_the_reward_to_the_reward_server(tokenizer, in_process) -> None:
    from rollwire.rollout.orchestrator.agent import EpisodeRunner
    from rollwire.services.core.config import AgentConfig, EnvDataset
    from rollwire.services.core.datasets import EnvTasks

    config = EnvServerConfig(mcp=McpConfig(servers={"test": in_process}))
    pool = EnvPool([LocalEnvs(config)])
    rows = tasks({"question": "What is 2 + 3?", "answer": "5", "domain": "reasoning_gym"})
    task = EnvTasks(EnvDataset(env_id="mcp_scored", env_kwargs={"tasks": rows}, seed=0))[0]
    actions = [tool_call_text("add", {"a": 2, "b": 3}), "The sum is <answer>5</answer>"]
    scored = []

    async def score(spec, prompt, response, info):
        scored.append((spec.env_id, prompt, response, info["reference"], info["domain"]))
        return 0.75, {"correct": 0.75}

    async def go():
        specs = await pool.specs()
        runner = EpisodeRunner(
            pool, specs, tokenizer, AgentConfig(max_episode_tokens=1024), 64, False,
            scripted(tokenizer, actions), score,
        )  # fmt: skip
        return await runner.run(task, 0, 1.0)

    trajectory = asyncio.run(go())
    assert scored == [
        ("mcp_scored", "What is 2 + 3? Use the tools, then reply <answer>...</answer>.",
         "The sum is <answer>5</answer>", "5", "reasoning_gym"),
    ]  # fmt: skip
    assert trajectory.reward == 0.75
    pool.backends[0].host.close_all()
