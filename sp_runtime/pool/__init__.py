"""The persistent worker pool: WorkerPool, ModelHandle and the errors a call can raise."""
from ..contract import Cancelled
from .errors import PoolClosedError, PoolForkedError, PoolStartError, RemoteError, WorkerError
from .handle import ModelHandle
from .pool import WorkerPool

__all__ = ["WorkerPool", "ModelHandle", "WorkerError", "PoolStartError", "PoolClosedError", "PoolForkedError",
           "RemoteError", "Cancelled"]
