"""Incremental detokenization: deltas concatenate to the full decode and never split a character."""

from __future__ import annotations

import random

from transformers import AutoTokenizer

from services.runtime.inputs.detokenizer import IncrementalDetokenizer


def test_deltas_concatenate_to_the_full_text_and_hold_back_split_characters(tiny_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_checkpoint))
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)  # noqa: E731
    text = "Héllo wörld — naïve café ✓ 日本語 " * 3
    ids = tokenizer(text)["input_ids"]
    rng = random.Random(0)
    for sequence in (ids, [rng.randrange(len(tokenizer)) for _ in range(200)]):
        detok = IncrementalDetokenizer(decode)
        deltas = [detok.add(t, last=i == len(sequence) - 1) for i, t in enumerate(sequence)]
        assert "".join(deltas) == decode(sequence)
    # Multi-byte characters are byte-level tokens here: some deltas must have been held back.
    detok = IncrementalDetokenizer(decode)
    deltas = [detok.add(t) for t in ids]
    assert "" in deltas and not any("\ufffd" in d for d in deltas)
