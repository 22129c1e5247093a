"""Video parts: the container's header checked first, then frames sampled, resized and cut into
patches as transformers' Qwen2-VL video processor does it, and the audio track when asked for.

Decoding is PyAV's (FFmpeg bundled in the wheel). What transformers does with a video given to
`Qwen3OmniMoeProcessor` / `Qwen2_5OmniProcessor` (`fps=F`, frames sampled), step by step:
- `read_video_pyav`: total frames = the stream's declared frame count, fps = its average rate;
  frames decoded in order, the sampled ones converted to rgb24.
- `Qwen2VLVideoProcessor.sample_frames`: n = total / fps * F, clamped to [min_frames, max_frames]
  and to the frames there are, floored to a multiple of temporal_patch_size; indices
  `arange(0, total, total / n).int()`.
- resize: `smart_resize` to multiples of patch_size * merge_size between the processor's
  `size.shortest_edge` and `size.longest_edge` pixels (the omni processors' own defaults win over
  the video processor's config); torchvision's bicubic antialiased resize of uint8 frames, which
  on CPU is torch's native uint8 `interpolate` (used here directly, one frame at a time).
- rescale and normalize fused: float32 (x - mean / rescale) / (std / rescale).
- patchify: the last frame repeated up to a multiple of temporal_patch_size, then
  [grid_t * grid_h * grid_w, C * t * p * p] in merge-window order; `video_second_per_grid` is
  temporal_patch_size / F (the requested rate, not the sampled one).

torchvision itself is not importable beside the CPU torch wheel (its C++ ops are built for CUDA),
so this is the project's own code; tests/e2e/test_video_oracle.py checks it tensor for tensor
against transformers' own processor, run where torchvision imports.

Hostile input is refused from the header, before a frame is decoded: container and codec
allow-lists, frame size, declared frame count and duration. While decoding, a stream that
changes its frame size or ends before the frames it declared is refused too. Memory per video:
one decoded frame at its declared size, plus the sampled frames at their resized size (uint8),
plus the float32 patches (VIDEO_BYTES_PER_TOKEN a prompt token); the prompt token limit, checked
from the header, bounds the last two.
"""

from __future__ import annotations

import functools
import io
import math
from dataclasses import dataclass

import numpy as np

from services.base.errors import InvalidArgument
from services.runtime.inputs.limits import declared_image_size

# FFmpeg's demuxer names -> the formats accepted
CONTAINERS = {"mov,mp4,m4a,3gp,3g2,mj2": "mp4", "matroska,webm": "webm"}
VIDEO_CODECS = ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4")
AUDIO_CODECS = ("aac", "opus", "vorbis", "mp3", "flac", "pcm_s16le", "pcm_f32le")
# Probe at most this much of the container for its streams (FFmpeg's default is 5 MB).
PROBE_BYTES = 1 << 20

# Qwen2VLVideoProcessor's class defaults (transformers 5.19), where the checkpoint's
# video_preprocessor_config.json does not say otherwise.
_QWEN2_VL_VIDEO_DEFAULTS = {
    "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "min_frames": 4, "max_frames": 768,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "rescale_factor": 1 / 255,
}


