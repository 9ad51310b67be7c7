import json

import numpy as np
import pyarrow as pa
import pytest

from rstar_hpc.exchange.columns import conform, from_table, to_table
from rstar_hpc.exchange.schema import SCHEMA, SCHEMA_VERSION, TOOL_STATUSES, ToolCall, Trajectory, Turn
from rstar_hpc.synthetic.trajectories import make_step


def _equal(a: Trajectory, b: Trajectory) -> bool:
    ra, rb = a.to_row(), b.to_row()
    return ra == rb


def test_round_trip_through_arrow_and_json():
    trajs = make_step("r", "rl", 3, num_prompts=4, samples_per_prompt=3, mean_tokens=200)
    back = from_table(to_table(trajs))
    assert len(back) == len(trajs)
    assert all(_equal(a, b) for a, b in zip(trajs, back))
    assert isinstance(back[0].response_ids, np.ndarray)   # token fields come back as numpy, not lists
    again = Trajectory.from_row(json.loads(trajs[1].to_json()))
    assert _equal(again, trajs[1])


def test_schema_is_explicit_and_versioned():
    assert SCHEMA.metadata[b"rstar_hpc.schema_version"] == str(SCHEMA_VERSION).encode()
    assert SCHEMA.field("loss_mask").type == pa.list_(pa.uint8())
    assert SCHEMA.field("logprobs").type == pa.list_(pa.float32())
    assert set(TOOL_STATUSES) == {"ok", "error", "timeout", "memory", "output_truncated", "killed",
                                  "invalid_request", "parse_error", "internal_error", "unavailable"}
    names = SCHEMA.names
    for required in ("run", "stage", "step", "prompt_uid", "sample_index", "policy_version", "engine_rank",
                     "turns", "tool_calls", "finish_reason", "reward", "p_err", "p_format", "timings"):
        assert required in names


def _traj(**kw) -> Trajectory:
    base = dict(run="r", stage="rl", step=0, prompt_uid="u", sample_index=0, policy_version=0, engine_rank=0,
                prompt_ids=[1, 2], response_ids=[5, 6, 7, 8], loss_mask=[1, 1, 0, 1], logprobs=[-.1, -.2, 0, -.3],
                turns=[Turn("assistant", 0, 2), Turn("tool", 2, 3), Turn("assistant", 3, 4)],
                tool_calls=[ToolCall(0, "python", "{}", "ok", 0.1, "45")])
    base.update(kw)
    return Trajectory(**base)


@pytest.mark.parametrize("change, message", [
    (dict(loss_mask=[1, 1, 0]), "loss_mask has 3 entries"),
    (dict(logprobs=[0.0]), "logprobs has 1 entries"),
    (dict(loss_mask=[1, 2, 0, 1]), "only 0"),
    (dict(turns=[Turn("assistant", 0, 2), Turn("tool", 3, 4)]), "must start at 2"),
    (dict(turns=[Turn("assistant", 0, 3)]), "cover 3 response tokens"),
    (dict(turns=[Turn("user", 0, 4)], tool_calls=[]), "role 'user'"),
    (dict(tool_calls=[ToolCall(0, "python", "{}", "crashed", 0.1, "")]), "status 'crashed'"),
    (dict(tool_calls=[ToolCall(1, "python", "{}", "ok", 0.1, "")]), "must index an assistant turn"),
    (dict(finish_reason="eos"), "finish_reason 'eos'"),
])
def test_validate_names_the_problem(change, message):
    _traj().validate()
    with pytest.raises(ValueError, match=message):
        _traj(**change).validate()


def test_tool_call_error_and_truncation_flags():
    assert ToolCall(0, "p", "{}", "output_truncated", 0.1, "x").is_error is False
    assert ToolCall(0, "p", "{}", "timeout", 4.0, "").is_error is True
    assert ToolCall(0, "p", "{}", "ok", 0.1, "abc").output_chars == 3


def test_conform_fills_columns_added_later_and_rejects_type_changes():
    table = to_table([_traj()])
    old = table.drop_columns(["token_policy_versions"]).to_batches()[0]   # a v1 shard
    assert conform(old).column(SCHEMA.get_field_index("token_policy_versions")).null_count == 1
    v2 = pa.RecordBatch.from_arrays([*table.to_batches()[0].columns, pa.array([True]), pa.array(["kept_positive"])],
                                    names=[*table.column_names, "roc_kept", "roc_reason"])   # columns v3 removed
    assert conform(v2).schema.equals(SCHEMA, check_metadata=False)
    with pytest.raises(pa.ArrowInvalid, match="required column 'reward'"):
        conform(table.drop_columns(["reward"]).to_batches()[0])
    changed = table.set_column(table.schema.get_field_index("step"), "step", pa.array(["0"])).to_batches()[0]
    with pytest.raises(pa.ArrowInvalid, match="column 'step'"):
        conform(changed)


def test_trajectory_columns_read_every_named_column_as_typed_arrays():
    from rstar_hpc.exchange.columns import TrajectoryColumns

    trajs = make_step("run", "rl", 3, num_prompts=3, samples_per_prompt=2, mean_tokens=40)
    table = to_table(trajs)
    cols = TrajectoryColumns(table.slice(1))   # a slice: offsets of list columns do not start at 0
    rows = trajs[1:]
    assert len(cols) == len(rows)
    assert cols.prompt_uid.tolist() == [t.prompt_uid for t in rows]
    assert cols.reward.dtype == np.float32 and cols.reward.tolist() == [t.reward for t in rows]
    assert cols.policy_version.tolist() == [t.policy_version for t in rows]
    values, offsets = cols.response_ids
    assert [values[offsets[i]:offsets[i + 1]].tolist() for i in range(len(rows))] == \
        [list(t.response_ids) for t in rows]
    status, offsets = cols.tool_call_status
    assert [status[offsets[i]:offsets[i + 1]].tolist() for i in range(len(rows))] == \
        [[c.status for c in t.tool_calls] for t in rows]
