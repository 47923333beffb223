"""Run a snippet of Python in a separate, limited process: `run_python(code, ...)`.

What the child gets:

- its own process group, killed with SIGKILL when the wall-clock timeout
  passes (so a `while True: pass` or a `time.sleep(10**6)` ends on time);
- `RLIMIT_CPU` (the timeout rounded up, plus a second) and `RLIMIT_AS`
  (`memory_mb` of address space), so a memory bomb fails with MemoryError
  inside the child instead of exhausting the host; `RLIMIT_FSIZE` bounds any
  file it writes, `RLIMIT_CORE` 0 keeps crashes from dumping core;
- `python -I` (isolated: no PYTHON* variables, no user site, no cwd on the
  path), a minimal environment, stdin from /dev/null, and an empty temporary
  working directory that is removed afterwards;
- an audit hook, installed before the snippet runs, that refuses the audit
  events of socket creation and use (`socket.*`), starting programs
  (`subprocess.Popen`, `os.system`, `os.exec*`, `os.posix_spawn`, `os.spawn*`,
  `os.fork`, `os.forkpty`, `pty.spawn`), signalling other processes
  (`os.kill`, `os.killpg`) and loading C code through ctypes (importing
  `ctypes` and every `ctypes.*` event), and replacing a function's `__code__`
  (the one way to rewrite the hook itself). Python code cannot remove an audit hook.

What this does NOT stop, said plainly: it is a guard against accidents and
naive misuse by model-written code, not a security boundary. The child runs as
the same user as the env-server, so it can read and write any file that user
can (files are only size-limited); a C extension that is already installed can
make system calls (including socket(2)) without raising audit events; a
snippet that corrupts interpreter memory can get past the hook; the number of
threads is bounded only by `RLIMIT_AS`. `RLIMIT_AS` counts address space, not
resident memory, so libraries that reserve large mappings fail sooner than
their real use suggests. For untrusted code at scale, run the env-server in a
container or VM with no network (gVisor, nsjail, Firecracker) as well.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Runs inside the child with `python -I -u -c`; argv: snippet path, cpu seconds, memory bytes, file bytes.
_BOOTSTRAP = r"""
import resource, signal, sys

_path, _cpu, _memory, _file = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (_memory, _memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (_file, _file))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
# Past the file limit a write fails with OSError instead of the signal killing the child silently.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
with open(_path, encoding="utf-8") as _snippet:
    _source = _snippet.read()
# Tracebacks show the snippet's lines even though its file is not on the path.
import linecache, traceback
linecache.cache["snippet.py"] = (len(_source), None, _source.splitlines(True), "snippet.py")

def _refuse(event, args):
    # Constants only: a hook that read module globals could be switched off by the snippet.
    if event == "import" and args[0] in ("ctypes", "_ctypes"):
        # ImportError, so libraries that treat ctypes as optional (numpy) still import.
        raise ImportError("sandbox: ctypes is not available here")
    if event.startswith((
        "socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
        "os.fork", "os.forkpty", "pty.spawn", "os.kill", "os.killpg", "ctypes.",
    )) or (event == "object.__setattr__" and args[1] == "__code__"):
        raise PermissionError(f"sandbox: {event} is not allowed here")

sys.addaudithook(_refuse)
sys.argv = ["snippet.py"]
try:
    exec(compile(_source, "snippet.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as _error:
    # From the snippet's own frames on: this bootstrap is noise to the reader.
    traceback.print_exception(type(_error), _error, _error.__traceback__.tb_next)
    sys.exit(1)
"""

_SNIPPET = "snippet.py"


@dataclass(frozen=True)
class SandboxResult:
    """What a snippet printed and how it ended."""

    output: str
    """stdout and stderr interleaved as written, cut to `max_output_chars`."""
    exit_code: int
    """The child's exit status; negative for a signal (-9 when killed for the timeout)."""
    timed_out: bool
    """The wall-clock timeout passed and the process group was killed."""
    truncated: bool
    """More output was written than `output` holds."""
    tail: str = ""
    """The last `tail_chars` characters written, however long the output: where a traceback ends."""

    @property
    def ok(self) -> bool:
        """Ran to the end without an error or a timeout."""
        return self.exit_code == 0 and not self.timed_out


def _kill_group(pid: int) -> None:
    """SIGKILL to the child's process group: the child and anything it managed to start."""
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is already gone
        os.killpg(pid, signal.SIGKILL)


def run_python(
    code: str,
    timeout_s: float = 2.0,
    memory_mb: int = 256,
    max_output_chars: int = 2000,
    tail_chars: int = 300,
    python: str = sys.executable,
) -> SandboxResult:
    """Runs `code` in a fresh, limited Python process (see the module docstring) and waits for it.

    Blocks for at most about `timeout_s` plus process start-up; each call is a
    new process, so nothing carries over between calls.
    """
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    if memory_mb < 32:
        raise ValueError(
            f"memory_mb must be at least 32 for an interpreter to run, got {memory_mb}"
        )
    if max_output_chars < 1 or tail_chars < 0:
        raise ValueError(
            f"max_output_chars must be at least 1 and tail_chars at least 0, got {max_output_chars} and {tail_chars}"
        )
    cpu_seconds = math.ceil(timeout_s) + 1
    # Generous, so programs that print a lot are cut rather than failing; still bounded.
    file_bytes = max(4 * 2**20, 4 * max_output_chars)
    with (
        tempfile.TemporaryDirectory(prefix="rollwire-sandbox-") as scratch,
        tempfile.TemporaryFile() as output,
    ):
        # The snippet lies next to the working directory, which starts empty.
        snippet = Path(scratch, _SNIPPET)
        snippet.write_text(code, encoding="utf-8")
        workdir = Path(scratch, "work")
        workdir.mkdir()
        environment = {
            "PATH": os.defpath,
            "HOME": str(workdir),
            "TMPDIR": str(workdir),
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        args = [
            python,
            "-I",
            "-u",
            "-c",
            _BOOTSTRAP,
            str(snippet),
            str(cpu_seconds),
            str(memory_mb * 2**20),
            str(file_bytes),
        ]
        # start_new_session gives the child its own process group (setsid) without
        # a preexec_fn, which is unsafe in a process with threads such as a gRPC server.
        child = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env=environment,
            start_new_session=True,
            close_fds=True,
        )
        timed_out = False
        try:
            child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(child.pid)
            child.wait(timeout=10)
        written = output.seek(0, os.SEEK_END)
        output.seek(0)
        # A UTF-8 character is at most 4 bytes, so this many bytes hold max_output_chars.
        raw = output.read(4 * max_output_chars + 4)
        output.seek(max(0, written - 4 * tail_chars))
        tail = output.read().decode("utf-8", errors="replace")[-tail_chars:]
    text = raw.decode("utf-8", errors="replace")
    truncated = len(text) > max_output_chars or written > len(raw)
    return SandboxResult(text[:max_output_chars], child.returncode, timed_out, truncated, tail)
