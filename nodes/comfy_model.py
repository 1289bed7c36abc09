"""ComfyUI's own model config for an SP checkpoint, built from the safetensors header alone, and the weightless
MODEL (BaseModel + proxy diffusion_model + ModelPatcher on the CPU) that the stock sampler nodes take.

Real checkpoints go through ComfyUI's detection (comfy.model_detection) on a state dict of meta tensors, so the
config is what ComfyUI itself would build. ComfyUI's detection hardcodes real sizes and does not know this
project's test checkpoints, so when it finds nothing the config comes from our ModelInfo through the family's
ComfyHost (sp_runtime.families.comfy_host). Sizes in unet_config never matter here: no ComfyUI network is created.
"""
from __future__ import annotations

import inspect
import logging

import torch

import comfy.model_detection
import comfy.model_patcher
import comfy.patcher_extension
import comfy.supported_models
import comfy.utils

from sp_runtime.families import FAMILIES, comfy_host
from sp_runtime.checkpoints.loading import SAFETENSORS_DTYPES, count_blocks
from sp_runtime.formats.detect import plain_view

from . import model_options_policy as policy
from .weight_patches import UnsupportedPatch, cached_patch_set, translate

log = logging.getLogger("ulysses_sp")


HOST_MEMORY_FACTOR = 0.01  # read by some ComfyUI code paths; memory_required below is what the host needs
COMPILE_WRAPPER_KEY = "torch.compile"  # comfy_api.torch_helpers.torch_compile.COMPILE_KEY
HOST_LATENT_COPIES = 8  # x, noise, denoised, the sampler's state and the shared-memory copies, in float32


def meta_state_dict(header) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint header as a meta tensor of the right shape and dtype (no weight is read)."""
    state = {}
    for name, (dtype, shape) in header.tensors.items():
        state[name] = torch.empty(shape, dtype=SAFETENSORS_DTYPES.get(dtype, torch.float32), device="meta")
    return state


def _unprefixed(state: dict) -> dict:
    prefix = comfy.model_detection.unet_prefix_from_state_dict(state)
    return comfy.utils.state_dict_prefix_replace(state, {prefix: ""}, filter_keys=True) or state


def weight_shapes(header, model_config=None) -> dict[str, tuple[int, ...]]:
    """The diffusion model's weights as ComfyUI's model names them (no prefix) with their shapes, from the header:
    the keys ComfyUI's LoRA matching needs. Quantized files show their logical shapes, without scales and markers;
    a diffusers-layout file shows ComfyUI's converted names; every layout then goes through the config's
    process_unet_state_dict, as ComfyUI's loading does (newer ComfyUI renames Flux's q / k norms `.scale` ->
    `.weight` there). `model_config` defaults to ComfyUI's detection."""
    state = _unprefixed(meta_state_dict(plain_view(header)))
    detected = comfy.model_detection.model_config_from_unet(state, "")
    if detected is None:
        converted = comfy.model_detection.convert_diffusers_mmdit(state, "")
        if converted:
            state = converted
            detected = comfy.model_detection.model_config_from_unet(state, "")
    config = model_config or detected
    if config is not None:
        try:
            state = config.process_unet_state_dict(state)
        except Exception as error:  # a conversion that needs real values: the names before it still match most
            log.debug("ulysses-sp: ComfyUI's process_unet_state_dict failed on %s: %s", header.path, error)
    return {name: tuple(tensor.shape) for name, tensor in state.items()}


def detect_with_comfy(header):
    """ComfyUI's model config for the checkpoint, as comfy.sd.load_diffusion_model_state_dict detects it, or None."""
    state = _unprefixed(meta_state_dict(header))
    try:
        config = comfy.model_detection.model_config_from_unet(state, "", metadata=header.metadata)
        if config is None:
            converted = comfy.model_detection.convert_diffusers_mmdit(state, "")
            if converted is not None:
                config = comfy.model_detection.model_config_from_unet(converted, "")
    except Exception as error:  # detection of odd files may trip over shapes; our own detection decides then
        log.debug("ulysses-sp: ComfyUI detection failed on %s: %s", header.path, error)
        return None
    return config


