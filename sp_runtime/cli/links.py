"""The doctor's part for several machines: wait for the named machines to join (`python -m sp_runtime join`),
measure the link to each (round trips of a large payload over the join connection: the TCP path the collectives
take without InfiniBand), and compare the layouts across machines with the speed model: Ulysses inside each
machine with Ring or CFG across, against Ulysses across the machines.
"""
from __future__ import annotations

import time
from typing import Optional

PROBE_BYTES = 64 << 20
JOIN_WAIT_S = 120.0


def measure_links(out, listen: str, token_file: str, machines: list[str], wait_s: float = JOIN_WAIT_S,
                  probe_bytes: int = PROBE_BYTES) -> dict:
    """{machine: bytes/s one way}; machines that did not join within wait_s are reported and left out."""
    from ..pool.remote import JoinPoint
    point = JoinPoint(listen, token_file, {name: [] for name in machines})
    out.line(f"listening on {point.address}: on each machine run `python -m sp_runtime join {point.address} "
             f"--token-file <token file> --name <name>` ({', '.join(machines)})")
    links = {}
    try:
        deadline = time.monotonic() + wait_s
        while len(point.machines) < len(machines) and time.monotonic() < deadline:
            time.sleep(0.1)
        for name in machines:
            machine = point.machines.get(name)
            if machine is None:
                out.line(f"machine {name}: did not join within {wait_s:g} s"
                         + (f" (last refusal: {point.refusals[-1]})" if point.refusals else ""))
                continue
            links[name] = machine.probe(probe_bytes)
            out.line(f"machine {name} ({machine.peer}): {links[name] / 1e9:.3g} GB/s per direction "
                     f"({probe_bytes >> 20} MiB round trips over TCP)")
    finally:
        point.close()
    return links


def compare_layouts(out, shape, tokens: int, text: int, device, local_link, inter_bytes_per_s: float,
                    per_machine: int, machines: int) -> Optional[dict]:
    """Predicted step time of the layouts over `machines` x `per_machine` devices, the slow link counted where it
    is crossed; prints them and the recommendation."""
    from .speed_model import Layout, Link, predict
    if machines < 2 or per_machine < 1:
        return None
    inter = Link(inter_bytes_per_s, latency_s=100e-6)
    rows = {}
    ring = predict(shape, tokens, text, Layout(per_machine, machines), device, local_link)
    ring_inter = predict(shape, tokens, text, Layout(per_machine, machines), device, inter)
    shown = max(0.0, ring_inter.parts["ring_shift_s"] - ring_inter.parts["attention_s"])
    rows[f"u{per_machine}r{machines} (Ring across machines)"] = (ring.compute_s + ring.parts["all_to_all_s"] + shown,
                                                                  ring_inter.bytes_sent)
    if shape.cfg and machines == 2:
        cfg = predict(shape, tokens, text, Layout(per_machine, 1, 2), device, local_link)
        rows[f"u{per_machine}cfg2 (CFG across machines)"] = (cfg.step_s, cfg.bytes_sent)
    across = predict(shape, tokens, text, Layout(per_machine * machines), device, inter)
    rows[f"u{per_machine * machines} (Ulysses across machines)"] = (across.step_s, across.bytes_sent)
    for name, (seconds, sent) in rows.items():
        out.line(f"  {name:<36} {seconds * 1e3:>10.1f} ms/step  {sent / 1e9:>8.2f} GB sent per rank and step")
    best = min(rows, key=lambda name: rows[name][0])
    out.line(f"recommended across machines: {best}")
    return {"rows": {name: {"step_s": s, "bytes_sent": b} for name, (s, b) in rows.items()}, "recommended": best}
