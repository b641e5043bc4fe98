"""A prefix (radix) cache of paged KV blocks, shared across requests.

What SGLang's radix cache and vLLM's prefix caching do, at the granularity that matters for a
refit: KV is kept in blocks of ``block_size`` tokens; a finished request leaves the blocks of
its sequence in a tree keyed by their tokens; a later request whose prompt starts with those
tokens reuses the longest cached run of whole blocks (always leaving its last prompt token to
compute: its logits are the first output). Every cached token keeps the label of the weights
that computed its keys and values, so a reuse can be reported honestly - and a stale one found.

A block is referenced by the requests that reuse it (``lock``) until they end (``unlock``);
:meth:`PrefixCache.flush` refuses while any block is referenced: a running request's KV cannot
be dropped under it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

__all__ = ["Block", "PrefixCache"]


@dataclass
class Block:
    """One cached block: its tokens, the per-layer keys and values of each token, the label of
    the weights that computed each token, and how many live requests reference it."""

    tokens: tuple
    keys: list        # [layer][token] tensors
    values: list
    versions: tuple
    refs: int = 0
    children: dict = field(default_factory=dict)


class PrefixCache:
    """The tree of cached blocks (the root holds no tokens)."""

    def __init__(self, block_size: int = 4):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.root = Block((), [], [], ())

    def __len__(self) -> int:
        """Cached blocks."""
        stack, count = [self.root], -1
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count

    @property
    def referenced(self) -> bool:
        """Whether any cached block is held by a live request."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.refs:
                return True
            stack.extend(node.children.values())
        return False

    def match(self, tokens) -> list:
        """The cached blocks of the longest run of whole blocks ``tokens`` starts with, leaving
        at least its last token uncovered."""
        out, node, size = [], self.root, self.block_size
        usable = (len(tokens) - 1) // size * size
        for start in range(0, usable, size):
            node = node.children.get(tuple(tokens[start:start + size]))
            if node is None:
                break
            out.append(node)
        return out

    def insert(self, tokens, keys, values, versions) -> None:
        """Cache the whole blocks of a sequence: ``keys`` / ``values`` ``[layer][position]``,
        ``versions[position]`` the label of the weights that computed them. A block already
        cached is kept as it is (the first computation stays)."""
        node, size = self.root, self.block_size
        for start in range(0, len(versions) // size * size, size):
            key = tuple(tokens[start:start + size])
            child = node.children.get(key)
            if child is None:
                child = Block(key, [layer[start:start + size] for layer in keys],
                              [layer[start:start + size] for layer in values],
                              tuple(versions[start:start + size]))
                node.children[key] = child
            node = child

    @staticmethod
    def lock(blocks) -> None:
        for block in blocks:
            block.refs += 1

    @staticmethod
    def unlock(blocks) -> None:
        for block in blocks:
            block.refs = max(0, block.refs - 1)

    def flush_problem(self) -> Optional[str]:
        """Why the cache cannot be flushed now (a block a live request holds), else ``None``."""
        return "a running request holds cached blocks" if self.referenced else None

    def flush(self) -> Optional[str]:
        """Drop every block; the reason it cannot, else ``None`` (dropped)."""
        problem = self.flush_problem()
        if problem is None:
            self.root.children.clear()
        return problem
