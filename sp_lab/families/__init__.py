"""The lab's own families (toy: the pool's test model; synthetic: random weights drawn on the workers, for the
benchmark presets), registered through the family registry's plug-in hook, never in its production list.

Importing this package registers them in this process and in every worker a pool starts afterwards (the registry
passes them on in ULYSSES_SP_EXTRA_FAMILIES), and opts the process into loading their files
(detection.allow_internal_families): only code that writes such files itself imports the lab.
"""
from __future__ import annotations

from sp_runtime.families import register_family
from sp_runtime.detection import allow_internal_families

LAB_FAMILIES = {"toy": "sp_lab.families.toy", "synthetic": "sp_lab.families.synthetic"}


def register_lab_families() -> None:
    for family, module in LAB_FAMILIES.items():
        register_family(family, module)
    allow_internal_families()


register_lab_families()
