"""The judge's side: run the tests, calling the program's functions across the channel.

Run in its own sandbox as `python -I -S judge.py SRC` with `SRC/codec.py` and
`SRC/spec.bin` ({"tests": [code, ...], "setup": code}, encoded by `codec`). Stdin reads
the program's answers and stdout sends it calls (see `program.py`); the verdict is one
`codec` message on stderr: {"passed": [indices], "total": n} or {"load": why}. Every name the program
defines is a stand-in here that sends its arguments as plain data and returns the
answer decoded as plain data (`codec`): nothing the program does reaches this process
but those values. An answer that is not plain data, an exception, an answer that never
comes, fails the test that asked.
"""

import builtins
import io
import os
import sys


class CandidateError(Exception):
    """The program raised, sent something that is not plain data, or went away."""


def main() -> None:
    source = sys.argv[1]
    sys.path.insert(0, source)
    import codec

    answers = os.fdopen(os.dup(0), "rb")
    calls = os.fdopen(os.dup(1), "wb")
    verdict = os.fdopen(os.dup(2), "wb")
    with open(os.path.join(source, "spec.bin"), "rb") as file:
        spec = codec.decode(file.read())

    def receive() -> dict:
        try:
            return codec.read(answers)
        except EOFError:
            raise CandidateError("the program ended") from None

    try:
        first = receive()
    except (CandidateError, codec.CodecError) as error:
        first = {"load": str(error)}
    if type(first.get("ready")) is not list:
        codec.write(verdict, {"load": str(first.get("load", "no answer"))[:300]})
        return
    # A name of the language's own (abs, len, isinstance...) stays the language's: the
    # tests' `abs(candidate(x) - y) < 1e-6` must not call a program's `abs`.
    own = set(dir(builtins))
    names = [
        name
        for name in first["ready"]
        if type(name) is str and name.isidentifier() and name not in own
    ]

    def stand_in(name: str):
        def call(*args, **kwargs):
            try:
                codec.write(calls, {"call": name, "args": list(args), "kwargs": kwargs})
                answer = receive()
            except (OSError, codec.CodecError) as error:
                raise CandidateError(str(error)) from None
            if "value" in answer:
                return answer["value"]
            raise CandidateError(str(answer.get("raised", "no answer"))[:300])

        call.__name__ = call.__qualname__ = name
        return call

    namespace = {"__name__": "__main__"}
    namespace.update({name: stand_in(name) for name in names})
    sys.stdout = sys.stderr = io.StringIO()  # what the tests print is not the verdict
    passed = []
    try:
        if spec.get("setup"):
            exec(compile(spec["setup"], "setup", "exec"), namespace)
        tests = spec["tests"]
    except BaseException:
        tests = []
    for index, test in enumerate(tests):
        try:
            exec(compile(test, f"test_{index}", "exec"), namespace)
        except BaseException:
            pass
        else:
            passed.append(index)
        sys.stdout.seek(0)
        sys.stdout.truncate()
    codec.write(verdict, {"passed": passed, "total": len(spec["tests"])})


main()
