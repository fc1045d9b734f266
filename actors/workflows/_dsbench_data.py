"""dsbench_lite's data: tasks built from scikit-learn's bundled datasets, and their scoring.

A task is a `TaskSpec` (dataset, split seed, test fraction) that travels as JSON in
`Task.truth`, so the harness can rebuild the held-out labels from the task alone, whether it was
generated or read from a task file (`Task.extra` does not survive a file). `build_split` gives
the two files the agents see — train.csv (id, features, target) and test.csv (id, features) —
and the test labels, which stay with the harness. `score_submission` checks submission.csv and
computes MAPPA's quality metrics (appendix A.3); `fair_metrics` applies the paper's failure
penalties. Every dataset ships inside scikit-learn (no download).

    python -c 'from actors.workflows._dsbench_data import *; print(describe(TaskSpec("wine", 7)))'
"""
from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

CLASSIFICATION, REGRESSION = "classification", "regression"
SUBMISSION = "submission.csv"


@dataclass(frozen=True)
class Dataset:
    """A catalog entry: what to predict and how to load it (features, target, feature names)."""

    kind: str  # CLASSIFICATION or REGRESSION
    target: str  # the target column's name in train.csv and submission.csv
    load: Callable[[int], tuple[np.ndarray, np.ndarray, list[str]]]  # seed -> X, y, names


def _bundled(loader: str, column: int | None = None):
    def load(seed: int):
        from sklearn import datasets  # imported on first use: ~1 s, paid once per process

        bunch = getattr(datasets, loader)()
        y = bunch.target if column is None else bunch.target[:, column]
        return bunch.data, y, [str(n) for n in bunch.feature_names]
    return load


def _synthetic(kind: str):
    def load(seed: int):
        from sklearn import datasets

        if kind == CLASSIFICATION:
            X, y = datasets.make_classification(n_samples=300, n_features=8, n_informative=4,
                                                n_classes=2, random_state=seed)
        else:
            X, y = datasets.make_regression(n_samples=300, n_features=8, n_informative=5,
                                            noise=10.0, random_state=seed)
        return X, y, [f"x{i}" for i in range(X.shape[1])]
    return load


DATASETS: dict[str, Dataset] = {
    "iris": Dataset(CLASSIFICATION, "species", _bundled("load_iris")),
    "wine": Dataset(CLASSIFICATION, "cultivar", _bundled("load_wine")),
    "breast_cancer": Dataset(CLASSIFICATION, "diagnosis", _bundled("load_breast_cancer")),
    "digits": Dataset(CLASSIFICATION, "digit", _bundled("load_digits")),
    "synthetic_classification": Dataset(CLASSIFICATION, "label", _synthetic(CLASSIFICATION)),
    "diabetes": Dataset(REGRESSION, "progression", _bundled("load_diabetes")),
    # linnerud has three targets; the body weight is predicted from the three exercises
    "linnerud": Dataset(REGRESSION, "weight", _bundled("load_linnerud", column=0)),
    "synthetic_regression": Dataset(REGRESSION, "value", _synthetic(REGRESSION)),
}

# Appendix A.3: what a failed episode counts as in the "fair" metrics. ROC-AUC is not named
# there; 0.5 (chance, as for accuracy) is used.
FAIR_PENALTY = {"accuracy": 0.5, "f1": 0.0, "roc_auc": 0.5, "rmse_pct": 50.0, "mae_pct": 50.0}


