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


ADVISOR = ("coach.advisor.endpoints=[{name: adv, base_url: 'http://127.0.0.1:9/v1', "
           "model: advisor}]")
RULE = BASE[:-1]  # coach.kind=rule: the advisor needs endpoints of its own


@pytest.mark.parametrize("overrides,match", [
    (RULE + ["coach.advisor.enabled=true"], r"coach.advisor.endpoints is empty and coach.kind"),
    (RULE + ["coach.advisor.enabled=true", "coach.advisor.endpoints=[{model: m}]"],
     r"coach.advisor.endpoints\[0\].base_url is empty"),
    (RULE + ["coach.advisor.enabled=true", "coach.advisor.endpoints=[{base_url: 'http://x/v1'}]"],
     r"coach.advisor.endpoints\[0\].model is empty"),
    (RULE + ["coach.advisor.enabled=true",
             ADVISOR.replace("model: advisor}", "model: advisor, api_key_env: TROUPE_UNSET_KEY}")],
     r"coach.advisor.endpoints\[0\].api_key_env='TROUPE_UNSET_KEY'"),
    (RULE + ["coach.advisor.enabled=true",
             ADVISOR.replace("}]", "}, {name: adv, base_url: 'http://y/v1', model: m}]")],
     "coach.advisor.endpoints have repeated names"),
    (RULE + [ADVISOR, "coach.advisor.max_tokens=0"], r"coach.advisor.max_tokens=0: must be >= 1"),
    (RULE + [ADVISOR, "coach.advisor.temperature=-0.5"], r"coach.advisor.temperature=-0.5"),
    (RULE + [ADVISOR, "coach.advisor.max_concurrency=0"], "coach.advisor.max_concurrency=0"),
    (RULE + [ADVISOR, "coach.advisor.give_up_after_s=0"], "coach.advisor.give_up_after_s=0"),
])
def test_bad_advisor_values_name_the_field_and_the_fix(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_advisor_defaults_to_the_judges_and_may_bring_its_own():
    off = load_config(None, RULE).coach.advisor
    assert not off.enabled and off.endpoints == []  # no advisor unless asked for
    shared = load_config(None, BASE + [ENDPOINT, "coach.advisor.enabled=true"]).coach.advisor
    assert shared.endpoints == [] and shared.max_tokens is None  # the judges, as configured
    own = load_config(None, RULE + ["coach.advisor.enabled=true", ADVISOR,
                                    "coach.advisor.max_tokens=1024",
                                    "coach.advisor.temperature=0.7",
                                    "coach.advisor.extra_body={}"]).coach.advisor
    assert [e.label() for e in own.endpoints] == ["adv"]
    assert (own.max_tokens, own.temperature, own.extra_body) == (1024, 0.7, {})


def test_consult_refuses_a_run_without_advisor_and_malformed_messages():
    import asyncio

    from actors.episode import Episode, SamplingParams

    def episode(advisor=None):
        return Episode(run_id="r", workflow="arith_duo", task_id="t", round_id="o",
                       round_size=1, round_index=0, group_size=1, agent_models={"solver": "m"},
                       routes={}, sampling=SamplingParams(), advisor=advisor)

    chat = [{"role": "user", "content": "Review this code."}]
    with pytest.raises(RuntimeError, match="coach.advisor.enabled=true"):
        asyncio.run(episode().consult(chat))

    async def never(request):
        raise AssertionError("a malformed consult must not reach the pool")

    for bad in ([], "Review this.", [{"role": "critic", "content": "x"}],
                [{"role": "user", "content": ["x"]}], [{"role": "user"}]):
        with pytest.raises(ValueError, match="consult"):
            asyncio.run(episode(never).consult(bad))
    with pytest.raises(ValueError, match="purpose"):
        asyncio.run(episode(never).consult(chat, purpose="code review"))


def test_advisor_failure_survives_pickling():
    import pickle

    from actors.episode import Advice, AdvisorFailure

    failure = AdvisorFailure(Advice(None, "adv", 1.5, failed_reason="server_error",
                                    detail="coach_server_error: 3 attempts"))
    copy = pickle.loads(pickle.dumps(failure))
    assert (copy.reason, copy.endpoint, copy.latency_s) == ("server_error", "adv", 1.5)
    assert str(copy) == str(failure)
