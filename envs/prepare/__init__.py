"""Getting the data: ``python -m envs.prepare DATASET... [--corpus NAME] [--data-dir DIR] [--source DIR-or-URL]``
(``make data``) fetches the public QA files and a corpus into a data directory laid out as envs/datasets.py reads it.

- ``sources.py``: what can be fetched (publishers, sizes, sha256) and the file each download becomes;
- ``download.py``: one file over HTTP(S) or file://, with a progress bar, resume (HTTP Range onto ``NAME.part``, of
  the same version: If-Range), the size / sha256 check, and another public copy when the publisher fails;
- ``datadir.py``: the data directory as written to: a failed write said as such (``WriteError``), the check that
  it can be written, the removal of what a failed run created;
- ``convert.py``: downloads to the layout (FlashRAG jsonl to parquet, the gzipped corpus, the first-run corpus
  pooled from HotpotQA's paragraphs);
- ``plan.py``: what a run does in a data directory, its sizes, the disk check and the check of the files already
  there, decided before anything starts;
- ``cli.py``: the command.
"""
