"""The engine's host-side cost per step: `LLMEngine.step` around a runner that computes nothing.

Everything but the model runs for real (scheduler, KV block accounting, sampler over a
full-vocabulary logits tensor, detokenizer, stop checks, outputs); the runner returns
fixed random logits. So a step's time here is what the CPU spends per step whatever the
accelerator, the cost that a GPU step must hide or overlap (the engine issue's "CPU-bound
serving loop"). Batches of decoding requests (128-token prompts, EOS ignored), greedy or
sampled, the Llama-3.2-1B shape with the default model's 49,152-token vocabulary.

With `--baseline-tree DIR` the same measurement also runs on another checkout (e.g. a
`git worktree` of an older commit), alternating with this tree, run by run, in one call:
the table then gives the ratio.

The logits are random (N(0, 1): flat, nearly every token plausible, the worst case for
top-p) unless `--logits-from HF_DIR` names a Hugging Face model directory with the same
vocabulary (benchmarks/export_hf.py writes the default model's): then they are that
model's own next-token logits over a fixed English text (real distributions, mostly
peaked), each step taking the next window of positions.

`--runner graphs` adds the model runner's own host work (engine/model_runner.py with its
decode and mixed graphs, built without CUDA, their compute replaced by fixed logits);
`--closed-loop` replaces each request that ends, so steps carry prompts beside decodes.

    python -m testing.random_model .tok --tokenizer-only     # once: the tokenizer
    python -m benchmarks.engine_host --tokenizer .tok --batches 1,16,64,256 [--overlapped] \\
        [--baseline-tree /tmp/base] [--repeats 3] [--logits-from /tmp/hf] \\
        [--runner graphs] [--closed-loop]

Output: a markdown table on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("greedy", "sampled")
TEXT = ("The lighthouse stood at the end of a long spit of rock, and for forty years the same "
        "family had kept its lamp. Every evening the keeper climbed the stairs, trimmed the "
        "wick and wound the clockwork that turned the lens. In the mornings he wrote in the "
        "log: the wind, the state of the sea, the ships that had passed. Most of them were "
        "fishing boats from the harbour to the south, but sometimes a steamer went by far "
        "out, its smoke a grey thread on the horizon. His daughter learned the work before "
        "she could read. She knew how to tell a squall from a passing shower by the colour "
        "of the clouds over the headland, and she could name every boat in the harbour by "
        "the shape of its sail. When the supply boat came each month she ran down to the "
        "landing to meet it, because it brought letters, newspapers and, if the weather had "
        "been kind, fresh bread from the town. In winter the storms closed the landing for "
        "weeks at a time. Waves broke over the rocks and ran up the walls of the tower, and "
        "the whole building shook. Then the family lived on what was in the store: flour, "
        "salted fish, potatoes and tea. They read the old newspapers again, played cards by "
        "the stove and listened to the wind. Years later, when the light was automated and "
        "the last keeper left, people in the town still talked about the night of the great "
        "storm, when the lamp never went out.")


def model_logits(hf_dir: Path, tokenizer_dir: Path, out: Path) -> int:
    """The next-token logits of the model in `hf_dir` at every position of TEXT, saved to
    `out` (float32 [positions, vocab]); returns the number of positions."""
    import torch
    from transformers import LlamaForCausalLM

    from engine.engine_builder import load_tokenizer

    ids = load_tokenizer(tokenizer_dir).encode(TEXT)
    model = LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    torch.save(logits.contiguous(), out)
    return logits.shape[0]


def measure(tokenizer_dir: str, batch: int, mode: str, num_steps: int,
            logits_path: str | None = None, vocab_size: int = 49152,
            overlapped: bool = False, runner: str = "null", closed_loop: bool = False) -> float:
    """Seconds per engine step, with the engine found on sys.path (`logits_path`:
    model_logits' file). `vocab_size`: the logits' width (the tokenizer's first ids);
    `overlapped`: the steps a CUDA worker runs (LLMEngine.step(overlap=True)), the runner
    reading device tokens. `runner`: "null" returns logits and does nothing else; "graphs"
    is engine/model_runner.py's ModelRunner with its decode and mixed graphs, run without
    CUDA and with the model's compute replaced by fixed logits: every step's host work of a
    CUDA worker's runner (the static buffers' fill and uploads, the previous step's tokens
    read on the device) is done. `closed_loop`: each request ends after 128-384 tokens and
    a new one takes its place (one step in about one carries a 128-token prompt, as
    benchmarks/serving_loop.py at the same concurrency); else requests never end."""
    import dataclasses
    import random

    import torch

    from engine.engine_builder import load_tokenizer
    from engine.engine_config import EngineConfig
    from engine.kv_storage import KVStorage
    from engine.llm_engine import LLMEngine
    from protocol.sampling_params import SamplingParams
    from telemetry.start_up_heap import freeze_start_up_heap
    from testing.shapes import SHAPES

    class NullRunner:
        records_layer_events = False
        reads_device_tokens = overlapped  # its logits never depend on the tokens

        def __init__(self, vocab_size: int) -> None:
            self.logits = (torch.load(logits_path) if logits_path is not None else
                           torch.randn(max(batch, 1), vocab_size,
                                       generator=torch.Generator().manual_seed(0)))
            self.num_calls = 0

        def execute(self, schedule, on_layer=None, previous=None):
            rows = sum(1 for c in schedule.chunks if c.sample)
            # A window of consecutive positions, a different one each step (a view: no copy).
            start = (self.num_calls * 7) % (self.logits.shape[0] - rows + 1)
            self.num_calls += 1
            return self.logits[start:start + rows]

        def close(self) -> None:
            return None

    def graphs_runner(storage, logits: torch.Tensor):
        """ModelRunner over a one-layer model of the shape's widths, its captured steps
        returning `logits` instead of computing (no step here runs eagerly: every one
        fits a decode graph or a mixed graph)."""
        from engine.model_runner import ModelRunner
        from engine.models.llama import LlamaForCausalLM

        layer = dataclasses.replace(model_config, num_layers=1, hidden_size=512,
                                    intermediate_size=512, num_heads=model_config.num_kv_heads)
        model_runner = ModelRunner(LlamaForCausalLM(layer), storage, 16, use_kernels=True,
                                   mixed_graph_tokens=512,
                                   cuda_graph_batch_sizes=DEFAULT_BATCH_SIZES)
        for steps in (model_runner.graphs._steps, model_runner.mixed_graphs._steps):
            for key in steps:
                steps[key] = lambda: logits
        # A mixed step's logits are read from the graphs' static buffer.
        static = model_runner.mixed_graphs._logits
        static.copy_(torch.randn(static.shape, generator=torch.Generator().manual_seed(1)))
        return model_runner

    from engine.cuda_graphs import DEFAULT_BATCH_SIZES

    torch.set_num_threads(1)
    model_config = dataclasses.replace(SHAPES["llama3-1b"], vocab_size=vocab_size)
    longest = 128 + (384 if closed_loop else num_steps + 64)
    blocks = batch * (longest // 16 + 2) + 64
    config = EngineConfig(num_kv_blocks=blocks, block_size=16, max_num_seqs=max(batch, 1),
                          max_num_batched_tokens=512 if runner == "graphs" else max(2048, batch))
    storage = KVStorage.for_model(dataclasses.replace(model_config, num_layers=1), blocks, 16,
                                  torch.float32)
    null = NullRunner(model_config.vocab_size)
    engine = LLMEngine(null if runner == "null" else graphs_runner(storage, null.logits),
                       storage, model_config, load_tokenizer(Path(tokenizer_dir)), config,
                       sampler_seed=0)
    freeze_start_up_heap()  # as a worker does before traffic
    rng = random.Random(0)
    ids = iter(range(1 << 30))

    def add() -> None:
        max_tokens = rng.randrange(128, 385) if closed_loop else 1 << 20
        params = (SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                  if mode == "greedy" else
                  SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95,
                                 ignore_eos=True))
        engine.add_request(f"r{next(ids)}", [rng.randrange(min(1000, vocab_size // 40),
                                                           min(40000, vocab_size * 5 // 6))
                                             for _ in range(128)], params)

    def step() -> None:
        for out in engine.step(overlap=overlapped):
            if out.finish_reason is not None:
                add()

    # The batch joins two requests a step, so that no step holds more prefill chunks than
    # the mixed graphs do (such a step runs the model eagerly: under Triton's interpreter
    # here, minutes), and every prompt is computed before the timed steps.
    for _ in range(0, batch, 2):
        for _ in range(min(2, batch - engine.num_running - engine.num_waiting)):
            add()
        step()
    while engine.scheduler.num_waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.live_requests()):
        step()
    for _ in range(8 if not closed_loop else 400):
        step()
    started = time.perf_counter()
    for _ in range(num_steps):
        step()
    return (time.perf_counter() - started) / num_steps


def run_tree(tree: Path, args: argparse.Namespace, batch: int, mode: str) -> float:
    """One measurement in a fresh process on `tree`'s code."""
    # This file's measure() on `tree`'s engine: the script's own folder is first on
    # sys.path, `tree` next, so every `engine.` import is the tree's.
    env = {**os.environ, "PYTHONPATH": str(tree)}
    call = json.dumps([str(args.tokenizer), batch, mode, args.steps, args.logits_path,
                       args.vocab, args.overlapped, args.runner, args.closed_loop])
    out = subprocess.run([sys.executable, __file__, "--measure", call], cwd=tree, env=env,
                         check=True, capture_output=True, text=True, timeout=900)
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, required=True,
                        help="directory with tokenizer.json (testing/random_model.py "
                             "--tokenizer-only writes one)")
    parser.add_argument("--batches", default="1,16,64,256",
                        help="comma-separated decode batch sizes (default %(default)s)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated, from {', '.join(MODES)} (default: both)")
    parser.add_argument("--steps", type=int, default=200,
                        help="timed steps per measurement (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="measurements per tree, batch and mode; the median is reported "
                             "(default %(default)s)")
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="another checkout to measure alternately (optional)")
    parser.add_argument("--vocab", type=int, default=49152,
                        help="the logits' width (default %(default)s, the default model's "
                             "vocabulary); a small one leaves out the CPU argmax, which a "
                             "GPU runs on the device, so what is left is the host's own work")
    parser.add_argument("--overlapped", action="store_true",
                        help="overlapped steps (what a CUDA worker runs) instead of plain ones")
    parser.add_argument("--logits-from", type=Path, default=None,
                        help="a Hugging Face model directory whose own logits over a fixed "
                             "text the null runner returns (default: random logits)")
    parser.add_argument("--runner", choices=("null", "graphs"), default="null",
                        help="null: the runner returns logits and does nothing else (the "
                             "engine's own host work); graphs: engine/model_runner.py with its "
                             "decode and mixed graphs, the model's compute replaced by fixed "
                             "logits (adds a CUDA worker's runner-side host work)")
    parser.add_argument("--closed-loop", action="store_true",
                        help="requests end after 128-384 tokens and new ones replace them "
                             "(steps carry prompts, as in benchmarks/serving_loop.py); "
                             "default: requests never end, every step decodes")
    parser.add_argument("--measure", metavar="JSON",
                        help="internal: one measurement in this process, the arguments of "
                             "measure() as a JSON list; prints seconds per step")
    if argv is None and "--measure" in sys.argv[1:3]:
        print(json.dumps(measure(*json.loads(sys.argv[sys.argv.index("--measure") + 1]))))
        return 0
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    modes = args.modes.split(",")
    if min(batches) < 1 or args.steps < 1 or args.repeats < 1 or \
            any(m not in MODES for m in modes):
        parser.error("batches, steps and repeats must be >= 1; modes from "
                     + ", ".join(MODES))
    if not 2 <= args.vocab <= 49152:
        parser.error("--vocab must be in [2, 49152] (ids the default model's tokenizer has)")
    if not (args.tokenizer / "tokenizer.json").is_file():
        parser.error(f"{args.tokenizer}/tokenizer.json not found")
    args.tokenizer = args.tokenizer.resolve()
    args.logits_path = None
    if args.logits_from is not None:
        if not (args.logits_from / "config.json").is_file():
            parser.error(f"{args.logits_from}/config.json not found")
        scratch = tempfile.TemporaryDirectory(prefix="engine-host-")  # ~60 MB: removed at exit
        args.logits_path = str(Path(scratch.name) / "logits.pt")
        positions = model_logits(args.logits_from, args.tokenizer, Path(args.logits_path))
        if positions < max(batches):
            parser.error(f"the text has {positions} positions, fewer than batch {max(batches)}")
        print(f">> {positions} positions of {args.logits_from}'s logits", file=sys.stderr)
    here = Path(__file__).resolve().parent.parent
    trees = {"this tree": here}
    if args.baseline_tree is not None:
        trees["baseline"] = args.baseline_tree.resolve()
    rows = ["| batch | mode | " + " | ".join(f"{name} ms/step" for name in trees)
            + " | µs per row (this tree) |" + (" baseline / this tree |" if len(trees) > 1
                                                 else ""),
            "|---:|---|" + "---:|" * (len(trees) + 1 + (len(trees) > 1))]
    for batch in batches:
        for mode in modes:
            times: dict[str, list[float]] = {name: [] for name in trees}
            for repeat in range(args.repeats):
                for name, tree in trees.items():
                    times[name].append(run_tree(tree, args, batch, mode))
                    print(f"   batch {batch} {mode} {name} #{repeat + 1}: "
                          f"{times[name][-1] * 1e3:.3f} ms/step", file=sys.stderr)
            med = {name: statistics.median(t) for name, t in times.items()}
            cells = " | ".join(f"{med[name] * 1e3:.3f}" for name in trees)
            ratio = (f" {med['baseline'] / med['this tree']:.2f}x |" if len(trees) > 1 else "")
            rows.append(f"| {batch} | {mode} | {cells} | "
                        f"{med['this tree'] / batch * 1e6:.1f} |{ratio}")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
