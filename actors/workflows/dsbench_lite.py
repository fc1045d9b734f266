"""dsbench_lite: data engineer → modeler → analyst sharing one workspace (MAPPA §3.2, app. C).

Each episode gets a fresh sandbox workspace holding train.csv (id, features, target) and
test.csv (id, features); the test labels stay with the harness (actors/workflows/
_dsbench_data.py builds both from a dataset scikit-learn ships). The agents take turns in
order, each with its paper turn budget (data engineer 3, modeler 5, analyst 2). A turn is one
reply whose ```python blocks run in the workspace; the agent sees the output and the file list
on its next turn. An agent's turns end early once its required artifacts exist after a clean
run (data engineer: X_train.pkl, y_train.pkl, X_test.pkl; modeler: model.pkl; analyst:
submission.csv) or when a reply has no code (it reported instead). Prompts are appendix
C.1–C.3, filled with the task description, the workspace's current file list and the
upstream agents' summaries (each one's last reply and the last output its code printed,
clipped). The `<think>` lines
are kept: they are the paper's and Qwen3 thinks; for a model without a thinking mode they are
harmless text.

Turn numbers are fixed per (agent, turn index) — data engineer 0..2, modeler 3..7, analyst
8..9 with the paper budgets — because joint sampling groups rows by (agent, turn) across the
round's G episodes; an episode that stopped early leaves its later groups smaller (DESIGN §14).

The coach scores every action with the `dsbench` template (appendix C.4): the agent's input
carries "FILES SAVED BY PREVIOUS AGENTS", the tool observation carries the run's output and the
files after it. After the analyst's last turn the harness scores submission.csv on the
held-out labels, and the analyst's actions go to the coach only then, with those metrics as
their ground truth (`truth=`; `coach.truth_agents: [analyst]`), e.g. "Task type:
classification. Accuracy 0.833, F1 0.790, ROC-AUC 0.880" or "ERROR: No predictions found
(submission.csv missing)". Episode metrics follow appendix A.3 (see `DSBenchLite.run`).
The modeler's prompt names XGBoost and LightGBM, as the paper's does; where they are not
installed the import error is an observation like any other.
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from typing import Any

from actors.sandbox import SandboxConfig, Workspace
from actors.workflows._dsbench_data import (
    DATASETS, REGRESSION, SUBMISSION, Split, TaskSpec, build_split, describe, fair_metrics,
    metric_names, metrics_text, quality, score_submission)
from actors.workflows.base import Task
from actors.workflows.registry import register
from actors.workflows.tools import CodeTool

AGENTS = ("data_engineer", "modeler", "analyst")
ARTIFACTS = {"data_engineer": ("X_train.pkl", "y_train.pkl", "X_test.pkl"),
             "modeler": ("model.pkl",), "analyst": (SUBMISSION,)}
GIVEN = ("train.csv", "test.csv")  # the harness's files; every other file an agent saved


@dataclass
class DSBenchLiteConfig:
    data_engineer_turns: int = 3  # MAPPA §3.2 turn budgets (one code run per turn)
    modeler_turns: int = 5
    analyst_turns: int = 2
    data_engineer_tokens: int = 4096  # max new tokens per action
    modeler_tokens: int = 4096
    analyst_tokens: int = 4096
    # opens every reply (prompt tokens, never trained); "```python\n" makes a small model
    # write code at once (the closing fence then ends the action)
    code_prefix: str = ""
    observation_chars: int = 1500  # tool output shown to the next turn and the coach
    summary_chars: int = 1500  # an upstream agent's summary shown downstream
    # generator: datasets drawn from (keys of _dsbench_data.DATASETS), held-out fraction
    datasets: list[str] = field(default_factory=lambda: sorted(DATASETS))
    test_fraction: float = 0.25
    # scikit-learn imports take ~1 s and need more address space than the defaults
    sandbox: SandboxConfig = field(default_factory=lambda: SandboxConfig(
        timeout_s=60.0, cpu_s=60, memory_mb=4096))

    def __post_init__(self) -> None:
        for agent in AGENTS:
            for suffix in ("turns", "tokens"):
                name = f"{agent}_{suffix}"
                if getattr(self, name) < 1:
                    raise ValueError(f"workflow.params.{name}={getattr(self, name)}: must be >= 1")
        unknown = sorted(set(self.datasets) - set(DATASETS))
        if unknown or not self.datasets:
            raise ValueError(f"workflow.params.datasets={self.datasets}: name at least one of "
                             f"{sorted(DATASETS)}" + (f" (unknown: {unknown})" if unknown else ""))
        if not 0.05 <= self.test_fraction <= 0.5:
            raise ValueError(f"workflow.params.test_fraction={self.test_fraction}: use 0.05..0.5")
        for name in ("observation_chars", "summary_chars"):
            if getattr(self, name) < 100:
                raise ValueError(f"workflow.params.{name}={getattr(self, name)}: must be >= 100")


DATA_ENGINEER_PROMPT = """You are a Data Engineer in a data science pipeline.

