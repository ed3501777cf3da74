"""benchmarks/hotpotqa_start_candidate.py: a candidate changes only the options it names, and is compared with the
default start's own evaluation, never another build's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import benchmarks.hotpotqa_start_candidate as candidate
from experiments.model_manifest import weights_digest
from experiments.qa_start import QA_START_RECIPE

RECIPE = ("--model", "smollm2-135m", "--cite", "--questions", "640", "--lr", "3e-4", "--seed", "0")


def test_a_setting_replaces_only_its_own_value():
    assert candidate.recipe_with(RECIPE, ["lr=1e-3"]) == (
        "--model", "smollm2-135m", "--cite", "--questions", "640", "--lr", "1e-3", "--seed", "0")
    assert candidate.recipe_with(RECIPE, ["questions=817", "--seed=1"]) == (
        "--model", "smollm2-135m", "--cite", "--questions", "817", "--lr", "3e-4", "--seed", "1")
    assert candidate.recipe_with(RECIPE, []) == RECIPE


def test_the_default_recipe_takes_a_new_learning_rate():
    changed = candidate.recipe_with(QA_START_RECIPE, ["lr=7e-4"])
    assert [(a, b) for a, b in zip(QA_START_RECIPE, changed, strict=True) if a != b] == [
        (QA_START_RECIPE[QA_START_RECIPE.index("--lr") + 1], "7e-4")]


@pytest.mark.parametrize("setting, named", [("epoch=3", "--epoch"), ("cite=1", "--cite"), ("lr", "OPTION=VALUE"),
                                            ("lr=", "OPTION=VALUE")])
def test_an_option_the_recipe_does_not_set_is_refused_by_name(setting, named):
    with pytest.raises(ValueError, match=named):
        candidate.recipe_with(RECIPE, [setting])


def saved_model(directory: Path, content: bytes) -> Path:
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(content)
    return directory


def test_the_baseline_evaluation_must_be_of_the_default_starts_weights(tmp_path):
    start = saved_model(tmp_path / "start", b"weights of this machine's build")
    rows = [{"em": 1.0, "f1": 1.0, "answered": 1.0}]
    (tmp_path / "eval.json").write_text(json.dumps({"questions": {candidate.ENV: rows}}))
    digest = weights_digest(start)
    assert candidate.baseline_rows(f"{digest}=" + str(tmp_path / "eval.json"), start, tmp_path) == (digest, rows)
    with pytest.raises(ValueError, match=f"digest {digest}"):
        candidate.baseline_rows("0123456789ab=" + str(tmp_path / "eval.json"), start, tmp_path)


def test_the_table_reads_the_paired_change():
    rows = [{"em": em, "f1": em, "answered": 1.0} for em in (0, 0, 1, 0)]
    better = [{"em": em, "f1": em, "answered": 1.0} for em in (1, 0, 1, 1)]
    change = candidate.seed_summary(rows, better, ["bridge", "bridge", "comparison", "comparison"])
    text = candidate.markdown({"settings": ["lr=1e-3"], "questions": 4, "default_digest": "aaaa",
                               "candidate_digest": "bbbb", "build_seconds": 12.0, "change": change})
    assert "| default | aaaa | 0.250 | 1.000 | 0.250 |" in text
    assert "| candidate | bbbb | 0.750 | 1.000 | 0.750 |" in text
    assert "candidate - default: +0.500" in text
    assert "- bridge (0.000 -> 0.500): +0.500" in text


def test_a_flag_is_added_once_and_only_if_warmstart_has_it():
    assert candidate.recipe_with(RECIPE, ["lr=1e-3"], ["replay-bottom"]) == (
        "--model", "smollm2-135m", "--cite", "--questions", "640", "--lr", "1e-3", "--seed", "0", "--replay-bottom")
    assert candidate.recipe_with(RECIPE, [], ["--replay_bottom"])[-1] == "--replay-bottom"
    with pytest.raises(ValueError, match="sets --cite already"):
        candidate.recipe_with(RECIPE, [], ["cite"])
    with pytest.raises(ValueError, match=r"no flag --replay-everything .*--replay-bottom"):
        candidate.recipe_with(RECIPE, [], ["replay-everything"])
    with pytest.raises(ValueError, match="no flag --lr"):  # an option with a value is not a flag
        candidate.recipe_with(RECIPE, [], ["lr"])


def test_a_candidate_must_change_something(capsys):
    with pytest.raises(SystemExit):
        candidate.main(["--output", "unused"])
    assert "--set OPTION=VALUE or --flag FLAG" in capsys.readouterr().err
