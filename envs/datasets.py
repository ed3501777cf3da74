"""QA datasets and the retrieval corpus, read from their official published formats.

Every dataset becomes a list of :class:`QARecord` (id, question, gold answers, supporting titles), whatever
its source format. Files are looked up in a data directory laid out as::

    DATA_DIR/
      wiki/wiki-18.jsonl                          corpus: {"id", "contents": "\\"Title\\"\\ntext"} per line
                                                  (Search-R1's Wikipedia-2018, 21M passages, gunzipped)
      wiki/paragraphs.jsonl                       (or this smaller corpus in the same format)
      hotpotqa/hotpot_train_v1.1.json             HotpotQA JSON list (or hotpot_train_distractor_subset.json)
      hotpotqa/hotpot_dev_distractor_v1.json      (or hotpot_dev_fullwiki_v1.json, hotpot_dev_distractor_subset.json)
      2wikimultihopqa/{train,dev}.json            2WikiMultihopQA JSON list (or dev_subset.json)
      musique/musique_ans_v1.0_{train,dev}.jsonl  MuSiQue-Ans jsonl (or musique_ans_dev_subset.jsonl)
      qa/{nq,triviaqa,popqa,bamboogle}_test.jsonl FlashRAG jsonl {"id", "question", "golden_answers"}
                                                  (or FlashRAG's own NAME/{train,dev,test}.jsonl)
      NAME/{train,dev,test}.parquet               Search-R1's question files (any dataset NAME above): the
                                                  columns 'question' and 'golden_answers', 'id' if present

The full official file names take precedence over the subsets when both are present (and the full corpus over
the smaller one).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

DATA_DIR_ENV = "TREEGRPO_DATA_DIR"
CORPUS_CANDIDATES = ("wiki/wiki-18.jsonl", "wiki/paragraphs.jsonl")  # the full corpus first
CORPUS_LAYOUT = 'one JSON object per line: {"id": "...", "contents": "\\"Title\\"\\npassage text"}'


class DataError(ValueError):
    """A data file is malformed; the message names the path, the record and the expected layout."""


class UnknownSplitError(ValueError):
    """A split the dataset does not have; the message names the dataset's splits."""


class MissingDataError(FileNotFoundError):
    """A data file or directory is missing; the message names what was looked for and the layout."""


@dataclass(frozen=True)
class QARecord:
    """One question with its gold answers (any of them counts as correct)."""

    id: str
    question: str
    answers: tuple[str, ...]
    supporting_titles: tuple[str, ...] = ()

    @property
    def named_answers(self) -> tuple[str, ...]:
        """The gold answers a passage can name: a comparison's verdict (yes / no) left out."""
        return tuple(answer for answer in self.answers if answer.strip().lower() not in ("yes", "no"))


@dataclass(frozen=True)
class Passage:
    """One corpus passage: its id, Wikipedia title and text."""

    id: str
    title: str
    text: str


# ---------------------------------------------------------------------------------------------------------
# Data directory


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """The data directory: ``data_dir`` if given, else ``$TREEGRPO_DATA_DIR``, else ``./data``."""
    if data_dir is not None:
        candidates = [(Path(data_dir), "the data_dir argument")]
    elif os.environ.get(DATA_DIR_ENV):
        candidates = [(Path(os.environ[DATA_DIR_ENV]), f"${DATA_DIR_ENV}")]
    else:
        candidates = [(Path("data"), "./data (no data_dir given and $TREEGRPO_DATA_DIR unset)")]
    path, origin = candidates[0]
    if not path.is_dir():
        raise MissingDataError(
            f"data directory {path.resolve()} (from {origin}) does not exist. Point {DATA_DIR_ENV} or "
            f"data_dir at a folder laid out as described in envs/datasets.py (wiki/paragraphs.jsonl, "
            f"hotpotqa/..., qa/...)."
        )
    return path


# ---------------------------------------------------------------------------------------------------------
# Readers


