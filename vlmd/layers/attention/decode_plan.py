"""How a step's decodes read their cached contexts: few kernel calls, no whole-context copy.

A decode's context (its own new token included) is split into disjoint parts, each attended
without a mask and merged exactly by log-sum-exp (``cpu_paged._merge``):

- a **shared prefix**: leading blocks that several decodes have in common (the prefix
  cache hands every request of the same image and prompt the same blocks). All their
  queries are stacked and attend to those blocks in one call, so the prefix is read once
  per step instead of once per decode ("cascade" attention);
- **long runs**: ranges of consecutive blocks of at least ``MIN_VIEW_TOKENS`` tokens, which
  are plain views of the cache, attended in place, one call per run;
- the **leftover**: the partly used last block (it holds the token just written), unless
  it directly follows a long run (then it extends that run), and the short scattered
  ranges. Every decode's leftover is gathered into one padded
  ``[B, L]`` batch and attended in one masked call: decode tails grow a block at a time
  while other sequences grow too, so they are scattered, and a call per scattered block
  per decode per layer cost more than the whole step's linear layers (profile of the c8
  benchmark). A decode whose leftover exceeds ``MAX_LEFTOVER_TOKENS`` (a very fragmented
  table) has the excess gathered per sequence, a bounded chunk at a time.

Pure bookkeeping over block tables (lists of ints) plus the index tensors the kernels need.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlmd.layers.attention.segments import GATHER_CHUNK_TOKENS, MIN_VIEW_TOKENS, slot_ranges

# Decodes share a prefix call when they have at least this many tokens of blocks in common.
MIN_SHARED_TOKENS = 64
# Per decode, at most this many leftover tokens go into the padded batch (its width is the
# longest leftover, so one fragmented table must not widen every row).
MAX_LEFTOVER_TOKENS = 256


@dataclass
class SharedPrefix:
    rows: list[int]  # decode rows that share it
    ranges: list[tuple[int, int]]  # slot ranges of the shared blocks
    index: torch.Tensor = field(init=False)  # ``rows`` as a tensor, built once per step

    def __post_init__(self):
        self.index = torch.tensor(self.rows, dtype=torch.long)


@dataclass
class DecodePlan:
    shared: list[SharedPrefix] = field(default_factory=list)
    views: list[tuple[int, int, int]] = field(default_factory=list)  # (row, first slot, end slot)
    gathers: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (row, slots) beyond the leftover
    leftover_rows: list[int] = field(default_factory=list)  # decodes with a leftover (most of them)
    leftover_index: torch.Tensor | None = None  # ``leftover_rows`` as a tensor
    leftover_slots: torch.Tensor | None = None  # [R, L] their slots, padded with slot 0
    leftover_valid: torch.Tensor | None = None  # [R, 1, 1, L] True where a slot is real
    _staged: dict = field(default_factory=dict)

    def leftover_inputs(self, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The padded slots and the additive mask (0 or -inf, in the queries' dtype) on the
        cache's device: built once per step, reused by every layer. (The plan is built on
        the host, after the step's tensors were staged, hence the move here.)"""
        key = (dtype, device)
        if key not in self._staged:
            valid = self.leftover_valid.to(device)
            mask = torch.zeros(valid.shape, dtype=dtype, device=device).masked_fill_(~valid, float("-inf"))
            self._staged[key] = (self.leftover_slots.to(device), mask)
        return self._staged[key]


def plan_decodes(tables: list[list[int]], lengths: list[int], block_size: int) -> DecodePlan:
    """``tables[i]``: decode i's block table; ``lengths[i]``: its context, own token included."""
    plan = DecodePlan()
    # Blocks before the last used one are full: only those can be shared or viewed.
    full = [(length - 1) // block_size for length in lengths]
    shared_blocks = [0] * len(tables)
    for rows, count in shared_groups(tables, full, list(range(len(tables))), 0, block_size):
        plan.shared.append(SharedPrefix(rows, slot_ranges(tables[rows[0]][:count], count * block_size, block_size)))
        for row in rows:
            shared_blocks[row] = count
    leftovers: list[list[int]] = []
    for row, (table, length) in enumerate(zip(tables, lengths)):
        first, last = shared_blocks[row], full[row]
        tail = table[last] * block_size
        tail_end = tail + length - last * block_size
        ranges = slot_ranges(table[first:last], (last - first) * block_size, block_size)
        # The last block right after a long run (a prompt's blocks, then the next one the
        # pool handed out) is read as part of that run: one call less, no merge.
        extended = next(
            (i for i, (start, end) in enumerate(ranges) if end == tail and end - start >= MIN_VIEW_TOKENS), None
        )
        leftover = [] if extended is not None else list(range(tail, tail_end))
        excess: list[int] = []
        for index, (start, end) in enumerate(ranges):
            if index == extended:
                plan.views.append((row, start, tail_end))
            elif end - start >= MIN_VIEW_TOKENS:
                plan.views.append((row, start, end))
            elif len(leftover) + end - start <= MAX_LEFTOVER_TOKENS:
                leftover.extend(range(start, end))
            else:
                excess.extend(range(start, end))
        for piece in torch.tensor(excess, dtype=torch.long).split(GATHER_CHUNK_TOKENS) if excess else ():
            plan.gathers.append((row, piece))
        if leftover:
            plan.leftover_rows.append(row)
            leftovers.append(leftover)
    if leftovers:
        plan.leftover_index = torch.tensor(plan.leftover_rows, dtype=torch.long)
        width = max(len(slots) for slots in leftovers)
        padded = [slots + [0] * (width - len(slots)) for slots in leftovers]
        plan.leftover_slots = torch.tensor(padded, dtype=torch.long)
        counts = torch.tensor([len(slots) for slots in leftovers])
        plan.leftover_valid = (torch.arange(width).unsqueeze(0) < counts.unsqueeze(1)).view(len(leftovers), 1, 1, width)
    return plan


def shared_groups(tables, full, rows, depth, block_size):
    """Groups of >= 2 decodes (among ``rows``, which agree on blocks [0, depth)) with at
    least ``MIN_SHARED_TOKENS`` of leading full blocks in common: (rows, shared blocks).

    One level only: a decode is in at most one group. Where the rows agree on too few
    blocks, they are split by the first block they disagree on and each part is tried on
    its own (so two requests of one image still share, whatever a third one holds).
    """
    rows = [row for row in rows if full[row] > depth]
    if len(rows) < 2:
        return []
    reference = tables[rows[0]]
    common = min(full[row] for row in rows)
    for row in rows[1:]:
        table = tables[row]
        agreed = depth
        while agreed < common and table[agreed] == reference[agreed]:
            agreed += 1
        common = agreed
    if common * block_size >= MIN_SHARED_TOKENS:
        return [(rows, common)]
    by_block: dict[int, list[int]] = {}  # rows whose table goes on past block ``common``, by that block
    for row in rows:
        if full[row] > common:
            by_block.setdefault(tables[row][common], []).append(row)
    groups = []
    for members in by_block.values():
        groups.extend(shared_groups(tables, full, members, common + 1, block_size))
    return groups