**CRITICAL:** Keep your <think> reasoning BRIEF (under 1000 words). Then IMMEDIATELY write executable code in a ```python block. Do NOT describe code in thinking - just write it!

**Task Description:**
{task_description}

## CRITICAL FILE SYSTEM OBSERVATION
**Files currently available in your workspace:**
{available_files_list}

NOTE: The file names shown above are the ACTUAL files you can access. Always check this list!

**Your Responsibilities:**
1. **Load Data**: Read training data from 'train.csv' and test data from 'test.csv'
2. **Exploratory Data Analysis (EDA)**:
   - Inspect schema (dtypes, shape, missing values)
   - Analyze distributions, correlations
   - Identify data quality issues
3. **Data Preprocessing**:
   - Handle missing values (imputation/removal)
   - Encode categorical variables
   - Scale numerical features
   - Engineer new features based on domain insights
4. **CRITICAL: Save ALL Required Artifacts**:
   - 'X_train.pkl' - preprocessed training features
   - 'y_train.pkl' - training labels
   - 'X_test.pkl' - preprocessed TEST features (CRITICAL!)
   - 'scaler.pkl' or similar - fitted transformers
5. **Output Summary**: Print what files you saved

CRITICAL: You MUST save X_test.pkl!

The Analyst agent downstream will load X_test.pkl to generate predictions. If you don't save X_test.pkl, the entire pipeline will FAIL.

**Constraints:**
- Apply SAME transformations to both train and test data
- Do NOT use test data for fitting (no data leakage!)
- Make preprocessing deterministic (set random_state)
- ALWAYS save X_test.pkl - downstream Analyst needs it!"""

MODELER_PROMPT = """You are a Modeler in a data science pipeline.

**CRITICAL:** Keep your <think> reasoning BRIEF (under 1000 words). Then IMMEDIATELY write executable code in a ```python block.

**Task Description:**
{task_description}

## CRITICAL FILE SYSTEM OBSERVATION
**Files currently available in your workspace (saved by previous agents):**
{available_files_list}

NOTE: The file names shown above are the ACTUAL files you can load. You MUST use these exact file names!

**Preprocessing Summary from Data Engineer:**
{preprocessing_summary}

**Your Responsibilities:**
1. **Check Available Files FIRST**: Verify which files exist before loading
2. **Load Data**: Load the preprocessed data saved by Data Engineer
3. **Algorithm Selection**:
   - Analyze the problem type (classification/regression)
   - Consider dataset characteristics
   - Select appropriate algorithms (RandomForest, XGBoost, LightGBM)
4. **Model Training**:
   - Train selected models with cross-validation
   - Tune hyperparameters
   - Evaluate performance
5. **Model Selection**: Choose best model based on validation metrics
6. **CRITICAL: Save Model**: Save the trained model as `model.pkl` - the Analyst needs this!
7. **Output**: Print files saved and performance metrics

