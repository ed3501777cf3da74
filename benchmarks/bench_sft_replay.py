"""The HotpotQA warm start's fine-tuning with each row's frozen bottom replayed after its first epoch, against the
bottom computed in every epoch.

    python benchmarks/bench_sft_replay.py --questions 64 --rounds 2 --report docs/benchmarks.md

The start's recipe (``experiments/qa_start.py``'s ``QA_START_RECIPE``: SmolLM2-135M-Instruct, LoRA on the top 10 of
its 30 layers, 2 epochs, float32) on the oracle trajectories of the first ``--questions`` train questions of the data
directory (``$TREEGRPO_DATA_DIR``). Each arm fine-tunes a fresh model from the same seed on the same trajectories,
the arms interleaved round by round. It reports each epoch's seconds, the ratio every epoch / replay for epoch 2 and
for the whole fine-tuning, and the loss curves' largest difference (a replayed row sits in batches of other widths
than the one it was recorded in: the same values to float rounding, not to the bit, which is why the replay is off
by default and no cached recipe uses it yet).
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.report import machine_description, replace_section
from envs.datasets import resolve_data_dir
from experiments.qa_start import QA_START_RECIPE, QA_START_TOPK
from experiments.sft import train
from experiments.warmstart import build_model, training_data
from experiments.warmstart_options import parse_args
from policies.generation import end_of_turn_ids

ARMS = {"replay": True, "every epoch": False}
SECTION = ("sft-replay", "The warm start's frozen bottom once per row")  # the report's marker key and title


def recipe_args(questions: int, data_dir: str, output: str) -> argparse.Namespace:
    """The start's recipe as ``experiments/warmstart.py`` reads it, on ``questions`` train questions."""
    return parse_args(["--env", "HotpotQA-v0", "--data-dir", data_dir, "--topk", str(QA_START_TOPK),
                       "--dev-questions", "0", *QA_START_RECIPE, "--questions", str(questions), "--output", output])


def fine_tune(args: argparse.Namespace, data: list, replay: bool) -> dict:
    """One arm: a fresh model fine-tuned on ``data``; each epoch's seconds and the loss curve."""
    torch.manual_seed(args.seed)
    model, tokenizer = build_model(args)
    ends: list[float] = []
    start = time.perf_counter()
    curve = train(model, data, epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, seed=args.seed,
                  pad_id=tokenizer.pad_token_id, lr_floor=args.lr_floor, replay_bottom=replay,
                  log=lambda _line: ends.append(time.perf_counter()))  # one line at each epoch's end
    marks = [start, *ends]
    return {"epoch_s": [b - a for a, b in itertools.pairwise(marks)], "loss": curve["loss"]}


def report(rounds: list[dict[str, dict]], args: argparse.Namespace, data: list) -> str:
    load = os.getloadavg()
    tokens = sum(len(ids) for ids, _ in data)
    lines = [f"`python benchmarks/bench_sft_replay.py --questions {args.questions} --rounds {args.rounds}` on "
             f"{machine_description()}; 1-minute load average {load[0]:.2f} at the end (the runs' own).", "",
             f"The HotpotQA start's recipe (SmolLM2-135M, LoRA on the top 10 of 30 layers, 2 epochs, float32) on "
             f"{len(data)} oracle trajectories ({tokens:,} tokens); seconds per epoch; ratio: every epoch / replay.",
             "", "| round | arm | epoch 1 s | epoch 2 s | total s | losses |", "|---|---|---|---|---|---|"]
    epoch_ratios, total_ratios, gaps = [], [], []
    for number, runs in enumerate(rounds, 1):
        for arm, run in runs.items():
            lines.append(f"| {number} | {arm} | {run['epoch_s'][0]:.1f} | {run['epoch_s'][1]:.1f} | "
                         f"{sum(run['epoch_s']):.1f} | {', '.join(f'{x:.5f}' for x in run['loss'])} |")
        replay, every = runs["replay"], runs["every epoch"]
        epoch_ratios.append(every["epoch_s"][1] / replay["epoch_s"][1])
        total_ratios.append(sum(every["epoch_s"]) / sum(replay["epoch_s"]))
        gaps.append(max(abs(a - b) for a, b in zip(replay["loss"], every["loss"], strict=True)))
    lines += ["", f"Epoch 2: **{sum(epoch_ratios) / len(epoch_ratios):.2f}x** (rounds: "
                  f"{', '.join(f'{r:.2f}' for r in epoch_ratios)}); the whole fine-tuning "
                  f"**{sum(total_ratios) / len(total_ratios):.2f}x** ({', '.join(f'{r:.2f}' for r in total_ratios)}); "
                  f"the epoch losses differ by at most {max(gaps):.1e}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--questions", type=int, default=64, help="train questions (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="rounds, each arm once a round (default: %(default)s)")
    p.add_argument("--data-dir", default=None, help="data directory (default: $TREEGRPO_DATA_DIR, else ./data)")
    p.add_argument("--report", default=None, help="a markdown file whose section of this name the table replaces")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        recipe = recipe_args(args.questions, str(resolve_data_dir(args.data_dir).resolve()), scratch)
        model, tokenizer = build_model(recipe)
        env_kwargs = {"data_dir": recipe.data_dir, "max_turns": recipe.max_turns, "topk": recipe.topk,
                      "passage_words": recipe.passage_words}
        data = training_data(recipe, env_kwargs, tokenizer, min(end_of_turn_ids(tokenizer, model)))
        del model
        rounds = [{arm: fine_tune(recipe, data, replay) for arm, replay in ARMS.items()}
                  for _ in range(args.rounds)]
    table = report(rounds, args, data)
    print(table)
    if args.report:
        replace_section(Path(args.report), *SECTION, table)
    return table


if __name__ == "__main__":
    main()
