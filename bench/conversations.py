"""`omni-bench --conversations C`: conversations of several turns, where the prefix cache and prefix
routing matter, measured side by side in one run.

Each conversation is a long system prompt and T user turns; every turn re-sends the history (the
earlier user turns and the model's own replies), as a voice assistant's client does, so the
history grows by a user paragraph and a reply per turn (past 1,500 prompt tokens by turn 8 on
the tokenizer of the generated checkpoints). Two comparisons, the systems alternating turn by turn
so drift hits both alike:

- cache: one thinker with its prefix cache against one with `--prefix-cache-mb 0`, C conversations
  at once, text and audio: TTFT and TTFP of every turn, p50 of the last one compared.
- routing: two thinker replicas behind a router with `--routing random` against `--routing prefix`,
  R conversations at once (text only: the thinker is what routing moves): the share of the
  cacheable prompt tokens that hit, and each replica's requests.

"Cacheable" tokens of a turn are the whole blocks of the previous turn's prompt (what a single
replica with a large enough cache holds of it when the turn arrives): the hit rate is the hit
tokens over them. The stacks run `--exact-batching gemm` on a CPU in float32 (hits exact by
construction) unless `--exact-batching` says otherwise; with per-row kernels (`on`) exact mode
refuses hits and the cache cannot help.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import re
import statistics
from dataclasses import asdict, dataclass, field

import grpc

from bench.config import BenchConfig
from bench.loop import closed_loop
from bench.machine import describe_machine
from bench.stage_metrics import scrape
from omni.v1 import common_pb2, omni_pb2
from services.base.stages import Stage
from services.runtime.lm.prefix.keys import BLOCK_TOKENS
from services.serving.stage_stubs import stage_stub
from services.tools.client import collect, connect
from services.tools.launcher import Stack, StackOptions, free_port_block

SYSTEM_PROMPT = " ".join((
    "You are a helpful voice assistant in a busy household.", "Answer briefly and warmly, in plain words.",
    "When a question is unclear, ask one short question back instead of guessing.",
    "Keep track of what was said earlier in the conversation and refer back to it when it helps.",
    "Never read out long lists; offer the two or three most useful items and ask whether more are wanted.",
    "For cooking, give quantities in grams and millilitres and say how long each step takes.",
    "For travel, mention the time of day, the weather and how busy a place usually is.",
    "For health questions, give general information only and suggest seeing a professional when in doubt.",
    "Speak numbers the way people say them aloud, and spell out abbreviations.",
    "If the user sounds stressed, slow down, acknowledge it, and keep the answer even shorter.",
    "The household has two adults, two children aged seven and eleven, a dog called Pepper and a small garden.",
    "They live near the coast, cycle to school and work, and cook at home most evenings.",
))
USER_SENTENCES = (
    "We are planning dinner for tonight and have rice, eggs, spinach, a lemon and some feta in the fridge.",
    "The children want something they can help with, and the younger one does not like spicy food.",
    "Tomorrow we might cycle to the lighthouse if the wind is not too strong in the afternoon.",
    "Pepper has been limping a little since the walk on the beach on Sunday morning.",
    "I also need a reminder to water the tomatoes and to order new brake pads for my bike.",
    "Could you compare the two options we talked about and tell me which one you would pick?",
    "My eleven-year-old asked why the sea looks green near the harbour and blue further out.",
    "We have about forty minutes before we need to leave, so keep it simple, please.",
)


PLACEHOLDER = re.compile(r"<\|[a-z_]+_pad\|>")


def user_turn(conversation: int, turn: int) -> str:
    """A paragraph of about 130 tokens, different for every conversation and turn."""
    sentences = [USER_SENTENCES[(conversation + turn + k) % len(USER_SENTENCES)] for k in range(5)]
    return f"(Conversation {conversation}, turn {turn + 1}.) " + " ".join(sentences)


@dataclass
class TurnRecord:
    system: str
    conversation: int
    turn: int  # 0-based
    prompt_tokens: int = 0
    ttft_ms: float | None = None
    ttfp_ms: float | None = None
    error: str | None = None


@dataclass
class Conversation:
    index: int
    request: omni_pb2.GenerateRequest
    records: list[TurnRecord] = field(default_factory=list)


def new_conversations(n: int, audio: bool, max_new_tokens: int, talker_max_new_tokens: int) -> list[Conversation]:
    out = []
    for c in range(n):
        request = omni_pb2.GenerateRequest()
        # Its own system prompt: conversations share no blocks, so what hits is their own history.
        request.messages.add(role=omni_pb2.ROLE_SYSTEM).content.add(text=f"(Session {c}.) {SYSTEM_PROMPT}")
        request.output_modalities.append(omni_pb2.MODALITY_TEXT)
        request.thinker_sampling.max_new_tokens = max_new_tokens
        if audio:
            request.output_modalities.append(omni_pb2.MODALITY_AUDIO)
            request.talker_sampling.max_new_tokens = talker_max_new_tokens
        out.append(Conversation(c, request))
    return out


def run_turn(system: str, stub, conversations: list[Conversation], turn: int, timeout_s: float) -> None:
    """Turn `turn` of every conversation at once; each reply joins its history."""
    for conversation in conversations:
        conversation.request.messages.add(role=omni_pb2.ROLE_USER).content.add(
            text=user_turn(conversation.index, turn))

    def call(conversation: Conversation) -> TurnRecord:
        record = TurnRecord(system, conversation.index, turn)
        try:
            got = collect(stub, conversation.request, timeout=timeout_s)
        except grpc.RpcError as exc:
            record.error = f"{exc.code().name}: {exc.details()}"
            return record
        record.prompt_tokens = got.final.usage.prompt_tokens
        record.ttft_ms, record.ttfp_ms = got.ttft_ms, got.ttfp_ms
        # A generated checkpoint's random weights say media placeholders a client never sends back
        # (the thinker refuses them in text: INVALID_ARGUMENT); a trained model does not say them.
        reply = PLACEHOLDER.sub("", got.text)
        conversation.request.messages.add(role=omni_pb2.ROLE_ASSISTANT).content.add(text=reply)
        return record

    def failed(exc: Exception) -> TurnRecord:
        return TurnRecord(system, -1, turn, error=f"{type(exc).__name__}: {exc}")

    records, _ = closed_loop(conversations, len(conversations), call, failed)
    for conversation, record in zip(conversations, records):
        conversation.records.append(record)


def cacheable_tokens(conversations: list[Conversation]) -> int:
    """Whole blocks of each turn's previous prompt, at most what the turn may take from the cache."""
    total = 0
    for conversation in conversations:
        for before, now in zip(conversation.records, conversation.records[1:]):
            usable = max(now.prompt_tokens - 1, 0) // BLOCK_TOKENS
            total += min(before.prompt_tokens // BLOCK_TOKENS, usable) * BLOCK_TOKENS
    return total


def p50(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


@dataclass
class SystemSummary:
    name: str
    last_turn_ttft_ms: float | None
    last_turn_ttfp_ms: float | None
    ttft_ms_by_turn: list[float | None]
    prompt_tokens_by_turn: list[float | None]
    hit_tokens: int
    lookup_tokens: int
    refused_tokens: int
    cacheable_tokens: int
    requests_per_replica: dict[str, int]
    errors: list[str]  # the failed turns' errors

    @property
    def hit_rate(self) -> float | None:
        return self.hit_tokens / self.cacheable_tokens if self.cacheable_tokens else None


def thinker_counters(stack: Stack) -> tuple[dict[str, float], dict[str, int]]:
    """omni_prefix_cache_* counters summed over the stack's thinkers, and each thinker's streams."""
    totals: dict[str, float] = {}
    streams = {}
    for name, process in stack.processes.items():
        if process.stage != "thinker":
            continue
        port = process.args[process.args.index("--metrics-port") + 1]
        for (sample, _), value in scrape(f"http://{stack.options.host}:{port}/metrics").items():
            if sample.startswith("omni_prefix_cache_") and sample.endswith("_total"):
                totals[sample] = totals.get(sample, 0.0) + value
        with grpc.insecure_channel(f"{stack.options.host}:{process.port}") as channel:
            load = stage_stub(Stage.THINKER, channel).GetLoad(common_pb2.LoadRequest(), timeout=10)
        streams[name] = int(load.streams_total)
    return totals, streams


def summarize(name: str, stack: Stack, conversations: list[Conversation], turns: int) -> SystemSummary:
    totals, streams = thinker_counters(stack)
    by_turn = [p50(c.records[t].ttft_ms for c in conversations) for t in range(turns)]
    return SystemSummary(
        name=name, last_turn_ttft_ms=by_turn[-1],
        last_turn_ttfp_ms=p50(c.records[-1].ttfp_ms for c in conversations), ttft_ms_by_turn=by_turn,
        prompt_tokens_by_turn=[p50(c.records[t].prompt_tokens or None for c in conversations) for t in range(turns)],
        hit_tokens=int(totals.get("omni_prefix_cache_hit_tokens_total", 0)),
        lookup_tokens=int(totals.get("omni_prefix_cache_lookup_tokens_total", 0)),
        refused_tokens=int(totals.get("omni_prefix_cache_refused_tokens_total", 0)),
        cacheable_tokens=cacheable_tokens(conversations), requests_per_replica=streams,
        errors=[f"conversation {c.index} turn {r.turn + 1}: {r.error}" for c in conversations for r in c.records
                if r.error is not None])


class Comparison:
    """Two stacks, the same conversations on each, turn by turn in alternating order."""

    def __init__(self, config: BenchConfig, systems: dict[str, StackOptions], conversations: int, audio: bool):
        self.config, self.systems, self.audio = config, systems, audio
        self.conversations = {name: new_conversations(conversations, audio, config.max_new_tokens,
                                                      config.talker_max_new_tokens) for name in systems}

    def run(self, progress) -> list[SystemSummary]:
        with contextlib.ExitStack() as cleanup:
            stacks = {}
            for name, options in self.systems.items():
                progress(f"starting the {name} stack")
                stacks[name] = cleanup.enter_context(Stack(options))
            channels = {name: connect(stack.target) for name, stack in stacks.items()}
            for channel, _ in channels.values():
                cleanup.callback(channel.close)
            names = list(self.systems)
            for turn in range(self.config.turns):
                for name in names if turn % 2 == 0 else names[::-1]:
                    progress(f"{name}: turn {turn + 1}/{self.config.turns}")
                    run_turn(name, channels[name][1], self.conversations[name], turn, self.config.timeout_s)
            return [summarize(name, stacks[name], self.conversations[name], self.config.turns) for name in names]


def exact_mode(config: BenchConfig) -> str:
    """auto: the invariant GEMM where it runs (hits exact by construction), else the stage default."""
    if config.exact_batching != "auto":
        return config.exact_batching
    return "gemm" if config.device == "cpu" and config.dtype == "float32" else "auto"


def stack_options(config: BenchConfig, thinkers: int, thinker_args: tuple[str, ...] = (),
                  router_args: tuple[str, ...] = ()) -> StackOptions:
    exact = ("--exact-batching", exact_mode(config))
    return StackOptions(
        checkpoint=config.checkpoint, port=0, threads=config.threads, thinker_replicas=thinkers,
        thinker_args=config.stage_args() + exact + thinker_args, talker_args=config.talker_args() + exact,
        code2wav_args=config.stage_args(), router_args=router_args, log_prefix=False,
        metrics_base_port=free_port_block(count=8), device=config.device, cpu_layout=config.cpu_layout)


def run_conversations(config: BenchConfig, progress=print) -> dict:
    """Both comparisons; the report as a JSON-ready dict."""
    cache = Comparison(config, {"cache-on": stack_options(config, 1),
                                "cache-off": stack_options(config, 1, ("--prefix-cache-mb", "0"))},
                       config.conversations, audio=True).run(progress)
    routing = Comparison(config, {"random": stack_options(config, 2, router_args=("--routing", "random")),
                                  "prefix": stack_options(config, 2, router_args=("--routing", "prefix"))},
                         config.routing_conversations, audio=False).run(progress)
    on, off = cache
    return {
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": asdict(describe_machine()), "checkpoint": config.checkpoint, "preset": config.preset,
        "exact_batching": exact_mode(config), "turns": config.turns, "conversations": config.conversations,
        "routing_conversations": config.routing_conversations,
        "cache": [asdict(s) | {"hit_rate": s.hit_rate} for s in cache],
        "routing": [asdict(s) | {"hit_rate": s.hit_rate} for s in routing],
        "last_turn_ttft_speedup": _ratio(off.last_turn_ttft_ms, on.last_turn_ttft_ms),
        "last_turn_ttfp_speedup": _ratio(off.last_turn_ttfp_ms, on.last_turn_ttfp_ms),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def render(report: dict) -> str:
    def ms(v):
        return "-" if v is None else f"{v:.0f}"

    lines = [f"conversations: {report['conversations']} x {report['turns']} turns (cache), "
             f"{report['routing_conversations']} (routing); exact batching {report['exact_batching']}",
             "system      last-turn TTFT p50  TTFP p50  hit rate  hit/lookup tokens  requests per thinker  errors"]
    for s in report["cache"] + report["routing"]:
        rate = "-" if s["hit_rate"] is None else f"{100 * s['hit_rate']:.0f}%"
        per = ", ".join(str(v) for v in s["requests_per_replica"].values())
        lines.append(f"{s['name']:<11} {ms(s['last_turn_ttft_ms']):>18}  {ms(s['last_turn_ttfp_ms']):>8}  {rate:>8}  "
                     f"{s['hit_tokens']:>8}/{s['lookup_tokens']:<8}  {per:>20}  {len(s['errors']):>6}")
    speedup = report["last_turn_ttft_speedup"]
    lines.append("last turn TTFT, cache off / on: " + ("-" if speedup is None else f"{speedup:.2f}x")
                 + "; TTFP: " + ("-" if report["last_turn_ttfp_speedup"] is None
                                 else f"{report['last_turn_ttfp_speedup']:.2f}x"))
    return "\n".join(lines)


def write(report: dict, config: BenchConfig) -> str:
    config.out.mkdir(parents=True, exist_ok=True)
    path = config.out / "conversations.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    return str(path)
