"""Config validation: every shipped config loads; bad keys and values name the field."""
from pathlib import Path

import pytest

from runtime.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads_and_starts_with_its_command(path):
    cfg = load_config(path)
    assert cfg.models
    first = path.read_text().splitlines()[0]
    assert first.startswith("#"), f"{path.name} must open with a comment giving its run command"
    assert "launch_async.py" in path.read_text().split("\n", 3)[1] + first


def test_overrides_apply():
    cfg = load_config(CONFIGS[0], ["run.max_steps=7", "rollout.concurrency=3"])
    assert cfg.run.max_steps == 7 and cfg.rollout.concurrency == 3


def test_unknown_key_names_the_key():
    with pytest.raises(ConfigError, match="no_such_field"):
        load_config(CONFIGS[0], ["run.no_such_field=1"])


def test_bad_type_names_the_field():
    with pytest.raises(ConfigError, match="max_steps"):
        load_config(CONFIGS[0], ["run.max_steps=many"])


@pytest.mark.parametrize("override,field", [
    ("run.max_steps=0", "max_steps"),
    ("rollout.temperature=0", "temperature"),
    ("workflow.name=chess", "workflow.name"),
    ("workflow.group_size=0", "group_size"),
    ("coach.latency_s=-1", "latency_s"),
])
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field):
        load_config(CONFIGS[0], [override])


def test_agent_mapped_to_unknown_model():
    with pytest.raises(ConfigError, match="not a key of models"):
        load_config(None, ["workflow.name=arith_duo", "workflow.agents.solver=a",
                           "workflow.agents.verifier=b", "models.a.path=tiny"])


def test_readiness_must_match_estimator():
    with pytest.raises(ConfigError, match="readiness"):
        load_config(None, ["workflow.name=arith_duo", "workflow.agents.solver=p",
                           "workflow.agents.verifier=p",
                           "models.p.learner.advantage=reinforce_pp"])
    cfg = load_config(None, ["workflow.name=arith_duo", "workflow.agents.solver=p",
                             "workflow.agents.verifier=p",
                             "models.p.learner.advantage=reinforce_pp",
                             "models.p.buffer.readiness=episode"])
    assert cfg.models["p"].buffer.readiness == "episode"


def test_temperature_mismatch_is_refused():
    with pytest.raises(ConfigError, match="temperature"):
        load_config(CONFIGS[0], ["rollout.temperature=0.7"])


def test_overrides_index_lists_and_bad_indexes_are_config_errors():
    http = Path(__file__).resolve().parents[2] / "configs" / "arith_duo_http.yaml"
    cfg = load_config(http, ["coach.endpoints[0].model=judge-a"])
    assert cfg.coach.endpoints[0].model == "judge-a"
    assert load_config(http, ["coach.endpoints.0.model=judge-b"]).coach.endpoints[0].model == "judge-b"
    with pytest.raises(ConfigError, match="endpoints"):
        load_config(http, ["coach.endpoints[7].model=x"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(http, ["run.max_steps"])


def test_agent_sampling_overrides_one_agent_and_is_checked_per_model():
    # role-specialised: the tool samples cooler on its own model, whose learner agrees
    cfg = load_config(ROOT / "configs" / "sudoku_cpu_specialised.yaml", [
        "rollout.agent_sampling={tool: {temperature: 0.7, top_p: 0.95}}",
        "models.tool.learner.temperature=0.7"])
    assert (cfg.rollout.sampling_for("tool").temperature,
            cfg.rollout.sampling_for("tool").top_p) == (0.7, 0.95)
    assert cfg.rollout.sampling_for("planner").temperature == 1.0
    # the tool's learner left at 1.0: the tool's own override is named
    with pytest.raises(ConfigError, match=r"rollout.agent_sampling.tool.temperature=0.7"):
        load_config(ROOT / "configs" / "sudoku_cpu_specialised.yaml",
                    ["rollout.agent_sampling={tool: {temperature: 0.7}}"])
    # one shared model cannot sample two roles at two temperatures
    with pytest.raises(ConfigError, match="separate models"):
        load_config(ROOT / "configs" / "sudoku_cpu.yaml",
                    ["rollout.agent_sampling={tool: {temperature: 0.7}}"])
    with pytest.raises(ConfigError, match=r"agent_sampling names \['coder'\]"):
        load_config(ROOT / "configs" / "sudoku_cpu.yaml",
                    ["rollout.agent_sampling={coder: {top_p: 0.9}}"])
    with pytest.raises(ConfigError, match=r"agent_sampling.tool.top_p=1.5"):
        load_config(ROOT / "configs" / "sudoku_cpu.yaml",
                    ["rollout.agent_sampling={tool: {top_p: 1.5}}"])


@pytest.mark.parametrize("config, lam", [("sudoku_cpu.yaml", 0.6), ("plan_path_cpu.yaml", 0.5),
                                         ("sokoban_cpu.yaml", 0.4), ("math_duo_cpu.yaml", 0.7)])
def test_at_grpo_learner_must_mix_with_the_workflows_lambda(config, lam):
    """Rows carry the workflow's λ-mix and its kept candidates follow it; an at_grpo learner
    mixing with another λ (or eq. 4's α) would train on rewards the episode never used."""
    assert load_config(ROOT / "configs" / config).models["policy"].learner.team_lambda == lam
    with pytest.raises(ConfigError, match=rf"team_lambda=0.3 but .* λ={lam}"):
        load_config(ROOT / "configs" / config, ["models.policy.learner.team_lambda=0.3"])
    with pytest.raises(ConfigError, match=rf"team_lambda=None but .* λ={lam}"):
        load_config(ROOT / "configs" / config, ["models.policy.learner.team_lambda=null"])
