"""Where a workflow's tasks come from, and how a final answer is checked (DESIGN §14).

Owns `TaskConfig` (`workflow.tasks` in the run config), `TaskSource` (one split of a task file
or of a workflow's generator, one rollout actor's shard of it), `load_records` and the answer
check `answers_match` / `extract_answer` (math-verify).

Splits. A file path may hold "{split}" (one file per split, e.g. data/aime_{split}.jsonl);
otherwise each record names its split in `split_field`, and a file without that column is all
train: it has no eval split (we never carve one off silently). Train and eval never overlap: a
train record whose prompt (whitespace-normalised) is also an eval prompt is dropped from train,
counted in `skipped_overlap` and logged. A generator's task i is made with
`random.Random("eval/<i>")` in the eval split and `random.Random("train/<seed>/<i>")` in the
train split: a str seed is hashed with SHA-512 (the same in every process), so the seed ranges
of the splits, and of different seeds, never meet. (Integer seeds such as seed * 2**32 + i do
not work: Mersenne Twister's seeding makes Random(2**32 + 2) the same stream as Random(2).) The
eval set (the first `eval_size` eval tasks) is the same for every seed, so runs are
compared on the same tasks. A small generator can still repeat a prompt, so the train stream
also skips any task whose prompt is in the eval set (`skipped_overlap`).

Epochs and shards. A file's train split is served `epochs` times (0 = forever), each epoch in
an order shuffled by (seed, epoch) that every shard shares; shard k of n serves the epoch's
positions k, k+n, k+2n, ..., so the n shards partition every epoch exactly. A generator's train
stream is endless and shard k serves its indices k, k+n, .... An eval split is served once, in
file (or index) order. Task ids: a record's `id_field` value, else "<split>-<row>" (row counts
the split's records from 0), so a file's task keeps its id in every epoch (rounds tell the
repeats apart); a generator's task is "<split>-<the generator's id for index i>", unique across
shards.

math-verify runs with its signal-based timeouts off (they only work in the main thread, and
rollout actors call this from event loops in worker threads), so it logs once per process that
timeouts are disabled; the guards here instead bound the work: only the last
`_MAX_PREDICTION_CHARS` of a prediction are read, and an answer that would make sympy build an
astronomically large number or expansion (9^{9^{9^9}} never returns) is a mismatch.

    python -c 'from actors.tasks import answers_match as m; print(m(r"\\boxed{0.5}", "1/2"))'
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import random
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

import math_verify
import pyarrow.parquet as pq
import sympy
from sympy.functions.combinatorial.factorials import CombinatorialFunction

if TYPE_CHECKING:
    from actors.workflows.base import Task

log = logging.getLogger(__name__)
# math-verify warns once per process that its signal timeouts are off: they are, on purpose
# (signals work only in the main thread); answers_match bounds the work itself.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_MAX_SKIPS_IN_A_ROW = 1000  # generated train tasks that all repeat eval prompts: give up
_ALTERNATIVE_STRIDE = 2**40  # offset of the alternatives to a generated task that repeats an eval prompt
_MAX_PREDICTION_CHARS = 2000  # only a prediction's tail is parsed (the answer is at its end)
_MAX_NUMBER_BITS = 2**22  # comparing 3^(10^7) (16M bits) already takes seconds
_MAX_EXPANSION_DEGREE = 256  # expanding (x+1)^1000 takes seconds
_BOXED = re.compile(r"\\boxed\s*\{")


@dataclass
class TaskConfig:
    # JSONL (.jsonl) or Parquet (.parquet) file of tasks, may hold "{split}" (one file per
    # split); "" = the workflow's procedural generator
    path: str = ""
    split_field: str = "split"  # column naming each record's split (a file without "{split}")
    train_split: str = "train"  # the split rollout actors train on
    eval_split: str = "eval"  # the split evaluation plays
    id_field: str = "id"  # optional column of task ids; missing -> "<split>-<row>"
    prompt_field: str = "problem"  # column holding the task's text
    answer_field: str = "answer"  # column holding the ground truth (Task.truth = str(value))
    epochs: int = 0  # passes over a file's train split; 0 = forever (a generator is endless)
    shuffle: bool = True  # reshuffle a file's train split every epoch (seeded, deterministic)
    eval_size: int = 32  # eval tasks drawn from a generator (a file's eval split is used whole)

    def __post_init__(self) -> None:
        if self.path:
            bare = self.path.replace("{split}", "")
            if "{" in bare or "}" in bare:
                raise ValueError(f"workflow.tasks.path={self.path!r}: the only placeholder "
                                 "allowed is {split} (e.g. data/aime_{split}.jsonl)")
            if not bare.endswith((".jsonl", ".parquet")):
                raise ValueError(f"workflow.tasks.path={self.path!r}: use a .jsonl or .parquet "
                                 "file, or path='' for the workflow's own generator")
        for name in ("split_field", "train_split", "eval_split", "prompt_field", "answer_field"):
            if not getattr(self, name).strip():
                raise ValueError(f"workflow.tasks.{name}={getattr(self, name)!r}: must not be "
                                 "empty (name a column or split)")
        if self.train_split == self.eval_split:
            raise ValueError(f"workflow.tasks.eval_split={self.eval_split!r}: equals train_split;"
                             " train and eval must be different splits")
        if self.prompt_field == self.answer_field:
            raise ValueError(f"workflow.tasks.answer_field={self.answer_field!r}: equals "
                             "prompt_field; name the column holding the answer")
        if self.epochs < 0:
            raise ValueError(f"workflow.tasks.epochs={self.epochs}: use 0 (forever) or >= 1")
        if self.eval_size < 0:
            raise ValueError(f"workflow.tasks.eval_size={self.eval_size}: use >= 0 "
                             "(0 = no generated eval set)")


@runtime_checkable
class TaskSplits(Protocol):
    """A finite task set with its own train/eval split that a workflow ships (HumanEval, read
    from its wheel). Given to TaskSource as its `generator` (it is callable as one), it is
    served as a task file's split is: epochs, seeded shuffles, shards, train minus eval prompts.
    """

    def __call__(self, rng: random.Random, index: int) -> Task: ...

    def split_tasks(self, train: bool) -> list[Task]:
        """The train (True) or eval (False) tasks, in a fixed order."""
        ...


class TasksExhausted(Exception):
    """Every epoch of a finite split has been served."""


# ------------------------------------------------------------------------------ files

def load_records(path: str, split: str, cfg: TaskConfig) -> list[dict]:
    """The records of one split of a task file, in file order.

    Args:
        path: a .jsonl/.parquet file, or a template holding "{split}" (one file per split).
        split: the split to return.
        cfg: names the split, prompt and answer columns.

    Raises:
        FileNotFoundError: the split's file is missing.
        ValueError: a bad JSON line, a record without the prompt or answer field, a file
            without a split column asked for a non-train split, or a split with no records.
    """
    return _split_records(path, split, cfg, required=True)


def _split_records(path: str, split: str, cfg: TaskConfig, *, required: bool) -> list[dict]:
    """load_records; with required=False an absent split is [] (a train run's eval prompts)."""
    if "{split}" in path:
        file = path.replace("{split}", split)
        if not required and not os.path.exists(file):
            return []
        rows = _read_rows(file)
    else:
        file = path
        rows = _select_split(_read_rows(file), split, cfg, file, required)
    if required and not rows:
        raise ValueError(f"{file}: split {split!r} has no records; add some, or name another "
                         "with workflow.tasks.train_split / eval_split")
    for where, record in rows:
        for name in ("prompt_field", "answer_field"):
            column = getattr(cfg, name)
            if record.get(column) is None:
                raise ValueError(f"{file} {where}: no {column!r} field (workflow.tasks.{name}="
                                 f"{column!r}); its fields are {sorted(record)}: set "
                                 f"workflow.tasks.{name} to the right column")
    return [record for _, record in rows]


def _read_rows(file: str) -> list[tuple[str, dict]]:
    """(where, record) pairs of a JSONL or Parquet file; `where` names the line or row."""
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file}: no such task file (workflow.tasks.path); give an "
                                "existing .jsonl/.parquet file, or path='' for the generator")
    if file.endswith(".parquet"):
        return [(f"row {i}", record) for i, record in enumerate(pq.read_table(file).to_pylist())]
    rows = []
    with open(file, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{file} line {number}: not valid JSON ({exc.msg}); each line "
                                 "must be one JSON object") from None
            if not isinstance(record, dict):
                raise ValueError(f"{file} line {number}: a JSON {type(record).__name__}, not an "
                                 "object; each line must be one {\"problem\": ..., ...} object")
            rows.append((f"line {number}", record))
    return rows