@dataclass(frozen=True)
class VideoRules:
    """What the family's processor does with a video, read once from the checkpoint."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_frames: int
    max_frames: int
    min_pixels: int  # size.shortest_edge
    max_pixels: int  # size.longest_edge
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float
    fps: float  # frames sampled per second of video
    position_id_per_seconds: float  # with the audio track: time positions a second (the processor's)
    seconds_per_chunk: float  # Qwen2.5-Omni's interleave chunk

    @property
    def second_per_grid(self) -> float:
        return self.temporal_patch_size / self.fps


def video_rules(config_dict: dict, processor_defaults: dict, fps: float) -> VideoRules:
    """`config_dict`: the checkpoint's video processor config; `processor_defaults`: the omni
    processor's `videos_kwargs` defaults (they win, as in transformers' `_merge_kwargs`)."""
    merged = {**_QWEN2_VL_VIDEO_DEFAULTS, **config_dict}
    size = dict(merged.get("size") or {})
    if merged.get("min_pixels") is not None:
        size["shortest_edge"] = merged["min_pixels"]
    if merged.get("max_pixels") is not None:
        size["longest_edge"] = merged["max_pixels"]
    size.update(processor_defaults.get("size") or {})
    return VideoRules(
        patch_size=int(merged["patch_size"]), temporal_patch_size=int(merged["temporal_patch_size"]),
        merge_size=int(merged["merge_size"]), min_frames=int(merged["min_frames"]),
        max_frames=int(merged["max_frames"]), min_pixels=int(size["shortest_edge"]),
        max_pixels=int(size["longest_edge"]), image_mean=tuple(merged["image_mean"]),
        image_std=tuple(merged["image_std"]), rescale_factor=float(merged["rescale_factor"]), fps=float(fps),
        position_id_per_seconds=float(processor_defaults["position_id_per_seconds"]),
        seconds_per_chunk=float(processor_defaults["seconds_per_chunk"]),
    )


@dataclass(frozen=True)
class VideoLimits:
    max_seconds: float = 600.0  # declared duration
    max_frames: int = 36_000  # declared frames (bounds the decoding work: every frame up to the last sampled)
    max_pixels: int = 3840 * 2160  # per frame, as declared


@dataclass(frozen=True)
class AudioTrack:
    rate: int
    channels: int
    seconds: float  # declared


@dataclass(frozen=True)
class VideoHeader:
    container: str  # "mp4" or "webm"
    codec: str
    width: int
    height: int
    frames: int  # declared, or counted from the packets where the container declares none
    fps: float  # the stream's average rate
    audio: AudioTrack | None

    @property
    def seconds(self) -> float:
        return self.frames / self.fps


def _open(data: bytes, field_name: str):
    import av

    try:
        return av.open(io.BytesIO(data), mode="r", options={"probesize": str(PROBE_BYTES)})
    except (av.FFmpegError, ValueError, OSError) as exc:
        raise InvalidArgument(field_name, f"not a readable mp4/webm video ({type(exc).__name__})") from None


def declared_video(data: bytes, field_name: str, limits: VideoLimits, with_audio: bool = False) -> VideoHeader:
    """The container's header, checked against the limits before any frame is decoded."""

    if not data:
        raise InvalidArgument(field_name, "video is empty")
    with _open(data, field_name) as container:
        kind = CONTAINERS.get(container.format.name)
        if kind is None:
            raise InvalidArgument(field_name, f"container {container.format.name} is not mp4 or webm")
        if not container.streams.video:
            raise InvalidArgument(field_name, "has no video stream")
        stream = container.streams.video[0]
        codec = stream.codec_context.name
        if codec not in VIDEO_CODECS:
            raise InvalidArgument(field_name, f"video codec {codec} is not one of {', '.join(VIDEO_CODECS)}")
        width, height = int(stream.codec_context.width), int(stream.codec_context.height)
        if width <= 0 or height <= 0:
            raise InvalidArgument(field_name, f"video frames are {width}x{height} pixels")
        if width * height > limits.max_pixels:
            raise InvalidArgument(field_name, f"video frames have {width * height} pixels ({width}x{height}), "
                                              f"more than {limits.max_pixels}")
        rate = stream.average_rate
        if not rate or rate <= 0:
            raise InvalidArgument(field_name, "video declares no frame rate")
        fps = float(rate)
        seconds = _declared_seconds(container, stream)
        if seconds is not None and seconds > limits.max_seconds:
            raise InvalidArgument(field_name, f"video is {seconds:.1f} s, longer than {limits.max_seconds} s")
        frames = int(stream.frames)
        if frames > limits.max_frames:
            raise InvalidArgument(field_name, f"video declares {frames} frames, more than {limits.max_frames}")
        if frames / fps > limits.max_seconds:
            raise InvalidArgument(field_name, f"video is {frames / fps:.1f} s, longer than {limits.max_seconds} s")
        audio = _declared_track(container, field_name, seconds) if with_audio else None
        if frames == 0:  # a container without a frame count (webm): count the packets, no decoding
            frames = _count_packets(container, stream, field_name, limits)
            # Fewer frames than the declared duration holds (two frames of slack): cut short.
            if seconds is not None and frames < seconds * fps - 2:
                raise InvalidArgument(field_name, f"video holds {frames} frames, fewer than its {seconds:.2f} s at "
                                                  f"{fps:g} fps declare (truncated?)")
    if frames <= 0:
        raise InvalidArgument(field_name, "video has no frames")
    return VideoHeader(kind, codec, width, height, frames, fps, audio)


