"""``deepinfer chat``: a terminal chat in the model's chat format."""

from __future__ import annotations

import argparse

from deepinfer.cli.engine_args import llm_kwargs


def chat(args: argparse.Namespace) -> int:
    """A terminal chat: each reply streams as it is generated."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.chat import ChatOptions

    llm = LLM(args.model, **llm_kwargs(args))
    options = ChatOptions(thinking=False) if args.no_thinking else ChatOptions()
    parser = llm.chat_format.reply_parser(False, options)
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    print("deepinfer chat: type a message, an empty line or Ctrl-D to quit", flush=True)
    while True:
        try:
            text = input("> ")
        except EOFError:
            break
        if not text.strip():
            break
        messages.append({"role": "user", "content": text})
        ids = llm.chat_format.encode(messages, options=options)
        reply = ""
        for out in llm.stream({"prompt_token_ids": ids}, params):
            piece = out.outputs[0].text
            reply += piece
            print(piece, end="", flush=True)
        print(flush=True)
        if parser is None:
            messages.append({"role": "assistant", "content": reply})
        else:  # history keeps the answer; the format drops old reasoning anyway
            parsed = parser.parse(reply, True)
            messages.append(
                {"role": "assistant", "content": parsed.content, "reasoning_content": parsed.reasoning}
            )
    return 0
