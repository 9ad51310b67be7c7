"""Resample-on-Correct: the split table, corner cases, properties and the weighted mode's statistics."""
import numpy as np
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rstar_hpc.algo import RoCReason, roc_downsample, roc_split, trajectory_quality
from rstar_hpc.config.algo import RoCConfig

# the public code (microsoft/rStar rstar2_agent/down_sample/): positives out of 32 -> (kept +, kept -) with G = 16 and both minimums 2
TABLE = {1: (1, 15), 2: (2, 14), **{p: (2, 14) for p in (3, 4, 5)}, 6: (3, 13), **{p: (4, 12) for p in (7, 8, 9)},
         10: (5, 11), **{p: (6, 10) for p in (11, 12, 13)}, 14: (7, 9), **{p: (8, 8) for p in (15, 16, 17)},
         18: (9, 7), **{p: (10, 6) for p in (19, 20, 21)}, 22: (11, 5), **{p: (12, 4) for p in (23, 24, 25)},
         26: (13, 3), **{p: (14, 2) for p in (27, 28, 29, 30)}, 31: (15, 1)}


@pytest.mark.parametrize("n_pos", sorted(TABLE))
def test_reference_split_table(n_pos):
    assert roc_split(n_pos, 32 - n_pos) == TABLE[n_pos]
    rewards = np.r_[np.ones(n_pos), np.zeros(32 - n_pos)]
    sel = roc_downsample(np.zeros(32), rewards, np.zeros(32), np.zeros(32), seed=0)
    assert (int(sel.keep[:n_pos].sum()), int(sel.keep[n_pos:].sum())) == TABLE[n_pos]


def public_code_split(n_pos, n_neg, n, min_zero, min_nonzero):
    """A literal transcription of the public code's arithmetic (microsoft/rStar rstar2_agent/down_sample/)."""
    total = n_pos + n_neg
    k_neg, k_pos = round(n_neg * n / total), round(n_pos * n / total)
    if k_neg <= min(min_zero, n_neg):
        k_neg = min(min_zero, n_neg)
        k_pos = n - k_neg
    if k_pos <= min(min_nonzero, n_pos):
        k_pos = min(min_nonzero, n_pos)
        k_neg = n - k_pos
    return k_pos, k_neg


def test_split_equals_the_public_code_for_even_targets():
    for n in range(2, 21, 2):
        for total in range(n + 1, 2 * n + 9):
            for n_pos in range(total + 1):
                for mins in ((0, 0), (1, 1), (2, 2), (0, 2), (2, 1)):
                    if sum(mins) > n:
                        continue
                    cfg = RoCConfig(down_sample_to_n=n, min_zero_reward_trace_num=mins[0],
                                    min_non_zero_reward_trace_num=mins[1])
                    assert roc_split(n_pos, total - n_pos, cfg) == public_code_split(n_pos, total - n_pos, n, *mins)


def test_split_always_sums_to_target_for_odd_targets():
    # the code's two separate roundings give 4 + 4 = 8 here; ours keeps 9
    assert public_code_split(9, 9, 9, 0, 0) == (4, 4)
    assert sum(roc_split(9, 9, down_sample_to_n=9, min_zero_reward_trace_num=0,
                         min_non_zero_reward_trace_num=0)) == 9


def reasons(sel):
    return [RoCReason(c) for c in sel.reason]


def test_topk_keeps_lowest_penalties_with_stable_ties():
    # 4 positives, 4 negatives, G = 4 -> 2 + 2
    rewards = [1, 0, 1, 0, 1, 0, 1, 0]
    p = [0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0]
    sel = roc_downsample(np.zeros(8), rewards, p, np.zeros(8), positive_selection="topk", down_sample_to_n=4,
                         min_zero_reward_trace_num=1, min_non_zero_reward_trace_num=1, seed=0)
    assert sel.keep[[0, 2, 4, 6]].tolist() == [False, True, True, False]
    tie = roc_downsample(np.zeros(8), rewards, np.full(8, 0.5), np.zeros(8), positive_selection="topk",
                         down_sample_to_n=4, seed=0)
    assert tie.keep[[0, 2, 4, 6]].tolist() == [True, True, False, False]  # rollout order breaks ties
    assert sel.keep[[1, 3, 5, 7]].sum() == 2


