"""What a compiled step costs on each device, read from XLA (exact on every backend)."""

from __future__ import annotations


def memory(compiled) -> dict:
    """Per-device bytes of a compiled step: ``argument_bytes``, ``output_bytes``,
    ``alias_bytes`` (outputs written over donated arguments), ``temp_bytes`` and
    ``peak_bytes`` = argument + output + temp - alias."""
    m = compiled.memory_analysis()
    out = {"argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
           "alias_bytes": m.alias_size_in_bytes, "temp_bytes": m.temp_size_in_bytes}
    out["peak_bytes"] = (out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"]
                         - out["alias_bytes"])
    return out