@dataclass(frozen=True)
class TaskSpec:
    """What rebuilds a task's split exactly: the dataset, the split seed, the test fraction."""

    dataset: str
    seed: int
    test_fraction: float = 0.25

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset {self.dataset!r}: choose one of {sorted(DATASETS)}")
        if not 0.05 <= self.test_fraction <= 0.5:
            raise ValueError(f"test_fraction={self.test_fraction}: use 0.05..0.5")

    @property
    def kind(self) -> str:
        return DATASETS[self.dataset].kind

    @property
    def target(self) -> str:
        return DATASETS[self.dataset].target

    def to_truth(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_truth(cls, truth: str) -> "TaskSpec":
        """The spec in a task's truth: JSON, or a dict's repr (a task file's answer column
        holding an object becomes its Python repr in `Task.truth`)."""
        try:
            fields = json.loads(truth)
        except json.JSONDecodeError:
            try:
                fields = ast.literal_eval(truth)
            except (ValueError, SyntaxError):
                fields = None
        if not isinstance(fields, dict) or not {"dataset", "seed"} <= set(fields):
            raise ValueError(f"dsbench_lite task truth {truth[:200]!r}: expected JSON like "
                             '{"dataset": "wine", "seed": 7, "test_fraction": 0.25}')
        return cls(str(fields["dataset"]), int(fields["seed"]),
                   float(fields.get("test_fraction", 0.25)))


@dataclass(frozen=True)
class Split:
    """One task's data. `test_labels` is indexed by test id; `target_range` is max − min of the
    whole dataset's target (the denominator of RMSE and MAE in percent)."""

    spec: TaskSpec
    train: pd.DataFrame  # id, features..., target
    test: pd.DataFrame  # id, features...
    test_labels: pd.Series
    classes: tuple[str, ...]  # class labels as text (classification), else ()
    target_range: float


def _column_name(name: str) -> str:
    """'sepal length (cm)' -> 'sepal_length_cm': CSV headers a model can type."""
    return re.sub(r"[^0-9a-zA-Z]+", "_", name).strip("_").lower()


def build_split(spec: TaskSpec) -> Split:
    """The train/test split of `spec` (deterministic: same spec, same frames)."""
    from sklearn.model_selection import train_test_split

    dataset = DATASETS[spec.dataset]
    X, y, names = dataset.load(spec.seed)
    if dataset.kind == CLASSIFICATION:
        y = y.astype(np.int64)
    # Ids are a seeded permutation: row order in scikit-learn's files follows the class, so
    # a row index would leak the label.
    ids = np.random.default_rng(spec.seed).permutation(len(y)) + 1
    stratify = y if dataset.kind == CLASSIFICATION else None
    train_rows, test_rows = train_test_split(np.arange(len(y)), test_size=spec.test_fraction,
                                             random_state=spec.seed % 2**32, stratify=stratify)
    features = pd.DataFrame(X, columns=[_column_name(n) for n in names])
    features.insert(0, "id", ids)
    train = features.iloc[train_rows].reset_index(drop=True)
    train[dataset.target] = y[train_rows]
    test = features.iloc[test_rows].reset_index(drop=True)
    labels = pd.Series(y[test_rows], index=ids[test_rows], name=dataset.target)
    classes = (tuple(str(c) for c in np.unique(y)) if dataset.kind == CLASSIFICATION else ())
    return Split(spec, train, test, labels, classes, float(np.ptp(y)))


def describe(spec: TaskSpec) -> str:
    """The task description every agent reads (Task.prompt)."""
    split = build_split(spec)
    target, n_features = spec.target, split.test.shape[1] - 1
    if spec.kind == CLASSIFICATION:
        what = (f"Task type: classification. Predict the class in column '{target}' "
                f"(classes: {', '.join(split.classes)}).\n"
                "Evaluation: accuracy, macro F1 and ROC-AUC on the held-out test labels.")
    else:
        what = (f"Task type: regression. Predict the numeric column '{target}'.\n"
                "Evaluation: RMSE and MAE on the held-out test labels, as a percentage of "
                "the target's range.")
    return (f"Dataset: {spec.dataset} (scikit-learn), split seed {spec.seed}.\n{what}\n"
            f"Files: 'train.csv' ({len(split.train)} rows: id, {n_features} numeric features, "
            f"{target}) and 'test.csv' ({len(split.test)} rows: id and the same features, no "
            f"{target}).\n"
            f"Submission: '{SUBMISSION}' with columns 'id' and '{target}', one row for every id "
            "of test.csv.")


# ------------------------------------------------------------------------------ scoring

@dataclass(frozen=True)
class Score:
    """How a submission fared: `error` says why it failed ("" on success); `metrics` holds
    the raw quality metrics of a success (accuracy, f1, roc_auc | rmse_pct, mae_pct)."""

    success: bool
    error: str
    metrics: dict[str, float]


def _fail(error: str) -> Score:
    return Score(False, error, {})


def roc_auc_computable(split: Split) -> bool:
    """One-vs-rest ROC-AUC needs every class among the test labels, and two of them.

    It depends on the task alone (never on the submission), so every episode of a round
    reports the same metric keys.
    """
    if split.spec.kind != CLASSIFICATION:
        return False
    present = {str(v) for v in split.test_labels}
    return len(split.classes) >= 2 and present == set(split.classes)


def score_submission(path: Path, split: Split) -> Score:
    """Check submission.csv (appendix A.3 success) and score it on the held-out labels.

    Success: the file exists, has an `id` column holding every test id exactly once and no
    other id, and a prediction column (named as the target, else the only other column) with
    no missing value (a regression prediction must be a finite number).
    """
    if path.is_symlink() or not path.is_file():
        return _fail(f"ERROR: No predictions found ({SUBMISSION} missing)")
    try:
        frame = pd.read_csv(path)
    except (ValueError, UnicodeDecodeError) as exc:  # pandas' parser errors are ValueErrors
        return _fail(f"ERROR: {SUBMISSION} is not a readable CSV ({str(exc)[:200]})")
    columns = {str(c).strip().lower(): c for c in frame.columns}
    if "id" not in columns:
        return _fail(f"ERROR: {SUBMISSION} has no 'id' column (columns: {list(frame.columns)})")
    others = [c for key, c in columns.items() if key != "id"]
    target = split.spec.target
    chosen = columns.get(target) if target in columns else (others[0] if len(others) == 1
                                                             else None)
    if chosen is None:
        return _fail(f"ERROR: {SUBMISSION} has no prediction column '{target}' "
                     f"(columns: {list(frame.columns)})")
    ids = pd.to_numeric(frame[columns["id"]], errors="coerce")
    expected = set(int(i) for i in split.test_labels.index)
    if ids.isna().any() or not np.all(np.mod(ids, 1) == 0):
        return _fail(f"ERROR: {SUBMISSION} has ids that are not test.csv ids")
    ids = ids.astype(np.int64)
    duplicated, missing = int(ids.duplicated().sum()), len(expected - set(ids))
    extra = len(set(ids) - expected)
    if duplicated or missing or extra:
        return _fail(f"ERROR: {SUBMISSION} ids do not match test.csv ({missing} missing, "
                     f"{extra} unknown, {duplicated} repeated)")
    predictions = frame[chosen].set_axis(ids.to_numpy())
    predictions = predictions.loc[list(split.test_labels.index)]
    if split.spec.kind == REGRESSION:
        values = pd.to_numeric(predictions, errors="coerce").astype(float)
        bad = int((~np.isfinite(values.to_numpy())).sum())
    else:
        bad = int(predictions.isna().sum())
    if bad:
        return _fail(f"ERROR: {SUBMISSION} has {bad} missing or non-numeric predictions")
    if split.spec.kind == REGRESSION:
        return Score(True, "", _regression_metrics(split, values.to_numpy()))
    return Score(True, "", _classification_metrics(split, predictions))


def _label(value) -> str:
    """A prediction as class text: 2, 2.0 and "2" are the same class; others stay as written."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value).strip()
    return str(int(number)) if math.isfinite(number) and number.is_integer() else str(value)


def _classification_metrics(split: Split, predictions: pd.Series) -> dict[str, float]:
    from sklearn.metrics import f1_score, roc_auc_score

    truth = np.array([str(v) for v in split.test_labels])
    predicted = np.array([_label(v) for v in predictions])
    metrics = {"accuracy": float(np.mean(truth == predicted)),
               "f1": float(f1_score(truth, predicted, labels=list(split.classes),
                                    average="macro", zero_division=0))}
    if roc_auc_computable(split):
        # Hard labels as scores, one-vs-rest, macro-averaged: a submission holds a class, not
        # probabilities (for one class this is the mean of its TPR and TNR).
        metrics["roc_auc"] = float(np.mean([roc_auc_score(truth == c, predicted == c)
                                            for c in split.classes]))
    return metrics


def _regression_metrics(split: Split, predictions: np.ndarray) -> dict[str, float]:
    errors = predictions - split.test_labels.to_numpy(dtype=float)
    scale = 100.0 / split.target_range
    return {"rmse_pct": float(np.sqrt(np.mean(errors ** 2)) * scale),
            "mae_pct": float(np.mean(np.abs(errors)) * scale)}


def metric_names(split: Split) -> tuple[str, ...]:
    """The quality metrics this task reports (the same for every episode of a round)."""
    if split.spec.kind == REGRESSION:
        return ("rmse_pct", "mae_pct")
    return ("accuracy", "f1", "roc_auc") if roc_auc_computable(split) else ("accuracy", "f1")


def fair_metrics(split: Split, score: Score) -> dict[str, float]:
    """Appendix A.3's fair metrics: the raw value on success, the penalty on failure."""
    return {name: score.metrics[name] if score.success else FAIR_PENALTY[name]
            for name in metric_names(split)}


def quality(split: Split, score: Score) -> float:
    """The submission's quality in [0, 1] (0 on failure), what the rule coach rewards.

    Classification: the mean of accuracy and macro F1. Regression: 1 − RMSE% / 50, floored
    at 0 (50% of the range is the fair metrics' failure value).
    """
    if not score.success:
        return 0.0
    if split.spec.kind == CLASSIFICATION:
        return (score.metrics["accuracy"] + score.metrics["f1"]) / 2
    return max(0.0, 1.0 - score.metrics["rmse_pct"] / 50.0)


def metrics_text(split: Split, score: Score) -> str:
    """The harness's ground-truth line the coach reads for the Analyst (appendix A.1, C.4)."""
    if not score.success:
        return score.error
    m = score.metrics
    if split.spec.kind == REGRESSION:
        return (f"Task type: regression. RMSE {m['rmse_pct']:.1f}% of the target range, "
                f"MAE {m['mae_pct']:.1f}% of the target range")
    auc = f", ROC-AUC {m['roc_auc']:.3f}" if "roc_auc" in m else ""
    return f"Task type: classification. Accuracy {m['accuracy']:.3f}, F1 {m['f1']:.3f}{auc}"
