"""The prefix cache's host side: a radix tree over token prefixes whose nodes are the checkpoints
of the device pool (`spec.prefix`), one pool entry each. Host bookkeeping only: no JAX here.

A node at n tokens (n > 0) stands for the slot state after tokens 0..n-1 together with the NEXTN
cache row n-1, the pair (h_{n-1}, token_n): it is valid for a prompt that agrees on tokens 0..n,
so its key from the root is tokens[0 : n + 1]. Each node's edge label holds the part of that key
its parent's does not: tokens[0 : n + 1] under the root, tokens[p + 1 : n + 1] under a node at p.
Nodes sit on the grid n = I, 2I, ... (I the interval, a page of the pool), each owning the page of
rows [n - I, n); a leaf may also sit between two grid points (a finished request's checkpoint):
its page holds rows [I * floor(n / I), n), and it never has children (a later checkpoint on the
grid hangs from the grid node above it). A grid node may hold its page only (`state` False: its
entry's KDA states are not those at n): the grid nodes a finished request's leaf hangs below,
written from its slot's rows, whose states at those points nobody kept. A match stops at a node
with a state.

A prompt's match is its longest checkpoint at n < len(prompt): at least one prompt token is left
to prefill, since the first generated token is sampled from the last prompt token's logits.

Eviction: when no entry is free, the least recently used leaf that nobody pins goes. A request
pins the node its slot's state is on (its hit, then each checkpoint it writes) while it prefills,
so that the path a save extends is still there; a restore copies pool -> slot, and JAX runs
programs in dispatch order, so nothing needs pinning after the restore is dispatched."""

from __future__ import annotations

import itertools


class Node:
    __slots__ = ("entry", "n", "parent", "label", "children", "pins", "used", "state")

    def __init__(self, entry, n, parent, label, state=True):
        self.entry, self.n, self.parent, self.label, self.state = entry, n, parent, label, state
        self.children: dict[tuple, Node] = {}
        self.pins, self.used = 0, 0

    def path(self) -> list[int]:
        """The pool entries of the pages from the root's child down to this node."""
        out, node = [], self
        while node.parent is not None:
            out.append(node.entry)
            node = node.parent
        return out[::-1]


class PrefixIndex:
    def __init__(self, entries: int, interval: int):
        if entries < 1 or interval < 1:
            raise ValueError(f"a prefix cache needs at least one entry and an interval >= 1, got {entries}, "
                             f"{interval}")
        self.entries, self.interval = entries, interval
        self.root = Node(None, 0, None, ())
        self._free = list(range(entries - 1, -1, -1))
        self._nodes: dict[int, Node] = {}  # entry -> node
        self._clock = itertools.count(1)
        self.evictions = 0

    @property
    def used(self) -> int:
        return len(self._nodes)

    def _label(self, parent: Node, tokens, n: int) -> tuple:
        return tuple(tokens[0 if parent is self.root else parent.n + 1: n + 1])

    def match(self, tokens) -> Node:
        """The node of the longest checkpoint of tokens at n < len(tokens) (the root: none); the
        nodes on its path count as used now."""
        node, best, now, i = self.root, self.root, next(self._clock), self.interval
        while True:
            for c in node.children.values():  # a leaf between grid points
                if c.n % i and best.n < c.n < len(tokens) and c.label == self._label(node, tokens, c.n):
                    best = c
            grid = node.n + i
            child = node.children.get(self._label(node, tokens, grid)) if grid < len(tokens) else None
            if child is None:
                break
            node = child
            if node.state and node.n > best.n:
                best = node
        at = best
        while at is not None:
            at.used = now
            at = at.parent
        return best

    def grid_node(self, tokens, n: int) -> Node:
        """The deepest grid node (with a state or not) on tokens' path at most at n."""
        node, i = self.root, self.interval
        while node.n + i <= n:
            child = node.children.get(self._label(node, tokens, node.n + i)) if node.n + i < len(tokens) else None
            if child is None:
                break
            node = child
        return node

    def insert_chain(self, parent: Node, tokens, n: int) -> list[Node] | None:
        """The checkpoint of tokens at n (< len(tokens)) below the grid node parent, with page-only
        grid nodes between them where missing: the new nodes, top down, whose entries must be
        written (the last holds the state at n); None when no room (what was added stays, page-only,
        evictable)."""
        i, made = self.interval, []
        while parent.n + i < n:
            nxt = parent.n + i
            node = parent.children.get(self._label(parent, tokens, nxt))
            if node is None:
                entry = self._allocate(parent)
                if entry is None:
                    return None
                label = self._label(parent, tokens, nxt)
                node = self._nodes[entry] = parent.children[label] = Node(entry, nxt, parent, label, state=False)
                made.append(node)
            node.used = next(self._clock)
            parent = node
        node, fresh = self.insert(parent, tokens, n)
        if node is None:
            return None
        return made + [node] if fresh else made

    def insert(self, parent: Node, tokens, n: int) -> tuple[Node | None, bool]:
        """The checkpoint of tokens at n (< len(tokens)) under parent, the node at I * ceil(n / I - 1)
        on tokens' path: (node, whether its entry must be written: it is new, or was page-only),
        or (None, False) when every entry is pinned or on a pinned node's path."""
        if not parent.n < n <= parent.n + self.interval or parent.n % self.interval:
            raise ValueError(f"a checkpoint at {n} does not hang from one at {parent.n} (interval {self.interval})")
        label = self._label(parent, tokens, n)
        node = parent.children.get(label)
        fresh = node is None or not node.state  # a page-only node gets its state written too
        if node is None:
            entry = self._allocate(parent)
            if entry is None:
                return None, False
            node = self._nodes[entry] = parent.children[label] = Node(entry, n, parent, label)
        node.state = True
        node.used = next(self._clock)
        return node, fresh

    def _allocate(self, keep: Node) -> int | None:
        if self._free:
            return self._free.pop()
        leaves = [x for x in self._nodes.values() if not x.children and not x.pins and x is not keep]
        if not leaves:
            return None
        victim = min(leaves, key=lambda x: x.used)
        del victim.parent.children[victim.label]
        del self._nodes[victim.entry]
        self.evictions += 1
        return victim.entry

    def pin(self, node: Node) -> None:
        if node is not self.root:
            node.pins += 1

    def unpin(self, node: Node) -> None:
        if node is not self.root:
            assert node.pins > 0, "unpinned more often than pinned"
            node.pins -= 1
