"""Figure: docs/observability.md, "What tracing costs": the same stack with tracing off and on (every
request traced, spans exported over OTLP/gRPC to a collector in this process), side by side, in
alternating rounds. Rerun: `.venv/bin/python -m bench.probes.tracing_cost --concurrency 1,16
--requests 8 --rounds 8` (`--grpc-only`: one gRPC hop).

Two stacks of the same configuration run at once; within each concurrency level the rounds
alternate which one goes first, so drift hits both. Prints requests per second of each and their
ratio (traced / untraced) per level, and writes tracing_cost.json. The collector runs in this
process, beside the load generator: a real one runs elsewhere, so this errs on the costly side.

Requests per second are only as steady as the machine: on shared cores they swing by tens of
percent from round to round, far more than the cost looked for. So it also counts the CPU seconds
the stack's processes (router and stages, /proc/<pid>/stat) spend per completed request, which
other load on the machine barely moves: on CPU-bound cores, req/s falls as CPU per request rises.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.presets import PRESETS, ensure_checkpoint
from bench.prompts import built_in_prompts
from bench.systems import PipelineSystem
from services.base.errors import run_cli
from services.tools.launcher import Stack, StackOptions
from services.tools.otlp_sink import OtlpSink

TINY_CHECKPOINT = Path("models/tiny-qwen3-omni")  # what make setup writes

@dataclass(frozen=True)
class Level:
    concurrency: int
    requests: int  # per stack and round
    untraced_req_per_s: list[float]  # one per round
    traced_req_per_s: list[float]
    untraced_cpu_s_per_request: list[float]  # CPU seconds of the stack's processes per completed request
    traced_cpu_s_per_request: list[float]
    errors: int

    @property
    def ratio(self) -> float:
        """traced / untraced, of the requests per second summed over the rounds (1.0 = free)."""
        return sum(self.traced_req_per_s) / sum(self.untraced_req_per_s)

    @property
    def cpu_ratio(self) -> float:
        """traced / untraced, of the CPU seconds per request over the rounds (1.0 = free)."""
        return sum(self.traced_cpu_s_per_request) / sum(self.untraced_cpu_s_per_request)


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(stack: Stack) -> float:
    """User + system CPU seconds of the stack's live processes so far (Linux /proc)."""
    total = 0
    for process in stack.processes.values():
        with open(f"/proc/{process.popen.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / CLOCK_TICKS


def run_block(system: PipelineSystem, stack: Stack, prompts, concurrency: int) -> tuple[float, float, int]:
    """(requests per second, CPU seconds per request, errors) of one block."""
    before = cpu_seconds(stack)
    result = system.run(prompts, concurrency)
    errors = sum(1 for o in result.outcomes if o.timing is None)
    done = len(result.outcomes) - errors
    return done / result.wall_s, (cpu_seconds(stack) - before) / max(done, 1), errors


HOP_MODES = ("off", "client", "server", "both")


async def _echo_stage() -> tuple:
    """A stage's gRPC server (`build_server`: its own interceptors, health, reflection) whose
    Talker.Speak echoes every message; (handle, channel, the stream method)."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    from services.serving.grpc_server import build_server

    message = trace_service_pb2.ExportTraceServiceRequest  # any small message

    async def echo(requests, context):
        async for m in requests:
            yield m

    handle = build_server("127.0.0.1", 0, ("omni.v1.Talker",))
    handle.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("omni.v1.Talker", {
        "Speak": grpc.stream_stream_rpc_method_handler(echo, message.FromString, message.SerializeToString)}),))
    await handle.server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}")
    return handle, channel, channel.stream_stream("/omni.v1.Talker/Speak", message.SerializeToString, message.FromString)


async def _round_trips(speak, client_traced: bool, messages: int) -> None:
    """One stream of `messages` round trips, opened through `tracing.call` when `client_traced`."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    from services.serving import tracing

    call = tracing.call("/omni.v1.Talker/Speak", speak) if client_traced else speak()
    for _ in range(messages):
        await call.write(trace_service_pb2.ExportTraceServiceRequest())
        await call.read()
    await call.done_writing()
    await call.read()


async def _hop_costs(endpoint: str, rounds: int, streams: int = 40, messages: int = 60) -> dict[str, list[float]]:
    """CPU microseconds per message round trip on one loopback bidi stream hop (the shape of
    thinker -> talker -> code2wav), with tracing on neither end, the client's (`tracing.call`), the
    server's (its interceptor) or both: what tracing adds per message, without any model. The
    servers are a stage's (`build_server`: its own interceptors, health, reflection), one built
    before tracing is set up (untraced), one after. One process, the modes' rounds interleaved (in
    turn reversed), so that drift and other load hit every mode alike; each round ends with the
    exporter flushed, so a round pays for its own spans (the collector is in this process too)."""
    import asyncio

    from opentelemetry import trace

    from services.serving import tracing

    untraced = await _echo_stage()  # (its interceptors are chosen when it is built: tracing is off yet)
    tracing.setup("bench", tracing.TracingConfig(otlp_endpoint=endpoint), 1)
    traced = await _echo_stage()
    provider = trace.get_tracer_provider()
    # mode -> (the server's stream method, whether the client opens its calls through tracing.call)
    modes = {"off": (untraced[2], False), "client": (untraced[2], True), "server": (traced[2], False),
             "both": (traced[2], True)}

    async def block(mode: str) -> float:
        cpu = time.process_time()
        await asyncio.gather(*(_round_trips(*modes[mode], messages) for _ in range(streams)))
        await asyncio.sleep(0.01)  # the calls' done callbacks (client spans end there)
        provider.force_flush()
        return (time.process_time() - cpu) * 1e6 / (streams * messages)

    for mode in HOP_MODES:  # first-call costs, not counted
        await block(mode)
    costs: dict[str, list[float]] = {mode: [] for mode in HOP_MODES}
    for r in range(rounds):
        for mode in HOP_MODES if r % 2 == 0 else HOP_MODES[::-1]:
            costs[mode].append(await block(mode))
    for handle, channel, _ in (untraced, traced):
        await channel.close()
        await handle.server.stop(0)
    return costs


def grpc_hop_costs(rounds: int) -> dict:
    """Prints each mode's median and its median extra cost over `off` in the same round."""
    import asyncio

    load_before = os.getloadavg()
    with OtlpSink() as sink:
        costs = asyncio.run(_hop_costs(sink.endpoint, rounds))
    report = {"rounds": rounds, "us_per_message": costs, "load_average": [load_before[0], os.getloadavg()[0]]}
    for mode in HOP_MODES:
        extra = statistics.median(c - off for c, off in zip(costs[mode], costs["off"]))
        report[f"{mode}_extra_us"] = extra
        print(f"one gRPC stream hop, tracing on {mode:6}: {statistics.median(costs[mode]):6.1f} us CPU per message "
              f"round trip (median of {rounds} rounds), {extra:+5.1f} us over off in the same round (median)",
              flush=True)
    print(f"load average {load_before[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
          f"({os.cpu_count()} CPUs)")
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.probes.tracing_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help=f"checkpoint folder (default: {TINY_CHECKPOINT}, generated if missing)")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--requests", type=int, default=8, help="per stack, level and round; raised to the concurrency")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--talker-max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("out"))
    p.add_argument("--grpc-only", action="store_true",
                   help="only the per-message cost on one loopback gRPC stream (no model, no stack)")
    p.add_argument("--hop-rounds", type=int, default=10, help="--grpc-only: rounds of each mode, interleaved")
    return p