def test_penalty_switches_and_one_or_no_tool_call():
    clean_one_call = trajectory_quality(r"<answer>\boxed{1}</answer>", ["ok"], 2)
    no_call = trajectory_quality(r"<answer>\boxed{1}</answer>", [], 1)
    failed_call = trajectory_quality(r"<answer>\boxed{1}</answer>", ["timeout"], 2)
    qs = [no_call, failed_call, clean_one_call, clean_one_call]
    args = (np.zeros(8), [1, 1, 1, 1, 0, 0, 0, 0], [q.p_err for q in qs] + [0] * 4, [q.p_format for q in qs] + [0] * 4)
    kw = dict(positive_selection="topk", down_sample_to_n=6, min_zero_reward_trace_num=0,
              min_non_zero_reward_trace_num=0, seed=0)
    sel = roc_downsample(*args, **kw)  # 3 + 3: the failed-call positive (p_err 1) goes
    assert sel.keep[:4].tolist() == [True, False, True, True]
    assert sel.penalty[:4].tolist() == [0.5, 1.0, 0.0, 0.0]
    assert roc_downsample(*args, **kw, roc_error_ratio=False).penalty[:4].tolist() == [0.0] * 4
    with pytest.raises(ValueError, match="p_err is needed"):
        roc_downsample(args[0], args[1], None, args[3], seed=0)


@pytest.mark.parametrize("rewards, reject, expected", [
    ([0] * 6, True, [RoCReason.DROPPED_EQUAL_REWARD] * 6),        # no positives
    ([1] * 6, True, [RoCReason.DROPPED_EQUAL_REWARD] * 6),        # no negatives
    ([0] * 6, False, [RoCReason.KEPT_NEGATIVE] * 4 + [RoCReason.DROPPED_NEGATIVE] * 2),
    ([1] * 6, False, [RoCReason.KEPT_POSITIVE] * 4 + [RoCReason.DROPPED_POSITIVE] * 2),
])
def test_single_class_groups(rewards, reject, expected):
    sel = roc_downsample(np.zeros(6), rewards, np.arange(6) / 6, np.zeros(6), reject_equal_reward=reject,
                         positive_selection="topk", down_sample_to_n=4, seed=0)
    assert sorted(reasons(sel)) == sorted(expected)
    if not reject and rewards[0] == 1:
        assert sel.keep.tolist() == [True] * 4 + [False] * 2  # lowest penalties


def test_group_sizes_at_and_below_target():
    ids = ["a"] * 4 + ["b"] * 3 + ["c"] * 6
    rewards = [1, 0, 0, 1] + [1, 0, 0] + [1, 0, 1, 0, 1, 0]
    z = np.zeros(13)
    sel = roc_downsample(ids, rewards, z, z, down_sample_to_n=4, seed=0)
    assert reasons(sel)[:7] == [RoCReason.KEPT_GROUP] * 4 + [RoCReason.DROPPED_SMALL_GROUP] * 3
    assert sel.keep[7:].sum() == 4
    kept_small = roc_downsample(ids, rewards, z, z, down_sample_to_n=4, keep_small_groups=True, seed=0)
    assert kept_small.keep[:7].all()


def test_switches_off():
    rewards = [1, 1, 0, 0, 0, 1, 1, 1]
    off = roc_downsample(np.zeros(8), rewards, seed=0, mode="grpo", down_sample_to_n=8)
    assert off.keep.all() and set(reasons(off)) == {RoCReason.KEPT_GROUP}
    same = roc_downsample(np.zeros(4), [1, 1, 1, 1], seed=0, mode="grpo", down_sample_to_n=4,
                          reject_equal_reward=False)
    assert same.keep.all()
    ids = [0] * 4 + [1] * 4
    only_reject = roc_downsample(ids, [1, 1, 1, 1, 0, 1, 0, 1], seed=0, down_sample_to_n=0)
    assert only_reject.keep.tolist() == [False] * 4 + [True] * 4


def test_zero_penalty_is_finite_in_weighted_mode():
    sel = roc_downsample(np.zeros(8), [1] * 4 + [0] * 4, np.zeros(8), np.zeros(8), down_sample_to_n=4, seed=3)
    assert sel.keep.sum() == 4 and sel.keep[:4].sum() == 2


def test_bad_input_says_what_to_fix():
    with pytest.raises(ValueError, match="rewards holds NaN"):
        roc_downsample([0, 0], [1.0, float("nan")], seed=0, roc_error_ratio=False, roc_answer_format=False)
    with pytest.raises(ValueError, match="group_ids has shape"):
        roc_downsample([0], [1.0, 0.0], [0, 0], [0, 0], seed=0)
    with pytest.raises(pydantic.ValidationError, match="must be <= down_sample_to_n"):
        roc_downsample([0], [1.0], seed=0, down_sample_to_n=3)
    with pytest.raises(TypeError, match="valid names"):
        roc_downsample([0], [1.0], seed=0, downsample_to=3)


