"""SynthHop: a deterministic generated world whose every question the retrieval oracle answers."""

from __future__ import annotations

import json
from collections import Counter

import gymnasium as gym
import pytest

import envs  # noqa: F401  (registers the env ids)
from envs.synthetic import TEMPLATES, World, WorldSpec, write_world
from experiments.baselines import OracleAgent, run_episode

SMALL = {"people": 40, "companies": 20, "cities": 10, "countries": 4, "train_questions": 60, "dev_questions": 30}


def test_the_same_seed_writes_the_same_files_and_another_seed_does_not(tmp_path):
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        write_world(WorldSpec(seed=seed, **SMALL), tmp_path / name)
    files = ["wiki/paragraphs.jsonl", "synthhop/train.json", "synthhop/dev.json"]
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)
    assert (tmp_path / "a" / files[0]).read_bytes() != (tmp_path / "c" / files[0]).read_bytes()


def test_splits_are_disjoint_and_follow_the_hop_mix():
    spec = WorldSpec(**SMALL, hop_mix=(0.2, 0.5, 0.3))
    splits = World(spec).split_questions()
    assert Counter(q.hops for q in splits["dev"]) == {1: 6, 2: 15, 3: 9}
    assert Counter(q.hops for q in splits["train"]) == {1: 12, 2: 30, 3: 18}
    assert not {q.question for q in splits["dev"]} & {q.question for q in splits["train"]}


def test_bridge_entities_are_only_in_the_passages():
    world = World(WorldSpec(**SMALL))
    for q in world.split_questions()["dev"]:
        assert q.chain[0] in q.question
        for bridge in q.chain[1:]:  # found by reading the previous hop's passage, never given in the question
            assert bridge not in q.question
        for previous, bridge in zip(q.chain, q.chain[1:], strict=False):
            assert bridge in world.passage(previous)
        assert q.answer in world.passage(q.chain[-1])


def test_names_overlap_so_queries_must_be_precise():
    world = World(WorldSpec())
    people = [e.name for e in world.entities.values() if e.kind == "person"]
    first_names = Counter(name.split()[0] for name in people)
    assert max(first_names.values()) >= 3  # several people share a first name


def test_invalid_specs_name_the_field():
    with pytest.raises(ValueError, match="people"):
        WorldSpec(people=3)
    with pytest.raises(ValueError, match="hop_mix"):
        WorldSpec(hop_mix=(0.5, 0.5, 0.5))
    with pytest.raises(ValueError, match="unused 1-hop questions left for train"):
        World(WorldSpec(**{**SMALL, "train_questions": 500})).split_questions()


def test_every_template_asks_about_every_entity_of_its_kind():
    world = World(WorldSpec(**SMALL))
    questions = [q.question for qs in world.all_questions().values() for q in qs]
    kinds = Counter(e.kind for e in world.entities.values())
    for kind, _, template in TEMPLATES:
        head, tail = template.split("{}")
        asked = [q for q in questions if q.startswith(head) and q.endswith(tail)
                 and world.entities.get(q[len(head):len(q) - len(tail)], None) is not None]
        assert len(asked) >= kinds[kind], template
    assert len(questions) == sum(kinds[kind] for kind, _, _ in TEMPLATES)


@pytest.mark.parametrize("split", ["train", "dev"])
def test_the_oracle_answers_every_question_and_each_hop_is_retrieved_by_its_gold_query(tmp_path, split):
    root = write_world(WorldSpec(**SMALL), tmp_path / "world")
    env = gym.make("SynthHop-v0", split=split, data_dir=root, max_turns=3, topk=3)
    records = env.unwrapped.records
    for index in range(len(records)):
        agent = OracleAgent(max_searches=3)
        info, reward = run_episode(env, agent, index)
        assert info["em"] == 1.0 and reward == 1.0, records[index]
        assert agent.found == agent.searched == len(records[index].supporting_titles)
    rows = json.loads((root / "synthhop" / f"{split}.json").read_text())
    assert [len(r["supporting_facts"]) for r in rows] == [r["hops"] for r in rows]


def test_gym_make_generates_the_world_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TREEGRPO_CACHE_DIR", str(tmp_path))
    env = gym.make("SynthHop-v0", split="dev", world={**SMALL, "seed": 3})
    assert len(env.unwrapped.records) == SMALL["dev_questions"]
    assert len(list((tmp_path / "synthhop").iterdir())) == 1
    prompt, _ = env.reset(options={"index": 0})
    assert env.unwrapped.record.question in prompt
