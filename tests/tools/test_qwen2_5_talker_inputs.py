"""What `Qwen2_5OmniForConditionalGeneration.generate` feeds its talker, rebuilt by hand from the
thinker's outputs as docs/qwen2_5-omni.md ("What the talker needs from the thinker") describes it,
gives generate's own codes: the description a talker stage is built from is checked against the oracle.

The rebuild runs the talker without a KV cache and with plain 0..n-1 positions, applies generate's
talker repetition penalty (1.05 over every id of the talker's sequence) and its suppression of the
codec start id, and picks greedily.
"""

from __future__ import annotations

import pytest
import torch

from services.runtime.inputs.prompt import ChatMessage, Part, Role
from services.tools.reference import ReferenceRunner

THINKER_TOKENS = 6
TALKER_TOKENS = 16
REPETITION_PENALTY = 1.05

pytestmark = [pytest.mark.exactness, pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(scope="module")
def runner(tiny_qwen2_5_checkpoint) -> ReferenceRunner:
    return ReferenceRunner(tiny_qwen2_5_checkpoint)


def talker_prompt_and_reply(model, inputs: dict, voice: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(prompt embeds [L + 2, H], reply stream [R, H], L) in the thinker's width, from a greedy thinker run."""
    thinker, talker = model.thinker, model.talker
    embed = thinker.get_input_embeddings()
    run = thinker.generate(**inputs, max_new_tokens=THINKER_TOKENS, do_sample=False, output_hidden_states=True,
                           return_dict_in_generate=True)
    ids = inputs["input_ids"][0]
    prompt_len = len(ids)
    new = run.sequences[0, prompt_len:]
    assert len(new) == THINKER_TOKENS  # the tiny thinker never ends early
    layer0, last = run.hidden_states[0][0][0].clone(), run.hidden_states[0][-1][0]  # [L, H] each
    config = model.config.thinker_config
    media = (ids == config.audio_token_id) | (ids == config.image_token_id) | (ids == config.video_token_id)
    layer0[media] = 0  # audio and image positions: the last hidden state alone
    # Step i >= 1 forwards generated token i - 1: its layer-0 embedding plus its last hidden state.
    part = torch.cat([step[-1][0] + step[0][0] for step in run.hidden_states[1:]])  # [G - 1, H]: tokens 0..G-2
    assert torch.equal(run.hidden_states[1][0][0, 0], embed(new[:1])[0])
    one = lambda token_id: embed(torch.tensor([token_id]))[0]  # noqa: E731
    prompt = torch.cat([last + layer0, one(model.speaker_map[voice]["bos_token"])[None], part[:1]])
    reply = torch.cat([part[1:], one(talker.text_eos_token)[None], one(talker.text_pad_token)[None]])
    return prompt, reply, prompt_len


def rebuilt_codes(model, inputs: dict, voice: str) -> list[int]:
    talker = model.talker
    codec = talker.get_input_embeddings()  # [8448, thinker hidden]: added before the projection
    prompt, reply, prompt_len = talker_prompt_and_reply(model, inputs, voice)
    seen = [talker.codec_mask_token] * prompt_len + [talker.codec_pad_token, talker.codec_bos_token]
    rows, codes = list(prompt), []
    for step in range(TALKER_TOKENS):
        x = talker.thinker_to_talker_proj(torch.stack(rows)[None])
        positions = torch.arange(x.shape[1]).view(1, 1, -1).expand(3, 1, -1)
        logits = talker.codec_head(talker.model(inputs_embeds=x, position_ids=positions).last_hidden_state)[0, -1]
        penalised = torch.tensor(sorted(set(seen)))
        scores = logits[penalised]
        logits[penalised] = torch.where(scores > 0, scores / REPETITION_PENALTY, scores * REPETITION_PENALTY)
        logits[talker.codec_bos_token] = -float("inf")
        code = int(logits.argmax())
        codes.append(code)
        seen.append(code)
        # The next step's input: this code's embedding plus the next reply row; the last (text pad) repeats.
        rows.append(codec(torch.tensor([code]))[0] + reply[min(step, len(reply) - 1)])
    return codes


@pytest.mark.parametrize("media", [(), ("audio", "image")], ids=lambda m: "+".join(m) or "text")
def test_rebuilt_talker_inputs_give_generates_codes(runner, media, wav_bytes, png_bytes):
    parts = {"audio": Part(audio=wav_bytes), "image": Part(image=png_bytes)}
    messages = [ChatMessage(Role.USER, (*(parts[m] for m in media), Part(text="Hello! How are you today?")))]
    inputs = runner.inputs(messages)
    for voice in ("Ethan", "Chelsie"):
        want = runner.generate(messages, voice, THINKER_TOKENS, TALKER_TOKENS)
        with torch.inference_mode():
            got = rebuilt_codes(runner.model, inputs, voice)
        assert got == [frame[0] for frame in want.codec_frames], voice
