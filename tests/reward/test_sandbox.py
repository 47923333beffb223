"""The code sandbox: what runs, what is limited, and the usual escapes contained.

The escape tests run under `bwrap`, the boundary. `ROLLWIRE_SANDBOX_KIND=none pytest
tests/reward/test_sandbox.py -m integration` runs the same tests under the guard-only kind, to see
which escapes only bubblewrap stops (several of them fail there, as they should).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from rollwire.services.core import sandbox as sandbox_module
from rollwire.services.core.sandbox import Limits, Sandbox, SandboxUnavailable

KIND = os.environ.get("ROLLWIRE_SANDBOX_KIND", "bwrap")
NO_BWRAP = sandbox_module.bwrap_path() is None
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        KIND == "bwrap" and NO_BWRAP,
        reason="bubblewrap is not installed; bash deploy/install.sh installs it",
    ),
]


@pytest.fixture
def box() -> Sandbox:
    return Sandbox(KIND, max_parallel=4)


def processes_with(marker: str) -> list[int]:
    """Host pids whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_a_program_gets_its_files_stdin_and_a_clean_environment(box: Sandbox) -> None:
    program = (
        "import os, sys\n"
        "print(open(sys.argv[1]).read().strip(), sys.stdin.read().strip())\n"
        "print(sorted(os.listdir('.')), 'SECRET_TOKEN' in os.environ)\n"
    )
    os.environ["SECRET_TOKEN"] = "host value"
    try:
        result = box.run(
            ["{python}", "-I", "{src}/main.py", "{src}/data/input.txt"],
            files={"main.py": program, "data/input.txt": "from a file"},
            stdin="from stdin",
        )
    finally:
        del os.environ["SECRET_TOKEN"]
    assert result.ok, result.output
    assert result.output.splitlines() == ["from a file from stdin", "[] False"]


def test_a_file_name_may_not_leave_the_sandbox_folder(box: Sandbox) -> None:
    with pytest.raises(ValueError, match="leaves the sandbox"):
        box.run(["{python}", "-c", "pass"], files={"../x.py": "print(1)"})


def test_output_is_cut_and_its_tail_kept(box: Sandbox) -> None:
    result = box.run_python("print('x' * 10_000)\nprint('end')", Limits(max_output_chars=100))
    assert result.ok and result.truncated
    assert result.output == "x" * 100 and result.tail.endswith("end\n")


def test_an_infinite_loop_is_killed_at_the_wall_clock(box: Sandbox) -> None:
    result = box.run_python("while True:\n    pass", Limits(timeout_s=0.5))
    assert result.timed_out and not result.ok and result.exit_code < 0


def test_a_sleeping_program_is_killed_at_the_wall_clock(box: Sandbox) -> None:
    result = box.run_python("import time\ntime.sleep(30)", Limits(timeout_s=0.5))
    assert result.timed_out and result.seconds < 10


def test_a_memory_bomb_fails_inside_the_sandbox(box: Sandbox) -> None:
    result = box.run_python(
        "blocks = []\nwhile True:\n    blocks.append(bytearray(10**7))", Limits(memory_mb=128)
    )
    assert not result.ok and not result.timed_out
    assert result.tail.rstrip().endswith("MemoryError")


def test_a_big_file_fails_at_the_file_limit(box: Sandbox) -> None:
    result = box.run_python(
        "with open('big', 'wb') as f:\n    f.write(b'x' * (3 * 2**20))", Limits(file_mb=1)
    )
    assert not result.ok and "File too large" in result.tail + result.output


def test_no_network_not_even_to_the_hosts_loopback(box: Sandbox) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
        result = box.run_python(code)
        with pytest.raises(TimeoutError):
            listener.accept()
    assert not result.ok and "connected" not in result.output


