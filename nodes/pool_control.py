"""SPPoolControl, "Ulysses SP Pool": shows the pools' state, unloads their models or shuts them down."""
from __future__ import annotations

import json
import time

from comfy_api.latest import io, ui

from .loader import CATEGORY
from .pool_owner import OWNER

ACTIONS = ["show status", "unload models", "shut down pools"]


def summary(status: dict) -> str:
    """A few human lines per pool for the node's text output."""
    if not status["pools"]:
        return "No Ulysses SP pool is running."
    lines = []
    for pool in status["pools"]:
        lines.append(f"{', '.join(pool['devices'])}: layout {pool['layout']} ({pool['backend']}), {pool['state']}")
        for model in pool["models"]:
            loras = "".join(f" + LoRA {lora[0]} x{lora[1]}" for lora in model["loras"])
            lines.append(f"  model {model['path']} [{model['dtype']}]{loras}")
        step = pool.get("last_step")
        if step:
            speedup = f", speed-up x{step['speedup']:.2f}" if step.get("speedup") else ""
            lines.append(f"  last step {step['seconds'] * 1000:.0f} ms{speedup}")
    return "\n".join(lines)


class SPPoolControl(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SPPoolControl",
            display_name="Ulysses SP Pool",
            category=CATEGORY,
            description="Shows the Ulysses SP worker pools, unloads their models (pools stay up) or shuts them down "
                        "(frees every worker and its GPU memory). The SP panel in the sidebar does the same.",
            inputs=[io.Combo.Input("action", options=ACTIONS, default="show status")],
            outputs=[io.String.Output(display_name="status_json")],
            is_output_node=True,
        )

    @classmethod
    def fingerprint_inputs(cls, action):
        return time.time()  # acts on live pools: never reuse a cached result

    @classmethod
    def execute(cls, action) -> io.NodeOutput:
        if action == "unload models":
            OWNER.unload_all()
        elif action == "shut down pools":
            OWNER.shutdown()
        status = OWNER.status()
        return io.NodeOutput(json.dumps(status), ui=ui.PreviewText(summary(status)))
