"""Chat: messages (and tools) to prompt ids for each checkpoint's format, with message text that
never becomes a control token, and replies parsed back into OpenAI fields. Used by
``LLM.chat``, ``deepinfer chat`` and the server (it sits below both: ``llm`` and ``server``
import it, never the other way)."""

from deepinfer.chat.formats import ChatFormat, ChatOptions, chat_format_for
from deepinfer.chat.messages import normalize_messages, normalize_tools
from deepinfer.chat.template import encode_chat

__all__ = [
    "ChatFormat",
    "ChatOptions",
    "chat_format_for",
    "encode_chat",
    "normalize_messages",
    "normalize_tools",
]
