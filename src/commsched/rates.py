"""Link rates as people write them ('1gbit', '600mbit'): one parser below everything that takes a rate
(the emulated cluster, the namespace, the benchmark, the probe and the simulator)."""

from __future__ import annotations

from commsched.errors import bad_value


def parse_rate(text: str) -> float:
    """'10gbit', '200mbit', '1.5gbit', '100kbit' or a plain number of bits per second."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12, "bit": 1.0}
    lowered = text.strip().lower()
    for unit, scale in units.items():
        if lowered.endswith(unit):
            number = lowered[: -len(unit)]
            break
    else:
        number, scale = lowered, 1.0
    try:
        value = float(number) * scale
    except ValueError:
        raise bad_value("rate", text, "a number with a unit kbit/mbit/gbit, e.g. 1gbit or 200mbit") from None
    if value <= 0:
        raise bad_value("rate", text, "a positive rate, e.g. 1gbit")
    return value
