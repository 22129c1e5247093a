"""A full prefix-cache pool keeps a growing conversation's history: a lookup's hit counts as a use
(services/runtime/lm/prefix/, PrefixPool.lookup's `move_to_end`), so the blocks a turn just
found are the last to go when that same turn's new blocks need room.

Pinned bug (project issue 48, item 0): `lookup` not refreshing the recency of the blocks it hits.
Every engine test's pool never fills, and the pool test evicts with hits held pinned, so nothing
saw that in a full pool a conversation's turn then evicts the blocks of its own history it had
just found (they are released before the store, as the engines do: `from_cached_blocks` releases
the hit when the forward ends, `store` comes after), and its next turn hits only part of it.
"""

from __future__ import annotations

from services.runtime.lm.prefix.keys import BLOCK_TOKENS, block_keys
from services.runtime.lm.prefix.pool import PrefixPool
from tests.runtime.lm.test_prefix_cache import pool, prefilled

TAIL = 5  # tokens after a prompt's last whole block


def prefill(cache: PrefixPool, ids: list[int], seed: int) -> int:
    """What a thinker prefill does with the cache (ThinkerEngine._prefill_forward): look up the
    prompt's blocks, run the forward (the hit pinned), release, store the new blocks. Returns the
    tokens the hit covered."""
    keys = block_keys(ids, {})
    hit = cache.lookup(keys, (len(ids) - 1) // BLOCK_TOKENS, need_extras=False)
    cache.release(hit)  # the forward ended: from_cached_blocks releases before the store
    cache.store(keys, *prefilled(len(ids), seed), first=len(hit.blocks))
    return hit.tokens


def test_a_growing_conversation_in_a_full_pool_keeps_hitting_its_whole_history():
    """Turn t has t + 1 whole blocks; between turns, other requests fill the rest of the pool with
    blocks newer than the history. Each turn finds every block of the turn before it."""
    cache = pool(8)
    history = list(range(1000, 1000 + 8 * BLOCK_TOKENS))  # the conversation's tokens
    hits = []
    for turn in range(1, 6):
        hits.append(prefill(cache, history[:(turn + 1) * BLOCK_TOKENS + TAIL], seed=turn) // BLOCK_TOKENS)
        others = cache.capacity - (turn + 1)  # blocks of other prompts that fill the pool up
        prefill(cache, [turn] * (others * BLOCK_TOKENS + TAIL), seed=100 + turn)
        assert cache.blocks == cache.capacity
    assert cache.stats.evictions > 0
    assert hits == [0, 2, 3, 4, 5], f"blocks each turn found of its history: {hits}"


def test_a_turn_evicts_the_blocks_nobody_used_since_not_the_history_it_just_found():
    cache = pool(4)
    conversation = list(range(500, 500 + 4 * BLOCK_TOKENS))
    assert prefill(cache, conversation[:2 * BLOCK_TOKENS + TAIL], seed=1) == 0  # holds c1, c2
    other = [7] * (2 * BLOCK_TOKENS + TAIL)
    prefill(cache, other, seed=2)  # the pool is full: c1, c2 and the other prompt's two blocks, the newest
    assert cache.blocks == 4 and cache.stats.evictions == 0
    # Turn 2 finds c1, c2 and needs one block more: the other prompt's tail block goes, not the history's.
    assert prefill(cache, conversation[:3 * BLOCK_TOKENS + TAIL], seed=3) == 2 * BLOCK_TOKENS
    assert cache.stats.evictions == 1
    held = cache.lookup(block_keys(conversation[:3 * BLOCK_TOKENS + 1], {}), 3, need_extras=False)
    cache.release(held)
    assert held.tokens == 3 * BLOCK_TOKENS, "the conversation's three blocks are all held"
    assert prefill(cache, other, seed=2) == BLOCK_TOKENS, "the other prompt lost its tail block"
