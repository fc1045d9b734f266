"""dsbench_lite: tasks, workspace files, appendix A.3 metrics, rule scores, and whole episodes.

The episodes run the real sandbox (a few seconds: each run imports pandas or scikit-learn),
driven by a scripted episode that answers each agent with fixed pipeline code.
"""
import asyncio
import itertools
import math
import random

import numpy as np
import pandas as pd
import pytest

from actors.coach import CoachConfig
from actors.coach.prompts import PromptBook
from actors.coach.rule import RuleCoach
from actors.episode import Action, CoachRequest
from actors.sandbox import SandboxConfig
from actors.workflows._dsbench_data import (
    FAIR_PENALTY, TaskSpec, build_split, describe, fair_metrics, metrics_text, quality,
    score_submission)
from actors.workflows.base import Task
from actors.workflows.dsbench_lite import DSBenchLite, DSBenchLiteConfig


def task_for(spec: TaskSpec) -> Task:
    return Task(task_id=f"t-{spec.dataset}", prompt=describe(spec), truth=spec.to_truth())


# ------------------------------------------------------------------------------ tasks, files

def test_tasks_are_deterministic_and_cover_both_kinds():
    wf = DSBenchLite(DSBenchLiteConfig())
    first = [wf.make_task(random.Random(i), i) for i in range(16)]
    again = [wf.make_task(random.Random(i), i) for i in range(16)]
    assert [(t.task_id, t.prompt, t.truth) for t in first] == \
        [(t.task_id, t.prompt, t.truth) for t in again]
    specs = [TaskSpec.from_truth(t.truth) for t in first]
    assert {s.kind for s in specs} == {"classification", "regression"}
    assert len({t.prompt for t in first}) == len(first)  # the split seed tells prompts apart
    for task, spec in zip(first, specs):
        assert f"'{spec.target}'" in task.prompt and "submission.csv" in task.prompt
        assert f"Task type: {spec.kind}" in task.prompt


def test_task_truth_parses_json_and_a_dict_repr_and_names_the_format():
    spec = TaskSpec("iris", 5, 0.2)
    assert TaskSpec.from_truth(spec.to_truth()) == spec
    assert TaskSpec.from_truth("{'dataset': 'iris', 'seed': 5, 'test_fraction': 0.2}") == spec
    with pytest.raises(ValueError, match="expected JSON"):
        TaskSpec.from_truth("42")
    with pytest.raises(ValueError, match="choose one of"):
        TaskSpec.from_truth('{"dataset": "mnist", "seed": 1}')


@pytest.mark.parametrize("dataset", ["wine", "diabetes"])
def test_split_files_hide_the_test_target_and_keep_ids_consistent(dataset):
    spec = TaskSpec(dataset, 11)
    split, again = build_split(spec), build_split(spec)
    pd.testing.assert_frame_equal(split.train, again.train)
    pd.testing.assert_frame_equal(split.test, again.test)
    assert spec.target in split.train.columns and spec.target not in split.test.columns
    assert list(split.train.columns[:-1]) == list(split.test.columns)
    assert split.train.columns[0] == "id"
    train_ids, test_ids = set(split.train["id"]), set(split.test["id"])
    assert not train_ids & test_ids
    assert train_ids | test_ids == set(range(1, len(split.train) + len(split.test) + 1))
    assert list(split.test_labels.index) == list(split.test["id"])
    assert len(split.test) == math.ceil(0.25 * (len(split.train) + len(split.test)))


# ------------------------------------------------------------------------------ metrics

def submit(tmp_path, ids, predictions, target):
    path = tmp_path / "submission.csv"
    pd.DataFrame({"id": ids, target: predictions}).to_csv(path, index=False)
    return path


@pytest.fixture(scope="module")
def wine():
    return build_split(TaskSpec("wine", 3))


@pytest.fixture(scope="module")
def diabetes():
    return build_split(TaskSpec("diabetes", 3))


