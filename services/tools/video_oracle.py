"""The oracle's inputs for prompts with video: transformers' own processor with its real video
processor (`Qwen2VLVideoProcessor`, torchvision), in a child process.

torchvision is needed by transformers' video processor, and the only torchvision on the package
index for torch 2.13 on x86-64 (0.28.0) is a CUDA build: its C++ ops (`_C.so`) do not load beside
the CPU torch wheel, and `import torchvision` then fails in `_meta_registrations`
(`RuntimeError: operator torchvision::nms does not exist`) although nothing the video processor
uses (`transforms.v2.functional`: resize, normalize) needs those ops. So `make setup` installs that
wheel apart, into .venv/oracle-vision (never on the services' path: transformers would pick its
torchvision image backend there), and the child process here puts it on its path after defining
the schemas of the two ops that `_meta_registrations` registers fakes for (`nms`, `qnms`; they
stay unimplemented). The child builds the family's processor as `oracle_processor` does, with the
checkpoint's video processor (`AutoVideoProcessor`) in place of the stand-in and the image
processor pinned to the PIL backend (what it is where torchvision is absent, as for the services).

Inputs are what a user of transformers hands the processor (as Qwen's `process_mm_info` does): the
chat template rendered with a video block per video, each video decoded by transformers'
`load_video(backend="pyav")` (every frame, with its metadata; transformers 5.19 decodes a path
given to the processor with torchcodec only, not installable beside this torch either) and sampled
by the video processor (`fps` frames a second, `do_sample_frames=True`), and with
`use_audio_in_video` each video's audio track (decoded here with PyAV, channels averaged, 16 kHz
only: nothing is resampled) in prompt order among the audio parts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from services.runtime.inputs.prompt import ChatMessage

VISION_DIR = Path(sys.prefix) / "oracle-vision"  # `make setup`: pip install --target (torchvision, no deps)
AUDIO_SAMPLE_RATE = 16000


def video_inputs(folder: str | Path, prompts: list[tuple[list[ChatMessage], bool]], fps: float,
                 timeout: float = 600.0) -> list[dict]:
    """The processor's model inputs (tensors) for each (messages, use_audio_in_video), all built in
    one child process (it imports transformers once)."""
    from safetensors.torch import load_file

    if not (VISION_DIR / "torchvision").is_dir():
        raise RuntimeError(f"{VISION_DIR} has no torchvision: run `make setup`")
    with tempfile.TemporaryDirectory(prefix="video-oracle-") as tmp:
        jobs = []
        for k, (messages, use_audio_in_video) in enumerate(prompts):
            job = {"folder": str(folder), "use_audio_in_video": use_audio_in_video, "fps": fps, "messages": []}
            for i, message in enumerate(messages):
                parts = []
                for j, part in enumerate(message.parts):
                    if part.video_frames is not None:
                        paths = []
                        for n, frame in enumerate(part.video_frames):
                            paths.append(str(Path(tmp) / f"{k}-{i}-{j}-{n}.frame"))
                            Path(paths[-1]).write_bytes(frame)
                        parts.append({"type": "video_frames", "paths": paths, "fps": part.video_fps})
                        continue
                    for kind in ("audio", "image", "video"):
                        data = getattr(part, kind)
                        if data is not None:
                            path = Path(tmp) / f"{k}-{i}-{j}.{kind}"
                            path.write_bytes(data)
                            parts.append({"type": kind, "path": str(path)})
                            break
                    else:
                        parts.append({"type": "text", "text": part.text})
                job["messages"].append({"role": message.role.value, "content": parts})
            jobs.append(job)
        (Path(tmp) / "jobs.json").write_text(json.dumps(jobs))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(VISION_DIR), os.getcwd()]))
        done = subprocess.run([sys.executable, "-m", "services.tools.video_oracle", tmp], env=env,
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"video oracle failed:\n{done.stderr[-4000:]}")
        return [load_file(str(Path(tmp) / f"inputs-{k}.safetensors")) for k in range(len(jobs))]


def _shim_torchvision_ops() -> None:
    import torch

    lib = torch.library.Library("torchvision", "DEF")  # kept alive for the process's life
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _shim_torchvision_ops.lib = lib


def _track(path: str) -> np.ndarray:
    """A video file's first audio track, channels averaged, float32; 16 kHz only."""
    import av

    blocks = []
    with av.open(path) as container:
        stream = container.streams.audio[0]
        if stream.codec_context.sample_rate != AUDIO_SAMPLE_RATE:
            raise ValueError(f"the oracle takes 16 kHz audio tracks only, got {stream.codec_context.sample_rate} Hz")
        for frame in container.decode(stream):
            samples = frame.to_ndarray()  # planar float: [channels, samples]
            if not frame.format.is_planar:
                samples = samples.reshape(-1, len(frame.layout.channels)).T
            blocks.append(samples.astype(np.float32).mean(axis=0))
    return np.concatenate(blocks)


