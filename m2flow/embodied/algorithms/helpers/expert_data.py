"""Expert data: demonstrations as a policy trains on them, for behaviour cloning
(``algorithm=bc``), the demonstration term of PPO and GRPO (``algorithm.demo_coef``) and
RLPD's demonstrations (``algorithm=sac algorithm.demos=``).

Datasets (``algorithm.dataset``):

- an ``.h5`` file written by ``m2flow-demos`` (ManiSkill's trajectory format: groups
  ``traj_<i>`` with ``obs/<key>`` (T+1, ...) and ``actions`` (T, A)); the first
  ``algorithm.num_demos`` episodes (all if None) in episode order, each step's observation with
  the action taken from it;
- a ``.pt`` file written by ``torch.save(td, path)`` of a TensorDict with batch dims (N, T) or
  (B,): ``obs`` (as the env gives them, e.g. ``("obs", "state")`` (..., D)), ``action`` (the
  expert's, (..., A), or (..., K, A) for a policy with action chunks of K), and optionally
  ``valid`` (bool: steps to keep).

Action chunks: a policy that decodes K actions per call (``policy.chunk``, e.g. the OpenVLA-OFT
policy with ``chunk: 8``) is trained on (K, A) targets: the action of the step and of the K - 1
steps after it in the same episode, the last action of the episode repeated past its end (as
openvla-oft's RLDS ``chunk_act_obs`` pads, clamping future indices at the final step). Token
policies (the VLAs: ``policy.actions`` is their ``ActionTokenizer``) read ``action_tokens`` in
``evaluate_actions``: the expert's action bins, normalised by the policy's statistics first
(``policy.stats``, none for the tiny presets, whose actions are the env's [-1, 1]), computed
here once from the targets.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from tensordict import TensorDict

from m2flow import keys
from m2flow.embodied.algorithms.base import AlgorithmError

HDF5_SUFFIXES = (".h5", ".hdf5")


class ExpertData:
    """Demonstrations as a policy trains on them: read once (an m2flow-demos .h5 file's first
    ``num_demos`` episodes without their no-op steps, or a flat .pt batch), then the flat
    (M,) targets for the policy at hand (action chunks of its ``chunk``; for a token policy,
    its action tokens) built at the first :meth:`sample`. ``field`` and ``options`` name the
    config fields of the dataset and of the two arguments in errors (``algorithm.<field>``)."""

    def __init__(self, dataset: str, action_dim: int, *, num_demos: Optional[int] = None,
                 noop_threshold: float = 0.0, field: str = "dataset",
                 options: tuple[str, str] = ("num_demos", "noop_threshold")):
        self.dataset, self.action_dim, self.field = dataset, action_dim, field
        self.checked = False
        if Path(dataset).suffix in HDF5_SUFFIXES:
            kept = (drop_noops(ep, noop_threshold)
                    for ep in read_demos(dataset, action_dim, num_demos, field=field))
            self.episodes: Optional[list] = [ep for ep in kept if ep.shape[0] > 0]
            self.data: Optional[TensorDict] = None  # (M,): built for the policy's chunk
        elif num_demos is not None or noop_threshold > 0:
            name, value = ((options[0], num_demos) if num_demos is not None
                           else (options[1], noop_threshold))
            raise AlgorithmError(
                f"algorithm.{name}={value}: reads the episodes of an .h5 dataset "
                f"(m2flow-demos'); algorithm.{field}={dataset!r} is a flat .pt batch. Drop "
                f"{name} or point the dataset at an .h5 file.")
        else:
            self.episodes, self.data = None, load_dataset(dataset, action_dim, field=field)

    def sample(self, policy, n: int, gen: torch.Generator) -> TensorDict:
        """``n`` rows of the targets (without replacement while there are enough), drawn
        with ``gen``; on the CPU."""
        if self.data is None or not self.checked or _needs_tokens(policy, self.data):
            self.data = self._targets(policy)
            self.checked = True  # a .pt batch's action shape against the policy's chunk
        m = self.data.shape[0]
        if n <= m:
            idx = torch.randperm(m, generator=gen)[:n]
        else:  # a dataset smaller than a batch: with replacement
            idx = torch.randint(m, (n,), generator=gen)
        return self.data[idx]

    def _targets(self, policy) -> TensorDict:
        """The flat dataset (M,) with the targets ``policy`` trains on."""
        chunk = int(getattr(policy, "chunk", 1))
        where = f"algorithm.{self.field}={self.dataset!r}"
        if self.data is None:
            data = flatten_demos(self.episodes, chunk)
            self.episodes = None
        else:
            data = self.data
            shape = data[keys.ACTION].shape
            if chunk > 1 and (len(shape) != 3 or shape[1] != chunk):
                raise AlgorithmError(
                    f"{where}: actions of shape {list(shape[1:])} per step; the policy decodes "
                    f"chunks of {chunk}, so a .pt dataset needs action (..., {chunk}, "
                    f"{self.action_dim}), or use an .h5 dataset of whole episodes.")
        if getattr(policy, "state_aux", None) is not None and \
                keys.leaf(keys.PRIVILEGED) not in data[keys.OBS].keys():
            raise AlgorithmError(
                f"{where} holds no obs/privileged (the simulator state), which "
                f"policy.state_aux's loss predicts; record the demos with m2flow-demos "
                "env.privileged_state=true, or set policy.state_aux=0.")
        if _needs_tokens(policy, data):
            data[keys.ACTION_TOKENS] = action_bins(policy, data[keys.ACTION])
        return data


# -- action tokens ------------------------------------------------------------------------


def _needs_tokens(policy, data: TensorDict) -> bool:
    from m2flow.policies.action_tokenizer import ActionTokenizer

    return (isinstance(getattr(policy, "actions", None), ActionTokenizer)
            and keys.ACTION_TOKENS not in data.keys())


def action_bins(policy, action: torch.Tensor,
                noise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A token policy's action bins (M, K*A) int64 for expert actions (M, A) or (M, K, A):
    normalised by ``policy.stats`` (if any), plus ``noise`` (the actions' shape; in that
    normalised space), then OpenVLA's tokenizer (which clips to [-1, 1]); the bin index k is
    the policy's logit index (token id ``policy.actions.first_id + k``), as its ``act``
    samples.

    >>> from types import SimpleNamespace
    >>> from m2flow.policies.action_tokenizer import ActionTokenizer
    >>> vla = SimpleNamespace(actions=ActionTokenizer(1000), stats=None, gripper=None)
    >>> action_bins(vla, torch.tensor([[-1.0, 0.0, 1.0]])).tolist()
    [[255, 128, 0]]
    """
    if getattr(policy, "gripper", None) is not None:
        raise AlgorithmError(
            "algorithm=bc: the policy converts its decoded gripper action (policy.gripper), "
            "which cannot be inverted to tokens; use policy.gripper=as_is.")
    tok = policy.actions
    a = action.reshape(action.shape[0], -1, action.shape[-1])  # (M, K, A)
    if getattr(policy, "stats", None) is not None:
        a = policy.stats.normalize(a)
    if noise is not None:
        a = a + noise.reshape(a.shape)
    return (tok.encode(a) - tok.first_id).reshape(a.shape[0], -1)  # (M, K*A)


