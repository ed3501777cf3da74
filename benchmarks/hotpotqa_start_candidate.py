"""A candidate recipe for the HotpotQA warm start against the CPU default's, greedy on the env's 594 dev questions,
paired by question (issue 70: the start's EM; protocol: docs/protocol_hotpotqa_start.md).

    python benchmarks/hotpotqa_start_candidate.py --set lr=1e-3 --output outputs/start_candidate_lr
    python benchmarks/hotpotqa_start_candidate.py --set lr=1e-3 --baseline-eval 679249cd5a4f=PATH/eval.json ...
    python benchmarks/hotpotqa_start_candidate.py --flag replay-bottom --output outputs/start_candidate_replay

The candidate is ``QA_START_RECIPE`` with each ``--set OPTION=VALUE`` replacing that option's value (an option the
recipe does not set is refused by name) and each ``--flag FLAG`` added (a warmstart.py flag the recipe does not
set yet). It is built once into the cache under its own key (``cached_warm_start``;
killed, it resumes), timed, and evaluated greedily on the env's whole evaluation split with the CPU runs'
observations and step cap, as ``qa_start.py --evaluate`` evaluates the default start. The default start is
evaluated the same way, or its evaluation is taken from ``--baseline-eval DIGEST=EVAL_JSON`` when DIGEST is the
weights digest of the default start in this cache (greedy decoding of the same weights gives the same answers).
Writes OUTPUT/candidate.json and candidate.md: both starts' EM, answer rate and F1, and the candidate's paired
changes from the default (EM: t over the questions and bootstrap; by question type). The data are read from
$TREEGRPO_DATA_DIR (else ./data), where evaluate.py reads them too.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.bench_hotpotqa import ENV, evaluate, question_rows, question_types, seed_summary
from envs.datasets import resolve_data_dir
from experiments.model_manifest import weights_digest
from experiments.qa_start import CPU_OBSERVATION_OPTIONS, QA_START_RECIPE, QA_START_TOPK, QASource, qa_warm_start
from experiments.warmstart import cached_warm_start
from experiments.warmstart_options import parse_args as warmstart_options


def recipe_with(recipe: Sequence[str], settings: Sequence[str], flags: Sequence[str] = ()) -> tuple[str, ...]:
    """``recipe`` (warmstart.py's options) with each ``OPTION=VALUE`` of ``settings`` replacing that option's value
    and each flag of ``flags`` added; an option the recipe does not set, or sets as a flag without a value, and a
    flag that warmstart.py lacks or the recipe sets already, are ValueErrors naming it."""
    result = list(recipe)
    valued = {option for option, value in itertools.pairwise(recipe) if option.startswith("--")
              and not value.startswith("--")}
    for setting in settings:
        name, separator, value = setting.partition("=")
        option = "--" + name.removeprefix("--").replace("_", "-")
        if not separator or not value:
            raise ValueError(f"--set {setting}: expected OPTION=VALUE, e.g. lr=1e-3")
        if option not in valued:
            raise ValueError(f"--set {setting}: the recipe has no option {option} with a value (those it sets: "
                             f"{', '.join(sorted(valued))})")
        result[result.index(option) + 1] = value
    known_flags = sorted(name for name, default in vars(warmstart_options([])).items() if default is False)
    for flag in flags:
        option = "--" + flag.removeprefix("--").replace("_", "-")
        if option[2:].replace("-", "_") not in known_flags:
            raise ValueError(f"--flag {flag}: warmstart.py has no flag {option} (its flags: "
                             f"{', '.join('--' + name.replace('_', '-') for name in known_flags)})")
        if option in result:
            raise ValueError(f"--flag {flag}: the recipe sets {option} already")
        result.append(option)
    return tuple(result)


def baseline_rows(spec: str | None, default_start: Path, output: Path) -> tuple[str, list[dict]]:
    """The default start's weights digest and per-question evaluation: from ``spec`` (``DIGEST=EVAL_JSON``) where
    DIGEST is that start's, else evaluated into OUTPUT/default."""
    digest = weights_digest(default_start)
    if spec is None:
        return digest, question_rows(evaluate(str(default_start), output / "default", CPU_OBSERVATION_OPTIONS))
    claimed, _, path = spec.partition("=")
    if claimed != digest:
        raise ValueError(f"--baseline-eval {spec}: it evaluates the start with weights digest {claimed}, but the "
                         f"cached default start ({default_start}) has digest {digest}; leave it out to evaluate it")
    return digest, question_rows(Path(path))


def markdown(result: dict) -> str:
    change = result["change"]
    t, boot = change["change_t"], change["change_bootstrap"]
    lines = [f"HotpotQA warm start: the candidate ({' '.join(result['settings'])}) against the CPU default, greedy on "
             f"{result['questions']} dev questions; paired by question, 95% intervals.", "",
             "| start | weights digest | EM | answer rate | F1 |", "|---|---|---|---|---|"]
    for name, digest, suffix in (("default", result["default_digest"], "before"),
                                 ("candidate", result["candidate_digest"], "after")):
        lines.append(f"| {name} | {digest} | {change['em_' + suffix]:.3f} | {change['answered_' + suffix]:.3f} | "
                     f"{change['f1_' + suffix]:.3f} |")
    lines += ["", f"- EM, candidate - default: {t['mean']:+.3f}, t [{t['low']:+.3f}, {t['high']:+.3f}], bootstrap "
                  f"[{boot['low']:+.3f}, {boot['high']:+.3f}]",
              f"- answer rate, candidate - default: {change['answered_change']['mean']:+.3f} "
              f"[{change['answered_change']['low']:+.3f}, {change['answered_change']['high']:+.3f}]"]
    lines += [f"- {kind} ({row['before']:.3f} -> {row['after']:.3f}): {row['change']['mean']:+.3f} "
              f"[{row['change']['low']:+.3f}, {row['change']['high']:+.3f}]" for kind, row in change["by_type"].items()]
    lines.append(f"- the candidate's build: {result['build_seconds']:.0f} s (0 where it was cached)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", action="append", default=[], metavar="OPTION=VALUE", dest="settings",
                        help="a recipe option's value in the candidate (repeatable)")
    parser.add_argument("--flag", action="append", default=[], metavar="FLAG", dest="flags",
                        help="a warmstart.py flag the candidate adds to the recipe, e.g. replay-bottom (repeatable)")
    parser.add_argument("--baseline-eval", default=None, metavar="DIGEST=EVAL_JSON",
                        help="the default start's evaluation, used when DIGEST is its weights digest")
    parser.add_argument("--output", type=Path, default=Path("outputs/start_candidate"))
    args = parser.parse_args(argv)
    if not args.settings and not args.flags:
        parser.error("a candidate changes the recipe: give --set OPTION=VALUE or --flag FLAG")
    try:
        recipe = recipe_with(QA_START_RECIPE, args.settings, args.flags)
    except ValueError as error:
        parser.error(str(error))
    data_dir = resolve_data_dir(None)  # as evaluate.py finds it: $TREEGRPO_DATA_DIR, else ./data
    args.output.mkdir(parents=True, exist_ok=True)
    default_digest, before = baseline_rows(args.baseline_eval, qa_warm_start(ENV, data_dir), args.output)
    began = time.perf_counter()
    candidate = cached_warm_start(QASource.of(ENV, data_dir), recipe, topk=QA_START_TOPK)
    build_seconds = time.perf_counter() - began
    after = question_rows(evaluate(str(candidate), args.output / "candidate", CPU_OBSERVATION_OPTIONS))
    added_flags = recipe[len(QA_START_RECIPE):]
    result = {"settings": [*args.settings, *added_flags], "recipe": list(recipe), "model": str(candidate),
              "default_digest": default_digest, "candidate_digest": weights_digest(candidate),
              "build_seconds": build_seconds, "questions": len(after),
              "change": seed_summary(before, after, question_types(data_dir))}
    (args.output / "candidate.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    (args.output / "candidate.md").write_text(markdown(result), encoding="utf-8")
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
