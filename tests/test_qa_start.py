"""The real QA sets' warm start (experiments/qa_start.py, the real-question parts of warmstart.py and
oracle_trajectories.py, model_manifest.py): trained on the train split only, its bad inputs (no train split, no chat
template, supporting passages the corpus lacks, a damaged cached start), its cache key, and the oracle's citing
thoughts."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import gymnasium as gym
import pytest

import envs  # noqa: F401  (registers the env ids)
from envs.datasets import QARecord, content_digest
from envs.search_qa import first_words, format_passages
from experiments.baselines import (
    ANSWER_DECISION,
    SEARCH_DECISION,
    OracleAgent,
    in_format,
    named_form,
    passage_sentences,
    run_episode,
    sentence_naming,
)
from experiments.model_manifest import damage, structural_damage, write_manifest
from experiments.qa_start import CPU_QA_DEFAULTS, QA_START_RECIPE, QASource, warm_start_model
from experiments.warmstart import build_model, cached_warm_start, parse_args, training_data
from policies.models import load_model

SHARED = Path(os.environ.get("TREEGRPO_DATA_DIR", ""))
HOTPOT = SHARED / "hotpotqa"
needs_data = pytest.mark.skipif(not (HOTPOT / "hotpot_train_distractor_subset.json").is_file(),
                                reason="needs ../shared/data (HotpotQA)")


def small_hotpotqa(root: Path, questions: int, drop_title_of: int | None = None) -> Path:
    """A data directory with the first ``questions`` HotpotQA train and dev questions and a corpus of their gold
    paragraphs (less those titled by question ``drop_title_of``'s second supporting title)."""
    (root / "hotpotqa").mkdir(parents=True)
    (root / "wiki").mkdir()
    train = json.loads((HOTPOT / "hotpot_train_distractor_subset.json").read_text())[:questions]
    dev = json.loads((HOTPOT / "hotpot_dev_distractor_subset.json").read_text())[:questions]
    (root / "hotpotqa" / "hotpot_train_distractor_subset.json").write_text(json.dumps(train))
    (root / "hotpotqa" / "hotpot_dev_distractor_subset.json").write_text(json.dumps(dev))
    dropped = None if drop_title_of is None else train[drop_title_of]["supporting_titles"][1]
    with open(root / "wiki" / "paragraphs.jsonl", "w") as corpus:
        for question in train + dev:
            for title, sentences in question["context"]:
                if title != dropped:
                    corpus.write(json.dumps({"id": f"{len(title)}-{title}",
                                             "contents": f'"{title}"\n{"".join(sentences)}'}) + "\n")
    return root


def warm_args(data_dir: Path, *extra: str):
    return parse_args(["--env", "HotpotQA-v0", "--model", "tiny-random", "--data-dir", str(data_dir), "--cite",
                       "--topk", "2", *extra])


def test_first_words_cuts_each_passage_and_marks_the_cut():
    assert first_words("one two three", 2) == "one two ..."
    assert first_words("one two", 2) == "one two" and first_words("one two", None) == "one two"

    class Hit:
        def __init__(self, title, text):
            self.title, self.text = title, text

    block = format_passages([Hit("A", "a b c d"), Hit("B", "e f")], 2000, passage_words=3)
    assert "Doc 1(Title: A) a b c ...\nDoc 2(Title: B) e f</information>" in block


@needs_data
def test_a_passage_word_cap_is_checked_and_applies_to_every_search():
    with pytest.raises(ValueError, match="passage_words must be a positive int"):
        gym.make("HotpotQA-v0", passage_words=0)
    env = gym.make("HotpotQA-v0", topk=2, passage_words=5)
    env.reset(options={"index": 0})
    observation, *_ = env.step(in_format("look", "search", env.unwrapped.record.supporting_titles[0]))
    for passage in observation.split("\nDoc ")[:2]:
        assert len(passage.split(") ", 1)[1].replace("</information>", "").split()) <= 6  # 5 words and " ..."


def test_sentence_naming_quotes_the_passage_and_cuts_a_long_one_around_the_name():
    observation = ("<information>Doc 1(Title: X) X is a show. It starred Ann Lee as the coach. It ended.\n"
                   "Doc 2(Title: Y) Nothing here.</information>")
    assert sentence_naming([observation], "ann lee") == "It starred Ann Lee as the coach"
    assert sentence_naming([observation], "Bob") is None
    long = "<information>Doc 1(Title: Z) " + " ".join(f"w{i}" for i in range(50)) + " Ann Lee w.</information>"
    cut = sentence_naming([long], "Ann Lee", max_words=10).split()
    assert len(cut) == 10 and "Ann" in cut and "Lee" in cut


def test_the_oracle_reads_passages_under_parenthesised_titles_and_names_whole_words_only():
    observation = ("<information>Doc 1(Title: Fire (1996 film)) Fire is a film. It starred Nandita Das.\n"
                   "Doc 2(Title: Known (band)) He is known for music. Yesterday it rained.</information>")
    assert passage_sentences(observation) == ["Fire is a film.", "It starred Nandita Das.", "He is known for music.",
                                              "Yesterday it rained."]
    assert sentence_naming([observation], "Nandita Das") == "It starred Nandita Das"
    assert sentence_naming([observation], "no") is None and sentence_naming([observation], "yes") is None
    assert named_form("US", ["thus it was"]) is None and named_form("Fire (1996 film)", ["She saw Fire."]) == "Fire"
    agent = OracleAgent(1, cite=True, read=True)  # a comparison's verdict is named by no passage: no quote
    agent.start("", QARecord("q", "Was Fire made before Known?", ("no",), ("Fire (1996 film)",)))
    agent.act("")
    answer = agent.act("<information>Doc 1(Title: Fire (1996 film)) No one knew it. It came out in 1996.</information>")
    assert answer == in_format(ANSWER_DECISION, "answer", "no") and agent.unread == 0


# what ORACLE_FORMAT's oracle renders on real questions in test_the_oracles_text_on_real_questions_is_pinned
QA_ORACLE_TEXT = (3, "8e046a84632e9a31")


@needs_data
def test_the_oracles_text_on_real_questions_is_pinned():
    from experiments.oracle_trajectories import ORACLE_FORMAT, oracle_trajectory

    env = gym.make("HotpotQA-v0", split="train", data_dir=SHARED, topk=2, passage_words=64)
    records = env.unwrapped.records
    _, tokenizer = load_model("tiny-random")
    verdict = next(i for i, r in enumerate(records) if not r.named_answers)  # yes / no: nothing to quote
    qualified = next(i for i, r in enumerate(records) if any("(" in t for t in r.supporting_titles))
    rendered = [oracle_trajectory(env, tokenizer, i, 3, tokenizer.eos_token_id, cite=True, read=True)
                for i in (0, verdict, qualified)]
    digest = hashlib.sha256(json.dumps(rendered).encode()).hexdigest()[:16]
    assert (ORACLE_FORMAT, digest) == QA_ORACLE_TEXT, (
        "the oracle's trajectories of real questions changed: bump ORACLE_FORMAT (else cached warm starts trained on "
        "the old text are reused) and pin the new (format, digest) here and in tests/test_warmstart.py")


@needs_data
def test_the_citing_oracle_writes_down_the_bridge_and_the_answer_before_using_them():
    env = gym.make("HotpotQA-v0", topk=2)
    agent = OracleAgent(3, cite=True)
    steps = []
    original = agent.act
    agent.act = lambda observation: steps.append(original(observation)) or steps[-1]
    info, reward = run_episode(env, agent, 0)  # "...played the life coach in Modern Men's pilot?" Wendie Malick
    assert reward == 1.0 and info["em"] == 1.0
    assert "Wendie Malick played the life coach" in steps[1] and steps[1].endswith("<search> Wendie Malick </search>")
    assert "Wendie Malick" in steps[2].split("</think>")[0] and "<answer> Wendie Malick </answer>" in steps[2]
    # the decision opens each thought, in the same words whatever the quote
    assert [step.startswith(f"<think>{SEARCH_DECISION}") for step in steps] == [True, True, False]
    assert steps[2].startswith(f"<think>{ANSWER_DECISION}. ")


@needs_data
def test_no_dev_question_is_ever_trained_on(tmp_path):
    _, tokenizer = load_model("tiny-random")
    args = warm_args(SHARED, "--questions", "12")
    data = training_data(args, {"data_dir": str(SHARED), "max_turns": 3, "topk": 2, "passage_words": 48},
                         tokenizer, tokenizer.eos_token_id)
    def words(text: str) -> str:
        return " ".join(text.split())

    prompts = [words(tokenizer.decode(ids)) for ids, _ in data]
    dev = [words(q["question"]) for q in json.loads((HOTPOT / "hotpot_dev_distractor_subset.json").read_text())]
    train = [words(q["question"]) for q in json.loads((HOTPOT / "hotpot_train_distractor_subset.json").read_text())]
    assert len(prompts) >= 10
    assert all(any(f"Question: {q}" in p for q in train) for p in prompts)
    assert not any(f"Question: {q}" in p for q in dev for p in prompts)


@needs_data
def test_an_env_without_a_train_split_names_the_file_the_warm_start_needs():
    with pytest.raises(Exception, match=r"train split, which is missing: no musique train file .*musique_ans_v1"):
        QASource.of("Musique-v0", SHARED)
    _, tokenizer = load_model("tiny-random")
    args = parse_args(["--env", "Musique-v0", "--model", "tiny-random", "--data-dir", str(SHARED)])
    with pytest.raises(SystemExit, match=r"Musique-v0's train split, which is missing: .*musique_ans_v1.0_train"):
        training_data(args, {"data_dir": str(SHARED), "max_turns": 3, "topk": 3, "passage_words": None}, tokenizer,
                      tokenizer.eos_token_id)


@pytest.mark.parametrize("case", ["folder", "train file"])
def test_the_command_names_a_missing_folder_or_train_file_in_one_line(case, tmp_path, capsys):
    from experiments.qa_start import main

    dev_only = tmp_path / "dev_only" / "hotpotqa"
    dev_only.mkdir(parents=True)
    for dev in (SHARED / "hotpotqa").glob("*dev*"):
        (dev_only / dev.name).symlink_to(dev)
    argv = ["--data-dir", str(tmp_path / "nope" if case == "folder" else dev_only.parent)]
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qa_start.py: error: ")
    assert (str(tmp_path / "nope") if case == "folder" else "train split, which is missing: no hotpotqa train") \
        in err[0]


@needs_data
@pytest.mark.parametrize("model, refusal", [((), "warm start of HotpotQA-v0 .* no corpus in"),
                                            (("--model", "tiny"), "no corpus in")])
def test_the_mission_command_without_a_corpus_is_refused_in_one_line_naming_it(tmp_path, monkeypatch, model,
                                                                                 refusal):
    import algos.tree_grpo.settings as algorithm_settings
    from experiments.cli import SettingsError
    from experiments.preflight import check_before_ray
    from experiments.run import plan

    monkeypatch.setattr(algorithm_settings, "gpu_visible", lambda: False)  # the CPU command: from the warm start
    questions_only = tmp_path / "data" / "hotpotqa"
    questions_only.mkdir(parents=True)
    for split in HOTPOT.iterdir():
        (questions_only / split.name).symlink_to(split)
    settings = plan(["--data-dir", str(questions_only.parent), *model, "--output", str(tmp_path / "run")]).settings
    assert settings.model == (model[1] if model else "warm-start")
    with pytest.raises(SettingsError, match=rf"{refusal} {questions_only.parent}"):  # any model: the env searches it
        check_before_ray(settings)
    assert not (tmp_path / "run").exists()


@needs_data
def test_a_killed_build_resumes_from_its_data_moved_elsewhere_and_refuses_other_data(tmp_path):
    from experiments.warmstart import claim_output

    def data_dir(name: str, train: list | None = None) -> Path:
        root = tmp_path / name
        (root / "hotpotqa").mkdir(parents=True)
        (root / "wiki").symlink_to(SHARED / "wiki")
        for split in HOTPOT.iterdir():
            if train is not None and "train" in split.name:
                (root / "hotpotqa" / split.name).write_text(json.dumps(train))
            else:
                (root / "hotpotqa" / split.name).symlink_to(split)
        return root

    def options(root: Path):
        return parse_args(["--env", "HotpotQA-v0", *QA_START_RECIPE, "--data-dir", str(root),
                           "--output", str(tmp_path / "staging")])

    checkpoint, _ = claim_output(tmp_path / "staging", options(data_dir("first")))
    checkpoint.write_bytes(b"the state after epoch 1")  # a killed build
    assert claim_output(tmp_path / "staging", options(data_dir("moved")))[0] == checkpoint  # the same data
    train = json.loads(next(HOTPOT.glob("*train*")).read_text())[:5]
    with pytest.raises(SystemExit, match=r"checkpoint\.pt was written by other settings"):
        claim_output(tmp_path / "staging", options(data_dir("other", train)))


def test_a_model_without_a_chat_template_is_named(tmp_path):
    model, tokenizer = load_model("tiny-random")
    tokenizer.chat_template = None
    model.save_pretrained(tmp_path / "plain")
    tokenizer.save_pretrained(tmp_path / "plain")
    (tmp_path / "plain" / "chat_template.jinja").unlink(missing_ok=True)
    args = parse_args(["--env", "HotpotQA-v0", "--model", str(tmp_path / "plain")])
    with pytest.raises(SystemExit, match=rf"--model {tmp_path / 'plain'} has no chat template"):
        build_model(args)


def test_the_reading_oracle_searches_what_it_has_read_as_it_read_it_and_counts_what_it_had_not():
    """The title the question names first, although listed second; the other as the passage names it (without its
    qualifier); a query or answer named nowhere before it is counted as unread."""
    from envs.datasets import QARecord

    record = QARecord(id="q1", question="Who founded the label of the band Blue Fire?", answers=("Ann Lee",),
                      supporting_titles=("Sunset Records (label)", "Blue Fire"))
    agent = OracleAgent(2, cite=True, read=True)
    agent.start("prompt", record)
    assert "<search> Blue Fire </search>" in agent.act("prompt")
    first = "<information>Doc 1(Title: Blue Fire) Blue Fire signed with Sunset Records in 1990.</information>"
    assert (agent.act(first) == f"<think>{SEARCH_DECISION}. Blue Fire signed with Sunset Records in 1990</think>\n"
                                "<search> Sunset Records </search>")
    assert agent.act("<information>Doc 1(Title: Sunset Records (label)) It grew.</information>") == (
        f"<think>{ANSWER_DECISION}</think>\n<answer> Ann Lee </answer>")  # no passage names Ann Lee: nothing to quote
    assert agent.unread == 1  # the answer: no passage named Ann Lee
    unread = OracleAgent(2, read=True)
    unread.start("prompt", QARecord(id="q2", question="Who?", answers=("yes",), supporting_titles=("A", "B")))
    unread.act("prompt"), unread.act("<information>Doc 1(Title: A) Nothing.</information>")
    assert unread.unread == 2 and unread.act("x").endswith("<answer> yes </answer>")  # yes/no need no passage


@needs_data
def test_questions_whose_supporting_passage_the_corpus_lacks_are_counted_and_skipped(tmp_path, capsys):
    data_dir = small_hotpotqa(tmp_path, questions=4, drop_title_of=1)
    _, tokenizer = load_model("tiny-random")
    kwargs = {"data_dir": str(data_dir), "max_turns": 3, "topk": 2, "passage_words": None}
    data = training_data(warm_args(data_dir, "--require-gold"), kwargs, tokenizer, tokenizer.eos_token_id)
    assert len(data) == 3 and "1 of 4 questions skipped" in capsys.readouterr().out
    assert len(training_data(warm_args(data_dir), kwargs, tokenizer, tokenizer.eos_token_id)) == 4


@needs_data
def test_the_cache_key_follows_the_data_content_not_its_path_or_time(tmp_path):
    first = small_hotpotqa(tmp_path / "a", questions=3)
    copy = tmp_path / "b"
    shutil.copytree(first, copy)
    os.utime(copy / "hotpotqa" / "hotpot_train_distractor_subset.json", (0, 0))
    assert QASource.of("HotpotQA-v0", first).key == QASource.of("HotpotQA-v0", copy).key
    (copy / "wiki" / "paragraphs.jsonl").write_text('{"id": "1", "contents": "\\"T\\"\\ntext"}\n')
    assert QASource.of("HotpotQA-v0", first).key != QASource.of("HotpotQA-v0", copy).key
    assert content_digest(copy / "wiki" / "paragraphs.jsonl") in QASource.of("HotpotQA-v0", copy).key
    assert warm_start_model("smollm2-135m", "HotpotQA-v0", first) == "smollm2-135m"
    assert warm_start_model("warm-start", "HotpotQA-v0", first).endswith("/model")
    with pytest.raises(ValueError, match="SynthHop-v0 has none"):
        warm_start_model("warm-start", "SynthHop-v0", first)


def test_a_manifest_finds_a_truncated_or_altered_file(tmp_path):
    model, _ = load_model("tiny-random")
    directory = tmp_path / "start" / "model"
    model.save_pretrained(directory)
    weights = directory / "model.safetensors"
    assert structural_damage(directory) is None and damage(directory) is None  # a start cached before manifests
    assert not (tmp_path / "start" / "manifest.json").exists()  # checked only: a read-only cache is checked too
    write_manifest(directory)
    data = weights.read_bytes()
    weights.write_bytes(data[:-10] + bytes(10))
    assert "content differs" in damage(directory)
    weights.write_bytes(data[:-10])
    assert "bytes, not the" in damage(directory)
    assert "its header describes" in structural_damage(directory)
    (tmp_path / "start" / "manifest.json").unlink()
    assert "its header describes" in damage(directory)  # no manifest: the structure still finds it
    weights.write_bytes(data)
    write_manifest(directory)
    weights.unlink()
    assert damage(directory) == "model.safetensors is missing"


@needs_data
def test_a_damaged_cached_start_is_detected_and_trained_again(tmp_path, capsys):
    data_dir = small_hotpotqa(tmp_path / "data", questions=3)
    source = QASource.of("HotpotQA-v0", data_dir)
    recipe = ("--model", "scratch", "--hidden-size", "32", "--layers", "1", "--heads", "2", "--questions", "2",
              "--epochs", "1", "--cite")
    model = cached_warm_start(source, recipe, topk=2, cache_dir=tmp_path / "cache")
    weights = model / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    capsys.readouterr()
    again = cached_warm_start(source, recipe, topk=2, cache_dir=tmp_path / "cache")
    assert again == model and "is damaged" in capsys.readouterr().out
    assert weights.read_bytes() == whole  # the same recipe and seed train the same start
    load_model(str(model))


def test_the_recipe_is_one_declaration_of_warmstart_options():
    args = parse_args(list(QA_START_RECIPE))
    assert args.cite and args.require_gold and args.lora_rank and args.model == "smollm2-135m"


def test_on_a_cpu_the_real_qa_env_trains_from_its_warm_start_with_the_cpu_defaults(monkeypatch):
    from experiments.settings import RunSettings, lora_settings

    settings = RunSettings()
    assert settings.env == "HotpotQA-v0" and settings.model == "warm-start"
    assert {name: getattr(settings, name) for name in CPU_QA_DEFAULTS} == CPU_QA_DEFAULTS
    assert lora_settings(settings).layers == 10 and "down_proj" in lora_settings(settings).target_modules
    given = RunSettings(topk=3, M=2)  # what the user gives wins
    assert (given.topk, given.M, given.passage_words) == (3, 2, CPU_QA_DEFAULTS["passage_words"])
    full = RunSettings(lora_rank=None)  # full fine-tuning of the start: the LoRA options and their lr go together
    assert full.lora_rank is None and full.lora_layers is None
    assert full.lr == RunSettings.model_fields["lr"].default != CPU_QA_DEFAULTS["lr"]
    # defaults, not choices: only what the user gave counts as given (the device-defaults guard reads it)
    assert not settings.model_fields_set & CPU_QA_DEFAULTS.keys()
    assert given.model_fields_set & CPU_QA_DEFAULTS.keys() == {"topk", "M"}
    other = RunSettings(model="smollm2-135m")  # another model keeps the generic defaults
    assert (other.topk, other.passage_words, other.lora_rank, other.M) == (3, None, None, 2)
    assert RunSettings(env="SynthHop-v0").model == "smollm2-135m"
    with pytest.raises(ValueError, match="lora_layers, lora_targets: place LoRA adapters, but lora_rank is None"):
        RunSettings(model="smollm2-135m", lora_layers=4)


def test_a_given_lora_rank_keeps_the_profiles_other_lora_options_and_lr_and_full_fine_tuning_drops_them(
        monkeypatch):
    import algos.tree_grpo.settings as algorithm_settings
    from experiments.settings import RunSettings

    monkeypatch.setattr(algorithm_settings, "gpu_visible", lambda: False)  # the CPU command: from the warm start
    lora = ("lora_rank", "lora_layers", "lora_targets", "lr")
    ranked = RunSettings(lora_rank=8)  # still LoRA: only the rank changes
    assert [getattr(ranked, name) for name in lora] == [8, CPU_QA_DEFAULTS["lora_layers"],
                                                          CPU_QA_DEFAULTS["lora_targets"], CPU_QA_DEFAULTS["lr"]]
    assert ranked.model_fields_set & CPU_QA_DEFAULTS.keys() == {"lora_rank"}
    assert RunSettings(lora_rank=8, lr=1e-5, lora_layers=4).lr == 1e-5  # what is given wins
    generic = {name: RunSettings.model_fields[name].default for name in lora}
    for full in (RunSettings(lora_rank=None), RunSettings(reference_offload=True)):  # full fine-tuning
        assert {name: getattr(full, name) for name in lora} == generic
        assert full.topk == CPU_QA_DEFAULTS["topk"]  # the rest of the profile stays


def test_run_help_names_the_cpu_default_start_of_the_real_qa_envs(capsys):
    from experiments.run import run_parser

    help_text = " ".join(run_parser().format_help().split())
    assert "default: on CPU warm-start for HotpotQA-v0" in help_text and "experiments/qa_start.py" in help_text


@needs_data
def test_the_first_builds_minutes_follow_the_cpus_vector_unit(tmp_path, monkeypatch, capsys):
    """Minutes by vector unit (``BUILD_MINUTES``: AVX-512 measured, AVX2 estimated): the announcement says the one for
    this CPU, the slower where the vector unit was never measured; the help names both."""
    import torch

    from experiments import qa_start
    from experiments.run import run_parser

    wide, narrow = qa_start.BUILD_MINUTES["AVX512"], qa_start.BUILD_MINUTES["AVX2"]
    assert wide < narrow
    assert [qa_start.build_minutes(c) for c in ("AVX512", "AVX2", "DEFAULT")] == [wide, narrow, narrow]
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(qa_start, "cached_warm_start", lambda *args, **kwargs: tmp_path)  # announced, not built
    qa_start.qa_warm_start("HotpotQA-v0", data_dir=small_hotpotqa(tmp_path / "data", 4), cache_dir=tmp_path)
    assert f"about {narrow} minutes on 2 cores of this CPU" in capsys.readouterr().out
    help_text = " ".join(run_parser().format_help().split())
    assert f"about {wide} minutes on 2 cores with AVX-512, {narrow} with AVX2 only" in help_text


def test_evaluate_takes_a_runs_observations_from_its_config(tmp_path):
    from experiments.evaluate import parse_args as evaluate_args

    checkpoint = tmp_path / "run" / "checkpoints" / "iter_000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / "rllib_checkpoint.json").write_text("{}")
    server = "http://127.0.0.1:8000/retrieve"  # a run trained against a retrieval server is evaluated against it
    (tmp_path / "run" / "config.yaml").write_text(f"topk: 2\npassage_words: 48\nmax_step_tokens: 80\nmax_turns: 3\n"
                                                  f"retriever: {server}\n")
    args = evaluate_args(["--model", str(checkpoint), "--envs", "HotpotQA-v0"])
    assert (args.topk, args.passage_words, args.max_step_tokens, args.max_turns, args.retriever) == (
        2, 48, 80, 3, server)
    args = evaluate_args(["--model", str(checkpoint), "--envs", "HotpotQA-v0", "--topk", "5", "--retriever", "bm25"])
    assert (args.topk, args.retriever) == (5, "bm25")
    fresh = evaluate_args(["--model", "smollm2-135m", "--envs", "HotpotQA-v0"])
    assert (fresh.topk, fresh.retriever) == (3, "bm25")


@pytest.mark.parametrize("argv, error", [(["--retriever", "elastic"], "unknown retriever backend 'elastic'"),
                                         (["--model", "warm-start"], "python experiments/qa_start.py prints")])
def test_evaluate_names_a_wrong_retriever_or_the_unresolved_warm_start_in_one_line(argv, error, tmp_path, capsys):
    from experiments.evaluate import main as evaluate_main

    with pytest.raises(SystemExit) as caught:
        evaluate_main(["--model", "smollm2-135m", "--envs", "HotpotQA-v0", "--output", str(tmp_path / "out"), *argv])
    assert caught.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert error in err[-1] and not (tmp_path / "out").exists()


@pytest.mark.slow
@needs_data
def test_a_small_warm_start_then_one_tree_grpo_iteration_on_real_questions_earns_a_reward(tmp_path, ray_session):
    """Item 4 of issue 70: the real path end to end (pretrained tokenizer and chat template, BM25 over real passages,
    exact match), with real weights: the warm start on 32 train questions (three epochs at a higher rate, so that so
    few steps teach the format), then one iteration from it at the CPU defaults, on 2 prompts."""
    from experiments.cli import flag
    from experiments.run import main as run_main

    recipe = (*QA_START_RECIPE, "--questions", "32", "--epochs", "3", "--lr", "1e-3")  # the later options win
    model = cached_warm_start(QASource.of("HotpotQA-v0", SHARED), recipe, topk=2, cache_dir=tmp_path / "cache")
    defaults = {**CPU_QA_DEFAULTS, "model": str(model), "prompts_per_iteration": 2}
    run_main([*(part for name, value in defaults.items() for part in (flag(name), str(value))),
              "--env", "HotpotQA-v0", "--iterations", "1", "--no-mlflow", "--quiet", "--output", str(tmp_path / "run")])
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["leaves"] == 6 and row["reward_mean"] > 0  # some leaf earned a reward (0.2: a valid answer)