@st.composite
def batches(draw):
    target = draw(st.integers(1, 16))
    min_zero = draw(st.integers(0, target))
    min_nonzero = draw(st.integers(0, target - min_zero))
    groups = draw(st.lists(st.tuples(st.integers(1, 40), st.floats(0, 1)), min_size=1, max_size=8))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ids, rewards = [], []
    for gi, (size, rate) in enumerate(groups):
        ids += [gi] * size
        rewards += (rng.random(size) < rate).astype(float).tolist()
    n = len(ids)
    cfg = RoCConfig(down_sample_to_n=target, min_zero_reward_trace_num=min_zero,
                    min_non_zero_reward_trace_num=min_nonzero,
                    positive_selection=draw(st.sampled_from(["weighted", "topk"])),
                    reject_equal_reward=draw(st.booleans()))
    return np.array(ids), np.array(rewards), rng.random(n), rng.choice([0.0, 0.5, 1.0], n), cfg


@settings(max_examples=300, deadline=None, derandomize=True)
@given(batches(), st.integers(0, 2**31))
def test_properties(batch, seed):
    ids, rewards, pe, pf, cfg = batch
    sel = roc_downsample(ids, rewards, pe, pf, cfg, seed=seed)
    again = roc_downsample(ids, rewards, pe, pf, cfg, seed=seed)
    assert np.array_equal(sel.keep, again.keep) and np.array_equal(sel.reason, again.reason)
    n_target = cfg.down_sample_to_n
    for gi in np.unique(ids):
        m = ids == gi
        size, n_pos = int(m.sum()), int(rewards[m].sum())
        n_neg, kept = size - n_pos, sel.keep[m]
        kept_pos, kept_neg = int((kept & (rewards[m] == 1)).sum()), int((kept & (rewards[m] == 0)).sum())
        if cfg.reject_equal_reward and n_pos in (0, size):
            assert not kept.any()
        elif size < n_target:
            assert not kept.any()
        elif size == n_target:
            assert kept.all()
        else:
            assert kept_pos + kept_neg == n_target                       # group size
            assert kept_pos <= n_pos and kept_neg <= n_neg
            assert kept_pos >= min(cfg.min_non_zero_reward_trace_num, n_pos)  # minimums
            assert kept_neg >= min(cfg.min_zero_reward_trace_num, n_neg)
            if kept_pos > min(cfg.min_non_zero_reward_trace_num, n_pos) and \
                    kept_neg > min(cfg.min_zero_reward_trace_num, n_neg):
                assert abs(kept_pos - n_pos * n_target / size) <= 0.5       # pass rate within rounding
            if cfg.positive_selection == "topk" and 0 < kept_pos < n_pos:
                pen = sel.penalty[m][rewards[m] == 1]
                assert pen[kept[rewards[m] == 1]].max() <= pen[~kept[rewards[m] == 1]].min()


def test_weighted_mode_matches_sequential_sampling_statistically():
    """Inclusion frequencies of the Gumbel-top-k draw against numpy's sequential weighted sampling without
    replacement (Generator.choice), 4000 draws each. One frequency has std <= 0.008, a difference of two
    <= 0.012; the tolerance 0.04 is over 3 sigma. Seeds are fixed, so the test is deterministic."""
    penalties = np.array([0.0, 0.0, 0.5, 0.5, 1.0, 1.0, 1.5, 2.0])
    rewards = np.r_[np.ones(8), np.zeros(8)]
    pe = np.r_[penalties, np.zeros(8)]
    cfg = RoCConfig(down_sample_to_n=8, min_zero_reward_trace_num=0, min_non_zero_reward_trace_num=0,
                    roc_answer_format=False, weight_eps=0.1)
    trials = 4000
    ours = np.zeros(8)
    for seed in range(trials):
        ours += roc_downsample(np.zeros(16), rewards, pe, None, cfg, seed=seed).keep[:8]
    w = 1 / (penalties + 0.1)
    rng = np.random.default_rng(12345)
    ref = np.zeros(8)
    for _ in range(trials):
        ref[rng.choice(8, size=4, replace=False, p=w / w.sum())] += 1
    assert np.abs(ours / trials - ref / trials).max() < 0.04
    freq = ours / trials
    assert freq[0] > freq[2] > freq[4] > freq[6] > freq[7]  # lower penalty, kept more often
    assert freq[:2].mean() > 0.9 and freq[7] < 0.25


def test_weighted_single_pick_probability_is_proportional_to_weight():
    # 2 positives (penalty 0 and 1) and 2 negatives, G = 2 -> one positive; P(first) = 10 / (10 + 1/1.1)
    expected = 10 / (10 + 1 / 1.1)
    hits = sum(roc_downsample(np.zeros(4), [1, 1, 0, 0], [0.0, 1.0, 0, 0], None, seed=s, down_sample_to_n=2,
                              min_zero_reward_trace_num=1, min_non_zero_reward_trace_num=1,
                              roc_answer_format=False).keep[0] for s in range(4000))
    assert abs(hits / 4000 - expected) < 0.02  # std 0.0044: tolerance over 4 sigma


