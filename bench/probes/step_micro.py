"""Figure: docs/performance.md, "Decisions kept" (code predictor, column tiles). Rerun:
`.venv/bin/python -m bench.probes.step_micro --checkpoint models/tiny-qwen3-omni --batch 1 4 16`.

In-process microbenchmark of one talker engine step (talker decode + code predictor), of the code
predictor alone and of one thinker decode step, at several batch sizes, on a generated checkpoint.
Requests are synthetic (random thinker embeddings, a text row ready for every step), so every step
decodes the whole batch; greedy, repetition penalty 1.05 as the service's default. Prints the median
milliseconds per step and per frame; medians over `--repeats` interleaved rounds, since a shared
machine's timings are noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def build_engine(checkpoint: str, batch: int, exact: bool = True):
    from services.runtime.model.checkpoint import Stage, load_stage
    from services.talker.engine import TalkerEngine
    from services.talker.engine_base import TalkerEngineConfig

    stage = load_stage(checkpoint, Stage.TALKER)
    engine = TalkerEngine(stage.model, stage.config, engine_config=TalkerEngineConfig(
        max_batch_size=batch, num_slots=batch, max_model_len=1024, exact_batching=exact))
    return engine


def fill(engine, batch: int, rows: int, seed: int = 0):
    from services.runtime.inputs.prompt import PromptBuilder  # noqa: F401  (import cost outside the timing)
    from services.runtime.lm.sampling import SamplingConfig
    from services.runtime.model.qwen3_omni import talker_prompt_len
    from services.talker.engine import TalkerJob, TextRow

    cfg = engine.config
    gen = torch.Generator().manual_seed(seed)
    hidden = cfg.thinker_config.text_config.hidden_size
    speaker = next(iter(cfg.talker_config.speaker_id.values()))
    ids = [cfg.im_start_token_id, cfg.user_token_id, 20, 21, 22, cfg.im_start_token_id, cfg.assistant_token_id, 23]
    for i in range(batch):
        job = TalkerJob(prompt_token_ids=ids, prompt_embeds=torch.randn(len(ids), hidden, generator=gen),
                        multimodal_positions=[], multimodal_hidden=torch.zeros(0, hidden),
                        tts_embeds=torch.randn(3, hidden, generator=gen), speaker_id=int(speaker),
                        sampling=SamplingConfig(max_new_tokens=rows + 8, repetition_penalty=1.05),
                        prompt_len=talker_prompt_len(ids, cfg))
        engine.add(f"r{i}", job)
        for _ in range(rows):
            engine.add_input(f"r{i}", TextRow(torch.randn(hidden, generator=gen)))
    while engine.scheduler.waiting:  # one prefill per step
        engine.step()


def build_thinker(checkpoint: str, batch: int, exact: bool = True):
    from services.runtime.inputs.prompt import PromptBuilder
    from services.runtime.model.checkpoint import Stage, load_stage
    from services.thinker.engine import ThinkerEngine, ThinkerEngineConfig

    stage = load_stage(checkpoint, Stage.THINKER)
    engine = ThinkerEngine(stage.model, stage.config, engine_config=ThinkerEngineConfig(
        max_batch_size=batch, num_slots=batch, max_model_len=1024, exact_batching=exact))
    return engine, PromptBuilder(checkpoint, stage.config)


def fill_thinker(engine, builder, batch: int, tokens: int) -> None:
    from services.runtime.lm.sampling import SamplingConfig
    from services.thinker.engine import ThinkerJob
    from services.tools.reference import messages_from_args

    prompts = ["Hello there!", "Tell me a story about a lighthouse.", "Hi", "What is the weather like?"]
    for i in range(batch):
        prompt = builder.build(messages_from_args(prompts[i % len(prompts)], None, None, None))
        engine.add(f"t{i}", ThinkerJob(prompt, SamplingConfig(max_new_tokens=tokens), True))
    while engine.scheduler.waiting:
        engine.step()


def time_steps(engine, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_predictor(engine, batch: int, steps: int) -> float:
    states = list(engine._requests.values())[:batch]
    hidden = torch.randn(batch, 1, engine.model.config.text_config.hidden_size)
    times = []
    with torch.inference_mode():
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.predict_residuals(states, hidden)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--inexact", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = {}
    engines = {b: build_engine(args.checkpoint, b, not args.inexact) for b in args.batch}
    thinkers = {b: build_thinker(args.checkpoint, b, not args.inexact) for b in args.batch}
    for rep in range(args.repeats):
        for b, (thinker, builder) in thinkers.items():
            fill_thinker(thinker, builder, b, tokens=args.steps + 4)
            results.setdefault(b, {"step": [], "predictor": [], "thinker": []})
            results[b]["thinker"].append(time_steps(thinker, args.steps))
            for rid in list(thinker._requests):
                thinker.abort(rid)
        for b, engine in engines.items():
            fill(engine, b, rows=args.steps + 4, seed=rep)
            step = time_steps(engine, args.steps)
            pred = time_predictor(engine, b, args.steps)
            for rid in list(engine._requests):
                engine.abort(rid)
            results[b]["step"].append(step)
            results[b]["predictor"].append(pred)
    out = {b: {k: statistics.median(v) * 1e3 for k, v in r.items()} for b, r in results.items()}
    if args.json:
        print(json.dumps(out))
    else:
        for b, r in out.items():
            print(f"batch {b:3d}: talker step {r['step']:8.2f} ms ({r['step'] / b:6.2f} ms/frame)   "
                  f"code predictor {r['predictor']:8.2f} ms   thinker decode step {r['thinker']:7.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
