"""Worker side of a load: the family's loader run on the request, then sharding, weight accounting, kernels and
runtime options applied to what it built."""
from ..checkpoints.header import read_checkpoint_header
from ..detection import detect
from ..families import family


def load_worker_model(request, device, groups, progress):
    """Worker side: the worker of the family the host detected (its Family's load), sharded,
    weighed and given its kernels and runtime options. A request without its detection (made by a test, not the
    pool) is detected here; internal families are allowed since the host refuses them (pool._request_for)."""
    import torch

    from ..checkpoints.deferred import deferred_loading, read_deferred
    from ..formats import choose_kernels, weight_bytes
    from ..model_options import with_runtime_options
    from ..sharding import ShardSpec, shard_option, shard_worker, sharded_loading
    header = request.header or read_checkpoint_header(request.path)
    detection = request.detection or detect(header, allow_internal=True)  # the pool's requests carry it
    world = groups.config.world_size if groups is not None else 1
    shard = ShardSpec(groups.rank, world) if shard_option(request.options) and world > 1 else None
    tp = groups.tp if groups is not None and groups.tp.degree > 1 else None
    if tp is not None:
        _check_tensor_parallel(tp, request, detection, shard)
    # shard_weights: blocks read straight into this rank's shards; TP: the split weights read once split, as slices
    with sharded_loading(shard), deferred_loading(tp is not None):
        worker = family(detection.family).load(request, detection, device, groups, progress)
    if tp is not None:
        if not hasattr(worker, "split_tensor_parallel"):
            raise ValueError(f"tensor_parallel_degree={tp.degree} is not supported for {detection.family!r} models "
                             f"(not run by the executor)")
        worker.split_tensor_parallel(tp)  # the family's TP plan: its blocks' Linears split across the TP group
        read_deferred(worker.model, worker.tp_slices, device)
    if shard is not None:
        worker = shard_worker(worker, shard.rank, shard.world)  # shards a model its family loaded whole
    if isinstance(getattr(worker, "model", None), torch.nn.Module):
        worker.info.quant = detection.quant
        worker.info.weight_bytes = weight_bytes(worker.model) + (worker.shards.resident_bytes if shard else 0)
        if tp is not None:  # an uneven head count leaves the first TP ranks more: each reports the largest share
            worker.info.weight_bytes = _largest(tp, worker.info.weight_bytes, device)
        worker.info.quant_kernels = choose_kernels(worker.model, torch.device(device),
                                                   request.options.get("quant_kernels"))
    return with_runtime_options(worker, request.options)


def _largest(tp, value: int, device) -> int:
    import torch
    import torch.distributed as dist
    largest = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=tp.group)
    return int(largest.item())


def _check_tensor_parallel(tp, request, detection, shard) -> None:
    """What tensor parallelism cannot serve, refused by name before anything is read."""
    degree = f"tensor_parallel_degree={tp.degree}"
    if shard is not None:
        raise ValueError(f"{degree} with shard_weights: both split the weights; use one of them")
