"""The QA loaders on the real data, file precedence, and the errors on broken or missing files.

Expected sizes come from the data directory's README; expected fields are derived from the raw files.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from envs.datasets import (
    DATA_DIR_ENV,
    DATASETS,
    FORMATS,
    DataError,
    MissingDataError,
    Passage,
    QARecord,
    corpus_path,
    dataset_path,
    load_dataset,
    load_records,
    parse_passage,
    resolve_data_dir,
)


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------------------
# The real data


@pytest.mark.parametrize(
    ("name", "split", "size"),
    [
        ("hotpotqa", "train", 817),
        ("hotpotqa", "dev", 594),
        ("2wikimultihopqa", "dev", 164),
        ("musique", "dev", 250),
        ("nq", "test", 512),
        ("triviaqa", "test", 512),
        ("popqa", "test", 512),
        ("bamboogle", "test", 125),
    ],
)
def test_load_real_dataset(data_dir: Path, name: str, split: str, size: int) -> None:
    records = load_dataset(name, split, data_dir)
    assert len(records) == size
    assert all(isinstance(r, QARecord) for r in records)
    for r in records:
        assert r.question.strip(), r
        assert r.answers and all(isinstance(a, str) for a in r.answers), r
        assert r.id
    assert len({r.id for r in records}) == size  # ids are unique
    if name in ("hotpotqa", "2wikimultihopqa"):
        assert all(r.supporting_titles for r in records), [r.id for r in records if not r.supporting_titles]
    if name == "musique":
        # A few rows of this file (unanswerable ones, 'answerable': false) mark no supporting paragraph at all;
        # the exact titles of every row are checked against the raw file in test_musique_supporting_titles_*.
        assert sum(bool(r.supporting_titles) for r in records) >= 0.95 * size
    # shared per process: a second load returns the very same records
    assert load_dataset(name, split, data_dir) is records


def test_hotpotqa_fields_match_the_raw_file(data_dir: Path) -> None:
    path = dataset_path("hotpotqa", "dev", data_dir)
    raw = json.loads(path.read_text(encoding="utf-8"))
    records = load_dataset("hotpotqa", "dev", data_dir)
    for rec, row in zip(records, raw, strict=True):
        assert rec.id == row["_id"]
        assert rec.question == row["question"]
        assert rec.answers == (row["answer"],)
        assert list(rec.supporting_titles) == list(dict.fromkeys(row["supporting_titles"]))
        if row["supporting_facts"]:
            assert set(rec.supporting_titles) == {title for title, _ in row["supporting_facts"]}


def test_2wiki_titles_come_from_supporting_facts(data_dir: Path) -> None:
    raw = json.loads(dataset_path("2wikimultihopqa", "dev", data_dir).read_text(encoding="utf-8"))
    records = load_dataset("2wikimultihopqa", "dev", data_dir)
    for rec, row in zip(records, raw, strict=True):
        assert rec.id == row["_id"] and rec.answers == (row["answer"],)
        assert list(rec.supporting_titles) == list(dict.fromkeys(title for title, _ in row["supporting_facts"]))


def test_musique_answers_include_aliases(data_dir: Path) -> None:
    raw = _read_jsonl(dataset_path("musique", "dev", data_dir))
    records = {r.id: r for r in load_dataset("musique", "dev", data_dir)}
    with_aliases = [row for row in raw if row.get("answer_aliases")]
    assert with_aliases, "the MuSiQue dev file should hold some answers with aliases"
    for row in with_aliases:
        rec = records[row["id"]]
        assert rec.answers[0] == row["answer"]
        assert set(rec.answers) == {row["answer"], *row["answer_aliases"]}


def test_musique_supporting_titles_in_hop_order(data_dir: Path) -> None:
    raw = _read_jsonl(dataset_path("musique", "dev", data_dir))
    records = {r.id: r for r in load_dataset("musique", "dev", data_dir)}
    for row in raw:
        titles = {p["idx"]: p["title"] for p in row["paragraphs"]}
        hops = [titles[step["paragraph_support_idx"]] for step in row["question_decomposition"]
                if step.get("paragraph_support_idx") in titles]
        flagged = [p["title"] for p in row["paragraphs"] if p["is_supporting"]]
        rec = records[row["id"]]
        assert list(rec.supporting_titles) == list(dict.fromkeys(hops + flagged))


@pytest.mark.parametrize("name", ["nq", "triviaqa", "popqa", "bamboogle"])
def test_flashrag_answers_match_the_raw_file(data_dir: Path, name: str) -> None:
    raw = _read_jsonl(dataset_path(name, "test", data_dir))
    records = load_dataset(name, "test", data_dir)
    for rec, row in zip(records, raw, strict=True):
        assert (rec.id, rec.question, rec.answers) == (row["id"], row["question"], tuple(row["golden_answers"]))
        assert rec.supporting_titles == ()


def test_corpus_path_and_first_passage(data_dir: Path) -> None:
    path = corpus_path(data_dir)
    assert path == data_dir / "wiki" / "paragraphs.jsonl"
    with path.open(encoding="utf-8") as f:
        line = f.readline()
    contents = json.loads(line)["contents"]
    passage = parse_passage(line, "first line")
    assert contents == f'"{passage.title}"\n{passage.text}'
    assert passage.title and not passage.title.startswith('"') and not passage.title.endswith('"')


# ---------------------------------------------------------------------------------------------------------
# File precedence: the full official files first

HOTPOT_ROW = {"_id": "{id}", "question": "q {id}?", "answer": "a", "supporting_facts": [["T", 0]]}
TWOWIKI_ROW = {"_id": "{id}", "question": "q {id}?", "answer": "a", "supporting_facts": [["T", 0]]}
MUSIQUE_ROW = {"id": "{id}", "question": "q {id}?", "answer": "a", "answer_aliases": [],
               "paragraphs": [{"idx": 0, "title": "T", "paragraph_text": "x", "is_supporting": True}]}
FLASHRAG_ROW = {"id": "{id}", "question": "q {id}?", "golden_answers": ["a"]}


def _write(path: Path, rows: list[dict], jsonl: bool) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows) if jsonl else json.dumps(rows)
    path.write_text(text, encoding="utf-8")
    return path


def _row(template: dict, record_id: str) -> dict:
    return json.loads(json.dumps(template).replace("{id}", record_id))


@pytest.mark.parametrize(
    ("name", "split", "full", "subset", "template"),
    [
        ("hotpotqa", "dev", "hotpotqa/hotpot_dev_distractor_v1.json", "hotpotqa/hotpot_dev_distractor_subset.json",
         HOTPOT_ROW),
        ("hotpotqa", "dev", "hotpotqa/hotpot_dev_distractor_v1.json", "hotpotqa/hotpot_dev_fullwiki_v1.json",
         HOTPOT_ROW),
        ("hotpotqa", "dev", "hotpotqa/hotpot_dev_fullwiki_v1.json", "hotpotqa/hotpot_dev_distractor_subset.json",
         HOTPOT_ROW),
        ("hotpotqa", "train", "hotpotqa/hotpot_train_v1.1.json", "hotpotqa/hotpot_train_distractor_subset.json",
         HOTPOT_ROW),
        ("2wikimultihopqa", "dev", "2wikimultihopqa/dev.json", "2wikimultihopqa/dev_subset.json", TWOWIKI_ROW),
        ("musique", "dev", "musique/musique_ans_v1.0_dev.jsonl", "musique/musique_ans_dev_subset.jsonl",
         MUSIQUE_ROW),
        ("nq", "test", "nq/test.jsonl", "qa/nq_test.jsonl", FLASHRAG_ROW),
    ],
)
def test_full_files_take_precedence(
    tmp_path: Path, name: str, split: str, full: str, subset: str, template: dict
) -> None:
    jsonl = FORMATS[DATASETS[name][0]].jsonl
    _write(tmp_path / subset, [_row(template, "subset-1"), _row(template, "subset-2")], jsonl)
    assert dataset_path(name, split, tmp_path) == tmp_path / subset  # alone, the subset is found
    _write(tmp_path / full, [_row(template, "full-1")], jsonl)
    assert dataset_path(name, split, tmp_path) == tmp_path / full
    assert [r.id for r in load_dataset(name, split, tmp_path)] == ["full-1"]


def test_load_dataset_rereads_a_changed_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "qa" / "nq_test.jsonl", [_row(FLASHRAG_ROW, "old")], jsonl=True)
    assert [r.id for r in load_dataset("nq", "test", tmp_path)] == ["old"]
    _write(path, [_row(FLASHRAG_ROW, "new")], jsonl=True)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert [r.id for r in load_dataset("nq", "test", tmp_path)] == ["new"]


# ---------------------------------------------------------------------------------------------------------
# Missing and broken files


def test_missing_file_names_the_path_and_the_candidates(tmp_path: Path) -> None:
    with pytest.raises(MissingDataError) as err:
        dataset_path("hotpotqa", "dev", tmp_path)
    message = str(err.value)
    assert str(tmp_path) in message
    for candidate in DATASETS["hotpotqa"][1]["dev"]:
        assert candidate in message


def test_load_records_of_a_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.json"
    with pytest.raises(MissingDataError, match=r"nowhere\.json"):
        load_records(path, "hotpotqa")
    with pytest.raises(FileNotFoundError):  # MissingDataError is a FileNotFoundError
        load_records(tmp_path / "nowhere.jsonl", "flashrag")


def test_invalid_json_list_names_path_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    # line 1 "[", line 2 the first key, line 3 the bad value
    path.write_text('[\n{"_id": "a",\n "question": oops}\n]\n', encoding="utf-8")
    with pytest.raises(DataError) as err:
        load_records(path, "hotpotqa")
    assert str(path) in str(err.value)
    assert "line 3" in str(err.value)


def test_invalid_jsonl_line_names_path_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.jsonl"
    good = json.dumps(_row(FLASHRAG_ROW, "1"))
    # a blank line 2 is skipped but still counted: the bad record is on line 4 of the file
    path.write_text(f"{good}\n\n{good}\n{{not json}}\n{good}\n", encoding="utf-8")
    with pytest.raises(DataError, match=re.escape(f"{path}:4")):
        load_records(path, "flashrag")


@pytest.mark.parametrize(
    ("format_name", "template", "field"),
    [
        ("hotpotqa", HOTPOT_ROW, "question"),
        ("hotpotqa", HOTPOT_ROW, "answer"),
        ("hotpotqa", HOTPOT_ROW, "_id"),
        ("2wikimultihopqa", TWOWIKI_ROW, "supporting_facts"),
        ("musique", MUSIQUE_ROW, "paragraphs"),
        ("musique", MUSIQUE_ROW, "answer"),
        ("flashrag", FLASHRAG_ROW, "golden_answers"),
        ("flashrag", FLASHRAG_ROW, "question"),
    ],
)
def test_record_missing_a_field_names_the_record_and_the_field(
    tmp_path: Path, format_name: str, template: dict, field: str
) -> None:
    jsonl = FORMATS[format_name].jsonl
    bad = _row(template, "2")
    del bad[field]
    path = _write(tmp_path / ("data.jsonl" if jsonl else "data.json"), [_row(template, "1"), bad], jsonl)
    with pytest.raises(DataError) as err:
        load_records(path, format_name)
    message = str(err.value)
    assert repr(field) in message
    # the second record: line 2 of a jsonl file, record 1 (0-based) of a JSON list
    assert (f"{path}:2" if jsonl else f"{path}: record 1") in message


def test_field_of_the_wrong_type(tmp_path: Path) -> None:
    bad = {**_row(FLASHRAG_ROW, "1"), "golden_answers": "not a list"}
    path = _write(tmp_path / "data.jsonl", [bad], jsonl=True)
    with pytest.raises(DataError, match="golden_answers"):
        load_records(path, "flashrag")


def test_record_that_is_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "data.json"
    path.write_text(json.dumps([_row(HOTPOT_ROW, "1"), ["a", "list"]]), encoding="utf-8")
    with pytest.raises(DataError, match="record 1"):
        load_records(path, "hotpotqa")


def test_top_level_not_a_list(tmp_path: Path) -> None:
    path = tmp_path / "data.json"
    path.write_text(json.dumps({"data": [_row(HOTPOT_ROW, "1")]}), encoding="utf-8")
    with pytest.raises(DataError, match="list") as err:
        load_records(path, "hotpotqa")
    assert str(path) in str(err.value)


@pytest.mark.parametrize(
    ("filename", "text", "format_name"),
    [
        ("empty.json", "", "hotpotqa"),
        ("empty_list.json", "[]", "2wikimultihopqa"),
        ("empty.jsonl", "", "flashrag"),
        ("blank.jsonl", "\n  \n\n", "musique"),
    ],
)
def test_empty_file(tmp_path: Path, filename: str, text: str, format_name: str) -> None:
    path = tmp_path / filename
    path.write_text(text, encoding="utf-8")
    with pytest.raises(DataError) as err:
        load_records(path, format_name)
    assert str(path) in str(err.value)


def test_unknown_dataset_lists_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="squad") as err:
        dataset_path("squad", "dev", tmp_path)
    for name in ("hotpotqa", "2wikimultihopqa", "musique", "nq", "triviaqa", "popqa", "bamboogle"):
        assert name in str(err.value)


def test_unknown_split_lists_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="validation") as err:
        dataset_path("hotpotqa", "validation", tmp_path)
    assert "train" in str(err.value) and "dev" in str(err.value)
    with pytest.raises(ValueError, match="test"):
        load_dataset("2wikimultihopqa", "test", tmp_path)


def test_unknown_format_lists_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as err:
        load_records(tmp_path / "x.json", "csv")
    for name in FORMATS:
        assert name in str(err.value)


def test_missing_data_dir_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "no-such-dir"
    monkeypatch.setenv(DATA_DIR_ENV, str(missing))
    with pytest.raises(MissingDataError) as err:
        resolve_data_dir()
    assert DATA_DIR_ENV in str(err.value) and str(missing) in str(err.value)
    with pytest.raises(MissingDataError, match=DATA_DIR_ENV):
        load_dataset("hotpotqa", "dev")
    with pytest.raises(MissingDataError, match=DATA_DIR_ENV):
        corpus_path()


def test_missing_data_dir_argument(tmp_path: Path) -> None:
    with pytest.raises(MissingDataError, match=DATA_DIR_ENV):
        dataset_path("nq", "test", tmp_path / "no-such-dir")


def test_data_dir_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "no-such-dir"))
    assert resolve_data_dir(tmp_path) == tmp_path  # the argument wins over the environment
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert resolve_data_dir() == tmp_path


def test_missing_corpus(tmp_path: Path) -> None:
    with pytest.raises(MissingDataError, match=r"paragraphs\.jsonl"):
        corpus_path(tmp_path)


# ---------------------------------------------------------------------------------------------------------
# Corpus lines


@pytest.mark.parametrize(
    ("contents", "title", "text"),
    [
        ('"Paris"\nParis is the capital of France.', "Paris", "Paris is the capital of France."),
        ('"Say "Hi" (song)"\nA song.', 'Say "Hi" (song)', "A song."),  # only the outer quotes go
        ("Unquoted\nText.", "Unquoted", "Text."),
        ('"Multi"\nline one\nline two', "Multi", "line one\nline two"),
        ('"No text"', "No text", ""),
        ('"', '"', ""),  # a lone quote is not a quoted title
    ],
)
def test_parse_passage(contents: str, title: str, text: str) -> None:
    line = json.dumps({"id": 7, "contents": contents})
    assert parse_passage(line, "here") == Passage(id="7", title=title, text=text)
    assert parse_passage(line.encode(), "here") == Passage(id="7", title=title, text=text)


def test_parse_passage_errors() -> None:
    with pytest.raises(DataError, match=r"corpus\.jsonl: passage 3"):
        parse_passage(b"{not json", "corpus.jsonl: passage 3")
    with pytest.raises(DataError, match="'contents'"):
        parse_passage(json.dumps({"id": "1", "text": "x"}), "corpus.jsonl: passage 4")


# ---------------------------------------------------------------------------------------------------------
# Search-R1's formats: parquet question files and the wiki-18 corpus


def _write_parquet(path: Path, columns: dict[str, list]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path


def test_search_r1_parquet_files_serve_the_env_ids(tmp_path: Path) -> None:
    # Search-R1's processed files keep FlashRAG's columns beside their own (prompt, reward_model, ...)
    _write_parquet(tmp_path / "nq" / "test.parquet", {
        "id": ["test_0", "test_1"], "question": ["who wrote hamlet?", "capital of france"],
        "golden_answers": [["Shakespeare", "William Shakespeare"], ["Paris"]],
        "data_source": ["nq", "nq"], "reward_model": [{"style": "rule"}, {"style": "rule"}]})
    _write_parquet(tmp_path / "hotpotqa" / "dev.parquet", {  # no id column: the row number
        "question": ["Which is older?"], "golden_answers": [["the first"]]})
    assert load_dataset("nq", "test", tmp_path) == (
        QARecord("test_0", "who wrote hamlet?", ("Shakespeare", "William Shakespeare")),
        QARecord("test_1", "capital of france", ("Paris",)))
    assert load_dataset("hotpotqa", "dev", tmp_path) == (QARecord("0", "Which is older?", ("the first",)),)
    # a FlashRAG jsonl of the full split takes precedence, the subset does not
    (tmp_path / "qa").mkdir()
    (tmp_path / "qa" / "nq_test.jsonl").write_text(json.dumps({"id": "s", "question": "q", "golden_answers": ["a"]}))
    assert dataset_path("nq", "test", tmp_path).name == "test.parquet"
    (tmp_path / "nq" / "test.jsonl").write_text(json.dumps({"id": "f", "question": "q", "golden_answers": ["a"]}))
    assert dataset_path("nq", "test", tmp_path).name == "test.jsonl"


def test_a_parquet_file_without_golden_answers_names_the_file_and_column(tmp_path: Path) -> None:
    path = _write_parquet(tmp_path / "nq" / "test.parquet", {"question": ["q"], "answer": ["a"]})
    with pytest.raises(DataError, match=r"test\.parquet: no 'golden_answers' column \(it has question, answer\)"):
        load_records(path, "flashrag")
    bad_row = _write_parquet(tmp_path / "bad.parquet", {"question": ["q", "r"], "golden_answers": [["a"], None]})
    with pytest.raises(DataError, match=r"bad\.parquet: row 1: .*'golden_answers' a list of strings"):
        load_records(bad_row, "flashrag")
    not_parquet = tmp_path / "fake.parquet"
    not_parquet.write_text("id,question\n")
    with pytest.raises(DataError, match=r"fake\.parquet: not a readable parquet file"):
        load_records(not_parquet, "flashrag")


def test_the_wiki_18_corpus_takes_precedence(tmp_path: Path) -> None:
    (tmp_path / "wiki").mkdir()
    (tmp_path / "wiki" / "paragraphs.jsonl").write_text("")
    assert corpus_path(tmp_path).name == "paragraphs.jsonl"
    (tmp_path / "wiki" / "wiki-18.jsonl").write_text("")
    assert corpus_path(tmp_path).name == "wiki-18.jsonl"


def test_a_corpus_line_without_contents_names_the_file_and_passage(tmp_path: Path) -> None:
    from envs.retrieval import get_retriever

    path = tmp_path / "wiki-18.jsonl"
    lines = [{"id": "1", "contents": '"A"\nfirst'}, {"id": "2", "text": "no contents here"}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(DataError, match=r"wiki-18\.jsonl: passage 1: missing field 'contents'"):
        get_retriever("bm25", path, cache_dir=tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache").glob("bm25-*") if p.is_dir()]  # nothing half-built is left


def test_a_files_digest_is_read_once_while_it_is_unchanged_and_follows_its_content(tmp_path: Path) -> None:
    from envs.datasets import _file_digest, content_digest

    path = tmp_path / "train.json"
    path.write_text("[1]")
    first = content_digest(path)
    misses = _file_digest.cache_info().misses
    assert content_digest(path) == first and _file_digest.cache_info().misses == misses  # not read again
    path.write_text("[2]")
    os.utime(path, ns=(1, 1))  # another mtime, whatever the clock's resolution
    assert content_digest(path) != first
    copy = tmp_path / "copy.json"
    copy.write_text("[2]")
    assert content_digest(copy) == content_digest(path)  # by content, not by name


@pytest.mark.parametrize(
    ("format_name", "template", "field", "value"),
    [
        ("hotpotqa", HOTPOT_ROW, "supporting_facts", [5]),
        ("hotpotqa", HOTPOT_ROW, "supporting_titles", "T"),
        ("2wikimultihopqa", TWOWIKI_ROW, "supporting_facts", [[0, 0]]),
        ("musique", MUSIQUE_ROW, "paragraphs", [{"idx": 0, "paragraph_text": "x", "is_supporting": True}]),
        ("musique", MUSIQUE_ROW, "answer_aliases", "Xavier"),  # a string is not a list of its characters
    ],
)
def test_a_malformed_nested_field_names_the_record_and_the_field(
    tmp_path: Path, format_name: str, template: dict, field: str, value: object
) -> None:
    jsonl = FORMATS[format_name].jsonl
    bad = {**_row(template, "2"), field: value}
    path = _write(tmp_path / ("data.jsonl" if jsonl else "data.json"), [_row(template, "1"), bad], jsonl)
    with pytest.raises(DataError) as err:
        load_records(path, format_name)
    assert repr(field) in str(err.value)
    assert (f"{path}:2" if jsonl else f"{path}: record 1") in str(err.value)