# -- datasets -------------------------------------------------------------------------------


def read_demos(path: str, action_dim: int, num_demos: Optional[int] = None, *,
               transitions: bool = False, field: str = "dataset") -> list[TensorDict]:
    """The first ``num_demos`` episodes (all if None) of an m2flow-demos .h5 file, in episode
    order, each a TensorDict (T,) of ``obs`` (the observation each action was taken from) and
    ``action`` (T, A), on the CPU; with ``transitions`` also what followed each action, as a
    replay buffer's rows hold it (``next``: ``obs``, ``reward``, ``terminated``,
    ``truncated``). A missing or malformed file is one AlgorithmError naming
    ``algorithm.<field>``."""
    import h5py

    where = f"algorithm.{field}={path!r}"
    file = Path(path).expanduser()
    if not file.is_file():
        raise AlgorithmError(f"{where}: no such file; write one with m2flow-demos (e.g. "
                             "m2flow-demos env=maniskill_pushcube_rgb demos.output=demos/x).")
    try:
        f = h5py.File(file, "r")
    except OSError as e:
        raise AlgorithmError(f"{where}: cannot be read as HDF5 ({e}); write it with "
                             "m2flow-demos.") from None
    with f:
        names = sorted((k for k in f.keys() if k.startswith("traj_")),
                       key=lambda k: int(k.split("_", 1)[1]))
        names = _episode_order(file, names)
        if not names:
            raise AlgorithmError(f"{where} holds no traj_<i> episodes; write it with m2flow-demos.")
        if num_demos is not None and num_demos > len(names):
            raise AlgorithmError(f"algorithm.num_demos={num_demos}: {where} holds "
                                 f"{len(names)} episodes; use at most that many.")
        episodes = [_episode(f[name], where, name, transitions) for name in names[:num_demos]]
    dims = episodes[0][keys.ACTION].shape[-1]
    if dims != action_dim:
        raise AlgorithmError(f"{where}: actions have {dims} dims, the env's have {action_dim}; "
                             "record the dataset on this env and control mode.")
    return episodes


