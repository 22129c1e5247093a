"""The prompt set: built in, or a JSONL file, one object per line:

    {"prompt": "What do you hear?", "system": "Answer briefly.", "audio": "clips/a.wav", "image": "img/b.png",
     "video": "clips/c.mp4"}

Only `prompt` is required; relative `audio` / `image` / `video` paths are read from the JSONL file's
folder. The built-in mix has one video prompt: a 2 s, 6 fps, 64x48 clip made here (PyAV), 4 frames
sampled, 280 video tokens on the tiny checkpoint.
Files are read once, at load time, so no disk I/O lands inside a timed request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from services.base.errors import UserError
from services.runtime.inputs.prompt import ChatMessage, Part, Role
from services.tools.synthetic_video import video

# Short everyday requests of different lengths, as a voice assistant gets them.
BUILT_IN = (
    "Hello! How are you today?",
    "Tell me a short story about a small robot who learns to paint.",
    "What is the capital of France, and what is it famous for?",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for sleeping better.",
    "Translate 'good morning, my friend' into Spanish and German.",
    "What should I cook tonight with rice, eggs and spinach?",
    "Describe a sunrise over the sea to someone who has never seen one.",
)
BUILT_IN_SYSTEM = "You are a helpful voice assistant. Answer briefly."
BUILT_IN_VIDEO = "What happens in this clip?"


@dataclass(frozen=True)
class BenchPrompt:
    text: str
    system: str | None = None
    audio: bytes | None = None  # wav/flac file bytes
    image: bytes | None = None  # png/jpeg file bytes
    video: bytes | None = None  # mp4/webm file bytes
    label: str = ""  # where it came from, for messages: "built-in 3", "prompts.jsonl:7"

    @property
    def modalities(self) -> str:
        return "+".join(["text"] + (["audio"] if self.audio else []) + (["image"] if self.image else [])
                        + (["video"] if self.video else []))

    def messages(self) -> list[ChatMessage]:
        """The same conversation the pipeline request carries, for the in-process reference."""
        parts = [Part(audio=self.audio)] if self.audio else []
        parts += [Part(image=self.image)] if self.image else []
        parts += [Part(video=self.video)] if self.video else []
        user = ChatMessage(Role.USER, tuple(parts) + (Part(text=self.text),))
        return ([ChatMessage(Role.SYSTEM, (Part(text=self.system),))] if self.system else []) + [user]


def built_in_prompts() -> list[BenchPrompt]:
    prompts = [BenchPrompt(text, BUILT_IN_SYSTEM, label=f"built-in {i}") for i, text in enumerate(BUILT_IN)]
    clip = video(frames=12, width=64, height=48, fps=6, seed=7)
    return prompts + [BenchPrompt(BUILT_IN_VIDEO, BUILT_IN_SYSTEM, video=clip, label=f"built-in {len(prompts)}")]


def load_jsonl(path: Path) -> list[BenchPrompt]:
    if not path.is_file():
        raise UserError(f"--prompts {path}: file not found")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"]:
            raise UserError(f'{where}: expected an object with a non-empty "prompt" string')
        unknown = set(item) - {"prompt", "system", "audio", "image", "video"}
        if unknown:
            raise UserError(f"{where}: unknown keys {sorted(unknown)} (known: prompt, system, audio, image, video)")
        files = {}
        for kind in ("audio", "image", "video"):
            if item.get(kind):
                file = Path(item[kind])
                file = file if file.is_absolute() else path.parent / file
                if not file.is_file():
                    raise UserError(f"{where}: {kind} file not found: {file}")
                files[kind] = file.read_bytes()
        prompts.append(BenchPrompt(item["prompt"], item.get("system") or None, label=where, **files))
    if not prompts:
        raise UserError(f"--prompts {path}: no prompts in the file")
    return prompts