def _open_checked(path: Path, layout: str):
    if not path.is_file():
        raise MissingDataError(f"{path}: file not found; expected {layout}")
    return path.open(encoding="utf-8")


def _read_json_list(path: Path, layout: str) -> list[Any]:
    with _open_checked(path, layout) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}: invalid JSON at line {err.lineno} ({err.msg}); expected {layout}") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: top level is a {type(data).__name__}, expected a JSON list; {layout}")
    return data


def _iter_jsonl(path: Path, layout: str) -> Iterator[tuple[int, Any]]:
    with _open_checked(path, layout) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: invalid JSON ({err.msg}); expected {layout}") from None


def _field(raw: Any, key: str, kind: type | tuple[type, ...], where: str, layout: str) -> Any:
    if not isinstance(raw, dict):
        raise DataError(f"{where}: record is a {type(raw).__name__}, expected a JSON object; {layout}")
    if key not in raw:
        raise DataError(f"{where}: missing field {key!r}; expected {layout}")
    value = raw[key]
    if not isinstance(value, kind):
        raise DataError(f"{where}: field {key!r} is a {type(value).__name__}; expected {layout}")
    return value


def _strings(value: Any, key: str, where: str, layout: str) -> list[str]:
    """Field ``key``'s value as a list of strings (a JSON list of them), else a ``DataError``."""
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise DataError(f"{where}: field {key!r} is not a list of strings; expected {layout}")
    return value


def _fact_titles(facts: Any, where: str, layout: str) -> list[str]:
    """The titles of supporting facts, ``[[title, sentence_id], ...]``, else a ``DataError``."""
    if not isinstance(facts, list) or not all(isinstance(fact, list) and fact and isinstance(fact[0], str)
                                              for fact in facts):
        raise DataError(f"{where}: field 'supporting_facts' is not a list of [title, sentence_id] pairs; expected "
                        f"{layout}")
    return [fact[0] for fact in facts]


