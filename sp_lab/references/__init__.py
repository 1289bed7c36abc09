"""Single-device reference forwards per family: the independent side of every parity test (not product code)."""
