"""What the shard checksums cost: ``file_checksum`` (what ``--resume`` and ``tito inspect`` run per file)
against reading the same bytes, and ``write_table_atomic`` (which hashes what it writes) against writing
the table without hashing. Files already in the page cache; medians of interleaved rounds.

    .venv/bin/python scripts/bench_checksum.py [--files 12] [--mb 14] [--repeats 5] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rollout.data.shards import SCHEMA, file_checksum, rows_to_table, write_table_atomic  # noqa: E402
from scripts.benchdoc import markers, replace_section  # noqa: E402
from tests.test_data import synthetic_row  # noqa: E402  (a schema-complete sample row)


def _table(mb: int) -> pa.Table:
    """Real shard rows (the schema's every column) of 4,096 tokens each, about ``mb`` MB as Arrow IPC."""
    one = rows_to_table([synthetic_row(0, n=4096)])
    return rows_to_table([synthetic_row(i, n=4096) for i in range(max(1, mb * 2**20 // one.nbytes))])


def _plain_write(path: Path, table: pa.Table) -> None:
    """The same file without the checksum: built in memory, written, fsynced (as write_table_atomic)."""
    sink = pa.BufferOutputStream()
    with ipc.new_file(sink, SCHEMA) as w:
        w.write_table(table)
    with open(path, "wb") as f:
        f.write(sink.getvalue())
        f.flush()
        os.fsync(f.fileno())


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=12)
    ap.add_argument("--mb", type=int, default=14)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    table = _table(args.mb)
    rows = {"verify (file_checksum)": [], "read only": [], "write + sha256 (write_table_atomic)": [],
            "write only": []}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        paths = [d / f"train-{i:05d}.arrow" for i in range(args.files)]
        for p in paths:
            write_table_atomic(p, table)
        total_mb = sum(p.stat().st_size for p in paths) / 2**20
        for _ in range(args.repeats):  # interleaved: each round times every path
            rows["verify (file_checksum)"].append(_timed(lambda: [file_checksum(p) for p in paths]))
            rows["read only"].append(_timed(lambda: [p.read_bytes() for p in paths]))
            rows["write + sha256 (write_table_atomic)"].append(
                _timed(lambda: [write_table_atomic(d / f"w-{i}.arrow", table) for i in range(args.files)]))
            rows["write only"].append(_timed(lambda: [_plain_write(d / f"p-{i}.arrow", table) for i in range(args.files)]))
    load = os.getloadavg()[0]
    lines = ["## Shard checksums", "",
             f"Command: `.venv/bin/python scripts/bench_checksum.py --files {args.files} --mb {args.mb} "
             f"--repeats {args.repeats} --write docs/benchmarks.md`  ",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
             f"{time.strftime('%Y-%m-%d')}; 1-minute load {load:.1f}; {args.files} Arrow files, {total_mb:.0f} MB "
             f"in all, in the page cache; median of {args.repeats} interleaved rounds.", "",
             "| what | median ms/MB |", "|---|---:|"]
    for name, times in rows.items():
        lines.append(f"| {name} | {statistics.median(times) * 1000 / total_mb:.2f} |")
    lines += ["", "verify streams each file through sha256; read only is `read_bytes` of the same files, for "
              "scale. write + sha256 is what a run does per file (in memory, hash, temporary, fsync, rename); write "
              "only builds and fsyncs the same file without the hash or the rename."]
    body = "\n".join(lines)
    print(body)
    if args.write:
        begin, end = markers("bench_checksum")
        replace_section(args.write, "bench_checksum", f"{begin}\n{body}\n{end}")


if __name__ == "__main__":
    main()
