"""Step metrics: hand-computed on a small batch."""
import math

import numpy as np
import pytest
import torch

from rstar_hpc.algo import (
    behaviour_metrics,
    loss_metrics,
    policy_loss,
    response_length_metrics,
    roc_downsample,
    roc_metrics,
)


def test_roc_metrics_hand_computed():
    # group 0: 6 rollouts, 3 right (p_err .0 .5 1.), G = 4 topk -> keeps 2+2, the two lowest-p_err positives
    # group 1: all right (rejected), group 2: all wrong (rejected), group 3: 2 rollouts < G (dropped)
    ids = [0] * 6 + [1] * 4 + [2] * 4 + [3] * 2
    rewards = [1, 0, 1, 0, 1, 0] + [1] * 4 + [0] * 4 + [1, 0]
    pe = [0.0, 0, 0.5, 0, 1.0, 0] + [0.5] * 4 + [0] * 4 + [0, 0]
    pf = np.zeros(16)
    sel = roc_downsample(ids, rewards, pe, pf, down_sample_to_n=4, positive_selection="topk",
                         min_zero_reward_trace_num=1, min_non_zero_reward_trace_num=1, seed=0)
    m = roc_metrics(sel, rewards, pe, pf)
    assert m["roc/num_kept"] == 4 and m["roc/num_groups"] == 4
    assert m["roc/pass_rate_before"] == pytest.approx(8 / 16)
    assert m["roc/pass_rate_after"] == pytest.approx(2 / 4)
    assert (m["roc/groups_all_correct"], m["roc/groups_all_wrong"], m["roc/groups_rejected_equal"]) == (1, 1, 2)
    assert m["roc/groups_dropped_small"] == 1
    assert m["roc/p_err_kept_pos"] == pytest.approx(0.25)
    assert m["roc/p_err_all_pos"] == pytest.approx((1.5 + 2.0) / 8)
    assert m["roc/p_format_kept_pos"] == 0.0


def test_roc_metrics_with_nothing_kept_is_nan_not_an_error():
    sel = roc_downsample([0, 0], [0, 0], seed=0, roc_error_ratio=False, roc_answer_format=False)
    m = roc_metrics(sel, [0, 0])
    assert m["roc/num_kept"] == 0 and math.isnan(m["roc/pass_rate_after"])


def test_behaviour_metrics_hand_computed():
    # five trajectories: clean and right; typo, retry, right; two errors of three calls, wrong; no call, right;
    # one call lost to the sandbox (infra: no verdict) and one clean call, wrong
    rewards = [1, 1, 0, 1, 0]
    calls = [["ok"], ["error", "ok"], ["error", "timeout", "ok"], [], ["internal_error", "ok"]]
    offsets = np.cumsum([0] + [len(c) for c in calls])
    m = behaviour_metrics(rewards, [s for c in calls for s in c], offsets)
    # over the four trajectories that made a judged call: 0, 1/2, 2/3, 0 (the infra call counts for nothing)
    assert m["behaviour/tool_error_ratio"] == pytest.approx((0 + 0.5 + 2 / 3 + 0) / 4)
    assert m["behaviour/tool_error_ratio_pos"] == pytest.approx(0.25)   # trajectories 0 and 1
    assert m["behaviour/error_share"] == pytest.approx(2 / 5)
    assert m["behaviour/tool_calls"] == pytest.approx(8 / 5)
    assert m["behaviour/no_call_share"] == pytest.approx(1 / 5)
    assert m["behaviour/pass_rate_clean"] == pytest.approx(1 / 2)       # trajectories 0 (right) and 4 (wrong)
    assert m["behaviour/pass_rate_after_error"] == pytest.approx(1 / 2)
    assert behaviour_metrics([], [], [0]) == {}
    nan = behaviour_metrics([1], [], [0, 0])   # no call at all: the ratios have nothing to average
    assert math.isnan(nan["behaviour/tool_error_ratio"]) and nan["behaviour/no_call_share"] == 1.0


def test_loss_metrics_sum_micro_batches_exactly():
    lp = torch.log(torch.tensor([1.5, 1.0, 0.5, 0.5, 1.0]))
    adv = torch.tensor([1.0, 1.0, -1.0, 1.0, -1.0])
    mask = torch.tensor([1, 1, 1, 1, 0])
    stats = [policy_loss(lp[s], torch.zeros(len(lp))[s], adv[s], mask[s], global_num_tokens=4)[1]
             for s in (slice(0, 2), slice(2, 5))]
    m = loss_metrics(stats)
    assert m["train/num_tokens"] == 4
    assert m["train/clip_frac_high"] == 0.25  # token 0: A > 0, ratio 1.5
    assert m["train/clip_frac_low"] == 0.25   # token 2: A < 0, ratio 0.5
    kl = (1.5 - 1 - math.log(1.5)) + 2 * (0.5 - 1 - math.log(0.5))
    assert m["train/approx_kl"] == pytest.approx(kl / 4)
    assert loss_metrics(stats, num_tokens=8)["train/clip_frac_high"] == 0.125  # one rank of two


def test_response_length_metrics():
    m = response_length_metrics([100, 200, 300, 400], truncated=[0, 0, 0, 1])
    assert m["response/length_mean(tokens)"] == 250 and m["response/length_max(tokens)"] == 400
    assert m["response/length_p50(tokens)"] == 250 and m["response/truncated_frac"] == 0.25
    assert response_length_metrics([]) == {}