def _load_video(path: str):
    """transformers' `load_video(backend="pyav")`: every frame as RGB, and its `VideoMetadata`.

    The reader takes the frame count from the container (`stream.frames`), which a webm does not
    declare: there it is 0, the reader's default sampling picks no frame and fails. So for such a
    file the oracle counts the frames itself, by decoding them all (the pipeline counts packets),
    hands the reader every index, and writes the count and the duration it implies into the
    metadata, as the reader does from a declared count."""
    import av
    from transformers.video_utils import load_video

    with av.open(path) as container:
        if container.streams.video[0].frames:
            return load_video(path, backend="pyav")
        count = sum(1 for _ in container.decode(video=0))
    frames, metadata = load_video(path, backend="pyav", sample_indices_fn=lambda metadata, **_: np.arange(count))
    assert len(frames) == count, (len(frames), count)
    metadata.total_num_frames = count
    metadata.duration = count / metadata.fps
    return frames, metadata


def _build(job: dict) -> dict:
    from PIL import Image
    from transformers import (
        AutoFeatureExtractor,
        AutoImageProcessor,
        AutoTokenizer,
        AutoVideoProcessor,
        Qwen2_5OmniProcessor,
        Qwen3OmniMoeProcessor,
    )
    from transformers.video_utils import VideoMetadata

    # (in the child, after its path holds the oracle's torchvision: transformers is imported here, and
    # so is what imports it)
    from services.base.families import Family, family_of
    from services.tools.reference import oracle_audio

    folder = job["folder"]
    processor_class = Qwen2_5OmniProcessor if family_of(folder) is Family.QWEN2_5_OMNI else Qwen3OmniMoeProcessor
    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor_dict, _ = processor_class.get_processor_dict(folder)
    processor = processor_class(
        image_processor=AutoImageProcessor.from_pretrained(folder, backend="pil"),
        video_processor=AutoVideoProcessor.from_pretrained(folder),
        feature_extractor=AutoFeatureExtractor.from_pretrained(folder), tokenizer=tokenizer,
        chat_template=processor_dict.get("chat_template") or tokenizer.chat_template,
    )
    conversation, audios, images, videos, metadata_list = [], [], [], [], []
    for message in job["messages"]:
        content = []
        for part in message["content"]:
            kind = part["type"]
            content.append(part if kind == "text" else {"type": "video" if kind == "video_frames" else kind})
            if kind == "audio":
                audios.append(oracle_audio(Path(part["path"]).read_bytes(), "audio"))
            elif kind == "image":
                images.append(Image.open(part["path"]))
            elif kind == "video":
                frames, metadata = _load_video(part["path"])  # every frame; the processor samples
                videos.append(frames)
                metadata_list.append(metadata)
                if job["use_audio_in_video"]:
                    audios.append(_track(part["path"]))
            elif kind == "video_frames":  # frames as a user holds them: RGB arrays, with their rate
                frames = np.stack([np.asarray(Image.open(path).convert("RGB")) for path in part["paths"]])
                videos.append(frames)
                metadata_list.append(VideoMetadata(total_num_frames=len(frames), fps=part["fps"],
                                                   duration=len(frames) / part["fps"], height=frames.shape[1],
                                                   width=frames.shape[2]))
        conversation.append({"role": message["role"], "content": content})
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    out = processor(text=text, audio=audios or None, images=images or None, videos=videos or None,
                    use_audio_in_video=job["use_audio_in_video"], fps=job["fps"], do_sample_frames=True,
                    video_metadata=metadata_list or None, return_tensors="pt")
    return dict(out)


def main(argv: list[str] | None = None) -> int:
    tmp = Path((argv or sys.argv[1:])[0])
    _shim_torchvision_ops()
    import torch
    from safetensors.torch import save_file

    for k, job in enumerate(json.loads((tmp / "jobs.json").read_text())):
        out = _build(job)
        tensors = {name: (v if isinstance(v, torch.Tensor) else torch.tensor(v)).contiguous() for name, v in out.items()}
        save_file(tensors, str(tmp / f"inputs-{k}.safetensors"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
