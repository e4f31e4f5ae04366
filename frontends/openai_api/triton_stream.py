"""One generate request to the decoupled `ssd` model over a Triton gRPC stream.

Each response of the stream is a `Piece`: the text and token ids it adds, and on the last one the
finish reason and the request's statistics. Closing the generator early (the HTTP client went away)
cancels the gRPC call, and Triton cancels the request, so the `ssd` model stops decoding it.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import grpc
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from ssd_openai.errors import ApiError, from_triton

MODEL = "ssd"
DRAIN_S = 5.0


@dataclass
class Piece:
    text: str
    ids: list[int]
    finish_reason: str | None = None
    stats: dict | None = None


def _unavailable(e: Exception) -> ApiError:
    return ApiError(503, f"Triton is unavailable: {e}", code="triton_unavailable")


def _is_connection_error(e: Exception) -> bool:
    if isinstance(e, grpc.aio.AioRpcError):
        return e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    status = e.status() if isinstance(e, InferenceServerException) else None
    return bool(status) and "UNAVAILABLE" in str(status)


def _piece(result) -> Piece:
    text = result.as_numpy("text_output")
    ids = result.as_numpy("output_ids")
    finish = result.as_numpy("finish_reason")
    stats = result.as_numpy("stats")
    return Piece(text=text[0].decode("utf-8") if text is not None and len(text) else "",
                 ids=ids.tolist() if ids is not None else [],
                 finish_reason=finish[0].decode() if finish is not None and len(finish) else None,
                 stats=json.loads(stats[0]) if stats is not None and len(stats) else None)


async def generate(client: grpcclient.InferenceServerClient, inputs: dict):
    """Yields the `Piece`s of one request; raises ApiError for a refused or failed request."""
    tensors = []
    for name, (arr, dtype) in inputs.items():
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        tensors.append(t)

    async def one_request():
        yield {"model_name": MODEL, "inputs": tensors}

    responses = client.stream_infer(one_request())
    finished = False
    try:
        async for result, error in responses:
            if error is not None:
                finished = True  # an error response is the request's last
                raise from_triton(str(error.message() if hasattr(error, "message") else error))
            piece = _piece(result)
            finished = piece.finish_reason is not None
            yield piece
            if finished:
                break
        if not finished:
            raise ApiError(500, "the ssd model closed the stream without a final response")
    except ApiError:
        raise
    except (grpc.aio.AioRpcError, InferenceServerException) as e:
        if _is_connection_error(e):
            raise _unavailable(e) from None
        raise from_triton(str(e)) from None
    finally:
        await _close(responses, finished)


async def _close(responses, finished: bool) -> None:
    """Cancels a request still decoding; lets a finished one end its stream by itself (Triton closes
    it once the last response is out), so no cancel races the model's own clean-up."""
    if finished:
        try:
            async with asyncio.timeout(DRAIN_S):
                async for _ in responses:
                    pass
            return
        except (TimeoutError, grpc.aio.AioRpcError, InferenceServerException):
            pass
    responses.cancel()