def _select_split(rows: list[tuple[str, dict]], split: str, cfg: TaskConfig, file: str,
                  required: bool) -> list[tuple[str, dict]]:
    column = cfg.split_field
    labelled = [column in record for _, record in rows]
    if not any(labelled):
        if split == cfg.train_split:
            return rows  # no split column: the whole file is train
        if not required:
            return []
        raise ValueError(
            f"{file} has no {column!r} column (workflow.tasks.split_field), so all of it is "
            f"train and there is no {split!r} split: add a {column!r} field to every record, "
            "or keep one file per split with workflow.tasks.path holding '{split}' "
            "(e.g. data/tasks_{split}.jsonl)")
    if not all(labelled):
        where = rows[labelled.index(False)][0]
        raise ValueError(f"{file} {where}: no {column!r} field while other records have one; "
                         "give every record its split")
    selected = [(where, record) for where, record in rows if str(record[column]) == split]
    if required and not selected:
        present = sorted({str(record[column]) for _, record in rows})
        raise ValueError(f"{file}: no record has {column}={split!r} (splits present: {present});"
                         " set workflow.tasks.train_split / eval_split to match")
    return selected


def _records_to_tasks(records: list[dict], split: str, cfg: TaskConfig, path: str) -> list[Task]:
    from actors.workflows.base import Task  # here: actors.workflows.base imports TaskConfig

    tasks, seen = [], set()
    for row, record in enumerate(records):
        prompt = record[cfg.prompt_field]
        if not isinstance(prompt, str):
            raise ValueError(f"{path} split {split!r} record {row}: {cfg.prompt_field!r} is a "
                             f"{type(prompt).__name__}; a prompt must be text")
        task_id = record.get(cfg.id_field)
        task_id = f"{split}-{row}" if task_id is None else str(task_id)
        if task_id in seen:
            raise ValueError(f"{path} split {split!r}: task id {task_id!r} appears twice in "
                             f"column {cfg.id_field!r} (workflow.tasks.id_field); make ids "
                             "unique or drop the column")
        seen.add(task_id)
        other = {key: value for key, value in record.items()
                 if key not in (cfg.id_field, cfg.prompt_field, cfg.answer_field)}
        # Parquet can hold dates or decimals; extra travels in JSON metadata
        extra = json.loads(json.dumps(other, default=str))
        extra["split"] = split
        tasks.append(Task(task_id=task_id, prompt=prompt,
                          truth=str(record[cfg.answer_field]), extra=extra))
    return tasks


