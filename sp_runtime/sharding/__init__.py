"""Weights sharded across the pool (load option shard_weights): each rank keeps 1/P of every transformer block's
stored bytes, all-gathers a block just before it runs (the next one prefetched meanwhile) and frees it afterwards.

Why not torch FSDP2 (`fully_shard`): it runs under gloo for inference, but it shards only Parameters, so the
quantized layers (formats.QuantLinear keeps codes and scales as buffers) would stay whole on every rank; it
gathers per parameter with a copy-out, and its prefetch expects the root module's forward, which our families
never call (they call the blocks themselves). A flat all-gather of each block's stored bytes keeps quantized
and fp8 weights as stored on the wire, needs no copy (tensors are views of the gathered buffer) and works the same
over gloo and NCCL.
"""
from .options import shard_option  # noqa: F401
from .runtime import ShardedWorkerModel, WeightShards, model_shards, shard_model, shard_worker  # noqa: F401
from .streaming import ShardSink, ShardSpec, sharded_loading  # noqa: F401
