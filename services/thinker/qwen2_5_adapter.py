"""Qwen2.5-Omni's thinker as the server drives it (adapter.py): `Qwen2_5ThinkerEngine` (no CUDA
graphs); the voice is the thinker's business here (its bos token, spk_dict.pt, starts the talker's
prompt); the talker starts from `prompt_hidden` and `text_embeds` (TalkerStart fields 13, 14), and
token i's reply part travels with token i + 1 (`TextToken.reply`), so as for Qwen3-Omni there is
one TextToken per generated token except the last
(docs/qwen2_5-omni.md, section "What crosses the thinker -> talker boundary").
"""

from __future__ import annotations

from omni.v1 import omni_pb2, stages_pb2
from services.runtime.inputs.prompt import PromptInputs
from services.runtime.lm.sampling import SamplingConfig
from services.runtime.model import qwen2_5_omni
from services.runtime.model.checkpoint import voice_bos_tokens
from services.serving.wire import tensor_to_proto
from services.thinker.engine import Token
from services.thinker.qwen2_5 import Qwen2_5Prefilled, Qwen2_5ThinkerEngine, Qwen2_5ThinkerJob


def qwen2_5_talker_start(req: omni_pb2.GenerateRequest, route: stages_pb2.Route,
                         event: Qwen2_5Prefilled) -> stages_pb2.TalkerStart:
    """Qwen2.5-Omni's start message: the shared fields and its prefill payload (fields 13, 14)."""
    return stages_pb2.TalkerStart(
        request_id=req.request_id, route=route, voice=req.voice if req.HasField("voice") else None,
        sampling=req.talker_sampling, return_codec_frames=req.return_codec_frames,
        prompt_token_ids=event.prompt_token_ids, prompt_hidden=tensor_to_proto(event.prompt_hidden),
        text_embeds=tensor_to_proto(event.text_embeds),
    )


def qwen2_5_text_tokens(event: Token, previous_id: int | None) -> list[stages_pb2.TalkerInput]:
    """What Qwen2.5-Omni's talker gets for one thinker token: the previous token with its reply
    part (which this token's forward made), then after the last token the text-finished mark.
    So, as for Qwen3-Omni, one TextToken per generated token except the last."""
    out = []
    if event.reply is not None:
        out.append(stages_pb2.TalkerInput(token=stages_pb2.TextToken(token_id=previous_id,
                                                                     reply=tensor_to_proto(event.reply))))
    if event.last:
        out.append(stages_pb2.TalkerInput(finished=stages_pb2.TextFinished()))
    return out


class Qwen2_5ThinkerAdapter:
    engine = Qwen2_5ThinkerEngine
    cuda_graphs = False
    prefilled = Qwen2_5Prefilled

    def __init__(self, checkpoint: str, model_config, prompts):
        self.voices = voice_bos_tokens(checkpoint)  # voice name -> its bos token, what the talker's prompt starts from
        self.im_end = int(prompts.tokenizer.convert_tokens_to_ids("<|im_end|>"))

    def resolve_voice(self, voice: str | None) -> int:
        return qwen2_5_omni.resolve_voice(self.voices, voice)[1]

    def talker_prompt_len(self, prompt: PromptInputs) -> int:
        return qwen2_5_omni.talker_prompt_len(prompt.num_tokens)

    def job(self, prompt: PromptInputs, sampling: SamplingConfig, audio: bool, forced_ids: tuple[int, ...],
            voice: int | None) -> Qwen2_5ThinkerJob:
        return Qwen2_5ThinkerJob(prompt, sampling, want_talker_inputs=audio, forced_ids=forced_ids,
                                 voice_bos_token=voice)

    def end_token_id(self) -> int:
        return self.im_end

    def talker_start(self, req: omni_pb2.GenerateRequest, route: stages_pb2.Route, event: Qwen2_5Prefilled,
                     job: Qwen2_5ThinkerJob) -> stages_pb2.TalkerStart:
        return qwen2_5_talker_start(req, route, event)

    def talker_inputs(self, event: Token, previous_id: int | None) -> list[stages_pb2.TalkerInput]:
        return qwen2_5_text_tokens(event, previous_id)
