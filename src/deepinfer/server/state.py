"""The app's state, and the request checks and prompt preparation every route shares.

One ``ServerState`` per app, kept at ``app.state.server``; handlers receive it through the
``StateDep`` dependency rather than capturing it, so the routes are plain module-level functions.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Depends, Request

from deepinfer.chat import ChatOptions
from deepinfer.disagg.roles import KVRoles
from deepinfer.lora.request import LoRARequest
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.async_llm import AsyncLLM
from deepinfer.server.engine_client import EngineClient
from deepinfer.server.limits import ServerLimits
from deepinfer.server.metrics import ServerMetrics
from deepinfer.server.prompts import PromptPreparer
from deepinfer.server.protocol import RequestError, param_of


class ServerState:
    """The served model's name, its engine client, limits, prompt preparer and metrics.

    ``async_llm`` is the engine loop (``AsyncLLM``) that the app's lifespan or ``deepinfer
    serve`` starts and stops; the routes use ``client`` alone.
    """

    def __init__(
        self,
        async_llm: AsyncLLM,
        client: EngineClient,
        served_model_name: str,
        api_key: str | None,
        limits: ServerLimits,
    ) -> None:
        self.async_llm = async_llm
        self.client = client
        self.tokenizer = client.tokenizer
        self.chat_format = client.chat_format
        self.name = served_model_name
        self.api_key = api_key
        self.limits = limits
        self.prompts = PromptPreparer(
            client.tokenizer, client.max_model_len, limits.max_messages, limits.prompt_timeout_s
        )
        self.metrics = ServerMetrics(served_model_name, lora=client.lora_enabled)
        client.on_finished(self.metrics.observe_finished)
        # prefill/decode disaggregation (``deepinfer.disagg``): a prefill server's block sender,
        # or a decode server's calls to its prefill peer; None otherwise
        self.kv_roles: KVRoles | None = None
        self.warm_up()

    def warm_up(self) -> None:
        """Build what the first prompt would build (the chat encoder's tokenizer without added
        tokens, the compiled template): long native calls that hold the GIL, which would stall
        every connection if the first request paid for them."""
        if self.tokenizer is None:
            return
        try:
            self.tokenizer("warm-up")
            self.chat_format.encode([{"role": "user", "content": "warm-up"}], None, True, ChatOptions())
        except Exception:  # e.g. no chat template: such requests get their own error later
            pass

    # ---- checks ---------------------------------------------------------------------------

    def resolve_model(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model); a name that is
        neither the served model nor a loaded adapter is a 404."""
        if model is None or model == self.name:
            return None
        lora = self.client.lora_request(model)
        if lora is None:
            raise _unknown_model(model)
        return lora

    def check_model(self, model: str | None) -> None:
        """``model`` is the served model or one of its adapters (they share the tokenizer)."""
        self.resolve_model(model)

    def response_model(self, lora: LoRARequest | None) -> str:
        """The ``model`` a response names: the adapter the request ran with, or the served model."""
        return self.name if lora is None else lora.lora_name

    def check_lora_name(self, name: str) -> None:
        """An adapter may not take the served model's name: ``model`` could not tell them apart."""
        if name == self.name:
            raise RequestError(f"lora_name {name!r} is the served model's own name", "lora_name")

    def default_max_tokens(self, prompt_len: int) -> int:
        return max(1, self.client.cache_capacity - prompt_len)

    def check_fits(self, prompt_lens: list[int], max_tokens: int, field: str, prompt_field: str) -> None:
        """An explicit ``max_tokens`` that no prompt of the request leaves room for is a 400
        (vLLM's rule and message), not a silent clamp. ``param`` names the prompt when it
        alone fills the context."""
        context = self.client.max_model_len
        longest = max(prompt_lens)
        if longest >= context:
            field = prompt_field
        if longest + max_tokens > context:
            raise RequestError(
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} in the completion). "
                "Please reduce the length of the prompt or completion.",
                field,
            )

    def check_width(self, num_prompts: int, n: int, field: str) -> None:
        """A request of more sequences than run at once can never be admitted: 400, not 429."""
        most = self.client.max_num_seqs
        if num_prompts * n > most:
            what = f"{num_prompts} prompts x n={n}" if num_prompts > 1 else f"n={n}"
            raise RequestError(
                f"{field}: {what} is {num_prompts * n} sequences; this server runs at most {most} at once",
                field,
            )

    # ---- prompts --------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    async def prompt_ids(self, prompt: str | list[int], field: str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: send token ids", field)
            self.prompts.check_text(field, [prompt])
            return await self.prompts.run(field, lambda: self.tokenizer(prompt).input_ids)
        return list(prompt)

    async def encode_chat(
        self,
        messages: list[Any],
        tools: list[Any] | None,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None,
        chars: int,
        reasoning_effort: str | int | None = None,
    ) -> tuple[list[int], ChatOptions]:
        """Prompt ids of a conversation in the model's chat format, on a worker thread within
        the limits; errors name the field."""
        self.prompts.check_messages(messages, chars)

        def encode() -> tuple[list[int], ChatOptions]:
            try:
                options = ChatOptions.from_request(template_kwargs, reasoning_effort)
                return self.chat_format.encode(messages, tools, add_generation_prompt, options), options
            except ValueError as exc:
                raise RequestError(str(exc), _chat_param(str(exc))) from exc
            except Exception as exc:  # the template met something in these messages it cannot render
                raise RequestError(
                    f"messages: the chat template cannot render these messages ({type(exc).__name__}: {exc})",
                    "messages",
                ) from exc

        return await self.prompts.run("messages", encode)

    # ---- submission -----------------------------------------------------------------------

    async def add_all(
        self,
        base_id: str,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        salt: str | None,
        field: str,
        lora: LoRARequest | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> list[AsyncIterator[RequestOutput]]:
        """Queue ``n`` siblings of every prompt (seeds offset per sibling, as ``LLM`` does),
        run with the adapter ``lora`` (None: the base model); on a decode server, after taking
        a prefill server's blocks (``kv_transfer_params``, or its peer's prefill).
        All or nothing: if one is refused the others are aborted; add errors become
        ``RequestError`` naming ``field`` for the prompt, or the sampling field, and an
        adapter unloaded before the engine took the request is the 404 of an unknown model."""
        streams: list[AsyncIterator[RequestOutput]] = []
        ids_added: list[str] = []
        if self.kv_roles is not None and lora is None:
            await self.kv_roles.before_queueing(prompts, salt, kv_transfer_params)
        try:
            for p, ids in enumerate(prompts):
                for j in range(n):
                    rid = f"{base_id}-{p}-{j}"
                    streams.append(await self.client.add(rid, ids, params, j, salt, lora))
                    ids_added.append(rid)
        except Exception as exc:
            for rid in ids_added:
                self.client.abort(rid)
            if lora is not None and self.client.lora_request(lora.lora_name) != lora:
                raise _unknown_model(lora.lora_name) from exc
            if isinstance(exc, ValueError) and not isinstance(exc, RequestError):
                msg = str(exc)
                param = field if msg.startswith("prompt_token_ids") else param_of(msg)
                raise RequestError(msg, param) from exc
            raise
        return streams


def _unknown_model(model: str) -> RequestError:
    return RequestError(f"The model `{model}` does not exist.", "model", 404)


def _chat_param(message: str) -> str:
    """The request field a chat-encoding error names (``messages[1].tool_calls[0]...``)."""
    head = message.split(" ", 1)[0].rstrip(":")
    known = ("messages", "tools", "tool_choice", "reasoning_effort", "chat_template_kwargs")
    return head if head.startswith(known) else "messages"


async def get_state(request: Request) -> ServerState:
    """The dependency every route takes its app's state through (async: FastAPI would run a
    plain function on its thread pool, a hop that every request, ``/health`` too, would wait on)."""
    return request.app.state.server


StateDep = Annotated[ServerState, Depends(get_state)]
