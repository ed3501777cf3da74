"""Export the trained policy of a run as a plain Hugging Face model directory, to share or to load anywhere.

    python experiments/export.py outputs/run outputs/run-model
    python experiments/export.py outputs/run/checkpoints/iter_000010 outputs/model-10 --overwrite

CKPT is what ``run.py --resume`` takes: a run directory (its newest checkpoint), its ``checkpoints/`` directory,
``checkpoints/latest`` or one ``checkpoints/iter_NNNNNN``. OUT gets the weights as ``model.safetensors``,
``config.json``, ``generation_config.json`` and the tokenizer files (with the chat template), the layout
``AutoModelForCausalLM.from_pretrained(OUT)`` and ``AutoTokenizer.from_pretrained(OUT)`` read; ``run.py --model OUT``
and ``evaluate.py --model OUT`` take it too. A checkpoint of sharded learners (``--learner-sharding fsdp``) is
gathered from every learner's shards in this process, whatever their number. A policy trained with LoRA is exported
with its adapters merged into the base weights (a plain model, no peft needed to load it). The weights are the
learner's master weights in float32 (a ``--dtype bfloat16`` run trains float32 masters under bf16 compute), or
``--dtype bfloat16`` for a file half the size.

Checkpoints are pickles (load only your own); the export holds no pickle. OUT is written beside its final place
and renamed into it, so it is never left half-written; an OUT that exists and is not empty is refused unless
``--overwrite``, and an OUT inside the run (where a later save's pruning would delete it) always.
"""

from __future__ import annotations

import argparse
import os
import shutil
import stat
from pathlib import Path

import torch

from experiments.checkpoints import CheckpointError, resolve_checkpoint
from experiments.evaluate import load_policy
from policies.precision import DTYPES


class ExportError(ValueError):
    """An export that cannot be written where asked; the message names the path."""


def check_output(output: Path, checkpoint: Path, overwrite: bool) -> None:
    """Refuse an OUT that is a file, that holds the checkpoint, that is inside the checkpoint's run (where a save's
    pruning, or a run replaced, would delete it), or (without ``overwrite``) that is not empty."""
    if output.is_file():
        raise ExportError(f"{output} is a file; OUT must be a new or empty directory")
    run = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint
    resolved = output.resolve()
    if resolved in (checkpoint, *checkpoint.parents):
        raise ExportError(f"{output} holds the checkpoint {checkpoint}: choose an OUT outside the run")
    if resolved.is_relative_to(run):
        raise ExportError(f"{output} is inside the run {run}: choose an OUT outside it")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise ExportError(f"{output} exists and is not empty: choose another OUT, or pass --overwrite to replace it")


def merged(model, dtype: str = "float32"):
    """The plain model of a policy in ``dtype``: LoRA adapters (a peft model) merged into the base weights in float32
    (the base may be held in a bf16 compute dtype: merged there, the adapters' small deltas would round away), then
    cast."""
    model = model.to(torch.float32)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    return model.to(DTYPES[dtype])


def export_policy(checkpoint: str | Path, output: str | Path, *, overwrite: bool = False,
                  dtype: str = "float32") -> Path:
    """Write the policy of ``checkpoint`` (any spelling ``resolve_checkpoint`` takes) as a Hugging Face model
    directory ``output`` with weights in ``dtype``; returns ``output``. ``CheckpointError`` / ``ExportError`` name
    what is wrong."""
    source, output = resolve_checkpoint(checkpoint), Path(output).resolve()
    check_output(output, source, overwrite)
    model, tokenizer = load_policy(str(source))
    staging = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        merged(model, dtype).save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        # transformers writes the weights through a private temporary file (mode 0600): give them the mode the
        # umask gave every other file
        mode = stat.S_IMODE((staging / "config.json").stat().st_mode)
        for path in staging.iterdir():
            path.chmod(mode)
        if output.exists():
            shutil.rmtree(output)
        os.replace(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output


def export_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CKPT", help="a run directory or one of its checkpoints")
    p.add_argument("output", metavar="OUT", help="the model directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists and is not empty")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of the written weights (default: float32, the learner's master weights)")
    return p


def main(argv: list[str] | None = None) -> Path:
    parser = export_parser()
    args = parser.parse_args(argv)
    try:
        output = export_policy(args.checkpoint, args.output, overwrite=args.overwrite, dtype=args.dtype)
    except (CheckpointError, ExportError) as error:
        parser.exit(2, f"export.py: error: {error}\n")
    print(f"model: {output} (AutoModelForCausalLM.from_pretrained({str(output)!r}), or --model {output})")
    return output


if __name__ == "__main__":
    main()
