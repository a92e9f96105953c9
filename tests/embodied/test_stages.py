"""The stage scheduler: envs -> env groups -> S contiguous stages, hand-worked."""

import pytest

from m2flow.embodied.workers.stages import offsets, stage_groups, stage_sizes


def test_sizes_are_as_even_as_possible_with_the_first_ones_larger():
    assert stage_sizes(7, 1) == [7]
    assert stage_sizes(7, 2) == [4, 3]
    assert stage_sizes(7, 3) == [3, 2, 2]
    assert stage_sizes(8, 4) == [2, 2, 2, 2]
    assert stage_sizes(5, 5) == [1, 1, 1, 1, 1]


@pytest.mark.parametrize("groups", range(1, 7))
def test_every_stage_count_covers_each_group_once_in_order(groups):
    for stages in range(1, groups + 1):
        plan = stage_groups(groups, stages)
        assert len(plan) == stages and all(plan)
        assert [g for stage in plan for g in stage] == list(range(groups))  # contiguous


def test_four_groups_as_one_to_four_stages():
    assert stage_groups(4, 1) == [[0, 1, 2, 3]]
    assert stage_groups(4, 2) == [[0, 1], [2, 3]]
    assert stage_groups(4, 3) == [[0, 1], [2], [3]]
    assert stage_groups(4, 4) == [[0], [1], [2], [3]]


def test_offsets_index_the_first_env_of_each_group():
    assert offsets(stage_sizes(7, 3)) == [0, 3, 5]
    assert offsets([4]) == [0]


def test_impossible_counts_name_the_setting_to_change():
    with pytest.raises(ValueError, match=r"staging.pipeline_stages=5 \(or staging.env_groups\) with env.num_envs=4"):
        stage_sizes(4, 5)
    with pytest.raises(ValueError, match="set staging.env_groups >= 3"):
        stage_groups(2, 3)
    with pytest.raises(ValueError):
        stage_groups(2, 0)