def _unique(items: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


# ---------------------------------------------------------------------------------------------------------
# Per-format parsers: raw record -> QARecord


HOTPOTQA_LAYOUT = (
    "the official HotpotQA JSON list of objects with '_id', 'question', 'answer', "
    "'supporting_facts' ([[title, sentence_id], ...] or null) and optionally 'supporting_titles'"
)
TWOWIKI_LAYOUT = (
    "the official 2WikiMultihopQA JSON list of objects with '_id', 'question', 'answer' and "
    "'supporting_facts' ([[title, sentence_id], ...])"
)
MUSIQUE_LAYOUT = (
    "official MuSiQue jsonl: one object per line with 'id', 'question', 'answer', 'answer_aliases' and "
    "'paragraphs' ([{'title', 'paragraph_text', 'is_supporting'}, ...])"
)
FLASHRAG_LAYOUT = "FlashRAG jsonl: one object per line with 'id', 'question' and 'golden_answers' (a list)"
PARQUET_LAYOUT = ("a Search-R1 parquet question file: columns 'question' (a string) and 'golden_answers' (a list "
                  "of strings), and 'id' if present (else the row number)")


def _record(raw: Any, where: str, layout: str, id_key: str, answers: list[str], titles: list[str]) -> QARecord:
    """A record from the fields every format has (id, question) and the format's answers and titles."""
    return QARecord(
        id=str(_field(raw, id_key, (str, int), where, layout)),
        question=_field(raw, "question", str, where, layout),
        answers=tuple(str(a) for a in answers),
        supporting_titles=_unique(titles),
    )


def _parse_hotpotqa(raw: Any, where: str) -> QARecord:
    lay = HOTPOTQA_LAYOUT
    facts = raw.get("supporting_facts") if isinstance(raw, dict) else None
    titles = raw.get("supporting_titles") if isinstance(raw, dict) else None
    titles = _strings(titles, "supporting_titles", where, lay) if titles is not None else []
    if not titles and facts is not None:
        titles = _fact_titles(facts, where, lay)
    return _record(raw, where, lay, "_id", [_field(raw, "answer", str, where, lay)], titles)


def _parse_2wiki(raw: Any, where: str) -> QARecord:
    lay = TWOWIKI_LAYOUT
    facts = _field(raw, "supporting_facts", list, where, lay)
    return _record(raw, where, lay, "_id", [_field(raw, "answer", str, where, lay)], _fact_titles(facts, where, lay))


def _parse_musique(raw: Any, where: str) -> QARecord:
    lay = MUSIQUE_LAYOUT
    paragraphs = _field(raw, "paragraphs", list, where, lay)
    if not all(isinstance(p, dict) and isinstance(p.get("title"), str) for p in paragraphs):
        raise DataError(f"{where}: field 'paragraphs' holds an entry that is not an object with a 'title' string; "
                        f"expected {lay}")
    # Supporting paragraphs in hop order when the decomposition says so, else in paragraph order.
    order = [step.get("paragraph_support_idx") for step in raw.get("question_decomposition") or []]
    by_idx = {p.get("idx", i): p for i, p in enumerate(paragraphs)}
    supporting = [by_idx[i]["title"] for i in order if i in by_idx]
    supporting += [p["title"] for p in paragraphs if p.get("is_supporting")]
    aliases = _strings(raw.get("answer_aliases", []), "answer_aliases", where, lay)
    answers = _unique([_field(raw, "answer", str, where, lay), *aliases])
    return _record(raw, where, lay, "id", list(answers), supporting)


def _parse_flashrag(raw: Any, where: str) -> QARecord:
    lay = FLASHRAG_LAYOUT
    return _record(raw, where, lay, "id", _field(raw, "golden_answers", list, where, lay), [])


@dataclass(frozen=True)
class DatasetFormat:
    """How one dataset is stored: the parser, whether it is a JSON list or jsonl, its layout text."""

    parse: Callable[[Any, str], QARecord]
    jsonl: bool
    layout: str


FORMATS = {
    "hotpotqa": DatasetFormat(_parse_hotpotqa, jsonl=False, layout=HOTPOTQA_LAYOUT),
    "2wikimultihopqa": DatasetFormat(_parse_2wiki, jsonl=False, layout=TWOWIKI_LAYOUT),
    "musique": DatasetFormat(_parse_musique, jsonl=True, layout=MUSIQUE_LAYOUT),
    "flashrag": DatasetFormat(_parse_flashrag, jsonl=True, layout=FLASHRAG_LAYOUT),
}


def _flashrag_files(name: str) -> dict[str, tuple[str, ...]]:
    return {split: (f"{name}/{split}.jsonl", f"{name}/{split}.parquet", f"qa/{name}_{split}.jsonl")
            for split in ("train", "dev", "test")}


def read_parquet_records(path: Path) -> list[QARecord]:
    """The questions of a Search-R1 parquet file (``PARQUET_LAYOUT``), whatever dataset it holds."""
    import pyarrow.parquet as pq

    if not path.is_file():
        raise MissingDataError(f"{path}: file not found; expected {PARQUET_LAYOUT}")
    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several types for a file that is not parquet
        raise DataError(f"{path}: not a readable parquet file ({err}); expected {PARQUET_LAYOUT}") from None
    for column in ("question", "golden_answers"):
        if column not in table.column_names:
            raise DataError(f"{path}: no {column!r} column (it has {', '.join(table.column_names)}); expected "
                            f"{PARQUET_LAYOUT}")
    ids = table.column("id").to_pylist() if "id" in table.column_names else range(table.num_rows)
    rows = zip(ids, table.column("question").to_pylist(), table.column("golden_answers").to_pylist(), strict=True)
    records = []
    for i, (record_id, question, answers) in enumerate(rows):
        if not isinstance(question, str) or not isinstance(answers, list) or not all(
                isinstance(a, str) for a in answers):
            raise DataError(f"{path}: row {i}: 'question' must be a string and 'golden_answers' a list of strings, "
                            f"got {question!r} and {answers!r}; expected {PARQUET_LAYOUT}")
        records.append(QARecord(id=str(record_id), question=question, answers=tuple(answers)))
    return records


# dataset name -> (format name, split -> candidate paths relative to the data dir, full files first)
DATASETS: dict[str, tuple[str, dict[str, tuple[str, ...]]]] = {
    "hotpotqa": (
        "hotpotqa",
        {
            "train": ("hotpotqa/hotpot_train_v1.1.json", "hotpotqa/train.parquet",
                      "hotpotqa/hotpot_train_distractor_subset.json"),
            "dev": (
                "hotpotqa/hotpot_dev_distractor_v1.json",
                "hotpotqa/hotpot_dev_fullwiki_v1.json",
                "hotpotqa/dev.parquet",
                "hotpotqa/hotpot_dev_distractor_subset.json",
            ),
        },
    ),
    "2wikimultihopqa": (
        "2wikimultihopqa",
        {
            "train": ("2wikimultihopqa/train.json", "2wikimultihopqa/train.parquet"),
            "dev": ("2wikimultihopqa/dev.json", "2wikimultihopqa/dev.parquet", "2wikimultihopqa/dev_subset.json"),
        },
    ),
    "musique": (
        "musique",
        {
            "train": ("musique/musique_ans_v1.0_train.jsonl", "musique/train.parquet"),
            "dev": ("musique/musique_ans_v1.0_dev.jsonl", "musique/dev.parquet",
                    "musique/musique_ans_dev_subset.jsonl"),
        },
    ),
    **{name: ("flashrag", _flashrag_files(name)) for name in ("nq", "triviaqa", "popqa", "bamboogle")},
    # generated by envs.synthetic (HotpotQA format; its supporting facts are the gold queries in hop order)
    "synthhop": ("hotpotqa", {"train": ("synthhop/train.json",), "dev": ("synthhop/dev.json",)}),
    "synthbranch": ("hotpotqa", {"train": ("synthbranch/train.json",), "dev": ("synthbranch/dev.json",)}),
}


def dataset_path(name: str, split: str, data_dir: str | os.PathLike | None = None) -> Path:
    """The file holding ``name``'s ``split``: the first existing candidate (full official files first)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(sorted(DATASETS))}")
    _, splits = DATASETS[name]
    if split not in splits:
        raise UnknownSplitError(f"dataset {name!r} has no split {split!r}; its splits: {', '.join(splits)}")
    root = resolve_data_dir(data_dir)
    for rel in splits[split]:
        if (root / rel).is_file():
            return root / rel
    fmt = FORMATS[DATASETS[name][0]]
    raise MissingDataError(
        f"no {name} {split} file in {root}: looked for {', '.join(splits[split])}; expected {fmt.layout} (or, "
        f"for the .parquet names, {PARQUET_LAYOUT})"
    )


def load_records(path: str | os.PathLike, format_name: str) -> list[QARecord]:
    """Read one data file in the named format (see ``FORMATS``) into records, with errors naming the record; a
    ``.parquet`` file is read as Search-R1's question files are laid out, whatever the format name."""
    if format_name not in FORMATS:
        raise ValueError(f"unknown data format {format_name!r}; known formats: {', '.join(FORMATS)}")
    fmt, path = FORMATS[format_name], Path(path)
    if path.suffix == ".parquet":
        records = read_parquet_records(path)
        if not records:
            raise DataError(f"{path}: holds no records; expected {PARQUET_LAYOUT}")
        return records
    if fmt.jsonl:
        rows = ((f"{path}:{lineno}", raw) for lineno, raw in _iter_jsonl(path, fmt.layout))
    else:
        rows = ((f"{path}: record {i}", raw) for i, raw in enumerate(_read_json_list(path, fmt.layout)))
    records = [fmt.parse(raw, where) for where, raw in rows]
    if not records:
        raise DataError(f"{path}: holds no records; expected {fmt.layout}")
    return records


@lru_cache(maxsize=32)
def _load_dataset_cached(path: Path, mtime_ns: int, format_name: str) -> tuple[QARecord, ...]:
    return tuple(load_records(path, format_name))


def load_dataset(name: str, split: str, data_dir: str | os.PathLike | None = None) -> tuple[QARecord, ...]:
    """The records of a named dataset split, read once per process (every env of a process shares them)."""
    path = dataset_path(name, split, data_dir).resolve()
    return _load_dataset_cached(path, path.stat().st_mtime_ns, DATASETS[name][0])


# ---------------------------------------------------------------------------------------------------------
# Corpus


def corpus_path(data_dir: str | os.PathLike | None = None) -> Path:
    """The retrieval corpus of a data directory: ``wiki/wiki-18.jsonl`` if present, else ``wiki/paragraphs.jsonl``."""
    root = resolve_data_dir(data_dir)
    for rel in CORPUS_CANDIDATES:
        if (root / rel).is_file():
            return root / rel
    raise MissingDataError(f"no corpus in {root}: looked for {', '.join(CORPUS_CANDIDATES)}; expected {CORPUS_LAYOUT}")


DIGEST_CHUNK = 1 << 20
WHOLE_FILE_DIGEST_LIMIT = 1 << 30  # larger files (wiki-18) are keyed by size and their first and last MiB


def content_digest(path: Path) -> str:
    """A short digest of a file's content (a large one's size, first and last MiB): unlike the mtime, it survives a
    copy or a fresh checkout, so a cached start is found again. Read once per process while the file is unchanged
    (a run's checks and its start's key each ask for it)."""
    stat = Path(path).stat()
    return _file_digest(Path(path).resolve(), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=64)
def _file_digest(path: Path, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= WHOLE_FILE_DIGEST_LIMIT:
            for chunk in iter(lambda: f.read(DIGEST_CHUNK), b""):
                digest.update(chunk)
        else:
            digest.update(str(size).encode() + f.read(DIGEST_CHUNK))
            f.seek(size - DIGEST_CHUNK)
            digest.update(f.read())
    return digest.hexdigest()[:12]


def records_digest(records: Sequence[QARecord]) -> str:
    """A short digest of questions in order: each record's id, question and answers (ids alone would not tell apart
    two generated worlds of the same sizes). Computed once per env, in about 20 ms for 100k questions."""
    digest = hashlib.sha256()
    for record in records:
        digest.update("\x1f".join((record.id, record.question, *record.answers)).encode() + b"\x1e")
    return digest.hexdigest()[:16]


def train_and_corpus_digest(dataset: str, data_dir: str | os.PathLike | None = None) -> str:
    """What a warm start of ``dataset`` is built from, by content: its train split's and the corpus's digests (a
    moved or copied data directory gives the same)."""
    root = resolve_data_dir(data_dir)
    return f"{content_digest(dataset_path(dataset, 'train', root))}-corpus-{content_digest(corpus_path(root))}"


def split_contents(contents: str) -> tuple[str, str]:
    """A passage's ``contents`` -> (title, text): the first line is the title, quoted as in Search-R1."""
    title, _, text = contents.partition("\n")
    if len(title) >= 2 and title[0] == title[-1] == '"':
        title = title[1:-1]
    return title, text


def join_contents(title: str, text: str) -> str:
    """(title, text) -> ``contents`` in the corpus format (``split_contents`` reverses it)."""
    return f'"{title}"\n{text}'


def parse_passage(line: bytes | str, where: str) -> Passage:
    """One corpus line -> Passage."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: invalid JSON ({err.msg}); expected {CORPUS_LAYOUT}") from None
    title, text = split_contents(_field(raw, "contents", str, where, CORPUS_LAYOUT))
    return Passage(id=str(raw.get("id", "")), title=title, text=text)
