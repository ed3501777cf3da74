"""``python -m envs.synthetic DIR [--dataset synthbranch] [--FIELD VALUE ...]``: write a generated world to a
directory."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from envs.synthetic.files import write_world
from envs.synthetic.world import COMPANY_PASSAGES, PERSON_NAMES, SPECS, spec_from_fields


def main(argv: list[str] | None = None) -> Path:
    """``python -m envs.synthetic DIR [--dataset synthbranch] [--FIELD VALUE ...]``: write a world."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m envs.synthetic",
                                     description="Write a generated world (corpus + questions) to a directory.")
    parser.add_argument("output")
    parser.add_argument("--dataset", choices=list(SPECS), default="synthhop")
    for name in dict.fromkeys(f.name for spec in SPECS.values() for f in fields(spec)):
        if name not in ("hop_mix", "names", "passages", "lead"):
            parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    parser.add_argument("--hop-mix", type=float, nargs=3, default=None)
    parser.add_argument("--names", choices=PERSON_NAMES, default=None, help="how people are named")
    parser.add_argument("--passages", choices=COMPANY_PASSAGES, default=None,
                        help="how a SynthBranch company's passage names its people")
    parser.add_argument("--lead", action="store_true", default=None,
                        help="SynthBranch: questions name a person who works for the company, searched first")
    args = vars(parser.parse_args(argv))
    output, dataset = args.pop("output"), args.pop("dataset")
    try:
        spec = spec_from_fields(dataset, {k: v for k, v in args.items() if v is not None})
        spec.world().split_questions()  # a world too small for its questions fails here, before anything is written
    except ValueError as error:
        parser.error(str(error))
    return write_world(spec, output)