def _same_prompt_key(prompt: str) -> str:
    return " ".join(prompt.split())


# ------------------------------------------------------------------------------ sources

class TaskSource:
    """Tasks of one split for one rollout actor (deterministic given seed, split and shard).

    `seed` must be the same for every shard (it orders the epochs they partition). A task file
    takes precedence over `generator`; the generator, `make_task(rng, index)`, is used when
    `cfg.path` is "" (a `TaskSplits` generator is served as a file is). Attributes: `epoch`
    (0-based, files' train split), `skipped_overlap` (train tasks dropped or skipped because
    their prompt is an eval prompt).
    """

    def __init__(self, cfg: TaskConfig, split: str, *,
                 generator: Callable[[random.Random, int], Task] | None = None,
                 shard: int = 0, num_shards: int = 1, seed: int = 0) -> None:
        if split not in (cfg.train_split, cfg.eval_split):
            raise ValueError(f"split {split!r}: not workflow.tasks.train_split "
                             f"({cfg.train_split!r}) or eval_split ({cfg.eval_split!r})")
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} of {num_shards}: need 0 <= shard < num_shards")
        if not cfg.path and generator is None:
            raise ValueError("workflow.tasks.path is empty and this workflow has no task "
                             "generator: set workflow.tasks.path to a .jsonl or .parquet file")
        self.cfg, self.split, self.seed = cfg, split, seed
        self.shard, self.num_shards = shard, num_shards
        self.is_train = split == cfg.train_split
        self.epoch = 0
        self.skipped_overlap = 0
        self._position = 0  # next position in this shard's part of the epoch or stream
        self._shared_epoch, self._shared_order = -1, []  # task_at's cached epoch order
        # a set the workflow ships (TaskSplits) is served like a file; a file wins over both
        self._shipped = generator if not cfg.path and isinstance(generator, TaskSplits) \
            else None
        self._generator = None if cfg.path or self._shipped is not None else generator
        if self._generator is None:
            self._tasks = self._file_tasks()
            self._order = self._epoch_order()
            if self.is_train and not self._order:
                raise ValueError(f"{cfg.path}: train split has {len(self._tasks)} tasks, fewer "
                                 f"than the {num_shards} rollout actors sharing it; add tasks "
                                 "or use fewer rollout.actors")
        elif self.is_train:
            self._eval_prompts = {_same_prompt_key(t.prompt) for t in self._generated_eval()}
            self._check_stream_leaves_eval()

    def next(self) -> Task:
        """The next task; raises TasksExhausted when a finite split's epochs are done."""
        if self._generator is not None:
            return self._next_generated()
        while self._position >= len(self._order):
            epochs = self.cfg.epochs if self.is_train else 1  # 0: forever
            if epochs and self.epoch + 1 >= epochs:
                raise TasksExhausted(f"split {self.split!r}: all {epochs} epoch(s) of "
                                     f"{len(self._order)} tasks (shard {self.shard}) served")
            self.epoch += 1
            self._order = self._epoch_order()
            self._position = 0
        task = self._tasks[self._order[self._position]]
        self._position += 1
        return task

    def task_at(self, index: int) -> Task:
        """Task `index` of the split's one stream that every rollout actor shares.

        The version clock hands out the indices (one per admitted round), so however many
        rollout actors run, or are added, removed and replaced during a run, no two play the
        same task of an epoch and none is skipped; a resumed run continues the stream. With a
        file, index i is position i % n of epoch i // n (n tasks); raises TasksExhausted
        past the last of `cfg.epochs` (0: forever). With a generator, it is generated task
        `index`; one whose prompt is an eval prompt is replaced by a deterministic
        alternative (counted in `skipped_overlap`).
        """
        if index < 0:
            raise ValueError(f"task index {index}: must be >= 0")
        if self._generator is not None:
            if not self.is_train:
                raise TypeError("task_at serves the train stream; use all() for the eval set")
            task = self._generate(index, train=True)
            for retry in range(1, _MAX_SKIPS_IN_A_ROW + 1):
                if _same_prompt_key(task.prompt) not in self._eval_prompts:
                    return task
                self.skipped_overlap += 1
                # far beyond any index a run reaches: never another slot's task
                task = self._generate(index + retry * _ALTERNATIVE_STRIDE, train=True)
            raise ValueError(f"{_MAX_SKIPS_IN_A_ROW} generated train tasks in a row repeat eval "
                             "prompts; set workflow.tasks.eval_size lower (or 0)")
        epoch, position = divmod(index, len(self._tasks))
        epochs = self.cfg.epochs if self.is_train else 1
        if epochs and epoch >= epochs:
            raise TasksExhausted(f"split {self.split!r}: all {epochs} epoch(s) of "
                                 f"{len(self._tasks)} tasks served")
        if epoch != self._shared_epoch:
            self._shared_epoch, self._shared_order = epoch, self._full_order(epoch)
        self.epoch = epoch
        return self._tasks[self._shared_order[position]]

    def __iter__(self) -> TaskSource:
        return self

    def __next__(self) -> Task:
        try:
            return self.next()
        except TasksExhausted:
            raise StopIteration from None

    def __len__(self) -> int:
        """Tasks per epoch in this shard; a generator's endless train split raises TypeError."""
        if self._generator is None:
            return len(self._order)
        if self.is_train:
            raise TypeError("a generator's train split is endless: it has no length")
        return len(range(self.shard, self.cfg.eval_size, self.num_shards))

    def all(self) -> list[Task]:
        """This shard's tasks of a finite split, in file (or index) order: the eval set."""
        if self._generator is None:
            return self._tasks[self.shard::self.num_shards]
        if self.is_train:
            raise TypeError("a generator's train split is endless: use next()")
        return self._generated_eval()[self.shard::self.num_shards]

    # -------------------------------------------------------------------- files

    def _file_tasks(self) -> list[Task]:
        cfg = self.cfg
        if self._shipped is not None:
            tasks = self._shipped_tasks(self.is_train)
        else:
            tasks = _records_to_tasks(load_records(cfg.path, self.split, cfg), self.split, cfg,
                                      cfg.path)
        if not self.is_train:
            return tasks
        if self._shipped is not None:
            eval_prompts = {_same_prompt_key(t.prompt) for t in self._shipped_tasks(False)}
        else:
            eval_records = _split_records(cfg.path, cfg.eval_split, cfg, required=False)
            eval_prompts = {_same_prompt_key(str(r[cfg.prompt_field])) for r in eval_records}
        kept = [task for task in tasks if _same_prompt_key(task.prompt) not in eval_prompts]
        self.skipped_overlap = len(tasks) - len(kept)
        if self.skipped_overlap:
            log.warning("%s: %d of %d train tasks have a prompt of the %r split; dropped from "
                        "train", cfg.path, self.skipped_overlap, len(tasks), cfg.eval_split)
        if not kept:
            raise ValueError(f"{cfg.path}: every train task is also an eval task; give the "
                             "splits different problems")
        return kept

    def _shipped_tasks(self, train: bool) -> list[Task]:
        """The shipped set's train or eval tasks, labelled with the configured split name."""
        split = self.cfg.train_split if train else self.cfg.eval_split
        return [dataclasses.replace(task, extra={**task.extra, "split": split})
                for task in self._shipped.split_tasks(train)]

    def _epoch_order(self) -> list[int]:
        """This shard's positions of the epoch: every num_shards-th of one shared order."""
        return self._full_order(self.epoch)[self.shard::self.num_shards]

    def _full_order(self, epoch: int) -> list[int]:
        """Every task position of `epoch`, shuffled by (seed, epoch) when cfg.shuffle."""
        order = list(range(len(self._tasks)))
        if self.is_train and self.cfg.shuffle:
            # a str seed is hashed with SHA-512: the same order in every process
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    # -------------------------------------------------------------------- generators

    def _generate(self, index: int, *, train: bool) -> Task:
        """Task `index` of the train or eval stream, from its own seed (module docstring)."""
        seed = f"train/{self.seed}/{index}" if train else f"eval/{index}"
        split = self.cfg.train_split if train else self.cfg.eval_split
        task = self._generator(random.Random(seed), index)
        return dataclasses.replace(task, task_id=f"{split}-{task.task_id}",
                                   extra={**task.extra, "split": split})

    def _generated_eval(self) -> list[Task]:
        """The generator's whole eval set (every shard's), the same for every seed."""
        return [self._generate(index, train=False) for index in range(self.cfg.eval_size)]

    def _check_stream_leaves_eval(self) -> None:
        for index in range(_MAX_SKIPS_IN_A_ROW):
            prompt = self._generate(index, train=True).prompt
            if _same_prompt_key(prompt) not in self._eval_prompts:
                return
        raise ValueError(f"the workflow's generator repeats eval-set prompts in its first "
                         f"{_MAX_SKIPS_IN_A_ROW} train tasks: it has too few distinct prompts "
                         "to keep train and eval apart; set workflow.tasks.eval_size=0 (no eval "
                         "set) or a smaller one, or use a task file")

    def _next_generated(self) -> Task:
        if not self.is_train:
            index = self.shard + self._position * self.num_shards
            if index >= self.cfg.eval_size:
                raise TasksExhausted(f"split {self.split!r}: the {self.cfg.eval_size} generated"
                                     " eval tasks were served")
            self._position += 1
            return self._generate(index, train=False)
        for _ in range(_MAX_SKIPS_IN_A_ROW):
            index = self.shard + self._position * self.num_shards
            self._position += 1
            task = self._generate(index, train=True)
            if _same_prompt_key(task.prompt) not in self._eval_prompts:
                return task
            if not self.skipped_overlap:
                log.info("train split: skipping generated tasks whose prompt is in the eval set"
                         " (counted in skipped_overlap)")
            self.skipped_overlap += 1
        raise ValueError(f"{_MAX_SKIPS_IN_A_ROW} generated train tasks in a row repeat eval "
                         "prompts; set workflow.tasks.eval_size lower (or 0)")


