"""Run untrusted programs: `Sandbox(kind).run(argv, files, stdin, limits)`.

Two kinds.

`bwrap` (the default) is the boundary. Each run is a bubblewrap sandbox
(Debian's `bubblewrap`): new user, pid, network, ipc, uts and cgroup
namespaces (`--unshare-all`: no network at all, not even loopback to the
host), the system directories bound read-only (`/usr`, and `/lib*`, `/bin`,
`/sbin` where they are real directories), the interpreter's own prefix
read-only, the run's files read-only at `/src`, and a fresh tmpfs of
`file_mb` as the working directory `/work` and as `/tmp`; nothing else of
the host's file system is there (no `/home`, `/root`, `/etc`, no project
checkout). The environment is cleared. Inside, before the program starts,
a small launcher sets the rlimits: CPU seconds, address space (`memory_mb`),
file size, processes and no core dumps. The wall-clock limit kills the
sandbox's process group; bwrap's `--die-with-parent` and the pid namespace
take every process of the run with it, including daemons and zombies it left.

Process limits. `RLIMIT_NPROC` counts the processes of a user id on the
host, so each parallel slot runs as its own uid when rollwire runs as root
(`uid_base + slot`, ids no account uses), which makes `processes` a limit
per run. Run as another user, the uid cannot change: the limit then is the
user's current process count plus `processes`, shared with whatever else
that user starts meanwhile.

`none` runs the program as a plain child with the same rlimits, a new
process group, an empty working directory and a cleared environment. For
Python it also installs the audit-hook guard of `run_python` (no sockets,
no child processes, no signals, no ctypes). It is a guard against accidents,
not a security boundary: the child can read and write every file the
service's user can, and code that bypasses the audit hook (a C extension)
gets past it. Choose it only for trusted code or where bubblewrap cannot
run (it needs unprivileged user namespaces, which some container runtimes
switch off).

Parallel runs are limited per host by slots: a run holds one of
`max_parallel` lock files (`/tmp/rollwire-sandbox-slots/`) while it runs,
so every process of every service on the machine that uses the same
settings shares one limit.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

SandboxKind = Literal["bwrap", "none"]

INSTALL_HINT = (
    "bubblewrap (the `bwrap` program) is not installed: install it "
    "(Debian/Ubuntu `apt-get install bubblewrap`, Fedora `dnf install bubblewrap`; "
    "`bash deploy/install.sh` does it), or set `sandbox.kind: none` to run the code "
    "without isolation (a guard against accidents only, see rollwire.services.core.sandbox)"
)

SLOT_DIR = Path(tempfile.gettempdir()) / "rollwire-sandbox-slots"
UID_BASE = 2_000_000
"""First uid of the sandbox slots when run as root: far above any account's id."""
JUDGE_UID_BASE = UID_BASE + 1_000_000
"""First uid of the judges of `run_pair` (a pair's two sandboxes run as two users)."""

# Runs as `python -I -S -c LAUNCHER cpu memory file processes -- argv...` inside the
# sandbox (or the plain child): sets the limits, then becomes the program.
_LAUNCHER = r"""
import os, resource, signal, sys
cpu, memory, size, processes = (int(v) for v in sys.argv[1:5])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if processes > 0:
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
# Past the file limit a write fails with OSError instead of the signal ending the program.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
os.execv(sys.argv[6], sys.argv[6:])
"""

