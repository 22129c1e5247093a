"""Qwen3-Omni's talker as the server drives it (adapter.py): `TalkerEngine`; the start message
carries the prompt embeddings, multimodal hidden states and tts embeddings, the voice is resolved
to the talker's speaker id here, and each later token brings a text row (`TextToken.embedding`)
(docs/qwen3-omni.md)."""

from __future__ import annotations

import torch

from omni.v1 import stages_pb2
from services.base.errors import ContextFull, InvalidArgument
from services.runtime.chunking import ChunkPolicy
from services.runtime.inputs.prompt import resolve_voice
from services.runtime.model.qwen3_omni import seconds_per_frame, talker_prompt_len
from services.serving.convert import sampling_from_proto
from services.serving.wire import tensor_from_proto
from services.talker.config import TalkerConfig
from services.talker.engine import TalkerEngine, TalkerJob, TextRow
from services.talker.engine_base import TextEnd


def talker_job_from_proto(start: stages_pb2.TalkerStart, model_config, config: TalkerConfig) -> TalkerJob:
    """Validate and convert the start message (fields named as in the proto)."""
    hidden = model_config.thinker_config.text_config.hidden_size
    _, speaker_id = resolve_voice(model_config, start.voice if start.HasField("voice") else None)
    ids = list(start.prompt_token_ids)
    # The talker's prefill starts at the last "<|im_start|>assistant\n" (3 positions): a prompt
    # without one is refused here, rather than failing the engine step of every running request.
    im_start, assistant = model_config.im_start_token_id, model_config.assistant_token_id
    if not any(ids[i] == im_start and ids[i + 1] == assistant for i in range(len(ids) - 2)):
        raise InvalidArgument("start.prompt_token_ids", "must hold the assistant turn's <|im_start|>assistant\\n")
    embeds = tensor_from_proto(start.prompt_embeds)
    if (embeds.ndim != 2 or embeds.shape[1] != hidden or embeds.shape[0] != len(start.prompt_token_ids)
            or not embeds.is_floating_point()):
        raise InvalidArgument("start.prompt_embeds", f"must be [{len(start.prompt_token_ids)}, {hidden}], "
                                                     f"got {list(embeds.shape)} {embeds.dtype}")
    positions = list(start.multimodal_positions)
    mm_hidden = (tensor_from_proto(start.multimodal_hidden) if start.HasField("multimodal_hidden")
                 else torch.zeros((0, hidden)))
    if (mm_hidden.shape != (len(positions), hidden) or not mm_hidden.is_floating_point()
            or any(not 0 <= p < embeds.shape[0] for p in positions)):
        raise InvalidArgument("start.multimodal_hidden", "must have one row per multimodal position inside the prompt")
    if any(b <= a for a, b in zip(positions, positions[1:])):
        # The rows go to the positions in prompt order (a mask, as generate places them).
        raise InvalidArgument("start.multimodal_positions", "must be strictly increasing (one row per position, "
                                                            "in prompt order)")
    tts = tensor_from_proto(start.tts_embeds)
    if tts.shape != (3, hidden) or not tts.is_floating_point():
        raise InvalidArgument("start.tts_embeds", f"must be [3, {hidden}] floats, got {list(tts.shape)} {tts.dtype}")
    sampling = sampling_from_proto(start.sampling, "talker_sampling", config.default_max_new_tokens,
                                   config.max_new_tokens_limit, default_repetition_penalty=1.05)
    prompt_len = talker_prompt_len(ids, model_config)
    needed = prompt_len + sampling.max_new_tokens
    if needed > config.engine.max_model_len:
        raise ContextFull("talker_sampling.max_new_tokens",
                          f"talker prompt + max_new_tokens ({needed}) exceeds the talker's per-request cache "
                          f"({config.engine.max_model_len})")
    return TalkerJob(
        prompt_token_ids=ids, prompt_embeds=embeds, multimodal_positions=positions,
        multimodal_hidden=mm_hidden, tts_embeds=tts, speaker_id=speaker_id, sampling=sampling, prompt_len=prompt_len,
        image_grid_thw=tensor_from_proto(start.image_grid_thw) if start.HasField("image_grid_thw") else None,
        audio_feature_lengths=(tensor_from_proto(start.audio_feature_lengths)
                               if start.HasField("audio_feature_lengths") else None),
        video_grid_thw=tensor_from_proto(start.video_grid_thw) if start.HasField("video_grid_thw") else None,
        video_second_per_grid=(tensor_from_proto(start.video_second_per_grid)
                               if start.HasField("video_second_per_grid") else None),
    )


def text_input_from_proto(message: stages_pb2.TalkerInput, hidden: int | None = None) -> TextRow | TextEnd:
    """A Qwen3-Omni talker input after start: a token's text row ([hidden] floats when `hidden` is
    given), or the text's end."""
    if message.HasField("token"):
        row = tensor_from_proto(message.token.embedding)
        if hidden is not None and (tuple(row.shape) != (hidden,) or not row.is_floating_point()):
            raise InvalidArgument("token.embedding", f"must be [{hidden}] floats, got {list(row.shape)} {row.dtype}")
        return TextRow(row)
    if message.HasField("finished"):
        return TextEnd()
    raise InvalidArgument("event", "expected token or finished after start")


class Qwen3TalkerAdapter:
    engine = TalkerEngine
    cuda_graphs = True

    def __init__(self, model_config, config: TalkerConfig):
        self.model_config = model_config  # Qwen3OmniMoeConfig
        self.config = config
        self.seconds_per_frame = seconds_per_frame(model_config.code2wav_config)

    def job_from_proto(self, start: stages_pb2.TalkerStart) -> TalkerJob:
        return talker_job_from_proto(start, self.model_config, self.config)

    def input_from_proto(self, message: stages_pb2.TalkerInput) -> TextRow | TextEnd:
        return text_input_from_proto(message, self.model_config.thinker_config.text_config.hidden_size)

    def text_rows_to_first_chunk(self, chunks: ChunkPolicy) -> int:
        # Frame 0 (the prefill) takes row 0, frame f row f: a first chunk of n frames takes n rows.
        return chunks.first
