"""SGLang's RadixAttention cache: a radix tree over token ids (:ref:`ch03-paged-attention`).

Where vLLM names whole blocks by chained hashes, SGLang keeps every cached sequence in a radix
tree whose edges are runs of token ids and whose values are the KV slots of those tokens, one
slot per token. A new request walks the tree to find its longest cached prefix, splitting an
edge where the match ends inside it. Running requests lock their path; when slots run out, the
least recently used unlocked leaves are evicted first.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from labkit.checks import ParameterError, positive_int


@dataclass(eq=False)
class TreeNode:
    """An edge of the tree: its tokens, their KV slots, and the subtree below."""

    key: tuple[int, ...] = ()
    value: list[int] = field(default_factory=list)
    parent: TreeNode | None = None
    children: dict[int, TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0

    def __lt__(self, other: TreeNode) -> bool:  # heap order: least recently used first
        return self.last_access < other.last_access


class RadixCache:
    """A radix tree of cached sequences over ``capacity`` KV token slots."""

    def __init__(self, capacity: int) -> None:
        positive_int("capacity", capacity)
        self.capacity = capacity
        self.free_slots = list(range(capacity - 1, -1, -1))
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root is never evicted
        self._clock = itertools.count(1)
        self.evictable_size = 0  # cached tokens on unlocked paths
        self.protected_size = 0  # cached tokens on locked paths

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], TreeNode]:
        """KV slots of the longest cached prefix of ``token_ids``, and the node it ends at."""
        node, _, slots = self._walk(token_ids)
        return slots, node

    def insert(self, token_ids: Sequence[int], slots: Sequence[int]) -> int:
        """Cache ``token_ids`` with their KV ``slots``; returns how many were cached already.

        The caller owns the slots of the already-cached part and should free its copies.
        """
        if len(token_ids) != len(slots):
            raise ParameterError("slots", f"slots must be one per token: {len(token_ids)} "
                                          f"tokens but {len(slots)} slots")
        node, matched, _ = self._walk(token_ids)
        if matched < len(token_ids):
            leaf = TreeNode(tuple(token_ids[matched:]), list(slots[matched:]), node,
                            last_access=node.last_access)
            node.children[token_ids[matched]] = leaf
            self.evictable_size += len(leaf.key)  # a new leaf is unlocked
        return matched

    def _walk(self, token_ids: Sequence[int]) -> tuple[TreeNode, int, list[int]]:
        """Follow ``token_ids`` down the tree, splitting the edge where they diverge inside it.

        Returns the deepest node reached, how many tokens matched, and their slots; every node
        on the way is marked as used now (LRU order).
        """
        node, matched, slots = self.root, 0, []
        now = next(self._clock)
        node.last_access = now
        while matched < len(token_ids) and token_ids[matched] in node.children:
            child = node.children[token_ids[matched]]
            n = _common_length(child.key, token_ids[matched:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            slots.extend(child.value)
            node, matched = child, matched + n
        return node, matched, slots

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect the path from ``node`` to the root while a request uses it."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise ParameterError("node", "node: dec_lock_ref on an unlocked node")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_size -= len(node.key)
                self.evictable_size += len(node.key)
            node = node.parent

    def alloc(self, n: int) -> list[int] | None:
        """Take ``n`` free KV slots, evicting unlocked leaves if needed; None if impossible."""
        if n > len(self.free_slots):
            self.evict(n - len(self.free_slots))
        if n > len(self.free_slots):
            return None
        return [self.free_slots.pop() for _ in range(n)]

    def free(self, slots: Sequence[int]) -> None:
        """Return slots that are not in the tree (a request's duplicates or its uncached tail)."""
        self.free_slots.extend(slots)

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots from least recently used unlocked leaves."""
        leaves = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            leaf = heapq.heappop(leaves)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            self.free_slots.extend(leaf.value)
            self.evictable_size -= len(leaf.key)
            freed += len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return freed

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child``'s edge after ``n`` tokens; return the new upper node."""
        upper = TreeNode(child.key[:n], child.value[:n], child.parent, {child.key[n]: child},
                         child.lock_ref, child.last_access)
        child.parent.children[child.key[0]] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        return upper

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.root:
                yield node


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
