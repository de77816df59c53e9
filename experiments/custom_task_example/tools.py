"""The example task's tool: exact unit conversion (the model reads the question, the tool does the arithmetic)."""
from agentfly_jax.tools import tool

#: metres per unit (length) and grams per unit (mass)
FACTORS = {
    "length": {"m": 1.0, "km": 1000.0, "cm": 0.01, "mm": 0.001, "mile": 1609.344, "yard": 0.9144, "foot": 0.3048,
               "inch": 0.0254},
    "mass": {"g": 1.0, "kg": 1000.0, "mg": 0.001, "pound": 453.59237, "ounce": 28.349523125},
}
UNITS = {unit: kind for kind, table in FACTORS.items() for unit in table}


def convert(value: float, from_unit: str, to_unit: str) -> float:
    if from_unit not in UNITS or to_unit not in UNITS:
        unknown = from_unit if from_unit not in UNITS else to_unit
        raise ValueError(f"unknown unit {unknown!r}; known: {', '.join(sorted(UNITS))}")
    if UNITS[from_unit] != UNITS[to_unit]:
        raise ValueError(f"cannot convert {UNITS[from_unit]} ({from_unit}) to {UNITS[to_unit]} ({to_unit})")
    table = FACTORS[UNITS[from_unit]]
    return value * table[from_unit] / table[to_unit]


@tool
def convert_units(value: float, from_unit: str, to_unit: str) -> str:
    """Converts a quantity between units of length (m, km, cm, mm, mile, yard, foot, inch) or mass (g, kg, mg,
    pound, ounce).

    Args:
      value: the quantity to convert.
      from_unit: the unit the quantity is in.
      to_unit: the unit to convert to.
    """
    return f"{convert(value, from_unit, to_unit):.6g}"
