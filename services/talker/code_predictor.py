"""The talker's code predictor: one frame's 15 residual codes from the talker's hidden state and
the frame's layer-0 code (docs/qwen3-omni.md, "One frame").

A fresh cache per frame: prefill [talker hidden, layer-0 code embedding], then one single-token
step per residual code but the last; each picked code's embedding is summed with the others into
the talker's next input. The same loop serves the eager step (per-row picks on the host, so
sampling requests can share the batch) and the CUDA graph of a whole greedy frame
(services/talker/graphs.py), so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.runtime.batching import batch_invariant


def predict_frame(talker, past_hidden: torch.Tensor, codes0: torch.Tensor, cache,
                  pick: Callable[[torch.Tensor], torch.Tensor], exact: bool):
    """past_hidden [B, 1, H] talker hidden; codes0 [B, 1] layer-0 codes; `cache` the
    `past_key_values` of a fresh cache per row, advanced by `cache.commit()` after each forward;
    `pick`: logits [B, vocab] -> ids [B] on the model's device.
    Returns (codes [B, num_code_groups], sum of the codes' embeddings [B, 1, H])."""
    predictor = talker.code_predictor
    embeddings = predictor.get_input_embeddings()  # num_code_groups - 1 tables
    num_groups = int(talker.config.num_code_groups)
    first = talker.get_input_embeddings()(codes0)  # [B, 1, H]
    columns, hiddens = [codes0[:, 0]], [first]
    with batch_invariant(exact):
        out = predictor(inputs_embeds=torch.cat((past_hidden, first), dim=1), past_key_values=cache, use_cache=True)
        cache.commit()
        for step in range(1, num_groups):
            ids = pick(out.logits[:, -1]).view(-1, 1)  # [B, 1]
            columns.append(ids[:, 0])
            hiddens.append(embeddings[step - 1](ids))
            if step < num_groups - 1:
                out = predictor(input_ids=ids, past_key_values=cache, use_cache=True, generation_steps=step)
                cache.commit()
    return torch.stack(columns, dim=1), torch.cat(hiddens, dim=1).sum(1, keepdim=True)