def config_from_info(info) -> "comfy.supported_models_base.BASE":
    """Model config from our ModelInfo (family, variant, channels) when ComfyUI's detection does not apply."""
    host = comfy_host(info.family)
    name = host.model_class(info.variant) if host else None
    if name is None:
        supported = sorted(family for family in FAMILIES if comfy_host(family))
        raise ValueError(f"model family {info.family!r} (variant {info.variant or ''!r}) has no ComfyUI model class "
                         f"in ulysses-sp; supported families: {', '.join(supported)}")
    config_cls = getattr(comfy.supported_models, name, None)
    if config_cls is None:
        raise ValueError(f"model family {info.family!r} needs ComfyUI's model class supported_models.{name}, which "
                         f"this ComfyUI does not have: update ComfyUI (the README lists the version each family "
                         f"needs)")
    unet_config = {**config_cls.unet_config, **host.unet_config(info)}
    return config_cls(unet_config)


def comfy_model_config(header, info):
    """ComfyUI's config for the checkpoint (its header, as the pool read it); ComfyUI's detection first, our
    ModelInfo when it finds nothing."""
    config = detect_with_comfy(header)
    if config is None:
        config = config_from_info(info)
    elif comfy_host(info.family) and not (_same_family(config, info) and _same_metadata_variant(config, info)):
        log.warning("ulysses-sp: ComfyUI detects %s as %s but the workers load it as %s; using the workers' view",
                    header.path, type(config).__name__, info.family)
        config = config_from_info(info)
    return config


def _same_family(config, info) -> bool:
    wanted = set(comfy_host(info.family).model_classes.values())
    classes = [getattr(comfy.supported_models, name, None) for name in wanted]
    return any(isinstance(config, cls) for cls in classes if cls is not None)


def _same_metadata_variant(config, info) -> bool:
    """False when ComfyUI missed a variant it reads only from metadata (ComfyHost.metadata_variants)."""
    host = comfy_host(info.family)
    if info.variant not in host.metadata_variants:
        return True
    wanted = getattr(comfy.supported_models, host.model_class(info.variant), None)
    return wanted is not None and isinstance(config, wanted)


def host_memory_required(input_shape, cond_shapes={}) -> int:
    elements = 1
    for size in input_shape:
        elements *= int(size)
    return elements * 4 * HOST_LATENT_COPIES