def test_the_hosts_files_are_not_there(box: Sandbox, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("the host's secret")
    code = (
        "import pathlib\n"
        f"for path in [{str(secret)!r}, '/etc/passwd', '/root', {str(Path.cwd())!r}]:\n"
        "    try:\n"
        "        p = pathlib.Path(path)\n"
        "        print(path, p.read_text() if p.is_file() else sorted(x.name for x in p.iterdir()))\n"
        "    except OSError as error:\n"
        "        print(path, 'refused', type(error).__name__)\n"
    )
    result = box.run_python(code)
    assert result.ok, result.output
    lines = result.output.splitlines()
    assert len(lines) == 4 and all(" refused " in line for line in lines), result.output
    assert "secret" not in result.output.replace("secret.txt", "")


def test_writing_outside_the_work_folder_reaches_no_host_file(box: Sandbox, tmp_path: Path) -> None:
    target = tmp_path / "escaped.txt"
    system = Path(f"/usr/rollwire-escaped-{uuid.uuid4().hex}")
    code = (
        f"for path in [{str(target)!r}, {str(system)!r}, '/src/escaped.txt']:\n"
        "    try:\n"
        "        open(path, 'w').write('out')\n"
        "        print(path, 'written')\n"
        "    except OSError as error:\n"
        "        print(path, 'refused', type(error).__name__)\n"
    )
    try:
        result = box.run_python(code)
        assert result.ok, result.output
        assert not target.exists() and not system.exists()
    finally:
        system.unlink(missing_ok=True)  # only ever there if the sandbox failed
    assert all(" refused " in line for line in result.output.splitlines()), result.output


def test_a_fork_bomb_is_held_to_the_process_limit_and_leaves_nothing(box: Sandbox) -> None:
    marker = f"rollwire-fork-bomb-{uuid.uuid4().hex}"
    code = (
        "import os, sys\n"
        "started = 0\n"
        "while True:\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
        "    started += 1\n"
        "    if started > 500:\n"
        "        break\n"
        "print('started', started, flush=True)\n"
    )
    result = box.run_python(code, Limits(timeout_s=5, processes=16))
    assert result.output.startswith("started"), result.output
    assert int(result.output.split()[1]) <= 16
    deadline = time.monotonic() + 5
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(marker) == []


def test_a_daemon_it_leaves_behind_dies_with_the_run(box: Sandbox) -> None:
    marker = f"rollwire-daemon-{uuid.uuid4().hex}"
    code = (
        "import os, sys\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
        "    os._exit(0)\n"
        "print('parent done')\n"
    )
    result = box.run_python(code)
    assert result.ok, result.output
    deadline = time.monotonic() + 5
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(marker) == []


def test_it_cannot_kill_its_parent_or_another_host_process(box: Sandbox) -> None:
    sentinel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        code = (
            "import os, signal\n"
            f"for pid in [os.getppid(), {sentinel.pid}, {os.getpid()}, 1]:\n"
            "    try:\n"
            "        os.kill(pid, signal.SIGKILL)\n"
            "    except OSError as error:\n"
            "        print(pid, type(error).__name__)\n"
        )
        result = box.run_python(code)
        time.sleep(0.2)
        assert sentinel.poll() is None, "the sandbox killed a host process"
        assert result.exit_code in (0, 1)
    finally:
        sentinel.kill()
        sentinel.wait(timeout=10)


def test_a_pair_talks_over_two_pipes_and_neither_sees_the_other(box: Sandbox) -> None:
    """`run_pair`: the program's stdout is the judge's stdin and back; the judge's
    stderr is the verdict. The program cannot find the judge's process or files."""
    program = (
        "import os, sys\n"
        "visible = sorted(p for p in os.listdir('/proc') if p.isdigit())\n"
        "files = sorted(os.listdir('/src'))\n"
        "print(len(visible) <= 3, files, flush=True)\n"
        "print(sys.stdin.readline().strip()[::-1], flush=True)\n"
    )
    judge = (
        "import sys\n"
        "seen = sys.stdin.readline().strip()\n"
        "print('olleh', flush=True)\n"
        "sys.stderr.write(seen + ' | ' + sys.stdin.readline().strip() + '\\n')\n"
    )
    result = box.run_pair(
        (["{python}", "-I", "-S", "{src}/judge.py"], {"judge.py": judge, "secret.txt": "tests"}),
        (["{python}", "-I", "-S", "{src}/main.py"], {"main.py": program}),
        Limits(timeout_s=20),
    )
    assert result.exit_code == 0 and not result.timed_out, result
    assert result.verdict.decode().strip() == "True ['main.py'] | hello"


def test_a_pair_that_hangs_ends_both_at_the_wall_clock(box: Sandbox) -> None:
    marker = f"rollwire-pair-{uuid.uuid4().hex}"
    sleeper = f"import time; time.sleep(60)  # {marker}\n"
    result = box.run_pair(
        (["{python}", "-I", "-S", "{src}/a.py", marker], {"a.py": sleeper}),
        (["{python}", "-I", "-S", "{src}/b.py", marker], {"b.py": sleeper}),
        Limits(timeout_s=1),
    )
    assert result.timed_out and 1 <= result.seconds < 10
    deadline = time.monotonic() + 5  # the kernel ends a killed namespace's processes soon after
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(marker) == []


def test_runs_beyond_max_parallel_wait_for_a_slot() -> None:
    box = Sandbox(KIND, max_parallel=2)
    code = "import time\nstart = time.time()\ntime.sleep(0.4)\nprint('span', start, time.time())"
    results = []

    def one() -> None:
        results.append(box.run_python(code))

    threads = [threading.Thread(target=one) for _ in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(results) == 5 and all(r.ok for r in results), [r.output for r in results]
    # The program's own line: the output may also hold a log line written at fork time
    # by a library of this (multi-threaded) test process, e.g. gRPC's "E1203 ..." one.
    lines = [next(x for x in r.output.splitlines() if x.startswith("span ")) for r in results]
    spans = [tuple(map(float, line.split()[1:])) for line in lines]
    overlap = max(sum(start <= t < end for start, end in spans) for t, _ in spans)
    assert overlap <= 2


def test_without_bubblewrap_the_sandbox_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name, path=None: None)
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap.*kind: none"):
        Sandbox("bwrap")
    assert Sandbox("none").kind == "none"


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="kind"):
        Sandbox("docker")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="memory_mb"):
        Limits(memory_mb=8)
    with pytest.raises(ValueError, match="timeout_s"):
        Limits(timeout_s=0)


@pytest.mark.parametrize(
    ("code", "refused"),
    [
        ("import socket\nsocket.socket()", "socket.__new__ is not allowed"),
        ("import subprocess\nsubprocess.run(['true'])", "subprocess.Popen is not allowed"),
        ("import os\nos.system('true')", "os.system is not allowed"),
        ("import os\nos.fork()", "os.fork is not allowed"),
        ("import os\nos.kill(os.getppid(), 9)", "os.kill is not allowed"),
        ("import ctypes", "ctypes is not available"),
    ],
)
def test_the_guard_of_kind_none_refuses_processes_and_sockets(code: str, refused: str) -> None:
    result = Sandbox("none").run_python(code)
    assert not result.ok and refused in result.tail
