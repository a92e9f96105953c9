"""Problems with reference answers: a built-in arithmetic generator, or local JSONL/Parquet.

>>> train, test = make_datasets(DataConfig(train_size=50, test_size=10))
>>> p = train[0]; eval(p.solution.split("=")[0]) == int(p.answer)
True
>>> not {q.question for q in train} & {q.question for q in test}
True
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from m2flow.reasoning.config import DataConfig


class DataError(ValueError):
    """A data source that cannot be read, named with the field to fix."""


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str
    solution: Optional[str] = None
    """A worked solution ending in the answer (arithmetic only; used by the warm start)."""

    def prompt(self, template: str) -> str:
        return template.format(prompt=self.question)


NAMES = ["Ann", "Ben", "Cara", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivy", "Jon", "Kim", "Leo",
         "Mia", "Ned", "Omar", "Pia", "Quin", "Rosa", "Sam", "Tess"]
ITEMS = ["apples", "books", "coins", "pens", "cards", "shells", "stamps", "marbles", "cups",
         "eggs", "nuts", "rocks", "toys", "bells", "keys"]


def arithmetic_problem(rng: random.Random, max_operand: int, max_terms: int) -> Problem:
    """One word problem whose answer is a sum/difference of 2 (or 3) small numbers, never < 0."""
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    a = rng.randint(0, max_operand)
    b = rng.randint(0, max_operand)
    if rng.random() < 0.5:
        text = rng.choice([
            f"{name} has {a} {item}. {name} gets {b} more {item}.",
            f"{name} has {a} {item} and {other} gives {name} {b} {item}.",
            f"There are {a} {item} in a box. {name} puts {b} more {item} in it.",
        ])
        expr, total = f"{a}+{b}", a + b
    else:
        a, b = max(a, b), min(a, b)
        text = rng.choice([
            f"{name} has {a} {item}. {name} gives {b} {item} to {other}.",
            f"There are {a} {item} in a box. {name} takes {b} {item} out.",
            f"{name} had {a} {item} and lost {b} of them.",
        ])
        expr, total = f"{a}-{b}", a - b
    if max_terms >= 3 and rng.random() < 0.5:
        c = rng.randint(0, max_operand)
        if rng.random() < 0.5 or c > total:
            text += f" Then {name} finds {c} more {item}."
            expr, total = f"{expr}+{c}", total + c
        else:
            text += f" Then {name} loses {c} {item}."
            expr, total = f"{expr}-{c}", total - c
    where = "in the box" if "box" in text else ""
    question = (f"{text} How many {item} are {where} now?".replace("  ", " ") if where
                else f"{text} How many {item} does {name} have now?")
    return Problem(question, str(total), f" {expr}={total}")


def generate_arithmetic(n: int, seed: int, max_operand: int, max_terms: int,
                        exclude: frozenset = frozenset()) -> list[Problem]:
    rng = random.Random(seed)
    out, seen = [], set(exclude)
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise DataError(
                f"data: only {len(out)} distinct arithmetic problems for train_size/test_size "
                f"{n}; raise data.max_operand or lower the sizes."
            )
        p = arithmetic_problem(rng, max_operand, max_terms)
        if p.question not in seen:
            seen.add(p.question)
            out.append(p)
    return out


def load_records(path: str, field: str) -> list[dict]:
    """Rows of a .jsonl or .parquet file as dicts."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{field}={path!r} does not exist; give the path of a local file.")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    rows = []
    with p.open() as f:
        for i, line in enumerate(f):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(f"{field}={path!r} line {i + 1} is not JSON: {e}.") from None
    return rows


def records_to_problems(rows: list[dict], cfg: DataConfig, field: str) -> list[Problem]:
    out = []
    for i, row in enumerate(rows):
        for key, name in ((cfg.prompt_key, "data.prompt_key"), (cfg.answer_key, "data.answer_key")):
            if key not in row:
                raise DataError(
                    f"{field} row {i} has no field {key!r} ({name}); its fields are "
                    f"{sorted(row)}. Set {name} to the right one."
                )
        out.append(Problem(str(row[cfg.prompt_key]), str(row[cfg.answer_key])))
    return out


def make_datasets(cfg: DataConfig, seed: int = 0) -> tuple[list[Problem], list[Problem]]:
    """(train, test). Arithmetic test problems never appear in train."""
    if cfg.source == "arithmetic":
        if cfg.max_terms not in (2, 3):
            raise DataError(f"data.max_terms={cfg.max_terms}: use 2 or 3.")
        test = generate_arithmetic(cfg.test_size, 10_000 + seed, cfg.max_operand, cfg.max_terms)
        train = generate_arithmetic(cfg.train_size, seed, cfg.max_operand, cfg.max_terms,
                                    exclude=frozenset(p.question for p in test))
        return train, test
    if cfg.source in ("jsonl", "parquet"):
        if not cfg.train_path:
            raise DataError(f"data.source={cfg.source} needs data.train_path (a local file).")
        train = records_to_problems(load_records(cfg.train_path, "data.train_path"), cfg,
                                    "data.train_path")
        if cfg.test_path:
            test = records_to_problems(load_records(cfg.test_path, "data.test_path"), cfg,
                                       "data.test_path")
        else:
            if len(train) <= cfg.test_size:
                raise DataError(
                    f"data.train_path has {len(train)} rows, not more than data.test_size="
                    f"{cfg.test_size}; give data.test_path or lower data.test_size."
                )
            train, test = train[: -cfg.test_size], train[-cfg.test_size :]
        return train[: cfg.train_size], test[: cfg.test_size]
    raise DataError(f"data.source={cfg.source!r}: use arithmetic, jsonl or parquet.")
