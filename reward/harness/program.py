"""The program's side: load the program, then answer the judge's calls, one at a time.

Run in the program's sandbox as `python -I -S runner.py SRC` with `SRC/codec.py` and
`SRC/solution.py` (the program under test). Stdin and stdout are the channel to the
judge (`codec` messages); the program itself gets an empty stdin and writes to stderr.
Messages out: {"ready": [names]} once loaded (the top-level callables it defines), or
{"load": why}; then for each {"call": name, "args": [...], "kwargs": {...}} in,
{"value": value} or {"raised": why}. Nothing here is trusted by the judge: the program
can rewrite this file's functions once it runs, and it only ever answers for itself.
"""

import os
import sys


def main() -> None:
    source = sys.argv[1]
    sys.path.insert(0, source)
    import codec

    channel_in = os.fdopen(os.dup(0), "rb")
    channel_out = os.fdopen(os.dup(1), "wb")
    quiet = os.open(os.devnull, os.O_RDONLY)
    os.dup2(quiet, 0)  # the program reads nothing of the channel
    os.dup2(2, 1)  # and what it prints goes to stderr

    def send(message: dict) -> None:
        try:
            codec.write(channel_out, message)
        except codec.CodecError as error:
            codec.write(channel_out, {"raised": f"unencodable answer: {error}"})

    namespace = {"__name__": "__main__"}
    with open(os.path.join(source, "solution.py"), encoding="utf-8") as file:
        text = file.read()
    try:
        exec(compile(text, "solution.py", "exec"), namespace)
    except BaseException as error:  # the program's failure is its result
        send({"load": f"{type(error).__name__}: {str(error)[:200]}"})
        return
    functions = {k: v for k, v in namespace.items() if callable(v) and not k.startswith("__")}
    send({"ready": sorted(functions)})
    while True:
        try:
            request = codec.read(channel_in)
        except EOFError:
            return
        except codec.CodecError as error:
            send({"raised": f"bad call: {error}"})
            continue
        function = functions.get(request.get("call"))
        args, kwargs = request.get("args"), request.get("kwargs")
        if function is None or type(args) is not list or type(kwargs) is not dict:
            send({"raised": "bad call"})
            continue
        try:
            value = function(*args, **kwargs)
        except BaseException as error:  # SystemExit included: it is an answer
            send({"raised": f"{type(error).__name__}: {str(error)[:200]}"})
            continue
        send({"value": value})


main()
