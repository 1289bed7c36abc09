"""The planted bugs of `python3 dev.py mutate` (tests/mutate.py, docs/DEVELOPMENT.md): each entry replaces the exact
`original` text of `file` (it must occur there exactly once: tests/test_mutations.py checks it) by `replacement`,
and the pytest arguments `tests` (files or node ids, narrowed with -k to keep the whole run short) must then fail.
A new feature adds entries for the bugs that would hurt it most."""

MUTATIONS = [
    # ---- the pool's buffers and caches ------------------------------------------------------------------------
    dict(id="output-alias", bug="a call returns the reused shared-memory output buffer, not a private copy",
         file="sp_runtime/pool/arena.py",
         original="        out = torch.empty_like(view)\n        out.copy_(view)\n        return out\n",
         replacement="        return view\n",
         tests=["tests/test_pool_inputs.py", "-k", "stay_distinct"]),
    dict(id="stale-device-copy", bug="the device cache returns any cached copy of the same shape",
         file="sp_runtime/pool/context.py",
         original="            cached = self._cache.get(version, target_dtype)\n",
         replacement="            cached = next((copy for copy in self._cache._copies.values()\n"
                     "                           if copy.shape == tensor.shape), None)\n",
         tests=["tests/test_pool_inputs.py", "-k", "casts_its_inputs"]),
    dict(id="recycled-slot-version", bug="a recycled input slot keeps its old version (workers reuse the old copy)",
         file="sp_runtime/pool/arena.py",
         original="        slot.version = next(self._versions)\n",
         replacement="        slot.version = slot.version or next(self._versions)\n",
         tests=["tests/test_pool_inputs.py", "-k", "new_version"]),
]
