"""Build the book's two local evaluation tasks from the validation split of the shipped corpus (chapter 09).

- next_line (multiple choice): four lines of a speech as context; the true next line against three lines
  drawn from elsewhere in the split (seeded), choices shuffled.
- last_word (exact match): two lines of speech, then a third without its last word (of three letters or more);
  the answer is that word (generation stops at a line's end or punctuation; its first word is scored).

The validation split holds plays no shipped model was trained on, so the tasks measure what the model
learned about English verse and drama, not recall. Deterministic (seeded): rerunning writes the same files.

    python -m minillm.eval.make_tasks      # writes minillm/data/tasks/{next_line,last_word}.jsonl
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from minillm.eval.tasks import TASKS_DIR

VAL = Path(__file__).resolve().parent.parent / "data" / "shakespeare_val.txt"
STOPS = ",.;:!?"  # punctuation that ends a word (and the generation of last_word's answers)


def dialogue_lines(text: str) -> list[str]:
    """The split's lines, with "" for what is not speech: blank lines, speakers' names and the list of persons
    (lines opening with a word in capitals), stage directions."""
    lines = []
    for line in text.splitlines():
        s = line.strip()
        first = s.split(" ")[0].strip(",.;:") if s else ""
        if not s or (len(first) > 1 and first.isupper()) or s.startswith(("[", "Enter", "Exit", "Exeunt")):
            lines.append("")
        else:
            lines.append(s)
    return lines


def next_line_docs(lines: list[str], n: int, rng: random.Random) -> list[dict]:
    pool = [s for s in lines if 20 <= len(s) <= 70]
    starts = [i for i in range(4, len(lines) - 1) if all(lines[i - 4 : i + 2]) and 20 <= len(lines[i + 1]) <= 70]
    docs = []
    for i in sorted(rng.sample(starts, n)):
        gold_line = lines[i + 1]
        distractors = rng.sample([s for s in pool if s != gold_line], 3)
        choices = [gold_line, *distractors]
        rng.shuffle(choices)
        docs.append({"context": "\n".join(lines[i - 4 : i + 1]) + "\n", "choices": choices,
                     "gold": choices.index(gold_line)})
    return docs


def last_word_docs(lines: list[str], n: int, rng: random.Random) -> list[dict]:
    candidates = []
    for i in range(2, len(lines)):
        words = lines[i].split(" ")
        last = words[-1].rstrip(STOPS)
        if lines[i - 1] and lines[i - 2] and len(words) >= 5 and last.isalpha() and last.islower() and len(last) > 2:
            candidates.append((i, " ".join(words[:-1]), last))  # no trailing space: the word's token carries it
    docs = []
    for i, head, last in sorted(rng.sample(candidates, n)):
        docs.append({"context": lines[i - 2] + "\n" + lines[i - 1] + "\n" + head, "answer": last,
                     "until": ["\n", *STOPS]})
    return docs


def main() -> None:
    rng = random.Random(0)
    lines = dialogue_lines(VAL.read_text())
    TASKS_DIR.mkdir(parents=True, exist_ok=True)
    for name, docs in (("next_line", next_line_docs(lines, 200, rng)), ("last_word", last_word_docs(lines, 200, rng))):
        path = TASKS_DIR / f"{name}.jsonl"
        path.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs))
        print(f"wrote {path} ({len(docs)} documents)")


if __name__ == "__main__":
    main()