def test_perfect_and_partial_classification(tmp_path, wine):
    ids, labels = list(wine.test_labels.index), wine.test_labels.to_numpy()
    perfect = score_submission(submit(tmp_path, ids, labels.astype(float), "cultivar"), wine)
    assert perfect.success and perfect.error == ""  # 1.0 and 1 are the same class
    assert perfect.metrics == {"accuracy": 1.0, "f1": 1.0, "roc_auc": 1.0}
    assert fair_metrics(wine, perfect) == perfect.metrics
    assert metrics_text(wine, perfect) == ("Task type: classification. Accuracy 1.000, "
                                           "F1 1.000, ROC-AUC 1.000")
    wrong = labels.copy()
    wrong[:9] = (wrong[:9] + 1) % 3  # 9 of 45 wrong
    partial = score_submission(submit(tmp_path, ids, wrong, "cultivar"), wine)
    assert partial.success
    assert partial.metrics["accuracy"] == pytest.approx(36 / 45)
    assert 0.5 < partial.metrics["roc_auc"] < 1 and 0 < partial.metrics["f1"] < 1
    assert quality(wine, partial) == pytest.approx((36 / 45 + partial.metrics["f1"]) / 2)


def test_constant_classification_gets_chance_auc(tmp_path, wine):
    ids = list(wine.test_labels.index)
    score = score_submission(submit(tmp_path, ids, [0] * len(ids), "cultivar"), wine)
    assert score.success and score.metrics["roc_auc"] == pytest.approx(0.5)
    assert score.metrics["accuracy"] == pytest.approx(np.mean(wine.test_labels == 0))


def test_regression_rmse_and_mae_in_percent_of_the_range(tmp_path, diabetes):
    ids, truth = list(diabetes.test_labels.index), diabetes.test_labels.to_numpy(float)
    perfect = score_submission(submit(tmp_path, ids, truth, "progression"), diabetes)
    assert perfect.success and perfect.metrics == {"rmse_pct": 0.0, "mae_pct": 0.0}
    assert quality(diabetes, perfect) == 1.0
    shifted = score_submission(submit(tmp_path, ids, truth + 32.1, "progression"), diabetes)
    assert shifted.metrics["rmse_pct"] == pytest.approx(10.0)  # range 321: 32.1 is 10 %
    assert shifted.metrics["mae_pct"] == pytest.approx(10.0)
    assert quality(diabetes, shifted) == pytest.approx(0.8)
    assert metrics_text(diabetes, shifted) == ("Task type: regression. RMSE 10.0% of the "
                                               "target range, MAE 10.0% of the target range")


@pytest.mark.parametrize("case,error", [
    ("missing", "ERROR: No predictions found (submission.csv missing)"),
    ("unknown_id", "1 missing, 1 unknown, 0 repeated"),
    ("repeated_id", "0 missing, 0 unknown, 1 repeated"),
    ("nan", "1 missing or non-numeric predictions"),
    ("text_prediction", "1 missing or non-numeric predictions"),
    ("no_id_column", "no 'id' column"),
    ("two_unnamed_columns", "no prediction column 'progression'"),
])
def test_failed_submissions_get_the_fair_penalties(tmp_path, diabetes, case, error):
    ids = list(diabetes.test_labels.index)
    values = list(diabetes.test_labels.to_numpy(float))
    frame = pd.DataFrame({"id": ids, "progression": values})
    if case == "unknown_id":
        frame.loc[0, "id"] = 10_000
    elif case == "repeated_id":
        frame = pd.concat([frame, frame.iloc[:1]])
    elif case == "nan":
        frame.loc[3, "progression"] = np.nan
    elif case == "text_prediction":
        frame["progression"] = frame["progression"].astype(object)
        frame.loc[3, "progression"] = "high"
    elif case == "no_id_column":
        frame = frame.rename(columns={"id": "row"})
    elif case == "two_unnamed_columns":
        frame = frame.rename(columns={"progression": "a"}).assign(b=1.0)
    if case != "missing":
        frame.to_csv(tmp_path / "submission.csv", index=False)
    score = score_submission(tmp_path / "submission.csv", diabetes)
    assert not score.success and error in score.error and score.metrics == {}
    assert fair_metrics(diabetes, score) == {"rmse_pct": 50.0, "mae_pct": 50.0}
    assert quality(diabetes, score) == 0.0
    assert metrics_text(diabetes, score) == score.error