def test_excluded_rollouts_are_dropped_before_selection():
    # group of 8: 4 right, 4 wrong; two of the right ones lost a tool call to the sandbox's infrastructure
    rewards = np.r_[np.ones(4), np.zeros(4)]
    excluded = np.zeros(8, dtype=bool)
    excluded[[0, 1]] = True
    sel = roc_downsample(np.zeros(8), rewards, np.zeros(8), np.zeros(8), seed=3, down_sample_to_n=4,
                         keep_small_groups=True, excluded=excluded)
    assert (sel.reason[:2] == RoCReason.DROPPED_TOOL_INFRA).all() and not sel.keep[:2].any()
    # the other six are selected as if the two had never been generated: 2 right + 4 wrong -> G=4: 2 + 2
    assert sel.keep[2:4].sum() == 2 and sel.keep[4:].sum() == 2
    same = roc_downsample(np.zeros(6), rewards[2:], np.zeros(6), np.zeros(6), seed=3, down_sample_to_n=4,
                          keep_small_groups=True)
    assert (sel.keep[2:] == same.keep).all()
    # excluding leaves a group all wrong: it is rejected as equal-reward, like any other
    excluded[[2, 3]] = True
    sel = roc_downsample(np.zeros(8), rewards, np.zeros(8), np.zeros(8), seed=3, excluded=excluded)
    assert not sel.keep.any() and (sel.reason[4:] == RoCReason.DROPPED_EQUAL_REWARD).all()
    with pytest.raises(ValueError, match="excluded has shape"):
        roc_downsample(np.zeros(8), rewards, np.zeros(8), np.zeros(8), seed=3, excluded=[True])


def test_excluded_apply_with_down_sampling_off():
    sel = roc_downsample(["a", "a", "b"], [1.0, 0.0, 1.0], seed=0, mode="grpo", down_sample_to_n=0,
                         reject_equal_reward=False, excluded=[False, True, False])
    assert sel.keep.tolist() == [True, False, True]
    assert sel.group.tolist() == [0, 0, 1]


# --------------------------------------------------------------------------------------------------
# the ablation modes: what each samples and trains per prompt


@pytest.mark.parametrize("mode, sampled, trained", [("roc", 8, 4), ("random", 8, 4), ("grpo", 4, 4)])
def test_each_mode_samples_and_trains_its_counts(mode, sampled, trained):
    from rstar_hpc.algo.metrics import roc_metrics
    from rstar_hpc.config import load_config

    cfg = load_config("demo", [f"algo.roc.mode={mode}"])
    assert (cfg.algo.samples_per_prompt, cfg.algo.trained_per_prompt) == (sampled, trained)
    rng = np.random.default_rng(0)
    groups = 64
    ids = np.repeat(np.arange(groups), sampled)
    rewards = (rng.random(ids.size) < 0.5).astype(float)
    p_err = rng.random(ids.size) * 0.5
    sel = roc_downsample(ids, rewards, p_err, np.zeros(ids.size), cfg.algo.roc, seed=1)
    per_group = np.bincount(ids[sel.keep], minlength=groups)
    mixed = np.bincount(ids, weights=rewards) % sampled != 0   # groups with both right and wrong answers
    assert (per_group[mixed] == trained).all() and (per_group[~mixed] == 0).all()
    m = roc_metrics(sel, rewards, p_err)
    assert m["roc/sampled_per_group"] == sampled and m["roc/trained_per_group"] == trained
    assert m["roc/groups_trained"] == mixed.sum()


def test_random_mode_ignores_rewards_and_penalties():
    """RoC keeps clean positives first; random keeps each rollout with probability G / 2G whatever it is."""
    rewards, p_err = np.array([1.0] * 4 + [0.0] * 4), np.array([0.0, 0.0, 1.0, 1.0] + [0.5] * 4)
    picks = {m: np.zeros(8) for m in ("roc", "random")}
    for seed in range(400):
        for m in picks:
            picks[m] += roc_downsample(np.zeros(8), rewards, p_err, np.zeros(8), mode=m, down_sample_to_n=4,
                                       min_zero_reward_trace_num=0, min_non_zero_reward_trace_num=0,
                                       seed=seed).keep
    rate = picks["random"] / 400
    assert np.all(np.abs(rate - 0.5) < 0.1), rate
    assert picks["roc"][:2].mean() > 1.5 * picks["roc"][2:4].mean()   # RoC prefers the error-free positives


def test_public_switch_off_names_the_fair_replacement():
    from rstar_hpc.config.algo import RoCConfig

    assert RoCConfig.model_validate({"do_down_sampling": True}).mode == "roc"
    with pytest.raises(pydantic.ValidationError, match="mode: grpo"):
        RoCConfig.model_validate({"do_down_sampling": False})
