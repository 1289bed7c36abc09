"""Quantized checkpoint formats ComfyUI users download (legacy scaled fp8, ComfyUI mixed precision incl. int8
convrot / mxfp8 / nvfp4, GGUF): detected from the header, kept quantized in the workers, computed
with low-precision kernels where the device has them (kernels.py), else dequantized per layer."""
from .detect import Quantization, quantization  # noqa: F401
from .files import open_weights, read_plain, read_quant  # noqa: F401
from .weights import (QuantLinear, QuantWeight, choose_kernels, copies_into, install_quant_linears,  # noqa: F401
                      kept_copy, sharing_weights, weight_bytes)