def test_classification_failure_penalties(tmp_path, wine):
    score = score_submission(tmp_path / "submission.csv", wine)
    assert fair_metrics(wine, score) == {k: FAIR_PENALTY[k] for k in ("accuracy", "f1", "roc_auc")}
    assert FAIR_PENALTY["accuracy"] == 0.5 and FAIR_PENALTY["f1"] == 0.0


# ------------------------------------------------------------------------------ rule scores

@pytest.mark.parametrize("agent,context,score", [
    ("data_engineer", {"tool_called": True, "tool_ok": True, "artifacts_present": 1.0}, 1.0),
    ("data_engineer", {"tool_called": True, "tool_ok": True, "artifacts_present": 2 / 3}, 0.8667),
    ("data_engineer", {"tool_called": True, "tool_ok": False, "artifacts_present": 0.0}, 0.3),
    ("data_engineer", {"tool_called": False, "tool_ok": False, "artifacts_present": 1.0}, 0.0),
    ("modeler", {"tool_called": True, "tool_ok": True, "artifacts_present": 1.0}, 1.0),
    ("modeler", {"tool_called": True, "tool_ok": True, "artifacts_present": 0.0}, 0.6),
    ("analyst", {"tool_called": True, "tool_ok": True, "success": 1.0, "quality": 0.9}, 0.94),
    ("analyst", {"tool_called": True, "tool_ok": True, "success": 0.0, "quality": 0.0}, 0.4),
    ("analyst", {"tool_called": True, "tool_ok": False, "success": 0.0, "quality": 0.0}, 0.2),
    ("analyst", {"tool_called": False, "tool_ok": False}, 0.0),
])
def test_rule_scores(agent, context, score):
    wf = DSBenchLite(DSBenchLiteConfig())
    task = Task("t", "prompt", "")
    assert wf.rule_score(agent, task, "```python\n1\n```", "stop", context) == \
        pytest.approx(score, abs=1e-4)


def test_turn_numbers_are_fixed_per_agent_and_budgets_bound_groups():
    wf = DSBenchLite(DSBenchLiteConfig())
    assert wf.first_turn == {"data_engineer": 0, "modeler": 3, "analyst": 8}
    assert [wf.groups_per_round(a, 4) for a in wf.agents] == [3, 5, 2]
    with pytest.raises(ValueError, match="workflow.params.modeler_turns"):
        DSBenchLiteConfig(modeler_turns=0)
    with pytest.raises(ValueError, match="unknown: \\['mnist'\\]"):
        DSBenchLiteConfig(datasets=["mnist"])


# ------------------------------------------------------------------------------ episodes

class ScriptedEpisode:
    """The act/annotate/coach surface of actors.episode.Episode, answering from a script.

    Each agent's replies are used in order; a turn beyond its script fails the test. Coach
    requests are built as Episode builds them, so the real rule coach and prompts read them.
    """

    def __init__(self, task: Task, replies: dict[str, list[str]]) -> None:
        self.task = task
        self.replies = {agent: list(texts) for agent, texts in replies.items()}
        self.turns: list[tuple[str, int]] = []
        self.meta: dict[str, dict] = {}
        self.requests: list[CoachRequest] = []
        self._ids = itertools.count()

    async def act(self, agent, messages, *, turn, max_new_tokens, n=1, prefix="", stop=None,
                  **_):
        assert self.replies[agent], f"{agent} asked for turn {turn} beyond its script"
        self.turns.append((agent, turn))
        step_id = f"s{next(self._ids)}"
        self.meta[step_id] = {"prompt": messages[-1]["content"]}
        text = prefix + self.replies[agent].pop(0)
        return [Action(step_id, agent, turn, 0, text, np.zeros(0, np.int32), "stop")]

    def annotate(self, step_id, **meta):
        self.meta[step_id].update(meta)

    async def coach(self, actions, *, input_text, context=None, truth=None):
        for a in actions:
            self.requests.append(CoachRequest(
                step_id=a.step_id, model_id="policy", agent=a.agent, workflow="dsbench_lite",
                task_id=self.task.task_id, input_text=input_text, output_text=a.text,
                finish_reason=a.finish_reason, truth=self.task.truth if truth is None else truth,
                context=context or {}, problem=self.task.prompt, turn=a.turn))


