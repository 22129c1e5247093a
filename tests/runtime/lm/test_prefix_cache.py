"""The prefix cache's pool, keys and index without a model; the router's view and score of them."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from omni.v1 import common_pb2, omni_pb2
from services.runtime.lm.prefix.keys import BLOCK_TOKENS, PromptPrefix, block_keys
from services.runtime.lm.prefix.pool import PrefixPool
from services.serving.prefix_keys import media_digests, message_keys
from services.serving.prefix_routing import PrefixView, Routing
from services.serving.replicas import Replica, ReplicaSet, ReplicaSource

LAYERS, KV_HEADS, HEAD_DIM, HIDDEN = 2, 1, 4, 8


def pool(blocks: int) -> PrefixPool:
    return PrefixPool(layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, hidden=HIDDEN, extra_layers=2,
                       dtype=torch.float32, device="cpu", capacity_blocks=blocks)


def prefilled(tokens: int, seed: int) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
    """A prompt's cache as a prefill leaves it, its final and its extra layers' hidden states."""
    g = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    for layer in range(LAYERS):
        cache.update(torch.randn(1, KV_HEADS, tokens, HEAD_DIM, generator=g),
                     torch.randn(1, KV_HEADS, tokens, HEAD_DIM, generator=g), layer)
    return cache, torch.randn(tokens, HIDDEN, generator=g), torch.randn(2, tokens, HIDDEN, generator=g)


def test_a_hit_gives_back_the_stored_keys_values_and_hidden_states():
    cache, finals, hidden = prefilled(3 * BLOCK_TOKENS + 5, seed=1)
    keys = block_keys(list(range(3 * BLOCK_TOKENS + 5)), {})
    assert len(keys) == 3
    c = pool(8)
    c.store(keys, cache, finals, hidden, first=0)
    hit = c.lookup(keys, usable=2, need_extras=True)
    assert hit.tokens == 2 * BLOCK_TOKENS and all(b.pins == 1 for b in hit.blocks)
    into = DynamicCache()
    c.preload(hit, into)
    for layer in range(LAYERS):
        assert torch.equal(into.layers[layer].keys, cache.layers[layer].keys[:, :, :hit.tokens])
        assert torch.equal(into.layers[layer].values, cache.layers[layer].values[:, :, :hit.tokens])
    assert torch.equal(c.hidden_of(hit), hidden[:, :hit.tokens])
    assert torch.equal(c.finals_of(hit), finals[:hit.tokens])
    c.release(hit)
    assert c.stats.hit_tokens == 2 * BLOCK_TOKENS and c.stats.lookup_tokens == 2 * BLOCK_TOKENS


def test_keys_chain_so_a_block_after_another_history_or_another_image_is_another_block():
    ids = list(range(100, 100 + 3 * BLOCK_TOKENS))
    plain = block_keys(ids, {})
    assert block_keys(ids, {}) == plain
    other_start = block_keys([7] + ids[1:], {})
    assert all(a != b for a, b in zip(plain, other_start)), "a changed first block changes every later key"
    image = block_keys(ids, {BLOCK_TOKENS + 2: b"image-a"})
    assert image[0] == plain[0] and image[1] != plain[1] and image[2] != plain[2]
    assert block_keys(ids, {BLOCK_TOKENS + 2: b"image-b"})[1] != image[1]


def test_a_full_pool_evicts_the_least_recently_used_and_never_a_pinned_block():
    c = pool(4)
    first, second = (block_keys([seed] * (2 * BLOCK_TOKENS), {}) for seed in (1, 2))
    for keys, seed in ((first, 1), (second, 2)):
        c.store(keys, *prefilled(2 * BLOCK_TOKENS, seed), first=0)
    pinned = c.lookup(first, usable=2, need_extras=False)  # first: most recent and in use
    third = block_keys([3] * (2 * BLOCK_TOKENS), {})
    c.store(third, *prefilled(2 * BLOCK_TOKENS, 3), first=0)
    assert c.stats.evictions == 2 and c.lookup(second, 2, False).tokens == 0
    fourth = block_keys([4] * (2 * BLOCK_TOKENS), {})
    c.store(fourth, *prefilled(2 * BLOCK_TOKENS, 4), first=0)  # evicts third, not the pinned first
    assert c.lookup(first, 2, False, use=False).tokens == 0 and c.stats.refused_tokens == 2 * BLOCK_TOKENS
    assert c.blocks == 4 and all(b.pins == 1 for b in pinned.blocks)
    c.release(pinned)
    everything_pinned = [c.lookup(k, 2, False) for k in (first, fourth)]
    c.store(block_keys([5] * BLOCK_TOKENS, {}), *prefilled(BLOCK_TOKENS, 5), first=0)  # no room: nothing kept
    assert c.blocks == 4 and c.stats.evictions == 4
    for hit in everything_pinned:
        c.release(hit)


def test_a_ledger_counts_what_a_refused_lookup_would_have_found_and_copies_nothing():
    # What an engine that refuses hits keeps (per-row kernels): the pool's bookkeeping, no tensors.
    ledger = pool(4).ledger()
    assert ledger.capacity == 4 and ledger.keys.numel() == ledger.finals.numel() == ledger.extras.numel() == 0
    ids = [6] * (2 * BLOCK_TOKENS + 1)
    keys = block_keys(ids, {})
    ledger.store(keys, *prefilled(len(ids), 1), first=0)
    ledger.publish(PromptPrefix(starts=(0, len(ids)), media=(None,), keys=(b"m0",)), keys)
    assert ledger.blocks == 2 and ledger.index.report(0, 0)[3] == []  # nothing the router should route to
    assert ledger.lookup(keys, 2, need_extras=True, use=False).tokens == 0
    assert ledger.stats.refused_tokens == 2 * BLOCK_TOKENS and ledger.stats.hit_tokens == 0


def test_the_index_reports_changes_since_a_poll_and_everything_to_a_new_reader():
    c = pool(2)
    ids = [9] * (2 * BLOCK_TOKENS + 3)
    keys = block_keys(ids, {})
    prefix = PromptPrefix(starts=(0, BLOCK_TOKENS + 1, 2 * BLOCK_TOKENS + 3), media=(None, None),
                          keys=(b"m0", b"m1"))
    c.store(keys, *prefilled(len(ids), 1), first=0)
    c.publish(prefix, keys)
    epoch, seq, full, held = c.index.report(0, 0)
    assert full and dict(held) == {b"m0": BLOCK_TOKENS, b"m1": 2 * BLOCK_TOKENS}
    other = block_keys([8] * BLOCK_TOKENS, {})
    c.store(other, *prefilled(BLOCK_TOKENS, 2), first=0)  # evicts the chain's last block: m1 goes
    assert c.index.report(epoch, seq)[2:] == (False, [(b"m1", 0)])
    view = PrefixView()
    view.apply(common_pb2.PrefixReport(epoch=epoch, seq=seq, full=True,
                                       held=[common_pb2.PrefixHeld(key=k, tokens=t) for k, t in held]))
    _, seq2, _, changes = c.index.report(epoch, seq)
    view.apply(common_pb2.PrefixReport(epoch=epoch, seq=seq2, held=[common_pb2.PrefixHeld(key=k, tokens=t)
                                                                     for k, t in changes]))
    assert view.held == {b"m0": BLOCK_TOKENS} and view.matched([b"m0", b"m1", b"m2"]) == BLOCK_TOKENS


def conversation(turns: int, image: bytes = b"png") -> omni_pb2.GenerateRequest:
    request = omni_pb2.GenerateRequest()
    request.messages.add(role=omni_pb2.ROLE_SYSTEM).content.add(text="Be brief.")
    for t in range(turns):
        user = request.messages.add(role=omni_pb2.ROLE_USER)
        if t == 0:
            user.content.add(image=image)
        user.content.add(text=f"question {t}")
        request.messages.add(role=omni_pb2.ROLE_ASSISTANT).content.add(text=f"answer {t}")
    return request


def test_message_keys_name_each_prefix_and_the_media_by_content():
    short, longer = message_keys(conversation(1)), message_keys(conversation(2))
    assert longer[:len(short)] == short and len(longer) == len(short) + 2
    assert message_keys(conversation(2, image=b"other"))[1:] != longer[1:]
    assert message_keys(conversation(2, image=b"other"))[0] == longer[0]
    assert media_digests(conversation(1))[0] is None and media_digests(conversation(1))[1] is not None


def thinkers(routing: Routing, loads: dict[str, int], held: dict[str, int], queued: str = "") -> ReplicaSet:
    replicas = ReplicaSet("thinker", ReplicaSource(static=tuple(loads)), routing=routing)
    keys = message_keys(conversation(3))
    for address, load in loads.items():
        replica = Replica(address, healthy=True, in_flight=load,
                          load=common_pb2.LoadReport(running=load, queue_depth=1 if address == queued else 0))
        if held.get(address):
            replica.prefix.held[keys[3]] = held[address]
        replicas.replicas[address] = replica
    return replicas


def test_prefix_routing_weighs_the_held_prefix_against_load():
    keys = message_keys(conversation(3))
    # 1,500 tokens held are worth 6 requests of load (the default weight 4 per 1,000)
    assert thinkers(Routing.PREFIX, {"a:1": 5, "b:1": 0}, {"a:1": 1500}).pick(prefix_keys=keys).address == "a:1"
    assert thinkers(Routing.PREFIX, {"a:1": 7, "b:1": 0}, {"a:1": 1500}).pick(prefix_keys=keys).address == "b:1"
    # a replica with requests waiting for a slot gets no credit; least-loaded ignores the prefix
    assert thinkers(Routing.PREFIX, {"a:1": 1, "b:1": 0}, {"a:1": 1500}, queued="a:1").pick(
        prefix_keys=keys).address == "b:1"
    assert thinkers(Routing.LEAST_LOADED, {"a:1": 1, "b:1": 0}, {"a:1": 1500}).pick(prefix_keys=keys).address == "b:1"
    random_picks = {thinkers(Routing.RANDOM, {"a:1": 0, "b:1": 9}, {}).pick().address for _ in range(64)}
    assert random_picks == {"a:1", "b:1"}


def test_a_restarted_replica_s_report_replaces_the_router_s_view():
    view = PrefixView()
    view.apply(common_pb2.PrefixReport(epoch=7, seq=3, full=True, held=[common_pb2.PrefixHeld(key=b"k", tokens=32)]))
    assert view.request().prefix_epoch == 7 and view.request().prefix_since == 3
    view.apply(common_pb2.PrefixReport(epoch=9, seq=0, full=True))  # another start: an empty cache
    assert view.held == {} and view.matched([b"k"]) == 0 and view.epoch == 9
