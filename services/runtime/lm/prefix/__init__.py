"""The prefix cache of the LM stages (the thinker and both families' talkers): the KV of prompt blocks computed
before, kept across requests, so a conversation's turn prefills only what its history does not
already hold.

A prompt is cut into blocks of BLOCK_TOKENS tokens. Block b's key is a hash chain: the previous
block's key, the block's token ids and the media digests of the messages that start in it
(services/serving/prefix_keys.py), so the same text with another image, or the same block after
another history, is another key. A block holds every layer's keys and values of its tokens, the
final hidden states (what the LM head reads: a hit's LM head runs over the whole prompt's rows,
the cached ones from here, so its call is the cold one's), and, when the request that made it fed
the talker, the hidden states the talker's inputs are read from (`extra layers`: the layer-0
inputs and the family's other layer), so a talker-fed request that hits gets the same `Prefilled`
as without the cache.

The pool is allocated once (`--prefix-cache-mb`): a fixed number of blocks. Blocks a running
prefill uses are pinned; a full pool evicts the least recently used unpinned block, the last
blocks of a chain first (a chain's blocks are touched last to first), and a pool whose blocks
are all pinned stores nothing more: a request never fails for the cache. Blocks are written only
once their prefill finished, on the engine's thread, so an aborted prefill leaves nothing behind,
and only prompt blocks are kept (a generated token's KV comes from a decode step, whose bits are
not a prefill's).

`PrefixIndex` is what the router sees (services/serving/prefix_keys.py, services/serving/prefix_routing.py): the
message-prefix keys whose blocks are held, with their token counts, as a log of changes since a
sequence number.
"""