# The audit-hook guard of a Python program under `kind: none`; argv: the program's path.
_GUARD = r"""
import sys
_path = sys.argv[1]
with open(_path, encoding="utf-8") as _program:
    _source = _program.read()
import linecache, traceback
linecache.cache[_path] = (len(_source), None, _source.splitlines(True), _path)

def _refuse(event, args):
    # Constants only: a hook that read module globals could be switched off by the program.
    if event == "import" and args[0] in ("ctypes", "_ctypes"):
        # ImportError, so libraries that treat ctypes as optional (numpy) still import.
        raise ImportError("sandbox: ctypes is not available here")
    if event.startswith((
        "socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
        "os.fork", "os.forkpty", "pty.spawn", "os.kill", "os.killpg", "ctypes.",
    )) or (event == "object.__setattr__" and args[1] == "__code__"):
        raise PermissionError(f"sandbox: {event} is not allowed here")

sys.addaudithook(_refuse)
sys.argv = sys.argv[1:]
try:
    exec(compile(_source, _path, "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as _error:
    # From the program's own frames on: this guard is noise to the reader.
    traceback.print_exception(type(_error), _error, _error.__traceback__.tb_next)
    sys.exit(1)
"""


class SandboxUnavailable(RuntimeError):
    """The configured sandbox cannot run on this machine; the message says what to do."""


@dataclass(frozen=True)
class Limits:
    """What one run may use."""

    timeout_s: float = 5.0
    """Wall clock; the process group is killed after it (CPU time is capped at it, rounded up, plus 1 s)."""
    memory_mb: int = 512
    """Address space of each process (`RLIMIT_AS`)."""
    file_mb: int = 16
    """Largest file written (`RLIMIT_FSIZE`); with bwrap also the size of `/work` and of `/tmp`."""
    processes: int = 32
    """Processes and threads the program may have running besides itself (`RLIMIT_NPROC`,
    see the module docstring); 0 leaves it unset."""
    max_output_chars: int = 2000
    """Output kept from the start; more is cut (`truncated`)."""
    tail_chars: int = 300
    """Output kept from the end, however long it was (where a traceback ends)."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s!r}")
        if self.memory_mb < 32:
            raise ValueError(
                f"memory_mb must be at least 32 for an interpreter to run, got {self.memory_mb}"
            )
        if self.file_mb < 1 or self.processes < 0:
            raise ValueError(
                f"file_mb must be at least 1 and processes at least 0, got {self.file_mb} and {self.processes}"
            )
        if self.max_output_chars < 1 or self.tail_chars < 0:
            raise ValueError(
                "max_output_chars must be at least 1 and tail_chars at least 0, got "
                f"{self.max_output_chars} and {self.tail_chars}"
            )


@dataclass(frozen=True)
class SandboxResult:
    """What a program printed and how it ended."""

    output: str
    """stdout and stderr interleaved as written, cut to `max_output_chars`."""
    exit_code: int
    """The program's exit status; negative for a signal (-9 when killed for the timeout)."""
    timed_out: bool
    """The wall-clock limit passed and the run was killed."""
    truncated: bool
    """More output was written than `output` holds."""
    tail: str = ""
    """The last `tail_chars` characters written."""
    seconds: float = 0.0
    """Wall time of the run, start-up included."""

    @property
    def ok(self) -> bool:
        """Ran to the end without an error or a timeout."""
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True)
class PairResult:
    """How a `run_pair` ended: the judge's stderr (its verdict) and exit status."""

    verdict: bytes
    """What the judge wrote on stderr (the first MiB)."""
    exit_code: int
    """The judge's exit status; negative for a signal (-9 when killed for the timeout)."""
    timed_out: bool
    """The wall-clock limit passed and both were killed."""
    seconds: float = 0.0


@dataclass(frozen=True)
class _Command:
    """A sandboxed run, ready to start."""

    command: list[str]
    cwd: Path | None
    identity: dict[str, Any]
    """user, group and extra_groups for Popen (the slot's uid when run as root)."""
    environment: dict[str, str]


def bwrap_path() -> str | None:
    """The bubblewrap program, or None."""
    return shutil.which("bwrap")


def _readable_by_others(path: str) -> bool:
    """Every folder on the way searchable and the file readable by any user (a slot's uid)."""
    target = Path(path).resolve()
    try:
        if not target.stat().st_mode & stat.S_IROTH:
            return False
        return all(folder.stat().st_mode & stat.S_IXOTH for folder in target.parents)
    except OSError:
        return False