def _declared_track(container, field_name: str, video_seconds: float | None) -> AudioTrack:
    """The audio track's header (use_audio_in_video), checked before a sample is decoded."""
    if not container.streams.audio:
        raise InvalidArgument(field_name, "use_audio_in_video is set but the video has no audio track")
    track = container.streams.audio[0]
    if track.codec_context.name not in AUDIO_CODECS:
        raise InvalidArgument(field_name, f"audio codec {track.codec_context.name} is not one of "
                                          f"{', '.join(AUDIO_CODECS)}")
    rate = int(track.codec_context.sample_rate or 0)
    if rate <= 0:
        raise InvalidArgument(field_name, "the audio track declares no sample rate")
    seconds = _declared_seconds(container, track) or (video_seconds or 0.0)
    return AudioTrack(rate, int(track.codec_context.channels), seconds)


def declared_frames(frames: tuple[bytes, ...], fps: float, field_name: str, limits: VideoLimits,
                    with_audio: bool = False) -> VideoHeader:
    """A video given as png/jpeg frames: every frame's header (one size for all), checked against
    the limits before any is decoded."""
    if with_audio:
        raise InvalidArgument(field_name, "use_audio_in_video is set but video frames carry no audio track")
    if not fps > 0:
        raise InvalidArgument(f"{field_name}.fps", f"must be > 0, got {fps}")
    if not frames:
        raise InvalidArgument(f"{field_name}.frames", "at least one frame is required")
    if len(frames) > limits.max_frames:
        raise InvalidArgument(f"{field_name}.frames", f"{len(frames)} frames, more than {limits.max_frames}")
    if len(frames) / fps > limits.max_seconds:
        raise InvalidArgument(field_name, f"video is {len(frames) / fps:.1f} s, longer than {limits.max_seconds} s")
    sizes = [declared_image_size(frame, f"{field_name}.frames[{k}]") for k, frame in enumerate(frames)]
    width, height = sizes[0]
    for k, size in enumerate(sizes):
        if size != (width, height):
            raise InvalidArgument(f"{field_name}.frames[{k}]", f"is {size[0]}x{size[1]}, not {width}x{height} "
                                                               "as frame 0")
    if width <= 0 or height <= 0 or width * height > limits.max_pixels:
        raise InvalidArgument(field_name, f"video frames have {width * height} pixels ({width}x{height}), "
                                          f"not 1..{limits.max_pixels}")
    return VideoHeader("frames", "png/jpeg", width, height, len(frames), float(fps), None)


def _declared_seconds(container, stream) -> float | None:
    if stream.duration is not None and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        import av

        return container.duration / av.time_base
    return None


def _count_packets(container, stream, field_name: str, limits: VideoLimits) -> int:
    import av

    count = 0
    try:
        for packet in container.demux(stream):
            if packet.size == 0:
                continue
            count += 1
            if count > limits.max_frames:
                raise InvalidArgument(field_name, f"video has more than {limits.max_frames} frames")
    except av.FFmpegError as exc:
        raise InvalidArgument(field_name, f"not a readable mp4/webm video ({type(exc).__name__})") from None
    return count


def sample_indices(rules: VideoRules, header: VideoHeader, field_name: str) -> np.ndarray:
    """Frame indices the processor keeps (Qwen2VLVideoProcessor.sample_frames with fps)."""
    t = rules.temporal_patch_size
    total = header.frames
    max_frames = math.floor(min(rules.max_frames, total) / t) * t
    n = total / header.fps * rules.fps
    n = min(max(n, rules.min_frames), max_frames, total)
    n = math.floor(n / t) * t
    if n <= 0:
        raise InvalidArgument(field_name, f"video has {total} frames, fewer than the {t} one temporal patch needs")
    import torch

    return torch.arange(0, total, total / n).int().numpy()


