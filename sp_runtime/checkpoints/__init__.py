"""Checkpoint I/O above formats/: which files a path means and their headers (header), weight dtype names (dtypes),
and the weights read once through a family's key plan (loading)."""
