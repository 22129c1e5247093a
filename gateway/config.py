"""The gateway's configuration, from its flags and what it reads of a checkpoint: its config.json
alone, as JSON (no transformers, no weights), for the family, the voices and the end token."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from gateway.errors import bad_request
from gateway.voices import resolve_voice
from services.base.errors import UserError
from services.base.families import DEFAULT_VOICES, Family
from services.serving.replicas import ReplicaSource
from services.serving.security import TLSConfig, load_tokens, tls_from_args


@dataclass(frozen=True)
class GatewayConfig:
    router: str = "localhost:50051"
    # The sessions service's replicas (omni-session), /v1/realtime's sessions: host:port[,host:port] or
    # dns:///name:port (every address of a headless Service, re-resolved), each session to the least loaded.
    sessions: str = "localhost:50052"
    host: str = "0.0.0.0"
    port: int = 8000
    model: str = "qwen3-omni"
    voices: tuple[str, ...] = ()  # the checkpoint's speakers; empty = unknown (the router checks)
    timeout_s: float = 600.0  # deadline of every router call
    tls: TLSConfig = TLSConfig()  # gateway -> router
    max_message_bytes: int = 64 << 20
    max_body_bytes: int = 96 << 20  # HTTP request bodies (base64 makes a 64 MB message about 86 MB)
    end_token_id: int = 151645  # <|im_end|>: its text is not part of an OpenAI reply
    end_token_text: str = "<|im_end|>"
    family: Family = Family.QWEN3_OMNI  # the checkpoint's (its config.json model_type), for the default voice
    auth_tokens: tuple[bytes, ...] = ()  # callers' bearer tokens; empty = no check here (the router may check)
    send_timeout_s: float = 30.0  # a streamed write blocked this long (the client stopped reading) ends the call
    max_audio_seconds: float = 300.0  # per mp3 input audio part (the thinker's --max-audio-seconds default)
    router_refresh_s: float = 60.0  # a new channel (a new DNS resolution) this often: new router pods get calls

    @property
    def default_voice(self) -> str | None:
        """The voice a request without one gets, as the thinker picks it (families.DEFAULT_VOICES)."""
        if not self.voices:
            return None
        default = DEFAULT_VOICES[self.family].lower()
        return default if default in self.voices else self.voices[0]

    def voice(self, name: str, param: str) -> str:
        """The checkpoint voice a request's voice names (OpenAI's names mapped: gateway/voices.py);
        400 naming `param` for one the checkpoint does not have."""
        resolved = resolve_voice(name, self.voices, self.default_voice)
        if self.voices and resolved not in self.voices:
            raise bad_request(param, f"{param}: unknown voice {name!r}; known: "
                                     f"{', '.join(sorted(self.voices))} and OpenAI's names (docs/gateway.md)")
        return resolved


def read_checkpoint_config(folder: str | Path) -> dict:
    """A checkpoint's config.json (either family), read as JSON (no transformers, no weights)."""
    path = Path(folder) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"--checkpoint {folder}: cannot read config.json: {exc}") from None


def family_from_config(config: dict) -> Family:
    """The family its model_type names; Qwen3-Omni when there is none (no --checkpoint)."""
    try:
        return Family(config.get("model_type", Family.QWEN3_OMNI.value))
    except ValueError:
        raise UserError(f"--checkpoint: model_type {config.get('model_type')!r} is no omni family") from None


def voices_from_config(config: dict) -> tuple[str, ...]:
    """Qwen3-Omni: the speakers (talker_config.speaker_id), as services/runtime/inputs/prompt.py speaker_names
    reads them. Qwen2.5-Omni keeps its voices in spk_dict.pt, a torch file this process cannot read:
    none here (`omni-serve up` passes them as --voices; without them the thinker checks)."""
    if family_from_config(config) is not Family.QWEN3_OMNI:
        return ()
    return tuple(str(name).lower() for name in (config.get("talker_config") or {}).get("speaker_id", {}))


def end_token_from_config(config: dict) -> int:
    """The thinker's <|im_end|> id: Qwen3-Omni's im_end_token_id, Qwen2.5-Omni's thinker eos_token_id."""
    if family_from_config(config) is Family.QWEN2_5_OMNI:
        value = (config.get("thinker_config") or {}).get("eos_token_id")
    else:
        value = config.get("im_end_token_id")
    return GatewayConfig.end_token_id if value is None else int(value)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    checkpoint = read_checkpoint_config(args.checkpoint) if args.checkpoint else {}
    voices = voices_from_config(checkpoint)
    if args.voices:
        voices = tuple(v.strip().lower() for v in args.voices.split(",") if v.strip())
    tokens = load_tokens(args.auth_token_file)
    if args.require_auth and not tokens:
        raise UserError("--require-auth: no tokens (--auth-token-file or OMNI_AUTH_TOKENS)")
    ReplicaSource.parse(args.sessions, "--sessions")  # a bad value fails at start, naming the flag
    return GatewayConfig(
        router=args.router, sessions=args.sessions, host=args.host, port=args.port, voices=voices,
        model=args.model_name or (Path(args.checkpoint).name if args.checkpoint else "qwen3-omni"),
        timeout_s=args.timeout_s, tls=tls_from_args(args), max_message_bytes=args.max_message_mb << 20,
        max_body_bytes=args.max_body_mb << 20, end_token_id=end_token_from_config(checkpoint),
        family=family_from_config(checkpoint), auth_tokens=tokens, send_timeout_s=args.send_timeout_s,
        max_audio_seconds=args.max_audio_seconds, router_refresh_s=args.router_refresh_s)
