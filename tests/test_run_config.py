"""run.py --config: YAML files under command-line overrides, 'base' files, clear errors; the shipped configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.run import build_config, parse_args

PAPER_TABLE = {2: (1, 2, 1), 4: (2, 2, 1), 8: (2, 6, 1), 16: (4, 5, 1)}  # notes/tree-grpo.md
CONFIGS = sorted((Path(__file__).parent.parent / "experiments" / "configs").rglob("*.yaml"))


def test_command_line_overrides_the_file_which_overrides_the_defaults(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("algo: grpo\ngroup-size: 6\nlr: 3.0e-6\niterations: 7\n")
    args = parse_args(["--config", str(config), "--iterations", "2"])
    assert (args.algo, args.group_size, args.lr, args.iterations) == ("grpo", 6, 3e-6, 2)
    assert args.topk == 3  # untouched default


def test_base_files_are_read_first(tmp_path):
    (tmp_path / "base.yaml").write_text("M: 4\nN: 3\noutput: base_out\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\nN: 5\n")
    args = parse_args(["--config", str(tmp_path / "child.yaml")])
    assert (args.M, args.N, args.output) == (4, 5, "base_out")


@pytest.mark.parametrize(("text", "message"), [
    ("lrr: 1\n", "unknown option 'lrr'"),
    ("algo: ppo\n", "algo must be one of"),
    ("M: two\n", "M must be int"),
    ("- a\n", "expected a YAML mapping"),
    ("base: self.yaml\n", "cycle"),
])
def test_bad_config_files_name_the_key(tmp_path, capsys, text, message):
    config = tmp_path / "self.yaml"
    config.write_text(text)
    with pytest.raises(SystemExit):
        parse_args(["--config", str(config)])
    assert message in capsys.readouterr().err


def test_missing_config_file_names_the_path(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--config", str(tmp_path / "nope.yaml")])
    assert str(tmp_path / "nope.yaml") in capsys.readouterr().err


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_build_valid_algorithm_configs(path, data_dir):
    args = parse_args(["--config", str(path)])
    config = build_config(args)
    config.validate()
    if "budget" in path.name:
        budget = int(path.name.removeprefix("budget").split("_")[0])
        shape = (config.M, config.N, config.L)
        expected = (budget, 0, 0) if args.algo == "grpo" else PAPER_TABLE[budget]
        assert shape == expected


def test_train_questions_reaches_the_algorithm_config(data_dir):
    assert build_config(parse_args(["--data-dir", str(data_dir)])).train_questions is None
    config = build_config(parse_args(["--data-dir", str(data_dir), "--train-questions", "8"]))
    config.validate()
    assert config.train_questions == 8
