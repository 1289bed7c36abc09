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

    # ---- sharded weights ------------------------------------------------------------------------------------------
    dict(id="shard-model-reversed", bug="shard_model (a model loaded whole) keeps its shards in reversed rank order",
         file="sp_runtime/sharding/runtime.py",
         original="        lo, hi = layout.shard_range(rank)\n",
         replacement="        lo, hi = layout.shard_range(world - 1 - rank)\n",
         tests=["tests/test_shard_weights.py", "-k", "loaded_whole_shards"]),
    # ---- ring attention ---------------------------------------------------------------------------------------
    dict(id="ring-stale-lse", bug="the running log-sum-exp is not updated after a merge (right at ring degree 2 only)",
         file="sp_runtime/attention/lse.py",
         original="        self.lse = merged\n",
         replacement="",
         tests=["tests/test_family_layouts.py", "-k", "u1r3"]),
    dict(id="ring-bf16-merge", bug="bf16 partial outputs are merged in bf16, not float32",
         file="sp_runtime/attention/lse.py",
         original="            self.out, self.lse = out.float(), lse.float()\n",
         replacement="            self.out, self.lse = out, lse.float()\n",
         tests=["tests/test_ring_attention.py", "-k", "accumulates_in_float32"]),
]
