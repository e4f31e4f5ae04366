"""SSD on Triton: the pure-Python core of the `python_ssd` backend.

Rooms, with data flowing one way (serving -> decoding -> workers -> algorithm/engine):

- ``algorithm/``  sampling, verification, fan-out, speculation cache, n-gram backup, the round
                  record, the cost model and the scheduler, request statistics.
                  Engine-agnostic, no Triton, no model code.
- ``engine/``     the torch engine: a lean Llama/Qwen2 forward, per-sequence KV cache with prefix
                  reuse, rollback and tree (branch) decoding.
- ``workers/``    what each engine process does with a call: the target verifies, the drafter drafts
                  and speculates (it owns the speculation cache), the backup drafts fast.
- ``decoding/``   the per-request loops (AR, SD, SSD) that drive the workers through a client.
- ``serving/``    the Triton glue: request parsing, BLS clients, metrics, the model classes.
"""