**Constraints:**
- Check available files BEFORE trying to load them
- Set random_state for reproducibility
- Use cross-validation for model selection
- Report validation metrics honestly
- ALWAYS save your trained model to model.pkl"""

ANALYST_PROMPT = """You are an Analyst in a data science pipeline.

**CRITICAL: Keep your <think> reasoning BRIEF (under 1000 words). Then IMMEDIATELY write executable code.**

**Task Description:**
{task_description}

## CRITICAL FILE SYSTEM OBSERVATION
**Files currently available in your workspace:**
{available_files_list}

NOTE: The file names shown above are the ACTUAL files you can load. You MUST use these exact file names!

**Preprocessing Summary from Data Engineer:**
{preprocessing_summary}

**Model Summary from Modeler:**
{model_summary}

**Your Responsibilities:**
1. **CHECK AVAILABLE FILES FIRST**: Look at the file list above CAREFULLY!
   - You NEED 'model.pkl' to make predictions
   - You NEED 'X_test.pkl' with preprocessed test features
   - If these files are MISSING, report the issue!
2. **Load Saved Artifacts**: Load the model and preprocessed test data
3. **Generate Predictions**: Make predictions on test set
4. **Get IDs from test.csv**: Load original test.csv to get the ID column
5. **Create Submission**:
   - Save predictions to 'submission.csv'
   - MUST include correct ID column and prediction column
   - Follow competition format
6. **Quality Checks**:
   - Validate no missing predictions
   - Check value ranges
   - Verify column names and order

CRITICAL: Check file availability before loading!
If 'X_test.pkl' or 'model.pkl' is NOT in the available files list, you CANNOT create submission.csv.

**Constraints:**
- CHECK THE FILE LIST ABOVE before trying to load
- If required files are missing, report which ones
- Load the model from model.pkl
- Load preprocessed test data from X_test.pkl
- Get IDs from original test.csv
- Ensure predictions match test set size
- Save predictions to submission.csv"""

PROMPTS = {"data_engineer": DATA_ENGINEER_PROMPT, "modeler": MODELER_PROMPT,
           "analyst": ANALYST_PROMPT}
CONTINUE = """Execution output:
{observation}

Files currently available in your workspace:
{files}