class SPModelPatcher(comfy.model_patcher.ModelPatcher):
    """A ModelPatcher whose weights live in the SP workers. Its diffusion model shows ComfyUI meta tensors of the
    checkpoint's weights, so stock LoRA nodes and LoRA hooks find their keys; the weight patches they add are sent to
    the workers (translated by nodes/weight_patches.py) instead of being applied on the host: at sampling time the
    patcher that samples hands its patches, plus those of the hooks of the conditioning being run, to the proxy."""

    def model_size(self) -> int:
        """Bytes held in this process (the meta tensors of the weights hold none)."""
        if self.size <= 0:
            self.size = sum(t.nelement() * t.element_size() for t in self.model.state_dict().values()
                            if t.device.type != "meta")
        return self.size

    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
        added = super().add_patches(patches, strength_patch, strength_model)
        if added:
            weights = {key if isinstance(key, str) else key[0] for key in added}
            label = _label([patches[key] for key in added], len(weights))
            self.patch_labels = (*self._labels(), (label, float(strength_patch)))
            _check_supported(self.patches, self._proxy().weight_shapes)  # an error on the node that adds it
        return added

    def add_hook_patches(self, hook, patches, strength_patch=1.0, strength_model=1.0):
        added = super().add_hook_patches(hook, patches, strength_patch, strength_model)
        _check_supported(self.hook_patches.get(hook.hook_ref, {}), self._proxy().weight_shapes)
        return added

    def clone(self, *args, **kwargs):
        """ModelPatcher.clone with every argument passed through (newer ComfyUI: disable_dynamic, model_override,
        force_deepcopy, ...). The weights live in the workers, so a deep copy here is a clone sharing the proxy."""
        if kwargs.get("force_deepcopy") and kwargs.get("model_override") is None:
            kwargs["model_override"] = self.get_clone_model_override()
            kwargs["force_deepcopy"] = False
        copy = super().clone(*args, **_accepted(super().clone, kwargs))
        copy.patch_labels = self._labels()
        copy.option_origins = self._origins().cloned(policy.current_node(), self.option_keys())
        return copy

    def add_wrapper_with_key(self, wrapper_type, key, wrapper):
        """TorchCompileModel: the workers compile the blocks (the `compile` load option) instead of a host wrapper
        around a torch.compile of the proxy."""
        if wrapper_type == comfy.patcher_extension.WrappersMP.APPLY_MODEL and key == COMPILE_WRAPPER_KEY:
            proxy = self._proxy()
            self.add_object_patch("diffusion_model", proxy.with_spec(proxy.spec.with_options(compile=True)))
            log.info("ulysses-sp: TorchCompileModel on an SP model compiles the blocks in the workers")
            return
        return super().add_wrapper_with_key(wrapper_type, key, wrapper)

    def set_injections(self, key, injections):
        """Bypass LoRAs ("Load LoRA (Bypass)", comfy.sd.load_bypass_lora_for_models) become ordinary weight patches
        for the workers: base(x) + strength * adapter(x) is the adapter's weight patch at that strength. Other
        forward injections cannot reach the workers and are refused, naming the node."""
        hooks = _bypass_hooks(injections)
        if hooks is None:
            node = policy.current_node()
            raise RuntimeError(f"Ulysses SP model: forward injections {key!r}{f' (set by {node})' if node else ''} "
                               f"would change modules of ComfyUI's own network, which runs in the SP workers; "
                               f"remove that node for SP models")
        for hook in hooks:
            self.add_patches({f"diffusion_model.{hook.module.sp_key}": hook.adapter}, float(hook.multiplier))

    def option_keys(self) -> dict:
        """Every option this patcher carries, as model_options_policy names them."""
        return policy.model_option_keys(self.model_options, getattr(self, "wrappers", {}),
                                        getattr(self, "callbacks", {}), self.object_patches)

    def check_options(self) -> None:
        """Refuse, naming the node, any option the workers cannot serve (model_options_policy)."""
        policy.check(self.option_keys(), self._origins().origin)

    def pre_run(self):
        """Right before sampling: options are checked, and the diffusion model sends this patcher's weight patches
        with its calls."""
        self.check_options()
        self._proxy().option_origins = self._origins()
        super().pre_run()
        self.unpatch_hooks()

    def patch_hooks(self, hooks):
        """ComfyUI would rewrite the weights for the hooks of the conditioning about to run (a hook LoRA at its
        current keyframe strength): here the workers get this patcher's patches followed by the hooks' instead."""
        self._send_patches(hooks)
        self.current_hooks = hooks

    def unpatch_hooks(self, whitelist_keys_set=None) -> None:
        self._send_patches(None)
        self.current_hooks = None

    def _send_patches(self, hooks) -> None:
        if self.model.current_patcher is not self:  # only the patcher that samples drives the workers
            return
        combined = self.get_combined_hook_patches(hooks) if hooks is not None else {}
        patches = {key: [*self.patches.get(key, ()), *combined.get(key, ())]
                   for key in (*self.patches, *(key for key in combined if key not in self.patches))}
        used = [hook for hook in (hooks.hooks if combined else ()) if hook.hook_ref in self.hook_patches]
        labels = self._labels() + tuple((f"hook: {_hook_label(self.hook_patches[hook.hook_ref])}",
                                         float(hook.strength)) for hook in used)
        cache_key = (self.patches_uuid, tuple((id(hook.hook_ref), float(hook.strength)) for hook in used))
        proxy = self._proxy()
        proxy.weight_patches = cached_patch_set(cache_key, patches, proxy.weight_shapes, labels)

    def _labels(self) -> tuple:
        return getattr(self, "patch_labels", ())

    def _origins(self) -> policy.OptionOrigins:
        return getattr(self, "option_origins", None) or policy.OptionOrigins()

    def _proxy(self):
        return self.get_model_object("diffusion_model")