def _episode_order(file: Path, names: list) -> list:
    """The episodes the JSON beside the file lists, in its order (ManiSkill's convention);
    without that JSON, ``names`` (by index)."""
    meta = file.with_suffix(".json")
    if not meta.is_file():
        return names
    listed = [f"traj_{e['episode_id']}" for e in json.loads(meta.read_text()).get("episodes", [])]
    return [n for n in listed if n in set(names)] or names


def _episode(group, where: str, name: str, transitions: bool = False) -> TensorDict:
    if "obs" not in group or "actions" not in group:
        raise AlgorithmError(f"{where}: {name} has {sorted(group.keys())}; an episode needs "
                             "obs and actions (write the dataset with m2flow-demos).")
    action = torch.as_tensor(group["actions"][:], dtype=torch.float32)  # (T, A)
    t = action.shape[0]
    obs = {k: torch.as_tensor(group["obs"][k][:t]) for k in group["obs"].keys()}  # (T, ...)
    if any(v.shape[0] != t for v in obs.values()):
        raise AlgorithmError(f"{where}: {name} has fewer observations than actions.")
    out = TensorDict({keys.OBS: TensorDict(obs, batch_size=[t]), keys.ACTION: action},
                     batch_size=[t])
    if transitions:
        out[keys.NEXT] = _what_followed(group, where, name, t)
    return out


def _what_followed(group, where: str, name: str, t: int) -> TensorDict:
    """Of each of an episode's ``t`` actions: the observation, reward and flags after it."""
    missing = [k for k in ("rewards", "terminated", "truncated") if k not in group]
    if missing:
        raise AlgorithmError(f"{where}: {name} has no {', '.join(missing)} (a dataset written "
                             "before m2flow-demos recorded rewards); record it again with "
                             "m2flow-demos.")
    nxt = {k: torch.as_tensor(group["obs"][k][1 : t + 1]) for k in group["obs"].keys()}
    if any(v.shape[0] != t for v in nxt.values()):
        raise AlgorithmError(f"{where}: {name} lacks the observation after its last action.")
    return TensorDict({
        keys.OBS: TensorDict(nxt, batch_size=[t]),
        keys.leaf(keys.REWARD): torch.as_tensor(group["rewards"][:t], dtype=torch.float32),
        keys.leaf(keys.TERMINATED): torch.as_tensor(group["terminated"][:t], dtype=torch.bool),
        keys.leaf(keys.TRUNCATED): torch.as_tensor(group["truncated"][:t], dtype=torch.bool),
    }, batch_size=[t])