{status}"""


@dataclass
class _Stage:
    """What one agent's turns did; the analyst's actions wait in `pending` for the metrics."""

    turns: int = 0
    calls: int = 0
    clean: int = 0
    summary: str = "(no output)"
    observation: str = ""  # the output of the agent's latest code run
    pending: list[tuple[Any, str, dict[str, Any]]] = field(default_factory=list)


@register("dsbench_lite", DSBenchLiteConfig)
class DSBenchLite:
    name = "dsbench_lite"
    agents = AGENTS
    sampling = "joint"
    coach_prompt = "dsbench"  # configs/coach_prompts/dsbench.txt (MAPPA appendix C.4)

    def __init__(self, cfg: DSBenchLiteConfig) -> None:
        self.cfg = cfg
        self.tool = CodeTool(cfg.sandbox, cfg.observation_chars)
        self.turns = {agent: getattr(cfg, f"{agent}_turns") for agent in AGENTS}
        self.tokens = {agent: getattr(cfg, f"{agent}_tokens") for agent in AGENTS}
        # Each agent's first turn number: fixed by the budgets, the same in every episode.
        self.first_turn = {agent: sum(self.turns[a] for a in AGENTS[:i])
                           for i, agent in enumerate(AGENTS)}

    # ------------------------------------------------------------------ tasks
    def make_task(self, rng: random.Random, index: int) -> Task:
        """A dataset, a split seed and the task description; the spec travels in `truth`."""
        dataset = rng.choice(sorted(self.cfg.datasets))
        spec = TaskSpec(dataset, rng.randrange(2**31), self.cfg.test_fraction)
        return Task(task_id=f"dsbench-{index}-{dataset}", prompt=describe(spec),
                    truth=spec.to_truth(), extra={"kind": spec.kind})

    def groups_per_round(self, agent: str, group_size: int) -> int:
        return self.turns[agent]

    # ------------------------------------------------------------------ rewards
    def rule_score(self, agent, task, output_text, finish_reason, context) -> float:
        """The offline coach's score in [0, 1] (CPU runs; the LLM coach uses appendix C.4).

        A reply without code scores 0 for every agent (each must act through code).
        data_engineer: 0.3 for code + 0.3 if it ran cleanly + 0.4 × the fraction of its three
        artifacts present after the run. modeler: 0.3 + 0.3 + 0.4 if model.pkl is present.
        analyst: 0.2 for code + 0.2 if clean + 0.6 × success × quality of the final submission
        (quality in [0, 1]: the mean of accuracy and F1, or 1 − RMSE%/50).
        """
        if not context.get("tool_called"):
            return 0.0
        clean = float(bool(context.get("tool_ok")))
        if agent == "analyst":
            outcome = float(context.get("success", 0.0)) * float(context.get("quality", 0.0))
            return 0.2 + 0.2 * clean + 0.6 * outcome
        return 0.3 + 0.3 * clean + 0.4 * float(context.get("artifacts_present", 0.0))

    # ------------------------------------------------------------------ the episode
    async def run(self, task: Task, episode) -> dict[str, float]:
        """Play the pipeline; returns the episode metrics (the same keys for every episode
        of a task, as the rollout averages each key over a round):

        success, and success_classification or success_regression; the fair metrics
        (`<m>_fair`, appendix A.3) and `<m>_raw_x_success` (the raw metric on success, else
        0: the paper's raw metric, taken over successful episodes only, is its mean divided
        by the mean of success); `<agent>_turns`; tool_call_rate and tool_ok_rate over all
        actions; `has_<artifact>` for the five required files at the end.
        """
        split, train_csv, test_csv = _prepare(TaskSpec.from_truth(task.truth))
        with self.tool.workspace() as workspace:
            workspace.write("train.csv", train_csv)
            workspace.write("test.csv", test_csv)
            engineer = await self._stage("data_engineer", task, episode, workspace, {})
            modeler = await self._stage("modeler", task, episode, workspace,
                                        {"preprocessing_summary": engineer.summary})
            analyst = await self._stage("analyst", task, episode, workspace,
                                        {"preprocessing_summary": engineer.summary,
                                         "model_summary": modeler.summary})
            score = score_submission(workspace.path / SUBMISSION, split)
            final_files = set(workspace.files())
        # The harness's metrics are the analyst's ground truth (appendix A.1), known only now.
        truth, value = metrics_text(split, score), quality(split, score)
        for action, input_text, context in analyst.pending:
            await episode.coach([action], input_text=input_text, truth=truth,
                                context={**context, "success": float(score.success),
                                         "quality": value})
        stages = {"data_engineer": engineer, "modeler": modeler, "analyst": analyst}
        return _episode_metrics(split, score, stages, final_files)

    async def _stage(self, agent: str, task: Task, episode, workspace: Workspace,
                     summaries: dict[str, str]) -> _Stage:
        """One agent's turns; the data engineer's and modeler's actions are coached at once."""
        stage, required = _Stage(), ARTIFACTS[agent]
        saved_before = _listing([f for f in workspace.files() if f not in GIVEN])
        prompt = PROMPTS[agent].format(task_description=task.prompt,
                                       available_files_list=_listing(workspace.files()),
                                       **summaries)
        messages = [{"role": "user", "content": prompt}]
        prefix = self.cfg.code_prefix
        for index in range(self.turns[agent]):
            [reply] = await episode.act(agent, messages, turn=self.first_turn[agent] + index,
                                        max_new_tokens=self.tokens[agent], prefix=prefix,
                                        stop=self.tool.stop_strings(prefix))
            result = await self.tool.call(episode, reply, workspace)
            files = workspace.files()
            present = [name for name in required if name in files]
            context = _coach_context(result, files, present, required)
            coach_input = (f"{messages[-1]['content']}\n\nFILES SAVED BY PREVIOUS AGENTS:\n"
                           f"{saved_before}")
            if agent == "analyst":
                stage.pending.append((reply, coach_input, context))
            else:
                await episode.coach([reply], input_text=coach_input, context=context)
            stage.turns += 1
            stage.calls += result.called
            stage.clean += result.called and result.ok
            stage.observation = result.observation or stage.observation
            stage.summary = _summary(reply.text, stage.observation, self.cfg.summary_chars)
            if not result.called or (result.ok and len(present) == len(required)):
                break  # it reported instead of coding, or its files are saved
            missing = [name for name in required if name not in files]
            status = (f"Required files still missing: {', '.join(missing)}. Fix the problem "
                      "in another ```python block." if missing else
                      "The run did not finish cleanly. Fix it in another ```python block.")
            messages += [{"role": "assistant", "content": reply.text},
                         {"role": "user", "content": CONTINUE.format(
                             observation=result.observation, files=_listing(files),
                             status=status)}]
        return stage