def start_stacks(cleanup: contextlib.ExitStack, args, checkpoint: str, sink: OtlpSink) -> dict:
    """Two stacks of the same checkpoint, one exporting spans to `sink`: name -> (system, stack)."""
    stage = ("--device", args.device)
    out = {}
    for name, extra in (("untraced", ()), ("traced", ("--otlp-endpoint", sink.endpoint))):
        stack = cleanup.enter_context(Stack(StackOptions(
            checkpoint=checkpoint, port=0, threads=args.threads, thinker_args=stage, talker_args=stage,
            code2wav_args=stage, extra_args=extra, log_prefix=False, device=args.device)))
        system = PipelineSystem(stack.target, None, args.max_new_tokens, args.talker_max_new_tokens, 600)
        cleanup.callback(system.close)
        out[name] = (system, stack)
    return out


def measure_level(stacks: dict, block: list, concurrency: int, rounds: int) -> Level:
    """Rounds of the block on each stack, alternating which goes first."""
    rates, cpu = {"untraced": [], "traced": []}, {"untraced": [], "traced": []}
    errors = 0
    for r in range(rounds):
        for name in (("untraced", "traced") if r % 2 == 0 else ("traced", "untraced")):
            rate, cpu_s, failed = run_block(*stacks[name], block, concurrency)
            rates[name].append(rate)
            cpu[name].append(cpu_s)
            errors += failed
    return Level(concurrency, len(block), rates["untraced"], rates["traced"], cpu["untraced"], cpu["traced"], errors)


def print_level(level: Level) -> None:
    per_round = " ".join(f"{t / u:.3f}" for u, t in zip(level.untraced_req_per_s, level.traced_req_per_s))
    print(f"c={level.concurrency:<3} req/s untraced {statistics.median(level.untraced_req_per_s):.3f} traced "
          f"{statistics.median(level.traced_req_per_s):.3f} ratio {level.ratio:.3f} (rounds {per_round});  "
          f"CPU s/request untraced {statistics.median(level.untraced_cpu_s_per_request):.3f} traced "
          f"{statistics.median(level.traced_cpu_s_per_request):.3f} ratio {level.cpu_ratio:.3f};  "
          f"errors {level.errors}", flush=True)


def measure(args) -> None:
    checkpoint = args.checkpoint or str(ensure_checkpoint(PRESETS["tiny"], TINY_CHECKPOINT))
    prompts = built_in_prompts()
    os.environ.setdefault("OTEL_BSP_SCHEDULE_DELAY", "1000")
    with contextlib.ExitStack() as cleanup:
        sink = cleanup.enter_context(OtlpSink())
        stacks = start_stacks(cleanup, args, checkpoint, sink)
        for system, stack in stacks.values():  # first-call costs, not counted
            run_block(system, stack, prompts[:2], 2)
        load_before = os.getloadavg()
        results = []
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            n = max(args.requests, concurrency)
            results.append(measure_level(stacks, [prompts[i % len(prompts)] for i in range(n)], concurrency, args.rounds))
            print_level(results[-1])
        time.sleep(1.5)  # the last batch of spans
        spans = len(sink.spans())
    print(f"{spans} spans received; load average {load_before[0]:.1f} at the start, {os.getloadavg()[0]:.1f} "
          f"at the end ({os.cpu_count()} CPUs)")
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"checkpoint": checkpoint, "device": args.device, "rounds": args.rounds, "spans": spans,
              "load_average": [load_before[0], os.getloadavg()[0]], "cpus": os.cpu_count(),
              "levels": [{**asdict(level), "ratio": level.ratio, "cpu_ratio": level.cpu_ratio} for level in results]}
    (args.out / "tracing_cost.json").write_text(json.dumps(report, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.grpc_only:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tracing_hop_cost.json").write_text(json.dumps(grpc_hop_costs(args.hop_rounds), indent=1) + "\n")
        return 0
    return run_cli(lambda: measure(args))


if __name__ == "__main__":
    sys.exit(main())
