"""Qwen3-Omni's thinker as the server drives it (adapter.py): `ThinkerEngine`; the voice is the
talker's speaker, only checked here; the talker starts from the prefill's prompt embeddings,
multimodal hidden states and tts embeddings, and gets one text row (`TextToken.embedding`) per
generated token except the last (docs/qwen3-omni.md)."""

from __future__ import annotations

from omni.v1 import omni_pb2, stages_pb2
from services.runtime.inputs.prompt import PromptInputs, resolve_voice
from services.runtime.lm.sampling import SamplingConfig
from services.runtime.model.qwen3_omni import talker_prompt_len
from services.serving.wire import tensor_to_proto
from services.thinker.engine import Prefilled, ThinkerEngine, ThinkerJob, Token


class Qwen3ThinkerAdapter:
    engine = ThinkerEngine
    cuda_graphs = True
    prefilled = Prefilled

    def __init__(self, checkpoint: str, model_config, prompts):
        self.config = model_config  # Qwen3OmniMoeConfig

    def resolve_voice(self, voice: str | None) -> None:
        resolve_voice(self.config, voice)  # the talker maps it to its speaker id; checked before any output

    def talker_prompt_len(self, prompt: PromptInputs) -> int:
        return talker_prompt_len(prompt.input_ids[0].tolist(), self.config)

    def job(self, prompt: PromptInputs, sampling: SamplingConfig, audio: bool, forced_ids: tuple[int, ...],
            voice) -> ThinkerJob:
        return ThinkerJob(prompt, sampling, want_talker_inputs=audio, forced_ids=forced_ids)

    def end_token_id(self) -> int:
        return int(self.config.im_end_token_id)

    def talker_start(self, req: omni_pb2.GenerateRequest, route: stages_pb2.Route, event: Prefilled,
                     job: ThinkerJob) -> stages_pb2.TalkerStart:
        prompt = job.prompt
        start = stages_pb2.TalkerStart(
            request_id=req.request_id, route=route, voice=req.voice if req.HasField("voice") else None,
            sampling=req.talker_sampling, return_codec_frames=req.return_codec_frames,
            prompt_token_ids=event.prompt_token_ids, prompt_embeds=tensor_to_proto(event.prompt_embeds),
            multimodal_positions=event.multimodal_positions, tts_embeds=tensor_to_proto(event.tts_embeds),
        )
        if event.multimodal_positions:
            start.multimodal_hidden.CopyFrom(tensor_to_proto(event.multimodal_hidden))
        if prompt.image_grid_thw is not None:
            start.image_grid_thw.CopyFrom(tensor_to_proto(prompt.image_grid_thw))
        if prompt.video_grid_thw is not None:
            start.video_grid_thw.CopyFrom(tensor_to_proto(prompt.video_grid_thw))
            start.video_second_per_grid.CopyFrom(tensor_to_proto(prompt.video_second_per_grid))
        if prompt.audio_feature_lengths is not None:
            start.audio_feature_lengths.CopyFrom(tensor_to_proto(prompt.audio_feature_lengths))
        return start

    def talker_inputs(self, event: Token, previous_id: int | None) -> list[stages_pb2.TalkerInput]:
        if event.last:
            return [stages_pb2.TalkerInput(finished=stages_pb2.TextFinished())]
        return [stages_pb2.TalkerInput(token=stages_pb2.TextToken(token_id=event.token_id,
                                                                  embedding=tensor_to_proto(event.embedding)))]
