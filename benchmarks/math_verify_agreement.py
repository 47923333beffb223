"""How often the `math` domain agrees with math-verify's own test expectations, beside
math-verify called with its defaults, on the (gold, prediction, expected) cases of a
math-verify source checkout's tests.

    python benchmarks/math_verify_agreement.py /path/to/Math-Verify

The cases are read from the checkout's `tests/*.py` (their `pytest.mark.parametrize`
lists whose names begin `gold,pred,expected`), never copied here. Upstream tests call
math-verify with settings of their own (extraction targets, precision); this compares
both sides at their defaults, so neither agrees everywhere. Prints a table, then every
case where rollwire and math-verify's defaults disagree with each other.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

from rollwire.reward.scorers import ScoreInput, math_score


def upstream_cases(checkout: Path) -> list[tuple[str, str, str, float]]:
    """(file, gold, prediction, expected) of every literal gold/pred/expected case."""
    cases = []
    for path in sorted((checkout / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "parametrize"):
                continue
            if len(node.args) < 2 or not isinstance(node.args[0], ast.Constant):
                continue
            names = [n.strip() for n in str(node.args[0].value).split(",")]
            if names[:3] != ["gold", "pred", "expected"]:
                continue
            try:
                rows = ast.literal_eval(node.args[1])
            except ValueError:
                continue  # built by code, not literal
            for row in rows:
                gold, pred, expected = row[:3]
                if isinstance(gold, str) and isinstance(pred, str):
                    cases.append((path.name, gold, pred, float(expected)))
    return cases


def defaults(gold: str, pred: str) -> float:
    from math_verify import parse, verify

    return float(verify(parse(gold), parse(pred)))


def ours(gold: str, pred: str) -> float:
    try:
        return math_score(ScoreInput(response=pred, reference=gold)).reward
    except Exception:  # an error flag on the server: reward 0
        return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=Path, help="a Math-Verify source checkout")
    args = parser.parse_args()
    cases = upstream_cases(args.checkout)
    rows = [(f, g, p, e, defaults(g, p), ours(g, p)) for f, g, p, e in cases]
    print(f"{len(rows)} cases from {args.checkout / 'tests'}\n")
    print("| file | cases | math-verify defaults agree | rollwire `math` agrees |")
    print("|---|---|---|---|")
    for name in [*sorted({r[0] for r in rows}), "all"]:
        part = [r for r in rows if name in ("all", r[0])]
        d = sum(r[4] == r[3] for r in part)
        o = sum(r[5] == r[3] for r in part)
        print(f"| {name} | {len(part)} | {d} | {o} |")
    apart = [r for r in rows if r[4] != r[5]]
    print(f"\n{len(apart)} cases where rollwire and the defaults differ:")
    for f, g, p, e, d, o in apart:
        print(f"  {f}: gold {g!r} pred {p[:80]!r}: expected {e:g}, defaults {d:g}, rollwire {o:g}")


if __name__ == "__main__":
    main()
