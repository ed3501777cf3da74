"""The baseline agents run the envs through plain Gymnasium loops; the oracle checks the whole plumbing."""

from __future__ import annotations

import pytest

from experiments.baselines import NoSearchAgent, OracleAgent, RandomAgent, evaluate, main


@pytest.fixture(scope="module")
def rows(data_dir):
    agents = {"random": lambda: RandomAgent(0), "no_search": NoSearchAgent, "oracle": lambda: OracleAgent(3)}
    table = evaluate(["HotpotQA-v0", "Bamboogle-v0"], agents, limit=60)
    return {(r["env"], r["agent"]): r for r in table}


@pytest.mark.parametrize("env_id", ["HotpotQA-v0", "Bamboogle-v0"])
def test_oracle_is_perfect(rows, env_id):
    oracle = rows[env_id, "oracle"]
    assert oracle["n"] == 60 and oracle["em"] == oracle["f1"] == oracle["reward"] == 1.0


def test_oracle_finds_the_gold_passages(rows):
    oracle = rows["HotpotQA-v0", "oracle"]
    assert oracle["tool_calls"] == 2.0 and oracle["turns"] == 3.0  # two gold titles, then the answer
    assert oracle["gold_hit"] >= 0.9


def test_no_search_answers_at_once(rows):
    row = rows["HotpotQA-v0", "no_search"]
    assert row["tool_calls"] == 0 and row["turns"] == 1.0
    assert row["reward"] == pytest.approx(0.2 + 0.8 * row["em"])  # valid format: 1.0 if correct, else 0.2


def test_random_agent_is_seeded(data_dir, rows):
    again = evaluate(["HotpotQA-v0"], {"random": lambda: RandomAgent(0)}, limit=60)[0]
    assert again == rows["HotpotQA-v0", "random"]
    other = evaluate(["HotpotQA-v0"], {"random": lambda: RandomAgent(1)}, limit=60)[0]
    assert other != again
    assert 0 < again["tool_calls"] < 3 and again["em"] < 0.2


def test_cli_prints_the_table(data_dir, capsys, tmp_path):
    main(["--envs", "Musique-v0", "--agents", "oracle", "--limit", "5", "--json", str(tmp_path / "rows.json")])
    out = capsys.readouterr().out
    assert "| Musique-v0 | dev | oracle | 5 | 1.000 |" in out
    assert (tmp_path / "rows.json").read_text().count('"agent"') == 1
