"""Groups of completions and the micro-batches the learner builds from them."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from m2flow import keys


def collate(rows: list[TensorDict], pad_id: int) -> TensorDict:
    """Concatenates completion batches whose prompts were padded to different widths:
    prompts are left-padded again to the widest."""
    width = max(r[keys.PROMPT_IDS].shape[1] for r in rows)
    parts = []
    for r in rows:
        extra = width - r[keys.PROMPT_IDS].shape[1]
        r = r.clone(recurse=False)
        if extra:
            b = r.batch_size[0]
            r[keys.PROMPT_IDS] = torch.cat(
                [torch.full((b, extra), pad_id, dtype=torch.long), r[keys.PROMPT_IDS]], 1)
            r[keys.PROMPT_MASK] = torch.cat(
                [torch.zeros(b, extra, dtype=torch.bool), r[keys.PROMPT_MASK]], 1)
        parts.append(r)
    return torch.cat(parts, 0)


def sequences(batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(input ids, attention mask, completion start) of prompt + completion."""
    ids = torch.cat([batch[keys.PROMPT_IDS], batch[keys.COMPLETION_IDS]], 1)
    mask = torch.cat([batch[keys.PROMPT_MASK], batch[keys.COMPLETION_MASK]], 1).long()
    return ids, mask, batch[keys.PROMPT_IDS].shape[1]
