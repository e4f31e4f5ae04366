"""An OpenAI-compatible HTTP frontend for the `ssd` model (default http://127.0.0.1:9000/v1).

    python frontends/openai_api/server.py --tokenizer engines/qwen2.5-coder-1.5b --triton 127.0.0.1:8001

Serves /v1/models, /v1/completions and /v1/chat/completions (streamed as server-sent events ending
with `data: [DONE]`, or whole). Every request becomes one request to the decoupled `ssd` model over
a Triton gRPC stream, so the `ssd` model stays the single implementation of decoding; this process
only translates. SSD's knobs (`mode`, `num_draft_tokens`, ...) are accepted as extra body fields and
each response carries the request's statistics in the extra field `ssd_stats`.

A client that hangs up cancels its request: aiohttp cancels the handler when the connection is
lost (``handler_cancellation``), streamed or whole, and closing the gRPC stream makes Triton cancel
the request, which the `ssd` model notices within a round.
"""
from __future__ import annotations

import argparse
import json
import time
import uuid
from pathlib import Path

import tritonclient.grpc.aio as grpcclient
from aiohttp import web

from ssd.decoding.text import TextCodec
from ssd_openai.errors import ApiError
from ssd_openai.openai_request import GenerateCall, parse
from ssd_openai.triton_stream import generate


def _error_response(e: ApiError) -> web.Response:
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after is not None else None
    return web.json_response(e.body(), status=e.status, headers=headers)


class OpenAIFrontend:
    def __init__(self, tokenizer_dir: Path, triton_url: str, model_id: str):
        self.codec = TextCodec(tokenizer_dir)
        self.triton_url = triton_url
        self.model_id = model_id
        self.created = int(time.time())
        self.client: grpcclient.InferenceServerClient | None = None

    # -- prompts --------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict]) -> str:
        c = self.codec
        if c.template is None:
            raise ApiError(400, "this model has no chat template: use /v1/completions", "messages")
        return c.template.render(messages=messages, add_generation_prompt=True,
                                 bos_token=c.bos_token or "", eos_token=c.eos_token or "")

    def prompt_tokens(self, text: str) -> int:
        return len(self.codec.tokenizer.encode(text).ids)  # as the ssd model tokenizes a templated text

    # -- routes ---------------------------------------------------------------------------------
    def _model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "ssd"}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.model_id:
            return _error_response(self._unknown_model(request.match_info["model"]))
        return web.json_response(self._model_card())

    def _unknown_model(self, name: str) -> ApiError:
        return ApiError(404, f"The model '{name}' does not exist; this server serves '{self.model_id}'",
                        "model", "model_not_found")

    async def health(self, request: web.Request) -> web.Response:
        try:
            ready = await self.client.is_model_ready("ssd")
        except Exception as e:  # noqa: BLE001 - any failure to reach Triton means not healthy
            return _error_response(ApiError(503, f"Triton is unavailable: {e}", code="triton_unavailable"))
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ApiError(400, f"the request body is not valid JSON: {e}") from None
            call = parse(body, chat, self.render_chat)
            if call.model != self.model_id:
                raise self._unknown_model(call.model)
            pieces = generate(self.client, call.inputs)
            first = await pieces.__anext__()  # a refused request is an HTTP error, not a broken stream
        except ApiError as e:
            return _error_response(e)
        if call.stream:
            return await self._stream(request, call, first, pieces)
        text, ids, last = first.text, list(first.ids), first
        async for piece in pieces:
            text, ids, last = text + piece.text, ids + piece.ids, piece
        return web.json_response(self._whole(call, text, ids, last))

    def _usage(self, call: GenerateCall, n_out: int, stats: dict | None) -> dict:
        n_in = self.prompt_tokens(call.text)
        usage = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
        if stats and "cached_prompt_tokens" in stats:  # OpenAI's field for a prompt prefix found cached
            usage["prompt_tokens_details"] = {"cached_tokens": stats["cached_prompt_tokens"]}
        return usage

    def _head(self, call: GenerateCall, kind: str) -> dict:
        prefix = "chatcmpl" if call.chat else "cmpl"
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
                "model": self.model_id}

    def _whole(self, call: GenerateCall, text: str, ids: list[int], last) -> dict:
        if call.chat:
            out = self._head(call, "chat.completion")
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": last.finish_reason, "logprobs": None}
        else:
            out = self._head(call, "text_completion")
            choice = {"index": 0, "text": text, "finish_reason": last.finish_reason, "logprobs": None}
        out.update(choices=[choice], usage=self._usage(call, len(ids), last.stats), ssd_stats=last.stats)
        return out

    async def _stream(self, request: web.Request, call: GenerateCall, first, pieces) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        head = self._head(call, "chat.completion.chunk" if call.chat else "text_completion")

        async def send(payload: dict) -> None:
            await resp.write(f"data: {json.dumps(payload)}\n\n".encode())

        def chunk(text: str | None, finish: str | None, role: bool = False) -> dict:
            if call.chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            return {**head, "choices": [choice]}

        n_out, stats = 0, None
        try:
            if call.chat:
                await send(chunk(None, None, role=True))
            piece = first
            while True:
                n_out += len(piece.ids)
                if piece.text:
                    await send(chunk(piece.text, None))
                if piece.finish_reason is not None:
                    await send({**chunk(None, piece.finish_reason), "ssd_stats": piece.stats})
                    stats = piece.stats
                    break
                piece = await pieces.__anext__()
            if call.include_usage:
                await send({**head, "choices": [], "usage": self._usage(call, n_out, stats)})
        except ApiError as e:  # a failure after the stream began: reported in-band, as OpenAI does
            await send(e.body())
        except StopAsyncIteration:
            await send(ApiError(500, "the ssd model closed the stream without a final response").body())
        finally:
            await pieces.aclose()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # -- app ------------------------------------------------------------------------------------
    async def _open(self, app: web.Application) -> None:
        self.client = grpcclient.InferenceServerClient(self.triton_url)

    async def _close(self, app: web.Application) -> None:
        await self.client.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=8 * 2**20)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, required=True, help="the target's engine folder (tokenizer files)")
    ap.add_argument("--triton", default="127.0.0.1:8001", help="Triton's gRPC address")
    ap.add_argument("--model-name", default=None, help="the model id clients send (default: the folder's name)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9000)
    a = ap.parse_args()
    frontend = OpenAIFrontend(a.tokenizer, a.triton, a.model_name or a.tokenizer.resolve().name)
    print(f"[openai] serving '{frontend.model_id}' on http://{a.host}:{a.port}/v1 (Triton gRPC {a.triton})", flush=True)
    # a lost connection cancels its handler, and so its gRPC stream to Triton (triton_stream.py)
    web.run_app(frontend.app(), host=a.host, port=a.port, print=None, access_log=None, handler_cancellation=True)


if __name__ == "__main__":
    main()