def _coach_context(result, files: list[str], present: list[str],
                   required: tuple[str, ...]) -> dict[str, Any]:
    """What the coach sees of a turn's run (MAPPA §2.2) and the rule score reads."""
    context = {**result.context(), "artifacts": present,
               "artifacts_present": len(present) / len(required)}
    if result.called:  # the files the run left are part of what the coach judges (C.4)
        context["tool_observation"] = (f"{result.observation}\n\nFiles in the workspace "
                                       f"after this run: {', '.join(files)}")
    return context


@functools.lru_cache(maxsize=8)  # module level: the workflow object travels to Ray actors
def _prepare(spec: TaskSpec) -> tuple[Split, str, str]:
    """A task's split and the text of its two CSV files (the G episodes of a round share
    one task: built once)."""
    split = build_split(spec)
    return split, split.train.to_csv(index=False), split.test.to_csv(index=False)


def _listing(files: list[str], limit: int = 40) -> str:
    """A file list as the prompts show it (long listings are cut)."""
    if not files:
        return "(none)"
    shown = [f"- {name}" for name in files[:limit]]
    if len(files) > limit:
        shown.append(f"- ... and {len(files) - limit} more")
    return "\n".join(shown)


def _clip(text: str, limit: int) -> str:
    """Head and tail of `text` within `limit` characters."""
    if len(text) <= limit:
        return text
    half = (limit - 20) // 2
    return f"{text[:half]}\n[... cut ...]\n{text[-half:]}"


def _summary(reply: str, observation: str, limit: int) -> str:
    """An agent's last reply and what its code printed, for the agents downstream."""
    text = reply.strip() or "(empty reply)"
    if observation:  # the printed summary matters most: it gets at least half the room
        output = _clip(observation, limit // 2)
        return _clip(text, limit - len(output) - 20) + f"\n\nExecution output:\n{output}"
    return _clip(text, limit)


def _episode_metrics(split: Split, score, stages: dict[str, _Stage],
                     final_files: set[str]) -> dict[str, float]:
    success = float(score.success)
    kind = "regression" if split.spec.kind == REGRESSION else "classification"
    metrics = {"success": success, f"success_{kind}": success}
    for name, value in fair_metrics(split, score).items():
        metrics[f"{name}_fair"] = value
    for name in metric_names(split):
        metrics[f"{name}_raw_x_success"] = score.metrics.get(name, 0.0) * success
    turns = sum(s.turns for s in stages.values())
    calls = sum(s.calls for s in stages.values())
    clean = sum(s.clean for s in stages.values())
    for agent, stage in stages.items():
        metrics[f"{agent}_turns"] = float(stage.turns)
    metrics["tool_call_rate"] = calls / turns if turns else 0.0
    metrics["tool_ok_rate"] = clean / calls if calls else 0.0
    for artifacts in ARTIFACTS.values():
        for name in artifacts:
            metrics[f"has_{name.split('.')[0]}"] = float(name in final_files)
    return metrics
