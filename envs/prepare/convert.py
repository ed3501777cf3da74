"""From downloaded files to the data directory's layout (envs/datasets.py): pure functions over records and lines,
and the file-to-file steps built on them. Every output is written beside its final name and renamed into place,
so an interrupted conversion leaves nothing that looks finished."""

from __future__ import annotations

import gzip
import json
import os
import sys
import tarfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from tqdm import tqdm

from envs.datasets import DataError, QARecord, join_contents, load_records, parse_passage
from envs.prepare.datadir import writing
from envs.retrieval.corpus import replace_atomically

if TYPE_CHECKING:
    import pyarrow as pa

CONTEXT_LAYOUT = "the official HotpotQA JSON list of objects whose 'context' is [[title, [sentence, ...]], ...]"
TAR_MAGIC_OFFSET, TAR_MAGIC = 257, b"ustar"  # POSIX tar headers carry the magic at this offset
COPY_CHUNK = 1 << 20
CORPUS_NOTE = 'one {"id", "contents"} JSON object per line, gzipped (alone or as a tar\'s one .jsonl file)'


def write_output(target: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` beside ``target``, renamed into place, readable as any new file of the user's (the temporary
    file is made readable by its owner only; a data directory is often shared). ``write`` reads nothing that may
    fail with an OSError (a read error is a DataError by then): any OSError here is a failed write of ``target``."""
    with writing(target):
        replace_atomically(target, write)
        umask = os.umask(0)
        os.umask(umask)
        target.chmod(0o666 & ~umask)


def paragraph_text(sentences: Sequence[str]) -> str:
    """A HotpotQA context paragraph as one passage text: its sentences joined, each run of whitespace one space
    (the official sentences carry their own leading spaces, some two)."""
    return " ".join("".join(sentences).split())


def pooled_paragraphs(questions: Iterable[Any], where: str) -> dict[str, str]:
    """Title -> text of every context paragraph of HotpotQA questions; a title seen again keeps its first text (the
    paragraphs come from one Wikipedia dump, so a title's paragraph is the same in every question that has it)."""
    paragraphs: dict[str, str] = {}
    for i, question in enumerate(questions):
        context = question.get("context") if isinstance(question, dict) else None
        if not isinstance(context, list) or not all(
                isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], list)
                for item in context):
            raise DataError(f"{where}: record {i}: no 'context' of [title, [sentence, ...]] pairs; expected "
                            f"{CONTEXT_LAYOUT}")
        for title, sentences in context:
            paragraphs.setdefault(title, paragraph_text(sentences))
    return paragraphs


def corpus_lines(paragraphs: dict[str, str]) -> Iterator[str]:
    """The corpus file's lines (envs/datasets.py's CORPUS_LAYOUT), sorted by title, ids 0, 1, ... in that order."""
    for i, title in enumerate(sorted(paragraphs)):
        yield json.dumps({"id": str(i), "contents": join_contents(title, paragraphs[title])}, ensure_ascii=False)


def build_paragraph_corpus(sources: Sequence[Path], target: Path) -> int:
    """Write the pooled paragraphs of the HotpotQA files ``sources`` as the corpus ``target``; returns the passage
    count."""
    paragraphs: dict[str, str] = {}
    for source in sources:
        try:
            with source.open(encoding="utf-8") as f:
                questions = json.load(f)
        except json.JSONDecodeError as err:
            raise DataError(f"{source}: invalid JSON at line {err.lineno} ({err.msg}); expected {CONTEXT_LAYOUT}"
                            ) from None
        if not isinstance(questions, list):
            raise DataError(f"{source}: top level is a {type(questions).__name__}; expected {CONTEXT_LAYOUT}")
        for title, text in pooled_paragraphs(questions, str(source)).items():
            paragraphs.setdefault(title, text)

    def write(tmp: Path) -> None:
        with tmp.open("w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in corpus_lines(paragraphs))

    write_output(target, write)
    return len(paragraphs)


def question_table(records: Sequence[QARecord]) -> pa.Table:
    """Records as Search-R1's parquet question columns (envs/datasets.py's PARQUET_LAYOUT), as a pyarrow Table."""
    import pyarrow as pa

    return pa.table({"id": [r.id for r in records], "question": [r.question for r in records],
                     "golden_answers": [list(r.answers) for r in records]})


def flashrag_to_parquet(source: Path, target: Path) -> None:
    """A FlashRAG jsonl split (checked record by record, errors naming the line) as a parquet question file."""
    import pyarrow.parquet as pq

    table = question_table(load_records(source, "flashrag"))
    write_output(target, lambda tmp: pq.write_table(table, tmp))


def is_tar(header: bytes) -> bool:
    """Whether a file's first bytes are a tar header."""
    return header[TAR_MAGIC_OFFSET:TAR_MAGIC_OFFSET + len(TAR_MAGIC)] == TAR_MAGIC


def _unpack_error(source: Path, err: Exception) -> DataError:
    return DataError(f"{source}: cannot be unpacked ({err}); expected {CORPUS_NOTE}")


def _chunks(reader: IO[bytes], source: Path) -> Iterator[bytes]:
    """``reader``'s bytes; a damaged stream is said as the download's (a DataError), apart from a failed write."""
    try:
        while chunk := reader.read(COPY_CHUNK):
            yield chunk
    except (OSError, EOFError, tarfile.TarError) as err:
        raise _unpack_error(source, err) from None


def _copy(reader: IO[bytes], source: Path, tmp: Path, target: Path, total: int | None) -> None:
    """``reader`` (unpacked from ``source``) into ``tmp``, which becomes ``target``: a failed write is said as
    ``target``'s (the temporary name is gone by the time the error is read)."""
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"unpack {target.name}",
              file=sys.stderr) as bar, writing(target), tmp.open("wb") as out:
        for chunk in _chunks(reader, source):
            out.write(chunk)
            bar.update(len(chunk))


def _first_jsonl_member(archive: tarfile.TarFile, source: Path) -> tuple[IO[bytes], int]:
    for member in archive:
        if member.isfile() and member.name.endswith(".jsonl"):
            reader = archive.extractfile(member)
            assert reader is not None  # a regular file always has a reader
            return reader, member.size
    raise DataError(f"{source}: a tar archive without a .jsonl file; expected a corpus of {CORPUS_NOTE}")



def unpack_corpus(source: Path, target: Path) -> None:
    """A gzipped corpus as ``target`` (jsonl): the gzip's content, or the one .jsonl file of the tar it holds (what
    Search-R1's ``wiki-18.jsonl.gz`` turns out to be); its first line is checked before the file is renamed in."""

    def write(tmp: Path) -> None:
        try:
            with gzip.open(source, "rb") as stream:
                header = stream.read(512)
            if is_tar(header):
                with tarfile.open(source, mode="r|gz") as archive:
                    reader, size = _first_jsonl_member(archive, source)
                    _copy(reader, source, tmp, target, size)
            else:
                with gzip.open(source, "rb") as stream:
                    _copy(stream, source, tmp, target, None)
        except (OSError, EOFError, tarfile.TarError) as err:  # a write's error is a WriteError, not caught here
            raise _unpack_error(source, err) from None
        with tmp.open("rb") as f:
            parse_passage(f.readline(), f"{target} (unpacked from {source}): line 1")

    write_output(target, write)
