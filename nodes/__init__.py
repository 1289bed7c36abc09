"""ComfyUI nodes of ulysses-sp (thin: the runtime lives in sp_runtime)."""
