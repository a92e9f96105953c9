"""Groups of completions and the micro-batches the learner builds from them."""

from __future__ import annotations

import torch
from tensordict import TensorDict


def collate(rows: list[TensorDict], pad_id: int) -> TensorDict:
    """Concatenates completion batches whose prompts were padded to different widths:
    prompts are left-padded again to the widest."""
    width = max(r["prompt_ids"].shape[1] for r in rows)
    parts = []
    for r in rows:
        extra = width - r["prompt_ids"].shape[1]
        r = r.clone(recurse=False)
        if extra:
            b = r.batch_size[0]
            r["prompt_ids"] = torch.cat(
                [torch.full((b, extra), pad_id, dtype=torch.long), r["prompt_ids"]], 1)
            r["prompt_mask"] = torch.cat(
                [torch.zeros(b, extra, dtype=torch.bool), r["prompt_mask"]], 1)
        parts.append(r)
    return torch.cat(parts, 0)


def sequences(batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(input ids, attention mask, completion start) of prompt + completion."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1).long()
    return ids, mask, batch["prompt_ids"].shape[1]
