"""JSONL files read whole, every error naming the file and the 1-based row."""

from __future__ import annotations

import json
from pathlib import Path

from tailtamer.errors import DataError


def check_file(path: Path) -> None:
    if path.is_dir():
        raise DataError(f"{path}: is a directory; give the JSONL or parquet file in it")
    if not path.is_file():
        raise DataError(f"{path}: " + ("not a regular file (a pipe or device); give the file itself" if path.exists()
                                       else "file not found"))


def check_unicode(text: str, where: str, what: str) -> str:
    """`text`, refused when it cannot be encoded: JSON's escapes can write an unpaired
    surrogate, which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise DataError(f"{where}: the {what} is not valid Unicode (an unpaired surrogate such as \\ud800)") from None
    return text


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    check_file(path)
    rows = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a byte-order mark, as Windows writes
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid UTF-8 (byte {e.start + 1} of the line)") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            except RecursionError:
                raise DataError(f"{path}:{lineno}: JSON nested too deeply") from None
            except ValueError as e:  # Python's cap on a number's digits (4300), which json meets first
                raise DataError(f"{path}:{lineno}: a number Python will not read ({e})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            row["_row"] = lineno
            rows.append(row)
    if not rows:
        raise DataError(f"{path}: no rows (the file is empty)")
    return rows
