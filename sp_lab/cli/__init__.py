"""The lab's commands (`python -m sp_lab {demo,bench,gpu-suite}`) and the helpers the benchmarks share."""
