"""Recent step times per (model, latent shape, layout), shared by every pool of the process, so a pool can report
its speed-up over a single-device pool that ran the same model and shape (the figure the panel shows)."""
from __future__ import annotations

import statistics
import threading
from typing import Optional

STEP_HISTORY = 64  # recent step times kept per (model, shape, layout)
SINGLE_DEVICE = "1"  # SPConfig.layout_name of a one-device pool


class StepHistory:
    def __init__(self):
        self._times: dict[tuple, list[float]] = {}
        self._lock = threading.Lock()

    def record(self, model_key: str, shape: tuple, layout: str, seconds: float) -> None:
        with self._lock:
            history = self._times.setdefault((model_key, tuple(shape), layout), [])
            history.append(seconds)
            del history[:-STEP_HISTORY]

    def median(self, model_key: str, shape: tuple, layout: str) -> Optional[float]:
        with self._lock:
            times = list(self._times.get((model_key, tuple(shape), layout), ()))
        return statistics.median(times) if times else None

    def single_device(self, model_key: str, shape: tuple) -> Optional[float]:
        """Median step time of a one-device pool for this model and shape, when one ran here (the baseline)."""
        return self.median(model_key, shape, SINGLE_DEVICE)

    def speedup(self, model_key: str, shape: tuple, layout: str) -> Optional[float]:
        """Median single-device step time over median step time at `layout`, when both were measured here."""
        single, here = self.single_device(model_key, shape), self.median(model_key, shape, layout)
        return None if single is None or here is None else single / here


STEPS = StepHistory()
