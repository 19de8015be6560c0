"""Reading the trainer's --sample-log: which dataset indices each rank consumed, at which step."""

from __future__ import annotations

import json
from pathlib import Path


def global_order(output: Path, world_size: int, first_step: int, last_step: int) -> list[int]:
    """Rebuild the global order of one segment from its ranks' sample logs (rank r takes every W-th)."""
    per_rank = []
    for rank in range(world_size):
        records = [json.loads(line) for line in (output / f"samples-rank{rank}.jsonl").read_text().splitlines()]
        per_rank.append([index for record in records if first_step <= record["step"] < last_step
                         for index in record["indices"]])
    # An epoch's last global batch may leave ranks uneven shares (at most one sample apart, the lower ranks first).
    longest = max(len(indices) for indices in per_rank)
    assert all(longest - len(indices) <= 1 for indices in per_rank), [len(indices) for indices in per_rank]
    return [indices[i] for i in range(longest) for indices in per_rank if i < len(indices)]
