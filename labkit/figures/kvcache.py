"""The block table of PagedAttention, drawn from a real KV cache manager
(:ref:`ch03-paged-attention`)."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from labkit.checks import ParameterError
from labkit.kvcache import KVCacheManager, hash_request_blocks

#: More physical blocks than this no longer fit one legible row.
MAX_DRAWN_BLOCKS = 24

_REQUEST_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#8172B3", "#C44E52", "#937860")
_SHARED_COLOR = "#E6B800"
_CACHED_FREE_COLOR = "#D9D9D9"


def shared_prefix_example(block_size: int = 16, num_blocks: int = 12) -> KVCacheManager:
    """A KV cache after the allocations that :numref:`fig-block-table` shows.

    In order: request ``D`` (24 tokens) runs and finishes, so its one full block stays cached
    while nobody holds it; ``A`` (a 32-token system prompt and an 8-token question) is
    prefilled; ``B`` (20 unrelated tokens) is prefilled; ``C`` (the same system prompt, a
    13-token question) takes ``A``'s two system-prompt blocks from the prefix cache and one
    new block; then ``A`` decodes 10 tokens and needs a fourth block. Every step goes through
    :class:`~labkit.kvcache.KVCacheManager`'s own verbs, so the state is the manager's.
    """
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
    system = list(range(1000, 1000 + 2 * block_size))
    finished = list(range(5000, 5000 + block_size + block_size // 2))
    kv.allocate_slots("D", finished, len(finished))
    kv.free("D")
    a = system + list(range(1, 1 + block_size // 2))
    kv.allocate_slots("A", a, len(a))
    b = list(range(3000, 3000 + block_size + 4))
    kv.allocate_slots("B", b, len(b))
    c = system + list(range(2000, 2013))
    hits, num_cached = kv.get_computed_blocks(hash_request_blocks(c, block_size), len(c))
    kv.allocate_slots("C", c, len(c) - num_cached, hits)
    a_decoded = a + list(range(9000, 9010))
    kv.allocate_slots("A", a_decoded, len(a_decoded) - len(a))
    return kv


def block_table_figure(kv: KVCacheManager, request_ids: Sequence[str] | None = None) -> Figure:
    """Each request's block table and the physical blocks it points to
    (:ref:`ch03-paged-attention`).

    Top: one row per request, logical block ``i`` of its sequence with the physical block id
    its table names and how many of the block's slots hold tokens. Bottom: every physical
    block of the pool with its reference count: held by one request (its colour), shared by
    several (gold: a prefix-cache hit), free but still caching a full block (grey), or free
    and empty (white). Arrows go from table entries to blocks. ``request_ids`` defaults to
    every request the manager holds, in the order they were first allocated.
    """
    pool = kv.block_pool
    if kv.num_blocks > MAX_DRAWN_BLOCKS:
        raise ParameterError("kv", f"kv has {kv.num_blocks} blocks; the figure draws at most "
                                   f"{MAX_DRAWN_BLOCKS}")
    request_ids = list(kv.req_to_blocks) if request_ids is None else list(request_ids)
    tables = {rid: kv.get_block_ids(rid) for rid in request_ids}  # raises on an unknown id
    owner_color = {}
    for i, rid in enumerate(request_ids):
        for block_id in tables[rid]:
            owner_color.setdefault(block_id, _REQUEST_COLORS[i % len(_REQUEST_COLORS)])

    width = max(kv.num_blocks, max((len(t) for t in tables.values()), default=0) + 2)
    fig, ax = plt.subplots(figsize=(0.55 * width + 1.5, 0.5 * len(request_ids) + 1.6))
    pool_y = -1.8  # the physical row sits below the tables, arrows run down to it

    for row, rid in enumerate(request_ids):
        color = _REQUEST_COLORS[row % len(_REQUEST_COLORS)]
        y = (len(request_ids) - 1 - row) * 0.9  # the first request on top
        ax.text(-0.3, y + 0.35, f"request {rid}", ha="right", va="center", fontsize=9)
        slots = kv.req_num_slots[rid]
        for logical, block_id in enumerate(tables[rid]):
            filled = min(kv.block_size, slots - logical * kv.block_size)
            ax.add_patch(Rectangle((logical, y), 0.9, 0.7, facecolor="white",
                                   edgecolor=color, linewidth=1.5, zorder=2))
            ax.add_patch(Rectangle((logical, y), 0.9 * filled / kv.block_size, 0.12,
                                   facecolor=color, edgecolor="none", zorder=2))
            ax.text(logical + 0.45, y + 0.42, str(block_id), ha="center", va="center",
                    fontsize=10, fontweight="bold", gid=f"logical:{rid}:{logical}", zorder=3)
            ax.text(logical + 0.45, y + 0.2, f"{filled}/{kv.block_size}", ha="center",
                    va="center", fontsize=6, zorder=3)
            target = block_id + 0.45
            ax.annotate("", xy=(target, pool_y + 0.75), xytext=(logical + 0.45, y),
                        arrowprops=dict(arrowstyle="->", color=color, alpha=0.7, linewidth=1),
                        zorder=1)  # behind the boxes of the rows below

    for block in pool.blocks:
        if block.ref_cnt > 1:
            face = _SHARED_COLOR
        elif block.ref_cnt == 1:
            face = owner_color.get(block.block_id, "#999999")  # held by a request not drawn
        elif block.block_hash is not None:
            face = _CACHED_FREE_COLOR
        else:
            face = "white"
        x = block.block_id
        ax.add_patch(Rectangle((x, pool_y), 0.9, 0.75, facecolor=face, edgecolor="black",
                               alpha=0.85, gid=f"physical:{block.block_id}"))
        ax.text(x + 0.45, pool_y + 0.5, str(block.block_id), ha="center", va="center",
                fontsize=9, fontweight="bold")
        ax.text(x + 0.45, pool_y + 0.18, f"ref {block.ref_cnt}", ha="center", va="center",
                fontsize=6, gid=f"ref:{block.block_id}")

    ax.text(-0.3, pool_y + 0.37, "physical\nblocks", ha="right", va="center", fontsize=9)
    ax.text(-0.3, (len(request_ids) - 1) * 0.9 + 1.1, "logical block:", ha="right",
            va="center", fontsize=7)
    for logical in range(max((len(t) for t in tables.values()), default=0)):
        ax.text(logical + 0.45, (len(request_ids) - 1) * 0.9 + 1.1, str(logical), ha="center",
                va="center", fontsize=7)
    handles = [Rectangle((0, 0), 1, 1, facecolor=_SHARED_COLOR, edgecolor="black"),
               Rectangle((0, 0), 1, 1, facecolor=_CACHED_FREE_COLOR, edgecolor="black"),
               Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="black")]
    ax.legend(handles, ["shared (ref > 1)", "free, prefix still cached", "free, empty"],
              loc="upper right", fontsize=7, frameon=False, ncol=1)
    ax.set_xlim(-2.2, width + 0.2)
    ax.set_ylim(pool_y - 0.3, (len(request_ids) - 1) * 0.9 + 1.4)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"block tables: block_size {kv.block_size}, {kv.num_blocks} physical blocks",
                 fontsize=9)
    fig.tight_layout()
    return fig
