"""Where a run's dev-EM curve leaves a plateau for good (docs/protocol_branching.md, the extension pilot's rule).

    python benchmarks/plateau_exit.py outputs/bench_branching_pilot_extend/*/seed* \
        --threshold 0.7 --budgets 300000 400000 500000 600000

A run has left the plateau at the first curve point (a metrics row with ``dev_em``) from which every later point is
at least ``--threshold``; where it left is that row's ``tokens_generated_total``. Prints each run's exit (or that it
stayed), the share of silent updates in its second half (``silent_update_share``) and, for each budget, how many
runs had left by it.
"""

from __future__ import annotations

import argparse

from experiments.plot import load_metrics

# the protocol's rule (docs/protocol_branching.md): a run has left the one-role plateau (dev EM about 0.4-0.6) once its
# curve stays at or above this
PLATEAU_THRESHOLD = 0.7
# a gradient norm below this is a silent update: every advantage of the batch 0 (each prompt's leaves rewarded alike,
# as on the plateau where one role is written everywhere), only the small KL and entropy terms left (about 1e-4 here)
SILENT_GRAD_NORM = 1e-3
# the units a time to an outcome is counted in (metrics.jsonl's cumulative counts) and their names in the reports
TOKENS, ITERATIONS, OPTIMIZER_STEPS = "tokens_generated_total", "iteration", "optimizer_steps"
UNITS = {TOKENS: "tokens", ITERATIONS: "iterations", OPTIMIZER_STEPS: "optimizer steps"}


def progress(rows: list[dict], index: int, unit: str = TOKENS) -> int:
    """Where a run stood in ``unit`` (``UNITS``) at its metrics row ``index``: that row's count, else the last earlier
    row's (a row may lack a learner count, e.g. on an iteration whose update was skipped), 0 before any."""
    return next((int(row[unit]) for row in reversed(rows[:index + 1]) if row.get(unit) is not None), 0)


def plateau_exit_at(rows: list[dict], threshold: float, unit: str = TOKENS) -> int | None:
    """Where (in ``unit``) the run stood at the first curve point from which every later point's dev EM is
    >= ``threshold``; None if the last point is below it (or the run has no curve)."""
    exit_at = None
    for index in reversed(range(len(rows))):
        if rows[index].get("dev_em") is None:
            continue
        if rows[index]["dev_em"] < threshold:
            break
        exit_at = progress(rows, index, unit)
    return exit_at


def first_passage_at(rows: list[dict], threshold: float, unit: str = TOKENS) -> int | None:
    """Where (in ``unit``) the run stood at the first curve point whose dev EM is >= ``threshold``, whatever comes
    after (the fifth design's speed outcome); None if no point reaches it."""
    return next((progress(rows, index, unit) for index, row in enumerate(rows)
                 if row.get("dev_em") is not None and row["dev_em"] >= threshold), None)


def silent_update_share(rows: list[dict], threshold: float = SILENT_GRAD_NORM) -> float | None:
    """The share of a run's second half of iterations (by its metrics rows) whose gradient norm is below
    ``threshold``: how often its groups gave no signal at all. None without gradient norms."""
    norms = [row["grad_norm"] for row in rows if row.get("grad_norm") is not None]
    second_half = norms[len(norms) // 2:]
    return sum(norm < threshold for norm in second_half) / len(second_half) if second_half else None


def runs_left_by(exits: list[int | None], budget: int) -> int:
    """How many of the runs' exits (None: stayed) came at or before ``budget`` tokens."""
    return sum(tokens is not None and tokens <= budget for tokens in exits)


def main(argv: list[str] | None = None) -> dict[str, int | None]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="run directories (each holding metrics.jsonl)")
    p.add_argument("--threshold", type=float, default=PLATEAU_THRESHOLD,
                   help="dev EM a run stays at or above once it has left")
    p.add_argument("--budgets", type=int, nargs="+", default=[300_000, 400_000, 500_000, 600_000],
                   help="token budgets at which to count the runs that have left")
    args = p.parse_args(argv)
    exits = {}
    for run in args.runs:
        rows = load_metrics(run)
        exits[run] = plateau_exit_at(rows, args.threshold)
        last = max((r["tokens_generated_total"] for r in rows), default=0)
        where = "stayed" if exits[run] is None else f"left at {exits[run]:,} tokens"
        silent = silent_update_share(rows)
        silent_text = "" if silent is None else f"; silent updates in its second half: {silent:.2f}"
        print(f"{run}: {where} (curve to {last:,} tokens{silent_text})")
    for budget in args.budgets:
        print(f"by {budget:,} tokens: {runs_left_by(list(exits.values()), budget)} of {len(exits)} runs had left")
    return exits


if __name__ == "__main__":
    main()
