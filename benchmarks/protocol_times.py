"""Whether a study's protocol was committed before its first record and left alone since, from git's history: the
protocol's section (``studies.Protocol``: a file and the start of a heading) as it stood just before the commit that
added the study's first record file, against every later commit of that file and the working tree. A subsection
headed "Log" (the runs' events, appended as they happen) is not part of the rules compared.

    python benchmarks/protocol_times.py budget_table

The records may have lived elsewhere before (``studies.FORMER_RECORDS``: a study's first record is the earliest
file added under its folder or under its main output's former folders). Not in a git checkout, or with no record
committed yet, it says so rather than guess.
"""

from __future__ import annotations

import argparse
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from benchmarks.studies import FORMER_RECORDS, README, RESULTS, Protocol, Study, study

ROOT = Path(__file__).resolve().parent.parent
HEADING = re.compile(r"^(#+)\s+(.*)$")
LOG = "Log"  # the title of a protocol's log subsection


@dataclass(frozen=True)
class Commit:
    sha: str
    time: int  # seconds since the epoch (the committer's)
    date: str  # its ISO date, to print


def section(text: str, title: str) -> str | None:
    """The section of markdown ``text`` whose heading starts with ``title`` (to the next heading of its level or
    higher, code blocks included as text; the blank lines before that heading left out, so that a section added
    after it changes nothing in it); None without one."""
    lines, found, level = text.splitlines(), None, 0
    for index, line in enumerate(lines):
        match = HEADING.match(line)
        if not match:
            continue
        if found is not None and len(match.group(1)) <= level:
            return "\n".join(lines[found:index]).rstrip()
        if found is None and match.group(2).startswith(title):
            found, level = index, len(match.group(1))
    return "\n".join(lines[found:]).rstrip() if found is not None else None


def rules(text: str | None) -> str | None:
    """A protocol section less its Log subsection (``LOG``), which grows as runs go and declares nothing."""
    if text is None:
        return None
    log = section("\n".join(text.splitlines()[1:]), LOG)  # a subsection: below the section's own heading
    return text if log is None else text.replace(log, "").rstrip()


def git(*args: str, root: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout


def commits(*args: str, root: Path = ROOT) -> list[Commit]:
    """``git log --reverse`` with ``args``: oldest first."""
    lines = git("log", "--reverse", "--format=%H %ct %cI", *args, root=root).splitlines()
    return [Commit(sha, int(time), date) for sha, time, date in (line.split() for line in lines)]


def record_paths(entry: Study) -> list[str]:
    """Where the records the protocol declared are and were: the study's folder, and its main output's (the first:
    a study may keep the pilots that led to its protocol beside it) folders in ``FORMER_RECORDS``."""
    return [f"{RESULTS}/{entry.folder}", *(f"{former}/{output.name}" for output in entry.outputs[:1]
                                           for former in FORMER_RECORDS)]


NOT_RECORDS = ("*.png", "*.svg", "*.pdf")  # a study's plots, drawn from its records, are not records


def first_record(entry: Study, root: Path = ROOT) -> Commit | None:
    """The commit that added the study's first record (its folder's README, written before any run, and the plots
    drawn from the records are not records)."""
    excluded = [f":(exclude){RESULTS}/{entry.folder}/{README}", *(f":(exclude){glob}" for glob in NOT_RECORDS)]
    added = commits("--diff-filter=A", "--", *record_paths(entry), *excluded, root=root)
    return added[0] if added else None


def declaring_commit(protocol: Protocol, parent: str, root: Path = ROOT) -> Commit:
    """The last commit up to ``parent`` that changed the protocol's section (its rules): the one that gave the section
    the form the first record found, not merely the last to touch its file."""
    last, previous = None, None
    for commit in commits(parent, "--", protocol.path, root=root):
        text = protocol_text_at(protocol, commit.sha, root)
        if text != previous:
            last, previous = commit, text
    assert last is not None  # the section existed at ``parent``: some commit gave it that text
    return last


def protocol_text_at(protocol: Protocol, revision: str, root: Path = ROOT) -> str | None:
    """The protocol's section at ``revision`` (None: no such file or section then)."""
    try:
        text = git("show", f"{revision}:{protocol.path}", root=root)
    except subprocess.CalledProcessError:
        return None
    return rules(section(text, protocol.title))


def protocol_reading(entry: Study, root: Path = ROOT) -> str:
    """One sentence: when the study's protocol section was committed against its first record, and every commit
    (or the working tree) that changed the section after that record's parent."""
    protocol = entry.protocol
    if protocol is None:
        return "No protocol was declared for this study."
    where = f"{protocol.path}, \"{protocol.title}\""
    try:
        first = first_record(entry, root)
    except (OSError, subprocess.CalledProcessError):
        return f"Protocol: {where}; its commit time is unknown here (not a git checkout)."
    if first is None:
        return f"Protocol: {where}; no record of the study is committed yet."
    parent = f"{first.sha}^"
    declared = protocol_text_at(protocol, parent, root)
    if declared is None:
        when = ("in the same commit as" if protocol_text_at(protocol, first.sha, root) is not None else "after")
        return (f"PROTOCOL COMMITTED {when.upper()} ITS FIRST RECORD: {where} did not exist before the first record's "
                f"commit {first.sha[:7]} ({first.date}).")
    changed, previous = [], declared
    for commit in commits(f"{parent}..HEAD", "--", protocol.path, root=root):
        text = protocol_text_at(protocol, commit.sha, root)
        if text != previous:
            changed.append(f"{commit.sha[:7]} ({commit.date})")
            previous = text
    path = root / protocol.path
    if path.is_file() and rules(section(path.read_text(encoding="utf-8"), protocol.title)) != previous:
        changed.append("the working tree (not committed)")
    before = declaring_commit(protocol, parent, root)
    since = (f"the section as committed at {before.sha[:7]} ({before.date}), before the first record "
             f"({first.sha[:7]}, {first.date})")
    if not changed:
        return f"Protocol: {where}; {since}, and not edited since."
    return f"Protocol: {where}; {since}. PROTOCOL EDITED AFTER ITS FIRST RECORD, in {', '.join(changed)}."


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("study", help="a study's folder name (benchmarks/studies.py)")
    reading = protocol_reading(study(p.parse_args(argv).study))
    print(reading)
    return reading


if __name__ == "__main__":
    main()