# ------------------------------------------------------------------------------ answers

def extract_answer(text: str) -> str | None:
    """The content of the last \\boxed{...} (balanced braces, stripped), else None.

    An unclosed last box (a truncated output) gives None rather than an earlier answer.
    """
    starts = [match.end() for match in _BOXED.finditer(text)]
    if not starts:
        return None
    depth = 1
    for position in range(starts[-1], len(text)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth == 0:
            return text[starts[-1]:position].strip()
    return None


def answers_match(prediction: str, truth: str) -> bool:
    """Whether a model's text states the ground truth (math-verify parse + verify).

    Safe from any thread (no signals). `prediction` may be free text with a \\boxed{} answer
    (math-verify prefers the box); only its last `_MAX_PREDICTION_CHARS` are read. `truth` is a
    plain answer ("42", "1/2", "\\frac{1}{2}", "x^2+1"), parsed boxed or, failing that, as is.
    Anything unparseable, or too costly to compare, is False; this never raises.
    """
    gold = _parse_truth(truth)
    predicted = math_verify.parse(prediction[-_MAX_PREDICTION_CHARS:], parsing_timeout=None)
    if not gold or not predicted or any(_too_costly(item) for item in predicted):
        return False
    return math_verify.verify(list(gold), predicted, timeout_seconds=None)


@functools.lru_cache(maxsize=4096)  # one truth is compared against every candidate of a group
def _parse_truth(truth: str) -> tuple:
    boxed = math_verify.parse(f"\\boxed{{{truth}}}", parsing_timeout=None)
    return tuple(boxed or math_verify.parse(truth, parsing_timeout=None))


def _too_costly(item: Any) -> bool:
    """Whether comparing a parsed answer could run for minutes (math-verify has no timeout here).

    The bounds are upper estimates: numbers over _MAX_NUMBER_BITS bits (9^{9^{9^9}} would
    never return) or expansions of degree over _MAX_EXPANSION_DEGREE ((x+1)^{1000}: seconds).
    """
    if isinstance(item, sympy.MatrixBase):
        return any(_too_costly(entry) for entry in item)
    if not isinstance(item, sympy.Basic):
        return False  # a string fallback: compared as text
    try:
        return (_log2_bound(item) > _MAX_NUMBER_BITS
                or _expansion_degree(item) > _MAX_EXPANSION_DEGREE)
    except RecursionError:  # deeper than Python's stack: sympy could not compare it either
        return True


def _log2_bound(expr: sympy.Basic) -> float:
    """An upper bound on log2 of the magnitude of `expr` (a symbol counts as 1)."""
    if expr.is_Integer or expr.is_Rational:
        return math.log2(max(abs(expr.p), abs(expr.q), 2))
    if expr.is_Float:
        return math.log2(max(abs(float(expr)), 2.0))  # inf beyond float range: too costly
    args = [_log2_bound(arg) for arg in expr.args]
    if expr.is_Pow:
        base, exponent = args
        return math.inf if exponent > 60 else base * 2.0 ** exponent
    if isinstance(expr, (CombinatorialFunction, sympy.gamma)):
        top = max(args, default=1.0)  # n! <= n^n, and binomials and the like are below it
        return math.inf if top > 60 else top * 2.0 ** top
    if expr.is_Mul:
        return sum(args)
    return max(args, default=1.0) + math.log2(max(len(args), 1))


def _expansion_degree(expr: sympy.Basic) -> float:
    """An upper bound on the degree a full expansion of `expr` could reach."""
    degree = 0.0
    for node in sympy.preorder_traversal(expr):
        if node.is_Pow and node.base.is_Add and node.base.free_symbols:
            degree += 2.0 ** min(_log2_bound(node.exp), 60)
        elif node.is_Mul:
            degree += sum(1 for arg in node.args if arg.is_Add and arg.free_symbols)
    return degree
