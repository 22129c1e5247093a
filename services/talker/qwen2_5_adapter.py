"""Qwen2.5-Omni's talker as the server drives it (adapter.py): `Qwen2_5TalkerEngine` (no CUDA
graphs); the start message carries `prompt_hidden` and `text_embeds` (TalkerStart fields 13, 14;
the voice already chose the thinker's bos row), and each later token brings its reply part
(`TextToken.reply`) (docs/qwen2_5-omni.md, section "What crosses the thinker -> talker boundary")."""

from __future__ import annotations

from omni.v1 import stages_pb2
from services.base.errors import ContextFull, InvalidArgument
from services.runtime.chunking import ChunkPolicy
from services.serving.convert import sampling_from_proto
from services.serving.wire import tensor_from_proto
from services.talker.config import TalkerConfig
from services.talker.engine_base import TextEnd
from services.talker.qwen2_5 import Qwen2_5TalkerEngine, Qwen2_5TalkerJob, ReplyPart


def qwen2_5_job_from_proto(start: stages_pb2.TalkerStart, model_config, config: TalkerConfig) -> Qwen2_5TalkerJob:
    """Validate and convert Qwen2.5-Omni's start message (fields named as in the proto)."""
    hidden = model_config.thinker_config.text_config.hidden_size
    prompt_len = len(start.prompt_token_ids)
    if not start.HasField("prompt_hidden") or not start.HasField("text_embeds"):
        raise InvalidArgument("start.prompt_hidden", "Qwen2.5-Omni's talker needs prompt_hidden and text_embeds")
    prompt_hidden = tensor_from_proto(start.prompt_hidden)
    if prompt_hidden.shape != (prompt_len, hidden) or not prompt_hidden.is_floating_point():
        raise InvalidArgument("start.prompt_hidden", f"must be [{prompt_len}, {hidden}] floats, "
                                                     f"got {list(prompt_hidden.shape)} {prompt_hidden.dtype}")
    text_embeds = tensor_from_proto(start.text_embeds)
    if text_embeds.shape != (3, hidden) or not text_embeds.is_floating_point():
        raise InvalidArgument("start.text_embeds", f"must be [3, {hidden}] floats, got {list(text_embeds.shape)}")
    sampling = sampling_from_proto(start.sampling, "talker_sampling", config.default_max_new_tokens,
                                   config.max_new_tokens_limit, default_repetition_penalty=1.05)
    job = Qwen2_5TalkerJob(prompt_hidden=prompt_hidden, text_embeds=text_embeds, sampling=sampling)
    needed = job.prompt_len + sampling.max_new_tokens
    if needed > config.engine.max_model_len:
        raise ContextFull("talker_sampling.max_new_tokens",
                          f"talker prompt + max_new_tokens ({needed}) exceeds the talker's per-request cache "
                          f"({config.engine.max_model_len})")
    return job


def qwen2_5_input_from_proto(message: stages_pb2.TalkerInput, hidden: int) -> ReplyPart | TextEnd:
    """A Qwen2.5-Omni talker input after start: a token's reply part, or the text's end."""
    if message.HasField("finished"):
        return TextEnd()
    if not message.HasField("token") or not message.token.HasField("reply"):
        raise InvalidArgument("token.reply", "expected a token with its reply part, or finished")
    reply = tensor_from_proto(message.token.reply)
    if reply.shape != (hidden,) or not reply.is_floating_point():
        raise InvalidArgument("token.reply", f"must be [{hidden}] floats, got {list(reply.shape)} {reply.dtype}")
    return ReplyPart(reply)


class Qwen2_5TalkerAdapter:
    engine = Qwen2_5TalkerEngine
    cuda_graphs = False
    seconds_per_frame = None  # Token2Wav's audio trails the codes sent by its look-ahead

    def __init__(self, model_config, config: TalkerConfig):
        self.model_config = model_config  # Qwen2_5OmniConfig
        self.config = config
        self.hidden = model_config.thinker_config.text_config.hidden_size  # every vector the talker takes

    def job_from_proto(self, start: stages_pb2.TalkerStart) -> Qwen2_5TalkerJob:
        return qwen2_5_job_from_proto(start, self.model_config, self.config)

    def input_from_proto(self, message: stages_pb2.TalkerInput) -> ReplyPart | TextEnd:
        return qwen2_5_input_from_proto(message, self.hidden)

    def text_rows_to_first_chunk(self, chunks: ChunkPolicy) -> None:
        return None  # Token2Wav's first audio needs its look-ahead too, which code2wav's flags set
