"""p_err and p_format from structured tool results (paper Eq. 4-5)."""
import pytest

from rstar_hpc.algo import FAILED_TOOL_STATUSES, TOOL_STATUSES, p_err, p_format, trajectory_quality

ANSWER = r"<answer>\boxed{3}</answer>"


@pytest.mark.parametrize("statuses, expected", [
    ([], 0.5),                                   # no tool call: the paper's default
    (["ok"], 0.0),                               # one clean call
    (["error"], 1.0),                            # one failed call
    (["ok", "error", "timeout", "output_truncated"], 0.5),
    (["parse_error", "ok", "ok"], 1 / 3),        # a call whose JSON did not parse counts
    (["memory", "killed", "invalid_request", "ok"], 0.75),
])
def test_p_err(statuses, expected):
    assert p_err(statuses) == pytest.approx(expected)


def test_failure_set():
    assert FAILED_TOOL_STATUSES < TOOL_STATUSES
    assert TOOL_STATUSES - FAILED_TOOL_STATUSES == {"ok", "output_truncated", "internal_error", "unavailable"}


def test_statuses_match_the_trajectory_schema():
    schema = pytest.importorskip("rstar_hpc.exchange.schema")
    assert TOOL_STATUSES == set(schema.TOOL_STATUSES)


def test_unknown_status_raises_with_the_fix():
    with pytest.raises(ValueError, match="unknown tool status 'Error'.*FAILED_TOOL_STATUSES"):
        p_err(["ok", "Error"])


def test_output_that_mentions_error_is_not_a_failure():
    # the public code's substring rule would count this; the status says the program ran fine
    q = trajectory_quality("<tool_response>ValueError: no error here</tool_response>" + ANSWER, ["ok"], 2)
    assert q.p_err == 0.0


@pytest.mark.parametrize("response, turns, expected", [
    ("no answer", 1, 1.0),
    (ANSWER, 1, 0.0),
    (ANSWER * 2, 2, 0.5),
    (ANSWER * 2, 4, 0.25),
    (ANSWER * 3, 1, 1.0),                                  # capped at 1
    ("<answer>" + ANSWER, 1, 1.0),                         # unbalanced tags
    (ANSWER + "</answer>", 1, 1.0),
    ("<answer>truncated", 3, 1.0),
    (f"<tool_response>{ANSWER}</tool_response>" + ANSWER, 2, 0.0),  # answers in tool output do not count
])
def test_p_format(response, turns, expected):
    assert p_format(response, turns) == pytest.approx(expected)


def test_p_format_public_code_turn_count():
    # the public code never counts the first assistant turn
    assert p_format(ANSWER, 1, count_first_turn=False) == 1.0
    assert p_format(ANSWER * 2, 3, count_first_turn=False) == 0.5
    with pytest.raises(ValueError, match="num_turns must be >= 1"):
        p_format(ANSWER, 0)


@pytest.mark.parametrize("count_first_turn, no_tool_total, one_tool_total", [(True, 0.5, 0.0), (False, 1.5, 0.0)])
def test_total_penalty_of_clean_traces(count_first_turn, no_tool_total, one_tool_total):
    no_tool = trajectory_quality("<reason>x</reason>" + ANSWER, [], 1, count_first_turn=count_first_turn)
    one_tool = trajectory_quality("<tool_call>{}</tool_call><tool_response>3</tool_response>" + ANSWER, ["ok"], 2,
                                  count_first_turn=count_first_turn)
    assert no_tool.p_err + no_tool.p_format == no_tool_total
    assert one_tool.p_err + one_tool.p_format == one_tool_total
    assert (one_tool.num_tool_calls, one_tool.num_failed_calls, one_tool.num_answers) == (1, 0, 1)


def test_infrastructure_failures_are_left_out_of_p_err():
    # the sandbox died or was unreachable: no verdict on the model's code
    assert p_err(["ok", "unavailable"]) == 0.0
    assert p_err(["error", "internal_error", "ok"]) == 0.5
    assert p_err(["unavailable", "internal_error"]) == 0.0      # calls were made: not the no-call 0.5
    assert p_err([]) == 0.5
    q = trajectory_quality("<answer>\\boxed{1}</answer>", ["error", "unavailable"], 2)
    assert (q.num_tool_calls, q.num_failed_calls, q.p_err) == (1, 1, 1.0)