def drop_noops(episode: TensorDict, threshold: float) -> TensorDict:
    """``episode`` (T,) without its no-op steps: the arm's action (all dims but the last) of
    L2 norm below ``threshold`` with the gripper's (the last dim) as the step before's (the
    first step's "before" is the episode's first gripper command); unchanged for 0.

    >>> ep = TensorDict({"action": torch.tensor([[0.0, 0.0, 1.0], [0.5, 0.0, 1.0],
    ...                                          [0.001, 0.0, 1.0], [0.0, 0.0, -1.0]])}, [4])
    >>> drop_noops(ep, 0.01)["action"].tolist()
    [[0.5, 0.0, 1.0], [0.0, 0.0, -1.0]]
    """
    if threshold <= 0:
        return episode
    action = episode[keys.ACTION]  # (T, A)
    still = action[:, :-1].norm(dim=-1) < threshold
    grip = action[:, -1]
    same_grip = grip == torch.cat([grip[:1], grip[:-1]])
    return episode[~(still & same_grip)]


def flatten_demos(episodes: list[TensorDict], chunk: int = 1) -> TensorDict:
    """Episodes (T_e,) -> one flat TensorDict (M,), M = sum T_e: ``obs`` and ``action`` (M, A),
    or with ``chunk`` K > 1 ``action`` (M, K, A): the actions of steps t .. t+K-1 of the same
    episode, its last action repeated past its end.

    >>> ep = TensorDict({"obs": TensorDict({"state": torch.zeros(3, 1)}, [3]),
    ...                  "action": torch.tensor([[1.0], [2.0], [3.0]])}, [3])
    >>> flatten_demos([ep], chunk=2)["action"].squeeze(-1).tolist()
    [[1.0, 2.0], [2.0, 3.0], [3.0, 3.0]]
    """
    if chunk > 1:
        chunked = []
        for ep in episodes:
            t = ep.shape[0]
            idx = (torch.arange(t)[:, None] + torch.arange(chunk)[None]).clamp(max=t - 1)  # (T, K)
            ep = ep.clone(recurse=False)
            ep[keys.ACTION] = ep[keys.ACTION][idx]  # (T, K, A)
            chunked.append(ep)
        episodes = chunked
    return torch.cat(episodes, dim=0)


def load_dataset(path: str, action_dim: int, *, num_demos: Optional[int] = None,
                 chunk: int = 1, field: str = "dataset") -> TensorDict:
    """The dataset at ``path`` as a flat (M,) TensorDict of its valid steps, on the CPU: an
    m2flow-demos .h5 file (its first ``num_demos`` episodes, action chunks of ``chunk``) or a
    .pt TensorDict; a missing or malformed file is one AlgorithmError naming algorithm.dataset."""
    if Path(path).suffix in HDF5_SUFFIXES:
        return flatten_demos(read_demos(path, action_dim, num_demos, field=field), chunk)
    where = f"algorithm.{field}={path!r}"
    if not Path(path).expanduser().is_file():
        raise AlgorithmError(
            f"{where}: no such file; point it at an .h5 file written by m2flow-demos, or a .pt "
            "file saved with torch.save(TensorDict({'obs': ..., 'action': ...}, batch_size), "
            "path).")
    try:
        # a TensorDict is a pickled object, not plain tensors: the file must be trusted
        data = torch.load(Path(path).expanduser(), map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
        raise AlgorithmError(f"{where}: cannot be read by torch.load ({type(e).__name__}: "
                             f"{e}); save the dataset with torch.save(tensordict, path).") from None
    if not isinstance(data, TensorDict):
        raise AlgorithmError(f"{where} holds a {type(data).__name__}, not a TensorDict; save "
                             "TensorDict({'obs': ..., 'action': ...}, batch_size) instead.")
    missing = [k for k in (keys.OBS, keys.ACTION) if k not in data.keys()]
    if missing or data.batch_dims not in (1, 2):
        raise AlgorithmError(f"{where} has keys {sorted(data.keys())} and batch dims "
                             f"{list(data.batch_size)}; it needs 'obs' and 'action' with batch "
                             "dims (N, T) or (B,).")
    flat = data.reshape(-1)  # (M,)
    if flat[keys.ACTION].shape[-1] != action_dim:
        raise AlgorithmError(f"{where}: actions have {flat[keys.ACTION].shape[-1]} dims, the "
                             f"env's have {action_dim}; record the dataset on this env.")
    if keys.VALID in flat.keys():
        flat = flat[flat[keys.VALID].bool()]
    if flat.shape[0] == 0:
        raise AlgorithmError(f"{where} holds no valid steps.")
    return flat