ENGINEER = """```python
import pickle
import pandas as pd
train = pd.read_csv('train.csv')
test = pd.read_csv('test.csv')
target = [c for c in train.columns if c not in test.columns][0]
X_train = train.drop(columns=['id', target])
pickle.dump(X_train, open('X_train.pkl', 'wb'))
pickle.dump(train[target], open('y_train.pkl', 'wb'))
{save_test}print('saved', X_train.shape)
```"""
SAVE_TEST = "pickle.dump(test.drop(columns=['id']), open('X_test.pkl', 'wb'))\n"
MODELER = """```python
import pickle
from sklearn.linear_model import LogisticRegression, Ridge
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
X = pickle.load(open('X_train.pkl', 'rb'))
y = pickle.load(open('y_train.pkl', 'rb'))
model = make_pipeline(StandardScaler(), {estimator})
model.fit(X, y)
pickle.dump(model, open('model.pkl', 'wb'))
print('train score', model.score(X, y))
```"""
ANALYST = """```python
import pickle
import pandas as pd
model = pickle.load(open('model.pkl', 'rb'))
X_test = pickle.load(open('X_test.pkl', 'rb'))
ids = pd.read_csv('test.csv')['id']
pd.DataFrame({{'id': ids, '{target}': model.predict(X_test)}}).to_csv('submission.csv', index=False)
print('wrote', len(ids))
```"""


def workflow(tmp_path) -> DSBenchLite:
    sandbox = SandboxConfig(timeout_s=30, cpu_s=30, memory_mb=2048,
                            workspace_root=str(tmp_path / "ws"))
    return DSBenchLite(DSBenchLiteConfig(sandbox=sandbox))


def rule_scores(wf: DSBenchLite, requests: list[CoachRequest]) -> list[float]:
    coach = RuleCoach(wf)

    async def score_all():
        return [(await coach.score(r)).score for r in requests]
    return asyncio.run(score_all())


@pytest.mark.parametrize("dataset,estimator,quality_floor", [
    ("wine", "LogisticRegression(max_iter=2000)", 0.85),
    ("diabetes", "Ridge()", 0.5),
])
def test_a_correct_pipeline_succeeds_in_the_sandbox(tmp_path, dataset, estimator,
                                                    quality_floor):
    spec = TaskSpec(dataset, 21)
    task, wf = task_for(spec), workflow(tmp_path)
    episode = ScriptedEpisode(task, {
        "data_engineer": [ENGINEER.format(save_test=SAVE_TEST)],
        "modeler": [MODELER.format(estimator=estimator)],
        "analyst": [ANALYST.format(target=spec.target)]})
    metrics = asyncio.run(wf.run(task, episode))

    assert episode.turns == [("data_engineer", 0), ("modeler", 3), ("analyst", 8)]
    assert metrics["success"] == 1.0 and metrics[f"success_{spec.kind}"] == 1.0
    assert f"success_{'regression' if spec.kind == 'classification' else 'classification'}" \
        not in metrics
    if spec.kind == "classification":
        assert metrics["accuracy_fair"] == metrics["accuracy_raw_x_success"] > quality_floor
        assert 0.5 < metrics["roc_auc_fair"] <= 1 and 0 < metrics["f1_fair"] <= 1
    else:
        assert 0 < metrics["rmse_pct_fair"] == metrics["rmse_pct_raw_x_success"] < 25
        assert 0 < metrics["mae_pct_fair"] < metrics["rmse_pct_fair"]
    assert metrics["tool_call_rate"] == metrics["tool_ok_rate"] == 1.0
    assert all(metrics[f"has_{n}"] == 1.0 for n in
               ("X_train", "y_train", "X_test", "model", "submission"))
    assert (metrics["data_engineer_turns"], metrics["modeler_turns"],
            metrics["analyst_turns"]) == (1.0, 1.0, 1.0)
    assert all(m["tool_called"] and m["tool_ok"] for m in episode.meta.values())
    assert list((tmp_path / "ws").iterdir()) == []  # the workspace was removed

    engineer, modeler, analyst = episode.requests  # analyst last: coached after the metrics
    assert "FILES SAVED BY PREVIOUS AGENTS:\n(none)" in engineer.input_text
    assert "- X_test.pkl" in modeler.input_text.split("FILES SAVED BY PREVIOUS AGENTS:")[1]
    assert "saved" in engineer.context["tool_observation"]
    assert analyst.truth.startswith(f"Task type: {spec.kind}.")
    assert engineer.truth == task.truth  # the metrics go to the analyst's requests only
    assert "saved" in modeler.input_text  # the engineer's summary reached the modeler
    assert analyst.context["success"] == 1.0 and analyst.context["quality"] > quality_floor
    assert rule_scores(wf, episode.requests) == pytest.approx(
        [1.0, 1.0, 0.4 + 0.6 * analyst.context["quality"]])


