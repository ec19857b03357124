"""Which chat format a checkpoint speaks, and the one interface the server and ``LLM.chat`` use:
``encode`` (messages and tools to prompt ids), ``reply_parser`` (output text back to
reasoning, content and tool calls, or None where the format has no parser) and
``tool_constraint`` (the grammar that enforces ``tool_choice``, or None).

DeepSeek-V4 and V4.1 checkpoints use their published message format (``deepseek.py``); every
other checkpoint its tokenizer's Jinja chat template (``template.py``). Options follow vLLM's
``chat_template_kwargs``: ``thinking`` / ``enable_thinking`` (DeepSeek: on unless turned off,
as in vLLM's ``deepseek_v4`` mode), ``reasoning_effort``, ``drop_thinking``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from deepinfer.chat.deepseek import V4, V41, Dialect, encode_deepseek
from deepinfer.chat.deepseek_parser import DeepseekReplyParser
from deepinfer.chat.messages import normalize_tools
from deepinfer.chat.template import encode_chat
from deepinfer.chat.tool_choice import named_function, tool_call_tag

_DEEPSEEK = {"DeepseekV4ForCausalLM": V4, "DeepseekV41ForCausalLM": V41}


@dataclass(frozen=True)
class ChatOptions:
    """Per-request switches of the format (``chat_template_kwargs`` and ``reasoning_effort``)."""

    thinking: bool | None = None
    reasoning_effort: str | int | None = None
    drop_thinking: bool = True
    template_kwargs: dict[str, Any] | None = None

    @classmethod
    def from_request(
        cls, kwargs: dict[str, Any] | None, reasoning_effort: str | int | None = None
    ) -> ChatOptions:
        kwargs = dict(kwargs or {})
        thinking = None
        for key in ("thinking", "enable_thinking"):
            if key in kwargs:
                if not isinstance(kwargs[key], bool):
                    raise ValueError(f"chat_template_kwargs.{key} must be true or false")
                thinking = kwargs[key]
        effort = reasoning_effort if reasoning_effort is not None else kwargs.get("reasoning_effort")
        drop = kwargs.get("drop_thinking", True)
        if not isinstance(drop, bool):
            raise ValueError("chat_template_kwargs.drop_thinking must be true or false")
        return cls(thinking, effort, drop, kwargs)


class ReplyParser(Protocol):
    last: Any  # what the last ``delta`` read (None before the first)

    def parse(self, text: str, finished: bool) -> Any: ...

    def delta(self, text: str, finished: bool) -> dict[str, Any]: ...


class ChatFormat(Protocol):
    name: str

    def encode(
        self,
        messages: list[Any],
        tools: list[Any] | None = None,
        add_generation_prompt: bool = True,
        options: ChatOptions | None = None,
    ) -> list[int]: ...

    def reply_parser(self, tools: bool, options: ChatOptions | None = None) -> ReplyParser | None: ...

    def tool_constraint(
        self, tools: list[Any] | None, tool_choice: Any, options: ChatOptions | None, parallel: bool
    ) -> str | None: ...


class TemplateFormat:
    """The tokenizer's Jinja template; replies are plain content."""

    name = "template"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, messages, tools=None, add_generation_prompt=True, options=None) -> list[int]:
        kwargs = (options or ChatOptions()).template_kwargs
        return encode_chat(self.tokenizer, messages, add_generation_prompt, kwargs, normalize_tools(tools))

    def reply_parser(self, tools: bool, options: ChatOptions | None = None) -> None:
        if tools:
            raise ValueError("tools: this model's chat template has no tool-call parser in deepinfer")
        return None

    def tool_constraint(self, tools, tool_choice, options, parallel) -> None:
        """Nothing to enforce (a request with tools is refused by ``reply_parser``); a forced
        call cannot be asked for."""
        if named_function(tool_choice) is not None or tool_choice == "required":
            raise ValueError(
                "tool_choice: this model's chat template has no tool-call format in deepinfer; "
                "only 'auto' and 'none' apply"
            )
        return None


class DeepseekFormat:
    """DeepSeek-V4 / V4.1 messages, thinking and DSML tool calls, and their parser."""

    def __init__(self, tokenizer: Any, dialect: Dialect) -> None:
        self.tokenizer = tokenizer
        self.dialect = dialect
        self.name = dialect.name

    @staticmethod
    def thinking(options: ChatOptions | None) -> bool:
        options = options or ChatOptions()
        if options.reasoning_effort == "none":
            return False
        return True if options.thinking is None else options.thinking

    def encode(self, messages, tools=None, add_generation_prompt=True, options=None) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer: chat needs one")
        options = options or ChatOptions()
        prompt = encode_deepseek(
            messages,
            self.dialect,
            thinking=self.thinking(options),
            tools=normalize_tools(tools),
            reasoning_effort=options.reasoning_effort,
            add_generation_prompt=add_generation_prompt,
            drop_thinking=options.drop_thinking,
        )
        return prompt.token_ids(self.tokenizer)

    def reply_parser(self, tools: bool, options: ChatOptions | None = None) -> DeepseekReplyParser:
        return DeepseekReplyParser(self.dialect, self.thinking(options), tools)

    def tool_constraint(
        self, tools: list[Any] | None, tool_choice: Any, options: ChatOptions | None, parallel: bool
    ) -> str | None:
        """The structural tag that enforces ``tool_choice`` (``tool_choice.py``), or None."""
        functions = normalize_tools(tools)
        return tool_call_tag(self.dialect, functions, tool_choice, self.thinking(options), parallel)


def chat_format_for(architecture: str, tokenizer: Any) -> ChatFormat:
    """The format of a checkpoint with this ``architecture`` and tokenizer."""
    dialect = _DEEPSEEK.get(architecture)
    if dialect is not None:
        return DeepseekFormat(tokenizer, dialect)
    return TemplateFormat(tokenizer)