def _bypass_hooks(injections) -> "list | None":
    """The BypassForwardHooks inside ComfyUI's bypass-LoRA injections (held by their manager, which the injection's
    functions close over), when every hook targets a WeightPath of the proxy; None for anything else."""
    hooks = []
    for injection in injections:
        managers = [cell.cell_contents for function in (injection.inject, injection.eject)
                    for cell in (getattr(function, "__closure__", None) or ())
                    if hasattr(cell.cell_contents, "hooks") and hasattr(cell.cell_contents, "adapters")]
        if not managers:
            return None
        found = list(managers[0].hooks)
        if not all(hasattr(hook.module, "sp_key") and hasattr(hook, "adapter") for hook in found):
            return None
        hooks.extend(found)
    return hooks


def _accepted(method, kwargs: dict) -> dict:
    """kwargs without those `method` does not take (ComfyUI 0.3.64's clone takes none; nobody passes any there)."""
    parameters = inspect.signature(method).parameters
    if any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
        return kwargs
    return {key: value for key, value in kwargs.items() if key in parameters}


def _check_supported(patches: dict, shapes: dict) -> None:
    try:
        translate(patches, shapes)
    except UnsupportedPatch as error:
        raise RuntimeError(f"Ulysses SP model: {error}") from None


def _label(values: list, weights: int) -> str:
    """What a person reads in status() for one add_patches call or hook: the patch kinds and how many weights."""
    return f"{'/'.join(sorted({_kind(value) for value in values}))} on {weights} weights"


def _hook_label(hook_patches: dict) -> str:
    """_label of a hook's patches ({key: [(strength, patch, strength_model, offset, function)]})."""
    return _label([entry[1] for entries in hook_patches.values() for entry in entries], len(hook_patches))


def _kind(value) -> str:
    """A patch's kind: the adapter's name (lora, loha, ...) or diff / set."""
    name = getattr(value, "name", None)
    if name:
        return name
    return "diff" if isinstance(value, tuple) and len(value) == 1 else str(value[0]) if value else "?"


def _sizes_from_weights(unet_config: dict, shapes: dict) -> None:
    """ComfyUI's Flux LoRA key map (diffusers names, the fused qkv offsets) reads the width and block counts from
    unet_config, where ComfyUI's detection writes real Flux.1 sizes whatever the file: take them from the weights."""
    if unet_config.get("image_model") == "flux" and "img_in.weight" in shapes:
        unet_config["hidden_size"] = shapes["img_in.weight"][0]
        unet_config["depth"] = count_blocks(shapes, "double_blocks")
        unet_config["depth_single_blocks"] = count_blocks(shapes, "single_blocks")


def build_sp_model(model_config, proxy: torch.nn.Module, compute_dtype: torch.dtype) -> SPModelPatcher:
    """A MODEL for the stock nodes: ComfyUI's BaseModel of the family with `proxy` as its diffusion_model,
    patched and sampled on the CPU (no weights, no VRAM in the ComfyUI process)."""
    model_config.unet_config["disable_unet_model_creation"] = True
    _sizes_from_weights(model_config.unet_config, proxy.weight_shapes)
    model_config.set_inference_dtype(compute_dtype, None)
    model_config.memory_usage_factor = HOST_MEMORY_FACTOR
    model = model_config.get_model({}, "")
    model.diffusion_model = proxy
    model.memory_usage_factor = HOST_MEMORY_FACTOR
    # ComfyUI sizes batches and frees memory from this estimate; the network runs in the workers, so the host
    # needs room for a few latent copies only (a network-sized estimate would split cond/uncond into two calls)
    model.memory_required = host_memory_required
    cpu = torch.device("cpu")
    return SPModelPatcher(model, load_device=cpu, offload_device=cpu)