def test_a_missing_x_test_fails_the_analyst_and_the_fair_metrics_apply(tmp_path):
    spec = TaskSpec("breast_cancer", 4)
    task, wf = task_for(spec), workflow(tmp_path)
    analyst_code = ANALYST.format(target=spec.target)
    episode = ScriptedEpisode(task, {
        "data_engineer": [ENGINEER.format(save_test=""), "All files are saved."],
        "modeler": [MODELER.format(estimator="LogisticRegression(max_iter=2000)")],
        "analyst": [analyst_code, analyst_code]})
    metrics = asyncio.run(wf.run(task, episode))

    # the engineer's missing file keeps it going; its reply without code ends its turns
    assert episode.turns == [("data_engineer", 0), ("data_engineer", 1), ("modeler", 3),
                             ("analyst", 8), ("analyst", 9)]
    assert metrics["success"] == metrics["success_classification"] == 0.0
    assert (metrics["accuracy_fair"], metrics["f1_fair"], metrics["roc_auc_fair"]) == \
        (0.5, 0.0, 0.5)
    assert metrics["accuracy_raw_x_success"] == 0.0
    assert metrics["has_X_test"] == metrics["has_submission"] == 0.0
    assert metrics["has_model"] == 1.0
    assert (metrics["data_engineer_turns"], metrics["analyst_turns"]) == (2.0, 2.0)
    assert metrics["tool_call_rate"] == pytest.approx(4 / 5)
    assert metrics["tool_ok_rate"] == pytest.approx(2 / 4)

    by_turn = {r.turn: r for r in episode.requests}
    assert "Required files still missing: X_test.pkl" in episode.meta["s1"]["prompt"]
    analyst = by_turn[8]
    assert analyst.truth == "ERROR: No predictions found (submission.csv missing)"
    assert "FileNotFoundError" in analyst.context["tool_observation"]
    saved = analyst.input_text.split("FILES SAVED BY PREVIOUS AGENTS:")[1]
    assert "- model.pkl" in saved and "X_test.pkl" not in saved
    # the engineer's last reply had no code: its summary keeps the output of its last run
    assert "All files are saved." in analyst.input_text and "saved (" in analyst.input_text
    scores = dict(zip([r.turn for r in episode.requests], rule_scores(wf, episode.requests)))
    assert scores[0] == pytest.approx(0.3 + 0.3 + 0.4 * 2 / 3)
    assert scores[1] == 0.0 and scores[3] == pytest.approx(1.0)
    assert scores[8] == scores[9] == pytest.approx(0.2)

    # the LLM coach's prompt (appendix C.4) for the analyst shows the harness's verdict
    book = PromptBook(CoachConfig(prompt="dsbench", truth_agents=["analyst"],
                                  roles={"analyst": "Analyst"}), "dsbench_lite")
    text = book.score_prompt(analyst).messages[0][1]
    assert "ERROR: No predictions found" in text
    assert "Current agent being evaluated:\nAnalyst" in text
    assert "ground_truth_answer (metrics of the final submission, if applicable):\nN/A" in \
        book.score_prompt(by_turn[0]).messages[0][1]
