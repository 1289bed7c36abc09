"""Quantized checkpoint formats ComfyUI users download (legacy scaled fp8, ComfyUI mixed precision incl. int8
convrot / mxfp8 / nvfp4, GGUF): detected from the header, kept quantized in the workers, dequantized per layer."""
from .detect import Quantization, quantization  # noqa: F401
from .files import open_weights, read_plain, read_quant  # noqa: F401
from .weights import (QuantLinear, QuantWeight, copies_into, install_quant_linears, kept_copy,  # noqa: F401
                      sharing_weights, weight_bytes)
