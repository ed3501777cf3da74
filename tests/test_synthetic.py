"""SynthHop and SynthBranch: deterministic generated worlds whose every question the retrieval oracle answers."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from dataclasses import replace

import gymnasium as gym
import pytest
import ray

import envs
from envs.synthetic import (
    GIVEN_NAMES,
    SYLLABLES,
    TEMPLATES,
    BranchSpec,
    World,
    WorldSpec,
    question_path,
    read_spec,
    write_world,
)
from envs.synthetic import main as synthetic_main
from experiments.baselines import OracleAgent, run_episode
from experiments.run import main as run_main
from policies.models import load_model

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


def test_question_path_names_the_relations_each_question_asks_along():
    world = World(WorldSpec(**SMALL))
    questions = [q for qs in world.all_questions().values() for q in qs]
    # following the path found from the question's first entity gives the question's answer and chain: the longest
    # template wins ("In which country was the founder of X born?" is not "In which country was {} born?")
    for q in questions:
        assert world.answer(q.chain[0], question_path(q.question)) == (q.answer, q.chain), q.question
    assert {question_path(q.question) for q in questions} == {path for _, path, _ in TEMPLATES}
    assert question_path("What is the capital of Veldra?") is None
    assert question_path("Who founded ?") is None  # a template's words around no name


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


def test_a_world_env_refuses_what_it_would_otherwise_ignore(tmp_path, monkeypatch):
    """A data_dir that does not exist, a world= that is not the one data_dir holds, and the dataset, which the id
    names: each refused by name (each was silently ignored)."""
    monkeypatch.setenv("TREEGRPO_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(envs.datasets.MissingDataError, match=f"data_dir {tmp_path / 'typo'} does not exist"):
        gym.make("SynthHop-v0", world={**SMALL, "seed": 1}, data_dir=tmp_path / "typo")
    held = write_world(WorldSpec(**SMALL, seed=1), tmp_path / "held")
    assert gym.make("SynthHop-v0", world={**SMALL, "seed": 1}, data_dir=held).unwrapped.records  # the same world
    with pytest.raises(ValueError, match="is not the world written in data_dir"):
        gym.make("SynthHop-v0", world={**SMALL, "seed": 2}, data_dir=held)
    with pytest.raises(ValueError, match="serves the synthhop dataset; dataset='hotpotqa' cannot be set"):
        gym.make("SynthHop-v0", world={**SMALL, "seed": 1}, dataset="hotpotqa")


# -- SynthBranch: one routing decision per question ---------------------------------------------------------------

BRANCH = {"people": 20, "companies": 12, "cities": 6, "countries": 3, "train_questions": 16, "dev_questions": 8}


@pytest.mark.parametrize("hops", [2, 3, 4])
def test_every_branch_question_turns_on_which_person_the_first_passage_names(hops):
    world = BranchSpec(**BRANCH, hops=hops).world()
    splits = world.split_questions()
    assert not {q.question for q in splits["dev"]} & {q.question for q in splits["train"]}
    for split, questions in splits.items():
        roles = Counter("founder" if " founder " in q.question else "chair" for q in questions)
        assert roles["founder"] == roles["chair"] == BRANCH[f"{split}_questions"] // 2
        for q in questions:
            company = world.entities[q.chain[0]]
            right, wrong = q.chain[1], q.decoy.chain[1]
            assert q.hops == q.decoy.hops == hops and q.decoy.chain[0] == company.name in q.question
            # the first search's passage names both people; the question's wording says which one to follow
            assert {right, wrong} == {company.facts["founder"], company.facts["chair"]}
            assert right in world.passage(company.name) and wrong in world.passage(company.name)
            assert right not in q.question and wrong not in q.question
            assert q.answer != q.decoy.answer  # the wrong route ends elsewhere
            decision = world.spec.decision_hop  # the routes share the searches before it and part at it
            assert q.chain[:decision] == q.decoy.chain[:decision] and q.chain[decision] != q.decoy.chain[decision]


@pytest.mark.parametrize("hops", [3, 4, 5])
def test_a_lead_hop_puts_the_decision_after_the_second_search(hops):
    spec = BranchSpec(**BRANCH, hops=hops, lead=True)
    world, plain = spec.world(), BranchSpec(**BRANCH, hops=hops - 1).world()
    employees = set()
    for q in world.role_questions()["founder"] + world.role_questions()["chair"]:
        employee, company = world.entities[q.chain[0]], world.entities[q.chain[1]]
        assert q.hops == q.decoy.hops == hops and q.decoy.chain[:2] == q.chain[:2]  # the routes part at the third
        assert q.chain[2] != q.decoy.chain[2] and q.answer != q.decoy.answer
        assert q.chain[spec.decision_hop] == q.chain[2] != q.decoy.chain[spec.decision_hop]
        assert q.question.replace(f"the company {employee.name} works for", company.name) in {
            other.question for other in plain.role_questions()[q.role]}  # the same question, one hop further out
        assert f"{employee.name} works for {company.name}." in world.passage(employee.name)
        assert employee.name not in (company.facts["founder"], company.facts["chair"])
        employees.add(employee.name)
    assert len(employees) == spec.companies  # one lead per company, none shared
    # the people, companies and routes are those of the world without a lead hop; only the employees' passages grow
    assert {name: e.facts.get("chair") for name, e in plain.entities.items()} == {
        name: e.facts.get("chair") for name, e in world.entities.items()}
    assert all(world.passage(name) == plain.passage(name) for name in plain.entities if name not in employees)
    assert BranchSpec(**BRANCH, hops=hops - 1, lead=False).key == plain.spec.key != spec.key


def test_every_given_name_is_one_token_after_a_space_and_no_other_entitys_word():
    _, tokenizer = load_model("tiny-random")  # SmolLM2's tokenizer
    longer = [name for name in GIVEN_NAMES if len(tokenizer(f" {name}", add_special_tokens=False)["input_ids"]) != 1]
    assert not longer
    spelled = {"".join(parts).capitalize() for k in (2, 3) for parts in itertools.product(SYLLABLES, repeat=k)}
    assert len(set(GIVEN_NAMES)) == len(GIVEN_NAMES) and not spelled & set(GIVEN_NAMES)


@pytest.mark.parametrize("spec", [WorldSpec, BranchSpec])
def test_given_names_name_each_person_by_one_distinct_word_and_leave_the_default_key(spec):
    world = spec(**BRANCH, names="given").world()
    people = [name for name, e in world.entities.items() if e.kind == "person"]
    assert len(set(people)) == BRANCH["people"] and set(people) <= set(GIVEN_NAMES)
    assert people != [name for name, e in spec(**BRANCH, names="given", seed=1).world().entities.items()
                      if e.kind == "person"]  # another world draws other names
    assert spec(**BRANCH).key == spec(**BRANCH, names="syllables").key != spec(**BRANCH, names="given").key
    assert WorldSpec().key == "a9e55e48e87d"  # the key the default world was cached under before names existed


def test_a_branch_world_shares_the_synthhop_worlds_entities():
    sizes = {k: SMALL[k] for k in ("people", "companies", "cities", "countries")}
    hop, branch = WorldSpec(**sizes).world(), BranchSpec(**sizes, train_questions=10, dev_questions=4).world()
    assert hop.entities.keys() == branch.entities.keys()
    assert all(branch.passage(name) == hop.passage(name) for name, e in hop.entities.items() if e.kind != "company")


def test_role_passages_name_each_person_in_the_questions_words_and_leave_the_default_key():
    prose, roles = BranchSpec(**BRANCH, names="given").world(), BranchSpec(**BRANCH, names="given",
                                                                            passages="roles").world()
    assert prose.entities == roles.entities  # the same world, told differently
    for name, e in roles.entities.items():
        if e.kind != "company":
            assert roles.passage(name) == prose.passage(name)
            continue
        founder, chair = e.facts["founder"], e.facts["chair"]
        assert roles.passage(name).endswith(f". The founder of {name} is {founder}. The chair of {name} is {chair}.")
        assert f"chaired by {chair}." in prose.passage(name) and "The chair of" not in prose.passage(name)
    assert BranchSpec(**BRANCH).key == BranchSpec(**BRANCH, passages="prose").key
    assert BranchSpec(**BRANCH, passages="roles").key != BranchSpec(**BRANCH).key
    assert BranchSpec().key == "d59ce33bb2aa"  # the key the default world was cached under before passages existed


@pytest.mark.parametrize(("names", "passages", "lead"), [("syllables", "prose", False), ("given", "prose", False),
                                                      ("given", "roles", False), ("given", "prose", True)])
def test_the_oracle_answers_every_branch_question_and_the_wrong_route_answers_wrongly_in_format(tmp_path, names,
                                                                                               passages, lead):
    spec = BranchSpec(**BRANCH, names=names, passages=passages, lead=lead, hops=3 + lead)
    searches = spec.hops
    root = write_world(spec, tmp_path / "world")
    env = gym.make("SynthBranch-v0", split="train", data_dir=root, max_turns=searches)
    questions = spec.world().split_questions()["train"]
    assert [r.question for r in env.unwrapped.records] == [q.question for q in questions]
    for index, q in enumerate(questions):
        info, reward = run_episode(env, OracleAgent(max_searches=searches), index)
        assert info["em"] == 1.0 and reward == 1.0 and info["tool_calls"] == searches
        record = env.unwrapped.records[index]
        wrong = replace(record, supporting_titles=q.decoy.chain, answers=(q.decoy.answer,))
        agent = OracleAgent(max_searches=searches)
        observation, _ = env.reset(options={"index": index})
        agent.start(observation, wrong)
        done = False
        while not done:
            observation, reward, terminated, truncated, info = env.step(agent.act(observation))
            done = terminated or truncated
        assert agent.found == searches and info["em"] == 0.0 and reward == 0.2  # right format, wrong answer


@pytest.mark.parametrize(("fields", "message"), [
    ({"countries": 1}, "countries must be >= 2 with hops 3"),
    ({"cities": 1, "hops": 2}, "cities must be >= 2 with hops 2"),
    ({"hops": 5}, "hops must be one of [2, 3, 4]"),
    ({"hops": 2, "lead": True}, "hops must be one of [3, 4, 5] (searches per question, the lead hop included)"),
    ({"lead": True, "people": 12}, "people must be >= companies + 2 with lead"),
    ({"train_questions": 20}, "train_questions + dev_questions (28) exceed the 24 questions of 12 companies"),
    ({"people": 3}, "people must be an even number"),
    ({"names": "nicknames"}, "names must be one of syllables, given, got 'nicknames'"),
    ({"passages": "table"}, "passages must be one of prose, roles, got 'table'"),
    ({"names": "given", "people": 2 * len(GIVEN_NAMES)}, f"people must be <= {len(GIVEN_NAMES)} with names 'given'"),
])
def test_a_branch_world_too_small_names_the_field(fields, message):
    with pytest.raises(ValueError) as caught:
        BranchSpec(**{**BRANCH, **fields})
    assert message in str(caught.value)


def test_the_world_cli_writes_either_world_and_names_what_is_wrong(tmp_path, capsys):
    root = synthetic_main([str(tmp_path / "b"), "--dataset", "synthbranch", *itertools.chain.from_iterable(
        (f"--{k.replace('_', '-')}", str(v)) for k, v in BRANCH.items()), "--hops", "4", "--names", "given",
        "--passages", "roles", "--lead"])
    assert read_spec("synthbranch", root) == BranchSpec(**BRANCH, hops=4, names="given", passages="roles", lead=True)
    for argv, message in ((["--dataset", "synthbranch", "--companies", "2"], "exceed the 4 questions of 2 companies"),
                          (["--dataset", "synthbranch", "--hop-mix", "1", "0", "0"], "have no field hop_mix"),
                          (["--hops", "3"], "synthhop worlds have no field hops")):
        with pytest.raises(SystemExit):
            synthetic_main([str(tmp_path / "bad"), *argv])
        assert message in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_run_refuses_fewer_turns_than_the_worlds_hops_before_ray(tmp_path, capsys):
    root = write_world(BranchSpec(**BRANCH, hops=4), tmp_path / "world")
    assert envs.world_hops("SynthBranch-v0", data_dir=root) == 4 and envs.world_hops("HotpotQA-v0") is None
    with pytest.raises(SystemExit) as caught:
        run_main(["--env", "SynthBranch-v0", "--data-dir", str(root), "--model", "tiny-random",
                  "--output", str(tmp_path / "run")])
    assert caught.value.code == 2 and not ray.is_initialized() and not (tmp_path / "run").exists()
    err = capsys.readouterr().err
    assert "--max-turns 3: the SynthBranch-v0 world the run would serve asks 4-hop questions" in err


def test_a_world_env_refuses_fewer_turns_than_its_worlds_hops(tmp_path):
    root = write_world(BranchSpec(**BRANCH, hops=4), tmp_path / "world")
    with pytest.raises(ValueError, match="max_turns 3: the synthbranch world asks 4-hop questions"):
        gym.make("SynthBranch-v0", data_dir=root)
    assert gym.make("SynthBranch-v0", data_dir=root, max_turns=4).unwrapped.max_turns == 4
