"""Coach config errors name the field, the value and the fix; prompts render strictly."""
import pytest

from actors.coach.config import CoachConfig, EndpointConfig
from actors.coach.prompts import PromptBook, Template
from actors.episode import CoachRequest
from runtime.config import ConfigError, load_config

BASE = ["workflow.name=arith_duo", "workflow.agents.solver=p", "workflow.agents.verifier=p",
        "models.p.path=tiny", "coach.kind=http"]
ENDPOINT = "coach.endpoints=[{base_url: 'http://127.0.0.1:9/v1', model: judge}]"


@pytest.mark.parametrize("overrides,match", [
    ([], "coach.endpoints is empty"),
    (["coach.endpoints=[{model: judge}]"], r"endpoints\[0\].base_url"),
    (["coach.endpoints=[{base_url: 'http://x/v1'}]"], r"endpoints\[0\].model"),
    ([ENDPOINT.replace("judge}", "judge, api_key_env: TROUPE_TEST_UNSET_KEY}")],
     "TROUPE_TEST_UNSET_KEY"),
    ([ENDPOINT, "coach.combine=mode"], "coach.combine"),
    ([ENDPOINT, "coach.min_scores=2"], "coach.min_scores"),
    ([ENDPOINT, "coach.prompt=nope"], "coach.prompt='nope'"),
    ([ENDPOINT, "coach.retry.max_attempts=0"], "max_attempts"),
    ([ENDPOINT, "coach.breaker.open_s=0"], "open_s"),
    ([ENDPOINT, "coach.backprop.enabled=true", "rollout.sync_coach=true"], "sync_coach"),
    ([ENDPOINT, "coach.roles={critic: Critic}"], "critic"),
    (["coach.kind=oracle"], "coach.kind"),
])
def test_bad_coach_values_name_the_field(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, BASE + overrides)


def test_rule_coach_cannot_backpropagate():
    with pytest.raises(ValueError, match="backprop"):
        load_config(None, BASE[:-1] + ["coach.backprop.enabled=true"])


def test_api_key_is_read_from_the_named_variable_and_never_stored(monkeypatch):
    monkeypatch.setenv("TROUPE_TEST_KEY", "sk-secret-value")
    keyed = ENDPOINT.replace("judge}", "judge, api_key_env: TROUPE_TEST_KEY}")
    cfg = load_config(None, BASE + [keyed])
    assert "sk-secret-value" not in repr(cfg)
    from runtime.config import to_yaml
    assert "sk-secret-value" not in to_yaml(cfg)


def test_templates_fill_every_placeholder_and_nothing_else():
    book = PromptBook(CoachConfig(kind="http", endpoints=[EndpointConfig(base_url="http://x/v1",
                                                                         model="m")],
                                  roles={"verifier": "Verifier"}, truth_agents=["verifier"]),
                      "arith_duo")
    request = CoachRequest("s", "m", "verifier", "arith_duo", "t", "Check: 2+2 {agent_role}",
                           "\\boxed{4}", "stop", truth="4", problem="What is 2 + 2?")
    rendered = book.score_prompt(request)
    text = rendered.messages[0][1]
    assert rendered.require_answer
    assert "{" + "problem}" not in text and "What is 2 + 2?" in text
    assert "Check: 2+2 {agent_role}" in text  # substituted text is never re-scanned
    assert "\\boxed{4}" in text and "Ground truth answer (if applicable):\n4" in text
    for name in ("mathchat", "dsbench", "arith_duo", "backprop"):
        assert Template(name).fields  # every shipped template parses