def base_python() -> str:
    """The interpreter inside the sandbox when none is configured: this one without its
    virtual environment (the standard library only) where every user may run it, else the
    system's `python3`."""
    own = os.path.realpath(sys.executable)
    if os.geteuid() != 0 or _readable_by_others(own):
        return own
    for candidate in ("/usr/local/bin/python3", "/usr/bin/python3"):
        if os.path.exists(candidate):
            return os.path.realpath(candidate)
    return own


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(pid, signal.SIGKILL)


def _user_processes(uid: int) -> int:
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                count += entry.stat().st_uid == uid
    return count


# Real directories bound read-only into every bwrap sandbox (symlinks among them are
# recreated as symlinks: /bin -> usr/bin on merged-/usr systems).
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


class Sandbox:
    """Runs programs under `kind`'s isolation, at most `max_parallel` at once per host."""

    def __init__(
        self,
        kind: SandboxKind = "bwrap",
        max_parallel: int = 4,
        python: str | None = None,
        slot_wait_s: float = 60.0,
    ) -> None:
        if kind not in ("bwrap", "none"):
            raise ValueError(f"sandbox kind must be 'bwrap' or 'none', got {kind!r}")
        if max_parallel < 1:
            raise ValueError(f"max_parallel must be at least 1, got {max_parallel}")
        self.kind: SandboxKind = kind
        self.max_parallel = max_parallel
        self.python = python or base_python()
        self.slot_wait_s = slot_wait_s
        self._bwrap = bwrap_path() if kind == "bwrap" else None
        if kind == "bwrap" and self._bwrap is None:
            raise SandboxUnavailable(INSTALL_HINT)
        self._as_root = os.geteuid() == 0
        # Inside bwrap only what is under the bound system folders exists.
        self._setpriv = shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin")
        found = shutil.which("prlimit", path="/usr/bin:/bin")
        self._prlimit = found if found and found.startswith(_SYSTEM) else None
        if kind == "bwrap" and self._as_root and not _readable_by_others(self.python):
            raise SandboxUnavailable(
                f"the sandbox's Python {self.python} is not readable by other users, and the "
                "sandbox runs as its own user; set sandbox.python to one that is (e.g. /usr/bin/python3)"
            )
        self._local = threading.BoundedSemaphore(max_parallel)

    # -- slots ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _slot(self) -> Iterator[int]:
        """Holds one of the host's `max_parallel` slots (a lock file each) while the run lasts."""
        if not self._local.acquire(timeout=self.slot_wait_s):
            raise TimeoutError(f"no sandbox slot came free within {self.slot_wait_s:g}s")
        try:
            if not SLOT_DIR.exists():
                SLOT_DIR.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(PermissionError):  # another user made it first
                    SLOT_DIR.chmod(0o1777)  # every user's services share the slots
            deadline = time.monotonic() + self.slot_wait_s
            while True:
                for slot in range(self.max_parallel):
                    handle = open(SLOT_DIR / f"{slot}.lock", "a")  # noqa: SIM115 - held while running
                    try:
                        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        handle.close()
                        continue
                    try:
                        yield slot
                    finally:
                        handle.close()  # releases the lock
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"no sandbox slot of {self.max_parallel} came free within {self.slot_wait_s:g}s"
                    )
                time.sleep(0.005)
        finally:
            self._local.release()

    # -- running -------------------------------------------------------------------------

    def run(
        self,
        argv: Sequence[str],
        files: Mapping[str, str] | None = None,
        stdin: str = "",
        limits: Limits = Limits(),
    ) -> SandboxResult:
        """Runs `argv` with `files` (relative path -> text) readable at `/src/<path>`
        (`kind: none`: in a fresh directory the returned paths point to) and waits for it.

        In `argv`, `{src}` stands for that folder and `{python}` for the sandbox's interpreter.
        Blocks for at most about `limits.timeout_s` plus start-up (and the wait for a slot).
        """
        if not argv:
            raise ValueError("argv must name a program")
        with (
            self._slot() as slot,
            tempfile.TemporaryDirectory(prefix="rollwire-sandbox-") as scratch,
        ):
            return self._wait(self._prepare(argv, files, scratch, slot, limits), stdin, limits)

    def run_pair(
        self,
        judge: tuple[Sequence[str], Mapping[str, str | bytes]],
        program: tuple[Sequence[str], Mapping[str, str | bytes]],
        limits: Limits = Limits(),
    ) -> PairResult:
        """Runs two programs, each `(argv, files)` as `run` takes them, in two sandboxes
        that share nothing but two pipes: the program's stdout is the judge's stdin and
        the judge's stdout the program's stdin. The program's stderr is dropped; the
        judge's is returned (its verdict). Both run under `limits`, and both end when the
        judge does, or at the wall limit (`limits.timeout_s`). Under bwrap they run as two users, in two pid
        namespaces: neither can see, signal or read the other's memory or files."""
        with (
            self._slot() as slot,
            tempfile.TemporaryDirectory(prefix="rollwire-sandbox-") as judge_scratch,
            tempfile.TemporaryDirectory(prefix="rollwire-sandbox-") as program_scratch,
            tempfile.TemporaryFile() as verdict,
        ):
            judge_run = self._prepare(*judge, judge_scratch, slot, limits, JUDGE_UID_BASE)
            program_run = self._prepare(*program, program_scratch, slot, limits)
            started = time.monotonic()
            to_judge_r, to_judge_w = os.pipe()
            to_program_r, to_program_w = os.pipe()
            children: list[subprocess.Popen] = []
            try:
                children.append(
                    self._start(program_run, to_program_r, to_judge_w, subprocess.DEVNULL)
                )
                children.append(self._start(judge_run, to_judge_r, to_program_w, verdict))
            finally:
                for fd in (to_judge_r, to_judge_w, to_program_r, to_program_w):
                    os.close(fd)  # the children hold their ends; EOF when one side ends
            timed_out = False
            try:
                children[-1].wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                for child in children:
                    _kill_group(child.pid)
                for child in children:
                    child.wait(timeout=10)
            verdict.seek(0)
            written = verdict.read(2**20)
        return PairResult(written, children[-1].returncode, timed_out, time.monotonic() - started)

    def run_python(
        self,
        code: str,
        limits: Limits = Limits(),
        stdin: str = "",
        files: Mapping[str, str] | None = None,
    ) -> SandboxResult:
        """Runs the Python program `code` (`python -I -S`; under `kind: none` behind the audit-hook guard)."""
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, got {type(code).__name__}")
        files = {**(files or {}), "main.py": code}
        if self.kind == "bwrap":
            return self.run(["{python}", "-I", "-S", "-u", "{src}/main.py"], files, stdin, limits)
        return self.run(
            ["{python}", "-I", "-S", "-u", "-c", _GUARD, "{src}/main.py"], files, stdin, limits
        )

    def _launcher(self, limits: Limits, processes: int) -> list[str]:
        """What sets the limits and then becomes the program: util-linux's `prlimit` where
        there is one (no second interpreter start), else a few lines of Python."""
        cpu = math.ceil(limits.timeout_s) + 1
        memory, size = limits.memory_mb * 2**20, limits.file_mb * 2**20
        if self._prlimit:
            nproc = [f"--nproc={processes}"] if processes else []
            return [
                self._prlimit, f"--cpu={cpu}:{cpu + 1}", f"--as={memory}", f"--fsize={size}",
                "--core=0", *nproc, "--",
            ]  # fmt: skip
        return [
            self.python, "-I", "-S", "-c", _LAUNCHER,
            str(cpu), str(memory), str(size), str(processes), "--",
        ]  # fmt: skip

    def _prepare(
        self,
        argv: Sequence[str],
        files: Mapping[str, str | bytes] | None,
        scratch: str,
        slot: int,
        limits: Limits,
        uid_base: int = UID_BASE,
    ) -> _Command:
        """Writes `files` under `scratch` and builds the command that runs `argv` on them."""
        source = Path(scratch, "src")
        source.mkdir()
        for name, text in (files or {}).items():
            path = (source / name).resolve()
            if source.resolve() not in path.parents:
                raise ValueError(f"file name {name!r} leaves the sandbox's folder")
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(text, bytes):
                path.write_bytes(text)
            else:
                path.write_text(text, encoding="utf-8")
        if self.kind == "bwrap":
            # Readable by the slot's uid: the folder is bound read-only anyway.
            os.chmod(scratch, 0o755)
            for folder, _dirs, names in os.walk(source):
                os.chmod(folder, 0o755)
                for name in names:
                    os.chmod(Path(folder, name), 0o644)
            return self._bwrap_command(argv, slot, scratch, limits, uid_base)
        work = Path(scratch, "work")
        work.mkdir()
        return self._plain_command(argv, source, work, limits)

    def _bwrap_command(
        self, argv: Sequence[str], slot: int, scratch: str, limits: Limits, uid_base: int
    ) -> _Command:
        assert self._bwrap is not None
        command = [self._bwrap, "--unshare-all", "--die-with-parent", "--new-session"]
        for folder in _SYSTEM:
            if os.path.islink(folder):
                command += ["--symlink", os.readlink(folder), folder]
            elif os.path.isdir(folder):
                command += ["--ro-bind", folder, folder]
        prefix = str(Path(self.python).resolve().parent.parent)
        if not prefix.startswith(_SYSTEM) and os.path.isdir(prefix):
            command += ["--ro-bind", prefix, prefix]
        size = str(limits.file_mb * 2**20)
        command += [
            "--proc", "/proc", "--dev", "/dev",
            "--size", size, "--tmpfs", "/work", "--size", size, "--tmpfs", "/tmp",
            "--ro-bind", str(Path(scratch, "src")), "/src",
            "--chdir", "/work", "--hostname", "sandbox", "--clearenv",
            "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin",
            "--setenv", "HOME", "/work", "--setenv", "TMPDIR", "/tmp",
            "--setenv", "LANG", "C.UTF-8", "--setenv", "LC_ALL", "C.UTF-8",
            "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
            "--setenv", "OMP_NUM_THREADS", "1", "--setenv", "OPENBLAS_NUM_THREADS", "1",
            "--setenv", "MKL_NUM_THREADS", "1",
        ]  # fmt: skip
        if self._as_root:
            uid = uid_base + slot
            # bwrap's own processes outside the program count too (measured: 2).
            processes = limits.processes + 2 if limits.processes else 0
            identity = {}
            if self._setpriv is not None:
                # setpriv becomes the slot's user before bwrap starts. Popen's own user=
                # would make it fork() instead of vfork(), and a forked child of a process
                # with gRPC's threads runs gRPC's fork handlers, which can kill it (seen:
                # "epoll_wait error: Bad file descriptor", then SIGABRT or SIGBUS).
                ids = ["--reuid", str(uid), "--regid", str(uid), "--clear-groups", "--"]
                command = [self._setpriv, *ids, *command]
            else:
                identity = {"user": uid, "group": uid, "extra_groups": []}
        else:
            processes = (
                _user_processes(os.getuid()) + limits.processes + 2 if limits.processes else 0
            )
            identity = {}
        command += [*self._launcher(limits, processes), *self._expand(argv, "/src")]
        return _Command(command, None, identity, {})

    def _plain_command(
        self, argv: Sequence[str], source: Path, work: Path, limits: Limits
    ) -> _Command:
        environment = {
            "PATH": os.defpath,
            "HOME": str(work),
            "TMPDIR": str(work),
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        # Root is not held by RLIMIT_NPROC at all, so setting it would only mislead.
        held = limits.processes and os.geteuid() != 0
        processes = _user_processes(os.getuid()) + limits.processes + 1 if held else 0
        command = [*self._launcher(limits, processes), *self._expand(argv, str(source))]
        return _Command(command, work, {}, environment)

    @staticmethod
    def _start(run: _Command, stdin: Any, stdout: Any, stderr: Any) -> subprocess.Popen:
        # start_new_session gives the run its own process group without a preexec_fn,
        # which is unsafe in a process with threads such as a gRPC server.
        return subprocess.Popen(
            run.command,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            cwd=run.cwd,
            env=run.environment,
            start_new_session=True,
            close_fds=True,
            **run.identity,
        )

    def _expand(self, argv: Sequence[str], source: str) -> list[str]:
        return [arg.replace("{src}", source).replace("{python}", self.python) for arg in argv]

    def _wait(self, run: _Command, stdin: str, limits: Limits) -> SandboxResult:
        started = time.monotonic()
        with tempfile.TemporaryFile() as output, tempfile.TemporaryFile() as feed:
            feed.write(stdin.encode("utf-8"))
            feed.seek(0)
            child = self._start(run, feed, output, subprocess.STDOUT)
            timed_out = False
            try:
                child.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(child.pid)
                child.wait(timeout=10)
            seconds = time.monotonic() - started
            written = output.seek(0, os.SEEK_END)
            output.seek(0)
            # A UTF-8 character is at most 4 bytes, so this many bytes hold max_output_chars.
            raw = output.read(4 * limits.max_output_chars + 4)
            output.seek(max(0, written - 4 * limits.tail_chars))
            tail = (
                output.read().decode("utf-8", errors="replace")[-limits.tail_chars :]
                if limits.tail_chars
                else ""
            )
        text = raw.decode("utf-8", errors="replace")
        truncated = len(text) > limits.max_output_chars or written > len(raw)
        return SandboxResult(
            text[: limits.max_output_chars], child.returncode, timed_out, truncated, tail, seconds
        )


def confine(
    argv: Sequence[str],
    writable: str,
    read_only: Sequence[str] = (),
    network: bool = False,
    environment: Mapping[str, str] | None = None,
) -> list[str]:
    """The command that runs a long-lived program (an MCP server speaking over its stdin
    and stdout) inside bubblewrap.

    It sees the system folders and `read_only` read-only, `writable` (its own folder)
    read-write at the same path, a fresh `/tmp`, and nothing else of the host's files;
    it has no network unless `network`, and its environment is `environment` with PATH,
    HOME (`writable`) and LANG. Unlike `Sandbox.run` it has no time or memory limit of
    its own: its caller times each request and stops it when it hangs. Raises
    SandboxUnavailable where bubblewrap is missing.
    """
    bwrap = bwrap_path()
    if bwrap is None:
        raise SandboxUnavailable(INSTALL_HINT)
    # /tmp first: a tmpfs mounted after the binds would hide those under it.
    command = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--tmpfs", "/tmp"]
    if network:
        command.append("--share-net")
    for folder in _SYSTEM:
        if os.path.islink(folder):
            command += ["--symlink", os.readlink(folder), folder]
        elif os.path.isdir(folder):
            command += ["--ro-bind", folder, folder]
    if network:
        for name in ("/etc/resolv.conf", "/etc/hosts", "/etc/ssl", "/etc/ca-certificates"):
            if os.path.exists(name):
                command += ["--ro-bind", name, name]
    for path in dict.fromkeys(str(Path(p).resolve()) for p in read_only):
        if not path.startswith(_SYSTEM) and os.path.exists(path):
            command += ["--ro-bind", path, path]
    folder = str(Path(writable).resolve())
    command += [
        "--proc", "/proc", "--dev", "/dev",
        "--bind", folder, folder, "--chdir", folder, "--clearenv",
        "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin",
        "--setenv", "HOME", folder, "--setenv", "TMPDIR", "/tmp",
        "--setenv", "LANG", "C.UTF-8", "--setenv", "LC_ALL", "C.UTF-8",
        "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
    ]  # fmt: skip
    for name, value in (environment or {}).items():
        command += ["--setenv", name, value]
    return [*command, "--", *argv]
