"""``generate`` and ``chat``: the offline engine from a terminal, one prompt or a conversation."""

from __future__ import annotations

import argparse
import json

from kunlun_runtime.options.flags import Command, add_engine_args, engine_config_from_args


def _generate_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sampling-seed", dest="sampling_seed", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--raw", action="store_true", help="do not apply the chat template to --prompt")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run_generate(args: argparse.Namespace) -> int:
    from kunlun_runtime.engine.sampling_params import SamplingParams
    from kunlun_runtime.llm import LLM

    llm = LLM.from_config(engine_config_from_args(args))
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
    )
    if args.raw or llm.tokenizer.chat_template is None:
        result = llm.generate(args.prompt, params)[0]
    else:
        result = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    completion = result.outputs[0]
    if args.json:
        print(
            json.dumps(
                {
                    "text": completion.text,
                    "token_ids": completion.token_ids,
                    "prompt_token_ids": result.prompt_token_ids,
                    "finish_reason": completion.finish_reason,
                }
            )
        )
    else:
        print(completion.text)
    return 0


def _chat_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--system", default=None, help="system prompt")


def run_chat(args: argparse.Namespace) -> int:
    from kunlun_runtime.engine.sampling_params import SamplingParams
    from kunlun_runtime.llm import LLM

    llm = LLM.from_config(engine_config_from_args(args))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    printed = 0

    def stream(output) -> None:
        nonlocal printed
        text = output.outputs[0].text
        print(text[printed:], end="", flush=True)
        printed = len(text)

    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        printed = 0
        print("assistant> ", end="", flush=True)
        reply = llm.chat(messages, params, on_output=stream)[0].outputs[0].text
        print(reply[printed:])
        messages.append({"role": "assistant", "content": reply})


GENERATE = Command(
    "generate",
    "generate text for one prompt",
    _generate_args,
    run_generate,
)

CHAT = Command(
    "chat",
    "interactive chat; tokens stream as they come (Ctrl-D to quit)",
    _chat_args,
    run_chat,
)
