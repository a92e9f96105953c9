"""``combine``: K single-step results into one chunk transition, on any device (issue 13)."""

import torch
from tensordict import TensorDict

from m2flow.envs.chunked import combine

N, K = 4, 5  # envs, steps per chunk


def steps(device: str = "cpu", seed: int = 0) -> list[TensorDict]:
    """K steps of N envs; several episodes end inside the chunk, one env never ends."""
    g = torch.Generator().manual_seed(seed)
    done = torch.rand(K, N, generator=g) < 0.4
    done[:, 0] = False  # env 0: no episode ends in the chunk
    done[1, 1] = done[3, 1] = True  # env 1: two episodes end in it
    truncated = done & (torch.rand(K, N, generator=g) < 0.5)
    success = torch.rand(K, N, generator=g) < 0.5  # the goal reached and left, mid-episode too
    outs = []
    for t in range(K):
        state = torch.rand(N, 2, generator=g)
        outs.append(TensorDict({"obs": {"state": state + 10}, "next": {
            "obs": {"state": state}, "reward": torch.rand(N, generator=g),
            "done": done[t], "terminated": done[t] & ~truncated[t], "truncated": truncated[t],
            "success": success[t]}}, batch_size=[N]).to(device))
    return outs


def test_combine_makes_its_tensors_on_the_inputs_device():
    # meta tensors check device agreement like CUDA ones do: a CPU tensor mixed in raises
    out = combine(steps("meta"))
    for key, v in out.items(include_nested=True, leaves_only=True):
        assert v.device.type == "meta", key
    assert out["next", "obs", "state"].shape == (N, 2)
    assert out["next", "num_steps"].shape == out["next", "reward"].shape == (N,)


def test_combine_matches_a_plain_loop_over_envs_and_steps():
    outs = steps()
    out = combine(outs)
    for i in range(N):
        reward, num_steps, last = 0.0, 0, K - 1
        flags = {f: False for f in ("done", "terminated", "truncated", "success")}
        for t in range(K):  # the chunk's steps up to (and including) the first episode end
            nxt = outs[t]["next"]
            reward += nxt["reward"][i].item()
            num_steps += 1
            for f in flags:
                flags[f] |= bool(nxt[f][i])
            at_end = bool(nxt["success"][i])  # the flag of the episode's last step so far
            if nxt["done"][i]:
                last = t
                break
        assert bool(out["next", "success_at_end"][i]) == at_end, i
        assert abs(out["next", "reward"][i].item() - reward) < 1e-6, i
        assert out["next", "num_steps"][i].item() == num_steps, i
        assert torch.equal(out["next", "obs", "state"][i], outs[last]["next", "obs", "state"][i])
        assert torch.equal(out["obs", "state"][i], outs[-1]["obs", "state"][i])
        for f, v in flags.items():
            assert bool(out["next", f][i]) == v, (i, f)
        for t in range(K):
            assert out["next", "step_reward"][i, t] == outs[t]["next", "reward"][i]
            assert out["next", "step_done"][i, t] == outs[t]["next", "done"][i]
    assert out["next", "num_steps"][0] == K and out["next", "num_steps"][1] == 2
