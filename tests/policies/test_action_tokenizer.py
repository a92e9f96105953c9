"""OpenVLA's action tokenizer and un-normalisation (issue 5, part 1)."""

import numpy as np
import pytest
import torch

from m2flow.policies.action_tokenizer import ActionStats, ActionTokenizer


def test_round_trip_is_within_half_an_interval_and_uses_the_last_256_ids():
    tok = ActionTokenizer(vocab_size=32000)
    x = torch.rand(10_000, 7) * 2 - 1
    ids = tok.encode(x)
    assert ids.min() >= 32000 - 256 and ids.max() <= 31999
    half = 1.0 / 255  # half of one of the 255 intervals between 256 edges over [-1, 1]
    assert (tok.decode(ids) - x).abs().max() <= half + 1e-6


def test_encoding_matches_openvlas_numpy_digitize():
    tok = ActionTokenizer(vocab_size=500)
    x = np.random.default_rng(0).uniform(-1.2, 1.2, 1000)
    edges = np.linspace(-1, 1, 256)
    expected = 500 - np.digitize(np.clip(x, -1, 1), edges)
    assert np.array_equal(tok.encode(torch.from_numpy(x)).numpy(), expected)
    centers = (edges[:-1] + edges[1:]) / 2
    decoded = centers[np.clip(500 - expected - 1, 0, 254)]
    assert np.allclose(tok.decode(torch.from_numpy(expected)).numpy(), decoded, atol=1e-6)


def test_unnormalize_respects_the_mask_and_inverts_normalize():
    stats = ActionStats(q01=[-0.5, 0.0, -2.0], q99=[0.5, 4.0, 2.0], mask=[True, True, False])
    x = torch.tensor([[-1.0, 1.0, 0.3], [0.0, 0.0, -1.0]])
    a = stats.unnormalize(x)
    assert torch.allclose(a, torch.tensor([[-0.5, 4.0, 0.3], [0.0, 2.0, -1.0]]))
    assert torch.allclose(stats.normalize(a), x)


def test_stats_from_openvla_json_names_known_keys():
    stats = {"libero_spatial_no_noops": {"action": {"q01": [0.0], "q99": [1.0], "mask": [True]}}}
    assert ActionStats.from_openvla(stats, "libero_spatial_no_noops").q99 == [1.0]
    with pytest.raises(KeyError, match="libero_spatial_no_noops"):
        ActionStats.from_openvla(stats, "bridge_orig")