def resized_size(rules: VideoRules, height: int, width: int, field_name: str) -> tuple[int, int]:
    """(height, width) after Qwen2-VL's smart_resize."""
    factor = rules.patch_size * rules.merge_size
    if max(height, width) / min(height, width) > 200:
        raise InvalidArgument(field_name, f"video is {width}x{height}: aspect ratio over 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > rules.max_pixels:
        beta = math.sqrt((height * width) / rules.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < rules.min_pixels:
        beta = math.sqrt(rules.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_grid(rules: VideoRules, header: VideoHeader, field_name: str) -> tuple[int, int, int]:
    """(grid_t, grid_h, grid_w) in patches, from the header alone."""
    n = len(sample_indices(rules, header, field_name))
    h, w = resized_size(rules, header.height, header.width, field_name)
    return -(-n // rules.temporal_patch_size), h // rules.patch_size, w // rules.patch_size


def video_tokens(rules: VideoRules, grid: tuple[int, int, int]) -> int:
    t, h, w = grid
    return t * h * w // rules.merge_size ** 2


def bytes_per_token(rules: VideoRules) -> int:
    """float32 patch bytes one video prompt token holds."""
    return 4 * rules.merge_size ** 2 * 3 * rules.temporal_patch_size * rules.patch_size ** 2


def build_bytes(rules: VideoRules, header: VideoHeader, field_name: str = "video") -> int:
    """The most memory building one video's patches takes (docs/video.md), from its header: one
    decoded frame at its declared size (yuv420 and RGB: 4.5 bytes a pixel), the sampled frames at
    their resized size twice (uint8: in frame order and in patch order) and the float32 patches."""
    height, width = resized_size(rules, header.height, header.width, field_name)
    grid = video_grid(rules, header, field_name)
    frames = grid[0] * rules.temporal_patch_size  # the sampled frames, a whole number of temporal patches
    return (int(4.5 * header.width * header.height) + 2 * frames * 3 * height * width
            + video_tokens(rules, grid) * bytes_per_token(rules))


@dataclass
class DecodedVideo:
    pixel_values: object  # torch.Tensor [grid_t * grid_h * grid_w, C * t * p * p] float32
    grid: tuple[int, int, int]
    audio: np.ndarray | None  # mono float32 at the track's rate
    audio_rate: int


def decode_video(data: bytes, field_name: str, header: VideoHeader, rules: VideoRules,
                 with_audio: bool = False) -> DecodedVideo:
    """Decode the sampled frames (and the audio track) of a video whose header passed."""
    import av
    import torch

    indices = sample_indices(rules, header, field_name)
    slot = {int(i): k for k, i in enumerate(indices)}  # frame index -> its place among the sampled
    last = int(indices[-1])
    height, width = resized_size(rules, header.height, header.width, field_name)
    # The sampled frames' home, allocated before any frame is decoded: a resized frame allocated
    # while its full-size RGB array is alive would split the hole that array leaves, and the next
    # frame's array would grow the heap instead (measured at 3840x2160: ~9 MB kept a sampled frame).
    frames = torch.empty((len(indices), 3, height, width), dtype=torch.uint8)  # [T, 3, H, W]
    filled = 0
    try:
        with _open(data, field_name) as container:
            stream = container.streams.video[0]
            for i, frame in enumerate(container.decode(stream)):
                if i > last:
                    break
                if frame.width != header.width or frame.height != header.height:
                    raise InvalidArgument(field_name, f"frame {i} is {frame.width}x{frame.height}, not the "
                                                      f"{header.width}x{header.height} the header declares")
                if i in slot:  # [3, H, W], a view of the decoded HWC array (channels-last): no copy
                    rgb = torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1)
                    frames[slot[i]].copy_(_resize(rgb, height, width))
                    del rgb
                    filled += 1
                    _give_back_freed_memory()
            audio = _decode_audio(container, field_name) if with_audio else None
    except av.FFmpegError as exc:
        raise InvalidArgument(field_name, f"not a readable mp4/webm video, truncated or corrupt "
                                          f"({type(exc).__name__})") from None
    if filled < len(slot):
        raise InvalidArgument(field_name, f"video ends after fewer frames than the {header.frames} it declares "
                                          "(truncated?)")
    pixel_values, grid = normalized_patches(rules, frames)
    rate = header.audio.rate if header.audio is not None else 0
    return DecodedVideo(pixel_values, grid, audio, rate)


def video_from_frames(frames: list[np.ndarray], rules: VideoRules) -> DecodedVideo:
    """The sampled frames of a video given as images ([H, W, 3] uint8 RGB each) -> its patches."""
    import torch

    height, width = resized_size(rules, frames[0].shape[0], frames[0].shape[1], "video_frames")
    resized = [_resize(torch.from_numpy(np.array(f, dtype=np.uint8)).permute(2, 0, 1), height, width)
               for f in frames]
    pixel_values, grid = normalized_patches(rules, torch.stack(resized))
    return DecodedVideo(pixel_values, grid, None, 0)


def _give_back_freed_memory() -> None:
    """glibc's malloc_trim: return the freed full-size frame buffers to the kernel. Without it
    glibc keeps them (past the first free of a large block it raises its mmap threshold to that
    size and serves the next ones from the heap), and each sampled frame left ~12 MB more resident
    at 3840x2160: the peak grew with the frame count, by the allocator's whim (73-193 MB measured
    for the same 8 frames). A no-op where libc has no malloc_trim."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def _resize(frame, height: int, width: int):
    """torchvision's tensor resize (bicubic, antialias) of one uint8 frame, [3, H, W] -> [3, h, w]
    (contiguous). Given the decoded frame's own channels-last layout: torch's uint8 antialiased
    path runs on that layout and first copies a contiguous [3, H, W] into it, so a contiguous input
    cost two more full-size copies (53 MB at 3840x2160; the output is the same, bit for bit)."""
    import torch.nn.functional as F

    if tuple(frame.shape[-2:]) == (height, width):
        return frame.contiguous()
    return F.interpolate(frame[None], size=[height, width], mode="bicubic", align_corners=False,
                         antialias=True)[0].contiguous()


def normalized_patches(rules: VideoRules, frames) -> tuple[object, tuple[int, int, int]]:
    """uint8 [T, 3, H, W] -> float32 patches: transformers' fused rescale + normalize, then its
    patching. Patched first (in uint8) and normalized in place after, which gives the same values
    (the same elementwise operations on the same pixels) with one float32 copy alive, not two."""
    import torch

    patches, grid = patchify(rules, frames)
    n, width = patches.shape
    mean = (torch.tensor(rules.image_mean) * (1.0 / rules.rescale_factor)).view(1, -1, 1)
    std = (torch.tensor(rules.image_std) * (1.0 / rules.rescale_factor)).view(1, -1, 1)
    values = patches.to(torch.float32)
    values.view(n, mean.shape[1], -1).sub_(mean).div_(std)  # the patch's last dim is (C, t, p, p)
    return values, grid


def patchify(rules: VideoRules, frames) -> tuple[object, tuple[int, int, int]]:
    """[T, C, H, W] -> ([grid_t * grid_h * grid_w, C * t * p * p], (grid_t, grid_h, grid_w))."""
    import torch

    t, p, m = rules.temporal_patch_size, rules.patch_size, rules.merge_size
    if pad := -frames.shape[0] % t:
        frames = torch.cat((frames, frames[-1:].expand(pad, -1, -1, -1)), dim=0)
    n, c, h, w = frames.shape
    gt, gh, gw = n // t, h // p, w // p
    patches = frames.view(gt, t, c, gh // m, m, p, gw // m, m, p)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(gt * gh * gw, c * t * p * p), (gt, gh, gw)


def _decode_audio(container, field_name: str) -> np.ndarray:
    """The first audio track, channels averaged, float32 at its own rate."""
    blocks = []
    container.seek(0)
    for frame in container.decode(container.streams.audio[0]):
        samples = frame.to_ndarray()
        if frame.format.is_planar:
            block = samples.astype(np.float32)  # [channels, samples]
        else:
            block = samples.reshape(-1, len(frame.layout.channels)).T.astype(np.float32)
        if np.issubdtype(samples.dtype, np.integer):
            block = block / float(np.iinfo(samples.dtype).max + 1)
        blocks.append(block.mean(axis=0))
    if not blocks:
        raise InvalidArgument(field_name, "the audio track has no samples")
    return np.concatenate(blocks).astype(np.float32)
