"""Triton's gRPC endpoint with tritonclient, streamed: the text is printed as it is decoded.

    python examples/grpc_stream_client.py "Explain recursion in one paragraph."  [--url localhost:8001]
"""
import argparse
import queue

import numpy as np
import tritonclient.grpc as grpcclient


def tensor(name, arr, dtype):
    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


ap = argparse.ArgumentParser()
ap.add_argument("prompt")
ap.add_argument("--url", default="localhost:8001")
ap.add_argument("--max-tokens", type=int, default=128)
a = ap.parse_args()

responses = queue.Queue()
client = grpcclient.InferenceServerClient(a.url)
client.start_stream(callback=lambda result, error: responses.put((result, error)))
client.async_stream_infer("ssd", [
    tensor("text_input", np.array([a.prompt.encode()], dtype=np.object_), "BYTES"),
    tensor("max_tokens", np.array([a.max_tokens], dtype=np.int32), "INT32"),
    tensor("stream", np.array([True]), "BOOL"),
], enable_empty_final_response=True)
while True:
    result, error = responses.get()
    if error is not None:
        raise SystemExit(f"error: {error}")
    text = result.as_numpy("text_output")
    if text is not None:
        print(text[0].decode(), end="", flush=True)
    if result.get_response().parameters["triton_final_response"].bool_param:
        break
print()
# every response is in: cancel the stream rather than wait for the server to close it
client.stop_stream(cancel_requests=True)
